"""``static_kv``: fixed batch, step length and ``max_cache_len``; cache appended by Scatter, not Concat.

What the pass does (DESIGN.md, "Passes" → ``static_kv``), each step a function of
:mod:`onnxdeploy.passes._cache_edits`:

* Past K/V inputs become fixed buffers ``(B, H_kv, max_cache_len, D)``. The Concat that appended the
  step's K/V ``(B, H_kv, S, D)`` becomes ``ScatterElements(axis=2)`` (ONNX opset ≥ 11) writing at the
  new int64 input ``cache_position`` of shape ``[step_len]``; attention reads the whole buffer.
* Every other reader of a past input (the exporters' shape arithmetic: mask width, GQA head-repeat
  shape) reads a Slice view of ``max_cache_len - S`` slots, so ``past_len + S`` lands on
  ``max_cache_len`` and folds away once all inputs are static.
* The exporter's internal query-position vector (``past_len + arange(S)``, transformers'
  ``cache_position``) is found by running the original at two past lengths and replaced by the
  ``cache_position`` input, so the causal (and sliding-window) mask stays right for any position.
* ``attention_mask`` becomes int64 ``(B, max_cache_len)``; the host writes 1 for slots ≤ the current
  position. A ``-inf`` float constant becomes the dtype's most negative finite value
  (``numpy.finfo(dtype).min``, what transformers itself uses) so a fully masked row cannot make NaN.
* Shape arithmetic is folded (onnxsim, constant folding only, on a weightless copy) and the decode
  contract is written to ``metadata_props`` (DESIGN.md, "The decode contract").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import onnx_ir as ir
from pydantic import Field

from onnxdeploy.contract import write_contract
from onnxdeploy.errors import ConfigError, PostconditionError, PreconditionError
from onnxdeploy.kv_cache import KVCache, find_kv_cache, find_logits_output
from onnxdeploy.passes._cache_edits import (
    CACHE_POSITION,
    KNOWN_INPUTS,
    add_cache_position,
    build_contract,
    feed_query_positions,
    find_query_positions,
    fix_io_dims,
    refold_and_infer,
    replace_neg_inf,
    rewrite_cache_writes,
)
from onnxdeploy.passes._pass_infra import (
    ArtifactSet,
    Pass,
    PassConfig,
    PassContext,
    PipelineSettings,
    register_pass,
)
from onnxdeploy.report import PassReport
from onnxdeploy.resources import available_memory_bytes, format_bytes

__all__ = ["StaticKVConfig", "StaticKVCachePass", "MemoryEstimate", "estimate_memory"]

_FOLDED_AWAY = ("Shape", "Range", "Trilu")
RUNTIME_CACHE_COPIES = 3
"""Cache buffers alive while decoding: the past inputs, the present outputs and the runner's host copies."""
FOLDED_BYTES_PER_SLOT = 32
"""Bytes per cache slot (per batch row and token of step_len) that folding stores as constants, an upper bound.

Measured on the fixtures: folding the exporters' mask and position arithmetic over ``max_cache_len`` slots
stores 8-24 bytes per slot (int64 ranges, bool and float masks): 10^7 slots give ~241 MB of constants.
"""
FOLDING_PEAK_BYTES_PER_SLOT = 320
"""Peak bytes per cache slot (per batch row and token of step_len) while onnxsim folds, an upper bound.

Measured on the fixtures: folding at 10^6 slots grows the process by ~280 MB (onnxsim evaluates the masks
in ONNX Runtime and serialises them into protos, several copies at once).
"""


