"""What every pass of this package is to a user: its name, one-line summary and config model (pydantic only).

``onnxdeploy passes`` lists passes from here, and the pipeline loader validates each ``passes[i]`` entry against
its config model here, so neither imports the pass modules: those import onnx and onnx_ir, whose ``ml_dtypes``
import alone takes ~1.5 s (issue 20). A pass module imports its config class from this module, and
:func:`~onnxdeploy.passes._pass_infra.register_pass` registers its class against the entry of :data:`CATALOG`
named like it: the same config model, the module named here, and the summary given here (the class sets none;
the decorator fills ``Pass.summary`` in). ``tests/core/test_pass_catalog.py`` checks that the catalogue and the
registry filled by importing every pass module say the same.

Imports: pydantic, typing, :mod:`onnxdeploy.contract_terms`, :mod:`onnxdeploy.contract_cache` and
:mod:`onnxdeploy.passes._quant_rules` (pydantic only) only (no onnx, onnx_ir, numpy).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from onnxdeploy.contract_cache import CachePolicy
from onnxdeploy.contract_terms import CacheWrite
from onnxdeploy.passes._quant_rules import Budget, QuantRule

__all__ = [
    "CATALOG",
    "LOWEST_OPSET",
    "PROVE_MAX_BYTES",
    "EmbedExternalDataConfig",
    "ExternalizeConfig",
    "FuseMatMulsConfig",
    "GroupedAttentionConfig",
    "KVLayoutConfig",
    "Layout",
    "MaskRewriteConfig",
    "PassConfig",
    "PassInfo",
    "PinOpsetConfig",
    "QuantizeWeightsConfig",
    "SplitConfig",
    "StaticKVConfig",
    "describe_config",
]


class PassConfig(BaseModel):
    """Base of every pass config: typed, described fields; unknown keys and coerced types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


Layout = Literal["BHSD", "BSH2D", "BHDS_K"]
"""``kv_layout``'s cache layouts: BHSD (B, H_kv, L, D); BSH2D (B, L, H_kv, 2·D), K and V packed; BHDS_K, K as
(B, H_kv, D, L)."""

LOWEST_OPSET = 11
"""The lowest target ``pin_opset`` is tested to reach (the LLaMA exports lower to 11, IR 7)."""

PROVE_MAX_BYTES = 256 * 2**20
"""``pin_opset``'s proof runs by default on graphs with at most this many bytes of weights (256 MiB: two ORT CPU
sessions and their random feeds stay well inside a CI machine's memory and a few seconds)."""


