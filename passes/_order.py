"""Order facts and the up-front order check: what a pass needs of its input graph that another pass makes.

An :class:`OrderFact` is one predicate on a graph (its decode contract, a plain BHSD cache). Passes declare
the facts they need, provide and remove (:attr:`Pass.needs`, :attr:`Pass.provides`, :meth:`Pass.removes`);
:func:`pass_order_problem` reads those declarations before the first pass runs, :meth:`Pass.requires` checks the
same predicates on the graphs it is given, and passes ask the same objects: a precondition is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx_ir as ir

from onnxdeploy.contract import DecodeContract, read_contract
from onnxdeploy.graph import default_opset

if TYPE_CHECKING:
    from onnxdeploy.passes._pass_infra import Pass

__all__ = ["BHSD_CACHE", "CONTRACT", "ORDER_FACTS", "WHOLE_MODEL", "OrderFact", "pass_order_problem"]


@dataclass(frozen=True)
class OrderFact:
    """One fact a pass may need of its input graph, and the one predicate that decides it.

    Attributes:
        name: the fact's key (``contract``, ``bhsd_cache``).
        description: how a message names it ("a BHSD cache (B, H_kv, L, D)").
        predicate: decides the fact from a graph's decode contract (None: the graph has none).
        fix: what to do when a graph lacks it ({pass} is replaced by the pass's name).
    """

    name: str
    description: str
    predicate: Callable[[DecodeContract | None], bool]
    fix: str = ""

    def holds(self, contract: DecodeContract | None) -> bool:
        """Whether a graph with this decode contract (None: without one) has the fact."""
        return self.predicate(contract)

    def holds_on(self, model: ir.Model, source: str = "model") -> bool:
        """Whether ``model`` has the fact (its contract read from ``metadata_props``)."""
        return self.holds(read_contract(model, source=source))

    def problem(self, model: ir.Model, who: str, source: str = "model") -> str | None:
        """Why ``model`` lacks the fact, for :meth:`Pass.requires` (None: it has it)."""
        contract = read_contract(model, source=source)
        if self.holds(contract):
            return None
        found = (
            "no decode contract"
            if contract is None
            else f"part {contract.part.index} of a model split into {contract.part.count}"
            if contract.part is not None
            else f"kv_layout {contract.kv_layout}, head_dim_padded {contract.head_dim_padded}"
        )
        return f"graph '{source}' has {found}; {who} needs {self.description}: {self.fix.format(name=who)}"


CONTRACT = OrderFact(
    "contract", "the decode contract static_kv writes", lambda c: c is not None, "run static_kv before {name}"
)
"""The graph carries a decode contract (``static_kv`` wrote one)."""

BHSD_CACHE = OrderFact(
    "bhsd_cache",
    "a BHSD cache (B, H_kv, L, D)",
    lambda c: c is not None and c.kv_layout == "BHSD" and c.head_dim_padded == c.head_dim,
    "run {name} on the BHSD graph static_kv made, before kv_layout",
)
"""The cache is plain BHSD ``(B, H_kv, L, D)``: not repacked, not transposed, head dim not padded (what
``grouped_attention`` and ``kv_layout`` read)."""

WHOLE_MODEL = OrderFact(
    "whole_model",
    "a whole model, not split into parts",
    lambda c: c is None or c.part is None,
    "run {name} before split",
)
"""The graph is a whole decoder, not one part of a chain ``split`` cut (the cache rewrites read its whole I/O)."""

ORDER_FACTS: dict[str, OrderFact] = {f.name: f for f in (CONTRACT, BHSD_CACHE, WHOLE_MODEL)}
"""Every order fact by name."""


def _missing_from_input(passes: Sequence[Pass], i: int, fact: OrderFact) -> str:
    p = passes[i]
    later = next((j for j in range(i + 1, len(passes)) if fact in passes[j].provides), None)
    where = (
        f"move {p.name} after passes[{later}].{passes[later].name}"
        if later is not None
        else ("add static_kv before it" if fact is CONTRACT else f"run {p.name} on a graph that has it")
    )
    return f"needs {fact.description}, which the input model does not have; {where}"


def _fact_problem(passes: Sequence[Pass], i: int, known: dict[OrderFact, tuple[int, bool]]) -> str | None:
    """Why ``passes[i]`` lacks a fact it needs, given what the passes before it made or removed; else None."""
    p = passes[i]
    for fact in [f for f in ORDER_FACTS.values() if f in p.needs]:
        last = known.get(fact)
        if last is not None and not last[1] and last[0] < 0:
            return _missing_from_input(passes, i, fact)
        if last is not None and not last[1]:
            j = last[0]
            fix = (
                f"one {p.name} pass does it: keep only the one with the config you need"
                if passes[j].name == p.name
                else f"move {p.name} before {passes[j].name}"
            )
            return f"needs {fact.description}, which the earlier passes[{j}].{passes[j].name} does not leave; {fix}"
        later = next((j for j in range(i + 1, len(passes)) if fact in passes[j].provides), None)
        if last is None and later is not None:
            return (
                f"needs {fact.description}, which only the later passes[{later}].{passes[later].name} makes; "
                f"move {p.name} after {passes[later].name}"
            )
    return None


def _opset_problem(passes: Sequence[Pass], i: int, opset: int | None, opset_from: int | None, model) -> str | None:
    """Why ``passes[i]`` cannot take the ``ai.onnx`` opset it gets (set by ``passes[opset_from]``), else None."""
    p = passes[i]
    need = p.min_opset(model)
    if need is None or opset is None or opset >= need[0]:
        return None
    if opset_from is None:
        return (
            f"needs ai.onnx opset >= {need[0]} ({need[1]}); the input model has opset {opset}: add "
            f"pin_opset: {{opset: {need[0]}}} before {p.name}"
        )
    j = opset_from
    return (
        f"needs ai.onnx opset >= {need[0]} ({need[1]}), but passes[{j}].{passes[j].name} sets opset {opset}: "
        f"pin opset {need[0]} or higher, or move {passes[j].name} after {p.name}"
    )


def pass_order_problem(passes: Sequence[Pass], model: ir.Model | None = None) -> tuple[int, str] | None:
    """The first pass the pipeline's order keeps from running, before any runs: ``(index, reason and fix)``.

    Read off the passes' declarations (:attr:`Pass.needs`, :attr:`Pass.provides`, :meth:`Pass.removes`,
    :meth:`Pass.min_opset`, :meth:`Pass.output_opset`) and the input graph's own facts (:meth:`OrderFact.holds_on`),
    so it refuses only what the pass's own ``requires`` would refuse later:

    - a fact the pass needs was removed by an earlier pass (``grouped_attention`` after ``kv_layout`` to BHDS_K);
    - no earlier pass provides a fact the pass needs and a later one does (``grouped_attention`` before
      ``static_kv``: a later ``static_kv`` means the input has no contract yet);
    - the ``ai.onnx`` opset the pass gets is known (the input's, or one ``pin_opset`` set, carried by passes that
      keep it) and below the pass's minimum (``mask_rewrite`` after ``pin_opset: {opset: 11}``);
    - a pass that must follow it with its config is absent (:meth:`Pass.needs_later`: ``static_kv {window_cache:
      true}`` without ``mask_rewrite``);
    - the pass sets an opset below what an earlier pass's output needs (:meth:`Pass.opset_floor`: ``pin_opset: 19``
      after ``quantize_weights`` wrote blocked INT4 ``DequantizeLinear``, which exists from opset 21).

    Args:
        passes: the pipeline's passes, in order.
        model: the input graph (its facts, its opset, and what a pass's minimum opset depends on), or None.

    Returns:
        None when no order problem is known; else the index into ``passes`` and one line naming the fix.
    """
    known: dict[OrderFact, tuple[int, bool]] = {}  # fact -> (index of the last pass that made or removed it, present)
    if model is not None:  # what the input graph already has (index -1)
        contract = read_contract(model)
        known[CONTRACT] = (-1, CONTRACT.holds(contract))
        if contract is not None:
            known[BHSD_CACHE] = (-1, BHSD_CACHE.holds(contract))
            known[WHOLE_MODEL] = (-1, WHOLE_MODEL.holds(contract))
    opset = None if model is None else default_opset(model, None)  # type: ignore[arg-type]
    opset_from: int | None = None  # index of the pass that set the opset; None: the input's
    floor: tuple[int, str, int] | None = None  # (opset, what needs it, index): the highest floor written so far
    for i, p in enumerate(passes):
        problem = _fact_problem(passes, i, known) or _opset_problem(passes, i, opset, opset_from, model)
        if problem is not None:
            return i, problem
        later = p.needs_later()
        if later is not None and all(q.name != later[0] for q in passes[i + 1 :]):
            return i, f"needs a later {later[0]} pass ({later[1]}): add {later[0]} after it"
        for fact in p.provides:
            known[fact] = (i, True)
        for fact in p.removes():
            known[fact] = (i, False)
        if not p.keeps_opset:
            out = p.output_opset(opset)
            if out is not None and floor is not None and out < floor[0] and out != opset:
                return i, _floor_problem(passes, out, floor)
            if out != opset:  # a pass that keeps the opset it was given (with this config) is not named
                opset, opset_from = out, i
        written = p.opset_floor(model)
        if written is not None and (floor is None or written[0] > floor[0]):
            floor = (*written, i)
    return None


def _floor_problem(passes: Sequence[Pass], out: int, floor: tuple[int, str, int]) -> str:
    """Why a pass may not set ai.onnx opset ``out``: an earlier pass wrote ops that first exist at ``floor``."""
    need, what, j = floor
    return (
        f"sets ai.onnx opset {out}, but passes[{j}].{passes[j].name} writes {what}, which first exists at opset "
        f"{need}: pin opset {need} or higher, or move this pass before {passes[j].name}"
        + (" (or quantize with format: matmulnbits)" if passes[j].name == "quantize_weights" else "")
    )
