"""Per-weight bit widths and block sizes for ``quantize_weights``: the ``rules`` key and the keys it generalises.

A rule matches weights by node name (``nodes``: a shell pattern, as ``exclude``) and/or by what the node is
(``kind``: ``matmul``, ``gemm``, ``embedding`` — an embedding ``Gather`` — or ``lm_head``, the MatMul/Gemm
producing the logits) and sets ``bits`` (4, 8, or ``float``: left unquantized) and/or ``block_size`` (INT4).
A weight starts from the pass's ``bits`` and ``block_size``; the older keys act as rules placed first —
``embedding: false`` (the default) is ``{kind: embedding, bits: float}``, ``lm_head: false`` is
``{kind: lm_head, bits: float}``, each ``exclude`` pattern ``{nodes: PATTERN, bits: float}`` — then every rule
of ``rules`` in order; a later matching rule overrides the fields it sets. So
``rules: [{kind: lm_head, bits: 8}, {nodes: '*/mlp/down_proj/*', block_size: 32}]`` keeps the LM head at INT8 per
channel and quantizes down_proj in finer groups than the rest.
"""

from __future__ import annotations

import fnmatch
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Budget", "QuantRule", "Resolved", "legacy_rules", "resolve"]


class QuantRule(BaseModel):
    """One rule of ``quantize_weights.rules`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    nodes: str | None = Field(None, description="Node names (shell pattern) the rule applies to.")
    kind: Literal["matmul", "gemm", "embedding", "lm_head"] | None = Field(
        None, description="What the node is: matmul, gemm, embedding (Gather table) or lm_head (produces the logits)."
    )
    bits: Literal[4, 8, "float"] | None = Field(None, description="4, 8, or float (left unquantized).")
    block_size: Literal[16, 32, 64, 128] | None = Field(None, description="Input channels per group for INT4.")

    @model_validator(mode="after")
    def _complete(self) -> QuantRule:
        if self.nodes is None and self.kind is None:
            raise ValueError("a rule needs 'nodes' (a node-name pattern) or 'kind' (matmul/gemm/embedding/lm_head)")
        if self.bits is None and self.block_size is None:
            raise ValueError("a rule needs 'bits' (4, 8 or float) or 'block_size'")
        if self.bits == "float" and self.block_size is not None:
            raise ValueError("block_size with bits float (not quantized) has no effect; drop one of them")
        return self

    def label(self) -> str:
        """The rule as written, for report lines."""
        return "{" + ", ".join(f"{k}: {v}" for k, v in self.model_dump(exclude_none=True).items()) + "}"


class Resolved(BaseModel):
    """What the rules decide for one weight: ``bits`` (None: float) and ``block_size``, and why it is float."""

    bits: int | None
    block_size: int
    reason: str = ""
    matched: list[str] = Field(default_factory=list)


def legacy_rules(*, lm_head: bool, embedding: bool, exclude: list[str]) -> list[QuantRule]:
    """The rules the older keys stand for, in the order they apply (before ``rules``)."""
    rules = [] if embedding else [QuantRule(kind="embedding", bits="float")]
    rules += [] if lm_head else [QuantRule(kind="lm_head", bits="float")]
    return rules + [QuantRule(nodes=p, bits="float") for p in exclude]


def _why(rule: QuantRule, legacy: bool) -> str:
    if legacy and rule.kind == "embedding":
        return "embedding Gather (embedding: false)"
    if legacy and rule.kind == "lm_head":
        return "LM head (lm_head: false)"
    if legacy:
        return f"excluded by {[rule.nodes]}"
    return f"rule {rule.label()}"


def resolve(
    name: str, kinds: set[str], *, bits: int, block_size: int, legacy: list[QuantRule], rules: list[QuantRule]
) -> Resolved:
    """The bit width and block size the rules give one node's weight.

    Args:
        name: the node's name.
        kinds: what it is (``matmul``/``gemm``/``embedding``, plus ``lm_head``).
        bits: the pass's ``bits``.
        block_size: the pass's ``block_size``.
        legacy: :func:`legacy_rules` of the config.
        rules: the config's ``rules``.

    Returns:
        The decision; ``matched`` lists the ``nodes`` patterns that matched (for the "matched no node" warning).
    """
    out = Resolved(bits=bits, block_size=block_size)
    for index, rule in enumerate([*legacy, *rules]):
        if rule.kind is not None and rule.kind not in kinds:
            continue
        if rule.nodes is not None and not (name and fnmatch.fnmatchcase(name, rule.nodes)):
            continue
        if rule.nodes is not None:
            out.matched.append(rule.nodes)
        if rule.bits is not None:
            out.bits = None if rule.bits == "float" else int(rule.bits)
            out.reason = _why(rule, index < len(legacy)) if rule.bits == "float" else ""
        if rule.block_size is not None:
            out.block_size = int(rule.block_size)
    return out


class Budget(BaseModel):
    """``quantize_weights.budget``: bounds the kept candidate meets on the calibration text."""

    model_config = ConfigDict(extra="forbid")

    max_mean_kl: float | None = Field(None, gt=0, description="Largest mean KL(float || candidate), nats.")
    max_ppl_ratio: float | None = Field(None, ge=1, description="Largest perplexity ratio candidate / float.")

    @model_validator(mode="after")
    def _one_bound(self) -> Budget:
        if self.max_mean_kl is None and self.max_ppl_ratio is None:
            raise ValueError("budget needs max_mean_kl and/or max_ppl_ratio")
        return self

    def failures(self, kl: float, ppl_ratio: float) -> list[str]:
        """The bounds ``(kl, ppl_ratio)`` breaks, as report phrases (empty: it meets the budget)."""
        out = []
        if self.max_mean_kl is not None and kl > self.max_mean_kl:
            out.append(f"mean KL {kl:.4g} > {self.max_mean_kl:g}")
        if self.max_ppl_ratio is not None and ppl_ratio > self.max_ppl_ratio:
            out.append(f"perplexity ratio {ppl_ratio:.4f} > {self.max_ppl_ratio:g}")
        return out