class StaticKVConfig(PassConfig):
    """Config of ``static_kv``."""

    batch: int = Field(1, ge=1, description="Fixed batch size B of every input.")
    step_len: int | None = Field(
        None, ge=1, description="Tokens per call S of the one graph (1, the default: the decode graph); or step_lens."
    )
    step_lens: list[int] | None = Field(
        None,
        min_length=1,
        description="Several step lengths (1 = decode graph, larger = prefill buckets): one graph per (step "
        "length, cache length), all sharing one weights file.",
    )
    max_cache_len: int | None = Field(
        None, ge=1, description="Slots of the fixed cache buffer (B, H_kv, max_cache_len, D); bounds the context."
    )
    max_cache_lens: list[int] | None = Field(
        None,
        min_length=1,
        description="Several cache lengths: one graph per (step length, cache length); the host runs the smallest "
        "that fits the context and moves the buffers into the next one when it outgrows it.",
    )
    prefill_logits: Literal["last", "all"] = Field(
        "last",
        description="Graphs with step_len > 1: last = logits (B, 1, V) of the position at the last_token_index "
        "input only (the LM head skips the others); all = logits (B, step_len, V).",
    )
    cache_update: Literal["full_buffer", "new_token_only"] = Field(
        "full_buffer",
        description="full_buffer: present.* outputs are the updated buffers (B, H_kv, max_cache_len, D); "
        "new_token_only: present.* are the step's K/V (B, H_kv, step_len, D) for the host to write at "
        "cache_position.",
    )
    kv_dtype: Literal["float32", "float16"] | None = Field(
        None,
        description="Cache element type apart from the compute dtype (e.g. float16 on an fp32 model): cache I/O in "
        "this dtype, cast at the cache boundary; default: the model's.",
    )
    cache_write: CacheWrite | None = Field(
        None,
        description="How the graph writes the call's K/V at cache_position: scatter_elements, scatter_nd, where "
        "(Equal on a slot-index range + Where, for NPUs without a Scatter lowering) or host (cache_update "
        "new_token_only: the host writes; attention reads a where-written buffer); default: the target's "
        "matrix defaults.cache_write, else scatter_elements.",
    )

    row_positions: bool = Field(
        False,
        description="cache_position (B, S): each batch row writes and masks at its own positions (continuous "
        "batching; rows at different positions need mask_rewrite after static_kv). Contract version 4.",
    )
    prefill_batch: int | None = Field(
        None,
        ge=1,
        description="Batch of the step_len > 1 graphs of the set (1: a request is prefilled alone and its cache "
        "copied into a free row of the decode buffers); default: batch.",
    )
    window_cache: bool = Field(
        False,
        description="Layers with a sliding window W (read off the graph, confirmed by running) get ring buffers of "
        "W + max(step_lens) - 1 slots, slot = position mod that length; global layers keep max_cache_len (a "
        "mixed model's rings are read through a Gather view; every layout and cache_write). Needs mask_rewrite "
        "after, and full_buffer.",
    )
    cache_policy: CachePolicy | None = Field(
        None,
        description="{sinks: N, recent: R}: past max_cache_len the host keeps the first N positions and a ring of "
        "the last R (written in the contract; mask_rewrite then masks from slot_positions). Needs mask_rewrite "
        "after, the export's position_ids; sinks + recent <= max_cache_len.",
    )

    @model_validator(mode="after")
    def _one_form_each(self) -> Self:
        if (self.max_cache_len is None) == (self.max_cache_lens is None):
            raise ValueError("give exactly one of max_cache_len and max_cache_lens")
        if self.window_cache and (self.cache_update != "full_buffer" or self.cache_policy is not None):
            raise ValueError("window_cache needs cache_update full_buffer and no cache_policy")
        policy = self.cache_policy
        if policy is not None and policy.sinks + policy.recent > max(self.caches()):
            raise ValueError(
                f"cache_policy sinks {policy.sinks} + recent {policy.recent} > max_cache_len {max(self.caches())}: "
                "the kept tokens must fit the cache"
            )
        if self.step_len is not None and self.step_lens is not None:
            raise ValueError("give step_len or step_lens, not both")
        for key in ("step_lens", "max_cache_lens"):
            values = getattr(self, key)
            if values is not None and (min(values) < 1 or len(set(values)) != len(values)):
                raise ValueError(f"{key} must hold distinct integers >= 1, got {values}")
        if self.cache_write == "host":
            if "cache_update" in self.model_fields_set and self.cache_update != "new_token_only":
                raise ValueError("cache_write host means cache_update new_token_only (the host writes the cache)")
            self.cache_update = "new_token_only"
        if max(self.steps()) > min(self.caches()):
            raise ValueError(
                f"step length {max(self.steps())} does not fit cache length {min(self.caches())}: every step length "
                "must be <= every cache length"
            )
        return self

    def steps(self) -> list[int]:
        """The step lengths, ascending (``[1]`` when neither key is given)."""
        return sorted(self.step_lens) if self.step_lens is not None else [self.step_len or 1]

    def caches(self) -> list[int]:
        """The cache lengths, ascending."""
        return sorted(self.max_cache_lens) if self.max_cache_lens is not None else [self.max_cache_len or 0]

    def mask_rewrite_reason(self) -> str | None:
        """Why this config needs a later ``mask_rewrite``, else None (README: "Ring caches", "Past max_cache_len").

        A ring slot (``window_cache``) or a slot past ``max_cache_len`` (``cache_policy``) is masked by the position
        it holds, which the exporter's ``attention_mask`` mask cannot say; without it the contract would declare a
        host that feeds ``slot_positions`` to a graph that never reads them.
        """
        if self.window_cache:
            return "window_cache: a ring slot is masked by its position"
        if self.cache_policy is not None:
            return "cache_policy: its host masks by slot_positions, which only mask_rewrite's mask reads"
        return None

    def graphs(self) -> list[tuple[int, int]]:
        """Every ``(step_len, max_cache_len)`` pair, the primary graph (smallest S, largest L) first.

        Then the other decode-length graphs by cache length, then the prefill buckets by step length and
        cache length.
        """
        steps, caches = self.steps(), self.caches()
        primary = (steps[0], caches[-1])
        rest = sorted(((s, c) for s in steps for c in caches if (s, c) != primary), key=lambda sc: (sc[0], sc[1]))
        return [primary, *rest]