class StaticKVConfig(PassConfig):
    """Config of ``static_kv``."""

    batch: int = Field(1, ge=1, description="Fixed batch size B of every input.")
    step_len: int = Field(1, ge=1, description="Tokens per call S (1 for the decode graph).")
    max_cache_len: int = Field(
        ..., ge=1, description="Slots of the fixed cache buffer (B, H_kv, max_cache_len, D); bounds the context."
    )
    cache_update: Literal["full_buffer", "new_token_only"] = Field(
        "full_buffer",
        description="full_buffer: present.* outputs are the updated buffers (B, H_kv, max_cache_len, D); "
        "new_token_only: present.* are the step's K/V (B, H_kv, step_len, D) for the host to write at "
        "cache_position.",
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a static graph needs while it is built and at run time, with the arithmetic spelled out.

    Attributes:
        cache_bytes: ``2 × layers × B × H_kv × max_cache_len × D × dtype bytes × copies`` (bytes).
        cache_text: that product written out, e.g. ``2 × 2 layers × 1 × 2 heads × 64 slots × 16 × 4 bytes × 3
            copies = 96.0 KiB``.
        folded_bytes: constants of ``max_cache_len`` slots folding stores in the graph (bytes, upper bound).
        folding_peak_bytes: what folding holds at its peak (bytes, upper bound).
        folding_text: the folding arithmetic written out.
    """

    cache_bytes: int
    cache_text: str
    folded_bytes: int
    folding_peak_bytes: int
    folding_text: str

    @property
    def run_bytes(self) -> int:
        """Bytes resident while decoding: the cache copies and the folded constants."""
        return self.cache_bytes + self.folded_bytes

    def refusal(self, available: int) -> str | None:
        """Why ``available`` bytes are not enough (the arithmetic and the comparison), or None when they are."""
        if self.run_bytes > available:
            extra = f" + {format_bytes(self.folded_bytes)} folded constants" if self.folded_bytes else ""
            return f"{self.cache_text}{extra} > {format_bytes(available)} available"
        if self.folding_peak_bytes > available:
            return f"folding the mask arithmetic needs {self.folding_text} > {format_bytes(available)} available"
        return None


def estimate_memory(kv: KVCache, cfg: StaticKVConfig, *, copies: int = RUNTIME_CACHE_COPIES) -> MemoryEstimate:
    """Estimate the bytes of the cache buffers at run time and of the constants folding makes.

    Args:
        kv: the cache of the input model (layers, H_kv, D, dtype).
        cfg: the pass config (batch, step_len, max_cache_len).
        copies: cache buffers alive at once while decoding.

    Returns:
        The estimate with its arithmetic.
    """
    itemsize = kv.numpy_dtype.itemsize
    layers = len(kv.layers)
    cache = 2 * layers * cfg.batch * kv.num_kv_heads * cfg.max_cache_len * kv.head_dim * itemsize * copies
    slots = cfg.max_cache_len * cfg.step_len * cfg.batch
    peak = FOLDING_PEAK_BYTES_PER_SLOT * slots
    return MemoryEstimate(
        cache_bytes=cache,
        cache_text=(
            f"2 × {layers} layers × {cfg.batch} × {kv.num_kv_heads} heads × {cfg.max_cache_len} slots × "
            f"{kv.head_dim} × {itemsize} bytes × {copies} copies = {format_bytes(cache)}"
        ),
        folded_bytes=FOLDED_BYTES_PER_SLOT * slots,
        folding_peak_bytes=peak,
        folding_text=(
            f"~{FOLDING_PEAK_BYTES_PER_SLOT} bytes × {cfg.max_cache_len} slots × {cfg.step_len} × {cfg.batch} = "
            f"{format_bytes(peak)}"
        ),
    )


@register_pass
class StaticKVCachePass(Pass):
    """Make a decoder's KV cache static: fixed buffers updated by ScatterElements at ``cache_position``.

    Input: an exporter-convention decoder (``input_ids`` (B, S), ``attention_mask`` (B, past+S),
    optional ``position_ids`` (B, S), past K/V (B, H_kv, past, D), present K/V (B, H_kv, past+S, D),
    logits (B, S, V)). Output: the same graph with every dim static, a new ``cache_position`` int64
    ``[step_len]`` input, ``attention_mask`` int64 ``(B, max_cache_len)``, past K/V
    ``(B, H_kv, max_cache_len, D)``, and the decode contract in ``metadata_props``. The pass is functional: it
    rewrites a structural copy of the graph (:meth:`ArtifactSet.copy_graph`: no weight copied, the rewritten
    graph holds the same weight tensors) and returns a new set; the graph it was given is left as it was.

    Raises:
        ConfigError: from :meth:`check_settings` / :meth:`check_model` (verification cannot fit, cache
            buffers larger than the memory available).
        PreconditionError: more than one graph, no KV cache found (the message says what was looked for and
            found), no single logits output, an unknown non-cache input, a batch other than the export's fixed
            one, ``max_cache_len < step_len``, opset < 11, or a contract already present.
        PostconditionError: a graph input or output is still dynamic after folding.
    """

    name = "static_kv"
    summary = "Fix batch/step_len/max_cache_len; Concat-appended cache -> ScatterElements at cache_position."
    config_model = StaticKVConfig
    config: StaticKVConfig
    in_place = False

    # ------------------------------------------------------------------------------------- validation

    def check_settings(self, settings: PipelineSettings) -> None:
        """Refuse a verification the static graph cannot run (the caller prefixes the pipeline key).

        Args:
            settings: the pipeline's non-pass sections.

        Raises:
            ConfigError: ``len(prompt) + steps > max_cache_len``, or ``step_len > 1`` with verification.
                Messages start with the key below ``passes[i].static_kv`` (``max_cache_len=…``, ``step_len=…``).
        """
        cfg = self.config
        positions = settings.verify_positions
        if positions is None:
            return
        prompt = settings.verify_prompt_len or 0
        if positions > cfg.max_cache_len:
            raise ConfigError(
                f"max_cache_len={cfg.max_cache_len} is smaller than the {prompt} prompt tokens + "
                f"{positions - prompt} steps = {positions} positions verification decodes; lower verify.steps or "
                "raise max_cache_len"
            )
        if cfg.step_len > 1:
            raise ConfigError(
                f"step_len={cfg.step_len}: the runner decodes one token per call, so a step_len {cfg.step_len} graph "
                "(a prefill bucket) cannot be verified greedily yet; use step_len 1 or set verify: null"
            )

    def check_model(self, model: ir.Model, settings: PipelineSettings) -> None:
        """Find the cache and the logits on the graph (no weights read) and check the buffers fit in memory.

        Args:
            model: the input model.
            settings: the pipeline's non-pass sections.

        Raises:
            PreconditionError: no KV cache, no single logits output, or a batch other than the export's.
            ConfigError: ``2 × layers × B × H_kv × max_cache_len × D × dtype bytes × 3 copies`` plus the
                folded constants, or the peak of folding, exceed
                :func:`onnxdeploy.resources.available_memory_bytes`; the message spells out the arithmetic.
        """
        kv = self._find(model)
        available = available_memory_bytes()
        if available is None:
            return
        why = estimate_memory(kv, self.config).refusal(available)
        if why is not None:
            raise ConfigError(
                f"max_cache_len={self.config.max_cache_len} does not fit in memory: {why}; lower max_cache_len or batch"
            )

    def _find(self, model: ir.Model) -> KVCache:
        """The cache of ``model``, its logits output and a batch consistent with the export, or raise."""
        kv = find_kv_cache(model, who=self.name)
        find_logits_output(model.graph, {t.present_name for t in kv.tensors}, who=self.name)
        fixed = kv.batch
        ids = next((v for v in model.graph.inputs if v.name == "input_ids"), None)
        if fixed is None and ids is not None and ids.shape is not None and isinstance(ids.shape[0], int):
            fixed = ids.shape[0]
        if fixed is not None and fixed != self.config.batch:
            raise PreconditionError(
                self.name,
                f"batch={self.config.batch}, but the export fixed its batch dim to {fixed}; use batch {fixed}",
            )
        return kv

    def requires(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """One graph, ``max_cache_len >= step_len``, ai.onnx opset ≥ 11 and no contract yet.

        Raises:
            PreconditionError: naming what is missing.
        """
        cfg = self.config
        if len(artifacts.artifacts) != 1:
            raise PreconditionError(
                self.name, f"expected one graph (the export); got {len(artifacts.artifacts)}: run static_kv first"
            )
        model = artifacts.primary
        if cfg.max_cache_len < cfg.step_len:
            raise PreconditionError(
                self.name, f"max_cache_len={cfg.max_cache_len} is smaller than step_len={cfg.step_len}"
            )
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        if opset < 11:
            raise PreconditionError(self.name, f"ai.onnx opset {opset} < 11 has no ScatterElements; run pin_opset")
        if "onnxdeploy.contract" in model.metadata_props:
            raise PreconditionError(
                self.name,
                "the model already carries metadata_props['onnxdeploy.contract'] (it was made static before); "
                "run static_kv on the original export",
            )

    # ---------------------------------------------------------------------------------------- rewrite

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Rewrite the cache of the primary graph; see the class docstring."""
        cfg = self.config
        B, S, L = cfg.batch, cfg.step_len, cfg.max_cache_len
        model = artifacts.copy_graph(artifacts.primary)
        g = model.graph
        kv = self._find(model)
        cache_inputs = {t.past_name for t in kv.tensors}
        other = [
            str(v.name)
            for v in g.inputs
            if v.name not in cache_inputs and v.name not in KNOWN_INPUTS and v.name not in g.initializers
        ]
        if other:
            raise PreconditionError(
                self.name,
                f"unknown non-cache graph input(s) {other}; static_kv knows {list(KNOWN_INPUTS)} and the cache",
            )
        if "input_ids" not in {v.name for v in g.inputs}:
            raise PreconditionError(self.name, "the model has no 'input_ids' input")

        query_positions = find_query_positions(model, kv, context, who=self.name)
        if query_positions:
            report.changes.append(f"query-position tensor(s) {query_positions} now read the cache_position input")
        elif S > 1:
            raise PreconditionError(
                self.name,
                "no query-position tensor (past_len + arange(S)) found; a static step_len > 1 graph would get a "
                "wrong causal mask. Use step_len 1.",
            )
        else:
            report.warnings.append(
                "no query-position tensor found; the causal mask relies on attention_mask alone (fine for "
                "step_len 1 without sliding window)"
            )

        cache_position = add_cache_position(g, S, who=self.name)
        report.changes.append(f"added input {CACHE_POSITION} int64 [{S}]")
        report.changes += rewrite_cache_writes(
            g,
            kv,
            cache_position=cache_position,
            seq_axis=kv.seq_axis,
            cache_update=cfg.cache_update,
            max_cache_len=L,
            step_len=S,
        )
        feed_query_positions(g, query_positions, cache_position)
        report.dims_fixed += fix_io_dims(g, kv, batch=B, step_len=S, max_cache_len=L)

        n_inf = replace_neg_inf(g)
        folded = refold_and_infer(model)
        n_inf += replace_neg_inf(folded.graph)
        if n_inf:
            report.changes.append(f"{n_inf} -inf constant(s) replaced by the dtype's finite minimum")
        left = sorted({n.op_type for n in folded.graph if n.op_type in _FOLDED_AWAY})
        if left:
            report.warnings.append(f"ops left after folding: {left}")

        contract = build_contract(
            folded, kv, batch=B, step_len=S, max_cache_len=L, cache_update=cfg.cache_update, who=self.name
        )
        write_contract(folded, contract)
        report.changes.append(
            f"contract: {len(kv.layers)} layers, H_kv={kv.num_kv_heads}, D={kv.head_dim}, batch={B}, step_len={S}, "
            f"max_cache_len={L}, {cfg.cache_update}"
        )
        return artifacts.with_models([folded]), True

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Every graph input and output of the primary graph has a fully static shape.

        Raises:
            PostconditionError: naming the first dynamic input or output and its dims.
        """
        g = artifacts.primary.graph
        for value in [*g.inputs, *g.outputs]:
            shape = value.shape
            if shape is None or not all(isinstance(d, int) for d in shape):
                raise PostconditionError(self.name, f"'{value.name}' is not static after the rewrite: {shape}")