class MaskRewriteConfig(PassConfig):
    """Config of ``mask_rewrite``."""

    padding: bool = Field(
        False,
        description="Keep the attention_mask input (int64 (B, max_cache_len), 1 = the slot may be attended) and "
        "AND it with the causal/window mask, for padded batches; false removes the input.",
    )


class GroupedAttentionConfig(PassConfig):
    """Config of ``grouped_attention`` (the rewrite is exact; only the rank of the grouped products is chosen)."""

    max_rank: Literal[4, 5] = Field(
        4,
        description="4: fold the query group into the rows ((B, H_kv, G*S, D)), one product per KV head; 5: a "
        "one-token graph multiplies each query head by the buffer broadcast over the group ((G, B, H_kv, 1, D) "
        "@ (B, H_kv, D, L); ORT CPU's matrix-vector path, no packing of the cache; the same decode step time on "
        "benchmarks/decode.py)",
    )


class KVLayoutConfig(PassConfig):
    """Config of ``kv_layout``."""

    layout: Layout = Field(
        description="Cache layout: BHSD (B, H_kv, L, D); BSH2D (B, L, H_kv, 2·D), K and V packed on the last axis "
        "(one input and one output per layer); BHDS_K: K transposed (B, H_kv, D, L), V as BHSD."
    )
    pad_head_dim_to: int | None = Field(
        None,
        ge=1,
        description="Pad the cache head dim with zeros up to a multiple of this (e.g. 32 or 64, the NPU's SIMD "
        "width); exact. None: no padding.",
    )
    cache_write: CacheWrite | None = Field(
        None,
        description="How the graph writes the call's K/V in the new layout: scatter_elements, scatter_nd, where "
        "(Equal + Where) or host (cache_update new_token_only); default: the method the graph already uses.",
    )


class FuseMatMulsConfig(PassConfig):
    """Config of ``fuse_matmuls``."""

    exclude: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of MatMul node names to leave apart (e.g. '*/mlp/*' keeps gate/up unfused)",
    )


class QuantizeWeightsConfig(PassConfig):
    """Config of ``quantize_weights``."""

    bits: Literal[4, 8] = Field(4, description="Weight bits: 8 = per output channel, 4 = per group of block_size.")
    block_size: Literal[16, 32, 64, 128] = Field(
        32,
        description="Input channels per group for bits 4 (a K that is not a multiple: a partial last block in "
        "DequantizeLinear, as ONNX's blocked form allows; the zero level as padding in MatMulNBits).",
    )
    symmetric: bool = Field(True, description="Signed values without zero point; false: unsigned + zero points.")
    format: Literal["qdq", "matmulnbits"] = Field(
        "qdq",
        description="qdq: DequantizeLinear -> original op (runtimes that fold weight-only QDQ, e.g. ORT EPs; not "
        "RK3588: RKNN-Toolkit2 2.5.0 cannot build it; its NPU quantizes weights and activations itself, "
        "sdk.quantization); matmulnbits: com.microsoft::MatMulNBits (ORT).",
    )
    accuracy_level: Literal[0, 1, 2, 3, 4] = Field(
        0, description="MatMulNBits accuracy_level (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations)."
    )
    lm_head: bool = Field(True, description="Quantize the LM head (the MatMul/Gemm producing the logits).")
    embedding: bool = Field(False, description="Quantize embedding Gather tables (dequantized by DequantizeLinear).")
    exclude: list[str] = Field(default_factory=list, description="Node names (shell patterns) left in float.")
    rules: list[QuantRule] = Field(
        default_factory=list,
        description="Per-weight bits/block_size: [{nodes: PATTERN and/or kind: matmul|gemm|embedding|lm_head, "
        "bits: 4|8|float, block_size: 16..128}], applied in order after lm_head/embedding/exclude; later wins.",
    )
    act_order: bool = Field(
        False,
        description="Permute input channels by calibration importance, folded into the graph (needs calibration).",
    )
    method: Literal["rtn", "gptq"] = Field(
        "rtn", description="rtn: round to nearest; gptq: GPTQ error compensation (needs calibration)."
    )
    scale_search: Literal["none", "mse"] = Field(
        "none",
        description="mse: each block's scale from the clipping ratio of its range with the least squared error "
        "(weighted by diag(X^T X) when calibration is given); none: the range's extremes (ORT's MLAS rule).",
    )
    gptq_damp: float = Field(0.01, gt=0, le=1, description="GPTQ dampening: this fraction of mean(diag(H)) is added.")
    budget: Budget | None = Field(
        None,
        description="{max_mean_kl, max_ppl_ratio} on the calibration text: keep the fewest-bytes candidate of INT4 "
        "g128/g64/g32, INT8 per channel that meets it (bits/block_size then come from the candidate; rules apply).",
    )
    raise_opset: bool = Field(
        True,
        description="qdq: raise ai.onnx to 13 (per-axis INT8; 19 for float16/bfloat16 weights) / 21 and IR 10 "
        "(blocked INT4) when lower; false: refuse.",
    )

    @model_validator(mode="after")
    def _int8_blocks(self) -> QuantizeWeightsConfig:
        # QDQ INT8 is per output channel: a block size asked for it would be silently ignored
        for i, rule in enumerate(self.rules):
            if self.format == "qdq" and rule.bits == 8 and rule.block_size is not None:
                raise ValueError(
                    f"rules[{i}]: block_size with bits 8 in format qdq (INT8 is per output channel there); drop "
                    "block_size, or use format: matmulnbits (blocked INT8)"
                )
        return self


class PinOpsetConfig(PassConfig):
    """Config of ``pin_opset``."""

    opset: int = Field(
        ...,
        description=f"Target ai.onnx opset, {LOWEST_OPSET} up to the newest the installed onnx knows "
        "(onnx.defs.onnx_opset_version()); raised or lowered.",
    )
    prove: bool = Field(
        True,
        description="Prove the conversion: run the input and the output on ONNX Runtime CPU on the same random "
        "feeds and refuse to write an output that differs (float32 beyond rtol 1e-3/atol 1e-4). Skipped for "
        f"decoders (verify decodes them) and graphs with more than {PROVE_MAX_BYTES // 2**20} MiB of weights; "
        "false turns it off.",
    )

    @field_validator("opset")
    @classmethod
    def _in_range(cls, opset: int) -> int:
        import onnx  # noqa: PLC0415  (only when a pipeline names pin_opset: the range is the installed onnx's)

        newest = onnx.defs.onnx_opset_version()
        if not LOWEST_OPSET <= opset <= newest:
            raise ValueError(
                f"opset {opset} is outside the supported range {LOWEST_OPSET}..{newest} ({newest}: the newest "
                f"opset onnx {onnx.__version__} knows)"
            )
        return opset


class ExternalizeConfig(PassConfig):
    """Config of ``externalize``."""

    size_threshold: int = Field(
        1024, ge=0, description="Initializers larger than this many bytes go to the shared external data file."
    )


class EmbedExternalDataConfig(PassConfig):
    """Config of ``embed_external_data`` (no fields)."""


class SplitConfig(PassConfig):
    """Config of ``split``: how many parts, given, chosen from a size limit per part, or from the target's limit."""

    parts: int | Literal["auto"] | None = Field(
        None,
        description="Parts K to cut the decoder into, at layer boundaries (2 <= K <= the layer count), or auto: the "
        "fewest parts whose weights each fit the target's context_bytes limit (matrices/<target>.yaml, e.g. "
        "ort-qnn's 4 GB HTP context).",
    )
    max_part_bytes: int | None = Field(
        None,
        ge=1,
        description="Instead of parts: the fewest parts whose weights each fit this many bytes (e.g. an NPU "
        "context's limit); a layer larger than it is refused before any pass.",
    )

    weights: Literal["shared", "per_part"] = Field(
        "shared",
        description="shared: every part reads the run's one weights file; per_part: each part's weights go to a "
        "data file of its own (<stem>.part<i>.data), a tensor two parts read (a tied embedding/LM head) stored in "
        "both, and the report names it.",
    )

    @model_validator(mode="after")
    def _one_way(self) -> Self:
        if (self.parts is None) == (self.max_part_bytes is None):
            raise ValueError("give exactly one of parts and max_part_bytes")
        if isinstance(self.parts, int) and self.parts < 2:
            raise ValueError(f"parts={self.parts}: give 2 or more (or auto, or max_part_bytes)")
        return self


@dataclass(frozen=True)
class PassInfo:
    """One pass as a user meets it.

    Attributes:
        name: the registry key used in ``pipeline.yaml``.
        module: the pass module under ``onnxdeploy.passes`` that implements it (imported only to run it).
        summary: one line for ``onnxdeploy passes`` (and ``Pass.summary``).
        config_model: the pydantic config class (unknown keys are errors).
    """

    name: str
    module: str
    summary: str
    config_model: type[PassConfig]


def _entries(*infos: PassInfo) -> dict[str, PassInfo]:
    return {info.name: info for info in infos}


CATALOG: dict[str, PassInfo] = _entries(
    PassInfo(
        "static_kv",
        "static_kv",
        "Fix batch/step_len/max_cache_len (or a graph set); Concat-appended cache -> ScatterElements.",
        StaticKVConfig,
    ),
    PassInfo(
        "mask_rewrite",
        "mask_rewrite",
        "Exporter mask -> Where(mask from cache_position, scores, lowest) before each Softmax; drops attention_mask.",
        MaskRewriteConfig,
    ),
    PassInfo(
        "grouped_attention",
        "grouped_attention",
        "GQA head repeat (Expand/Tile of the cache) and K scale Mul -> grouped attention over the buffer: "
        "(B, H_kv, G*S, D), or (G, B, H_kv, 1, D) for one token with max_rank 5.",
        GroupedAttentionConfig,
    ),
    PassInfo(
        "kv_layout",
        "kv_layout",
        "Cache layout BHSD | BSH2D (K/V packed) | BHDS_K (K transposed), head dim padded; written in that layout.",
        KVLayoutConfig,
    ),
    PassInfo(
        "fuse_matmuls",
        "fuse_matmuls",
        "MatMuls reading one activation with their own constant weights (q/k/v, gate/up) -> one MatMul + Split; "
        "MatMulNBits of one format likewise.",
        FuseMatMulsConfig,
    ),
    PassInfo(
        "quantize_weights",
        "quantize_weights",
        "Weight-only INT8/INT4 (QDQ or MatMulNBits) per rule, act-order folded into the graph, RTN or GPTQ, "
        "clipping scale search, an accuracy budget.",
        QuantizeWeightsConfig,
    ),
    PassInfo(
        "pin_opset",
        "pin_opset",
        "Convert ai.onnx to a target opset (onnx version_converter plus exact adapters); checks the result with "
        "full shape inference and proves it on ORT CPU on random feeds (prove); names any op it cannot convert.",
        PinOpsetConfig,
    ),
    PassInfo(
        "split",
        "split",
        "Cut each static graph at layer boundaries into K parts run in sequence (hidden state in/out, each part "
        "its layers' caches); the contract lists the parts.",
        SplitConfig,
    ),
    PassInfo(
        "externalize",
        "external_data",
        "Write weights above size_threshold bytes to one external data file shared by all graphs.",
        ExternalizeConfig,
    ),
    PassInfo(
        "embed_external_data",
        "external_data",
        "Write every weight inline in the .onnx file (refused above the 2 GiB protobuf limit).",
        EmbedExternalDataConfig,
    ),
)
"""Every pass of this package by name (``register_pass`` refuses a package pass missing here)."""


def describe_config(config_model: type[BaseModel]) -> list[dict[str, Any]]:
    """List a config's fields: name, type, default and description (for ``onnxdeploy passes``).

    Returns:
        One dict per field in declaration order: ``name``, ``type`` (``Literal`` members spelled out, e.g.
        ``4 | 8``), ``default`` (None when required), ``required``, ``description``.
    """
    rows = []
    for fname, fld in config_model.model_fields.items():
        ann = fld.annotation
        members = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
        if any(typing.get_origin(m) is typing.Literal for m in members):  # Literal[...] or Literal[...] | None
            type_name = " | ".join(
                str(a) if typing.get_origin(m) is typing.Literal else "None" if a is type(None) else a.__name__
                for m in members
                for a in (typing.get_args(m) if typing.get_origin(m) is typing.Literal else (m,))
            )
        else:
            type_name = getattr(ann, "__name__", str(ann)).replace("typing.", "")
        rows.append(
            {
                "name": fname,
                "type": type_name,
                "default": None if fld.is_required() else fld.get_default(call_default_factory=True),
                "required": fld.is_required(),
                "description": fld.description or "",
            }
        )
    return rows
