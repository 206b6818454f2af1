"""``quantize_weights``: weight-only INT8/INT4 for MatMul/Gemm (and optionally embedding Gather) weights.

What the pass does (DESIGN.md, "Passes" → ``quantize_weights``; issue 7):

* **Targets.** ``MatMul`` and ``Gemm`` (either ``transB``; ``transA=0``, ``alpha=beta=1``) whose weight input is
  constant: an initializer (or ``Constant``) reached through a chain of ``Cast``/``Transpose``/``Identity``
  nodes, which is folded (an fp16 weight reaching a float32 MatMul through a Cast is quantized from its fp16
  values and dequantized to float32). The LM head (the MatMul/Gemm feeding the logits output) is included
  unless ``lm_head: false``; embedding ``Gather`` tables only with ``embedding: true``; ``exclude`` drops nodes
  by name (shell patterns). A weight several nodes read (a tied embedding and LM head) is quantized **once**
  and every consumer reads the same quantized tensor, transposed where its layout differs.
* **Granularity.** ``bits: 8``: per output channel. ``bits: 4``: per group of ``block_size`` input channels
  (16/32/64/128); a ``K`` that is not a multiple is padded (MatMulNBits) or ends in a partial block (QDQ).
  Symmetric (signed, no zero point) or asymmetric (unsigned with zero points); scales follow ORT's MLAS rules
  (:mod:`onnxdeploy.passes._weight_quant`).
* **Formats.** ``qdq``: ``DequantizeLinear`` feeding the original op. Per-axis INT8 needs ai.onnx opset ≥ 13
  (19 for float16/bfloat16 weights, whose scales keep that dtype),
  blocked INT4 opset ≥ 21 and IR ≥ 10: with ``raise_opset: true`` the graph is converted first (``pin_opset``'s
  converter), otherwise the pass refuses; no ``block_size`` attribute is ever written below opset 21.
  ``matmulnbits``: ``com.microsoft::MatMulNBits`` (INT8 as one block spanning ``K``: the next power of two
  ≥ ``K``, which ORT runs exactly), with ``accuracy_level``; the ``com.microsoft`` import is added. Embedding
  tables are always dequantized by ``DequantizeLinear`` (ORT's ``MatMulNBits`` has no Gather form).
* **Act-order** (``act_order: true``, needs ``calibration`` in the pipeline): input-channel importance
  ``diag(X^T X)`` is collected on the calibration tokens by running the model through the runner's decode
  loop; ``K`` is permuted by decreasing importance so each group holds channels of similar importance. The
  permutation is folded into the graph exactly: into the output channels of the producing MatMuls when the
  activation is an elementwise function of them alone (the MLP's gate/up rows with down's columns); for
  o_proj, into V's output channels within each KV head where V's channels never leave the graph
  (:mod:`onnxdeploy.passes._value_fold`; with a KV cache they do, so not there); else by a ``Gather`` on the
  activation (shared by every weight reading it). No ``g_idx`` is left. ``details.act_order`` lists each
  activation's fold and, for o_proj kept as a Gather, the reason.
* **GPTQ** (``method: gptq``, needs ``calibration``): error compensation over ``X^T X`` with the act-order
  as column order (natural order without act-order).
* **Report.** ``details.layers``: per weight, the calibration-weighted weight error of plain round-to-nearest
  in natural order and of what was emitted, and the fraction removed.

Weights are streamed: each is read (memory-mapped), quantized, and its quantized tensors written to a scratch
data file (mapped back) before the next is read, so memory holds one float weight at a time.
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx_ir as ir
from pydantic import Field

from onnxdeploy.artifacts import ArtifactSet, ScratchWriter
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.model_io import release_weights, stand_in_proto
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._pass_infra import Pass, PassConfig, register_pass
from onnxdeploy.passes._probe import calibration_decoder, open_probe, pruned_copy
from onnxdeploy.passes._value_fold import PROBES, ValueFold, concrete_dims, plan_value_fold
from onnxdeploy.passes._weight_quant import (
    act_order_permutation,
    gptq,
    inverse_hessian_factor,
    output_error,
    pack_matmulnbits,
    quantize_rtn,
    quantize_rtn_kn,
    quantize_rtn_stored,
)
from onnxdeploy.report import PassReport
from onnxdeploy.settings import PipelineSettings

__all__ = ["QuantizeWeightsConfig", "QuantizeWeightsPass"]

_CHAIN_OPS = {"Cast", "Transpose", "Identity"}
_ELEMENTWISE = {
    "Mul",
    "Add",
    "Sub",
    "Div",
    "Sigmoid",
    "Tanh",
    "Relu",
    "Erf",
    "Gelu",
    "FastGelu",
    "Softplus",
    "Neg",
    "Cast",
    "Identity",
    "Pow",
    "Sqrt",
    "Exp",
}
"""Ops through which a per-channel permutation of the last axis commutes (with scalar/other permuted operands)."""
_TO_LOGITS = {"Reshape", "Identity", "Cast", "Squeeze", "Unsqueeze", "Slice", "Add", "Mul", "Div", "Softcap"}
INLINE_BYTES = 1024
"""Quantized tensors up to this size stay in memory; larger ones are written to the scratch data file."""
CALIBRATION_CHUNK = 256
"""Tokens per calibration call for exporter-convention models (a contract model takes max_cache_len)."""


class QuantizeWeightsConfig(PassConfig):
    """Config of ``quantize_weights``."""

    bits: Literal[4, 8] = Field(4, description="Weight bits: 8 = per output channel, 4 = per group of block_size.")
    block_size: Literal[16, 32, 64, 128] = Field(
        32, description="Input channels per group for bits 4 (a K that is not a multiple is padded)."
    )
    symmetric: bool = Field(True, description="Signed values without zero point; false: unsigned + zero points.")
    format: Literal["qdq", "matmulnbits"] = Field(
        "qdq", description="qdq: DequantizeLinear -> original op (NPUs); matmulnbits: com.microsoft::MatMulNBits (ORT)."
    )
    accuracy_level: Literal[0, 1, 2, 3, 4] = Field(
        0, description="MatMulNBits accuracy_level (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations)."
    )
    lm_head: bool = Field(True, description="Quantize the LM head (the MatMul/Gemm producing the logits).")
    embedding: bool = Field(False, description="Quantize embedding Gather tables (dequantized by DequantizeLinear).")
    exclude: list[str] = Field(default_factory=list, description="Node names (shell patterns) left in float.")
    act_order: bool = Field(
        False,
        description="Permute input channels by calibration importance, folded into the graph (needs calibration).",
    )
    method: Literal["rtn", "gptq"] = Field(
        "rtn", description="rtn: round to nearest; gptq: GPTQ error compensation (needs calibration)."
    )
    gptq_damp: float = Field(0.01, gt=0, le=1, description="GPTQ dampening: this fraction of mean(diag(H)) is added.")
    raise_opset: bool = Field(
        True,
        description="qdq: raise ai.onnx to 13 (per-axis INT8; 19 for float16/bfloat16 weights) / 21 and IR 10 "
        "(blocked INT4) when lower; false: refuse.",
    )


def _default_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def _unique(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def _names(graph: ir.Graph) -> set[str]:
    names = {str(v.name) for v in graph.inputs} | set(graph.initializers)
    names |= {str(o.name) for node in graph for o in node.outputs}
    names |= {str(node.name) for node in graph if node.name}
    return names


# ------------------------------------------------------------------------------------------ targets


@dataclass
class _Weight:
    """A constant weight after its Cast/Transpose chain: where it starts, what it looks like at the consumer."""

    root: ir.Value
    chain: list[ir.Node]
    transposed: bool  # the consumer reads the root transposed
    dtype: ir.DataType  # element type the consumer reads
    shape: tuple[int, int]  # shape the consumer reads


def _tensor_of(value: ir.Value) -> ir.TensorProtocol | None:
    if value.const_value is not None:
        return value.const_value
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].as_tensor()
    return None


def _resolve_weight(value: ir.Value | None) -> _Weight | None:
    """Follow Cast/Transpose/Identity producers back to a constant 2-D float tensor, or None."""
    if value is None:
        return None
    chain: list[ir.Node] = []
    transposed = False
    cur = value
    while _tensor_of(cur) is None:
        node = cur.producer()
        if node is None or node.op_type not in _CHAIN_OPS or node.domain not in ("", "ai.onnx"):
            return None
        if len(node.inputs) != 1:
            return None
        if node.op_type == "Transpose":
            perm = node.attributes.get_ints("perm", None)
            if perm is not None and list(perm) not in ([1, 0], [0, 1]):
                return None
            transposed ^= perm is None or list(perm) == [1, 0]
        chain.insert(0, node)
        cur = node.inputs[0]
        if cur is None:
            return None
    tensor = _tensor_of(cur)
    assert tensor is not None
    if len(tensor.shape) != 2 or not tensor.dtype.is_floating_point():
        return None
    dtype = value.dtype or tensor.dtype
    for node in chain:
        if node.op_type == "Cast":
            dtype = ir.DataType(node.attributes.get_int("to"))
    if not dtype.is_floating_point():
        return None
    rows, cols = (int(d) for d in tensor.shape)
    return _Weight(cur, chain, transposed, dtype, (cols, rows) if transposed else (rows, cols))


@dataclass
class _Target:
    """One node whose weight is quantized.

    ``nk``: the consumer reads the weight as (N, K) (Gemm transB=1, Gather) rather than (K, N).
    """

    node: ir.Node
    kind: Literal["matmul", "gemm", "gather"]
    weight: _Weight
    input_index: int
    nk: bool
    lm_head: bool = False

    @property
    def activation(self) -> ir.Value | None:
        return None if self.kind == "gather" else self.node.inputs[0]

    @property
    def root_nk(self) -> bool:
        """The root initializer is stored (N, K)."""
        return self.nk != self.weight.transposed


def _logits_value(model: ir.Model) -> ir.Value | None:
    contract = read_contract(model)
    outputs = {str(v.name): v for v in model.graph.outputs}
    if contract is not None:
        return outputs.get(contract.logits)
    if "logits" in outputs:
        return outputs["logits"]
    from onnxdeploy.kv_cache import find_kv_cache, find_logits_output  # noqa: PLC0415

    try:
        kv = find_kv_cache(model, who="quantize_weights")
        return find_logits_output(model.graph, {t.present_name for t in kv.tensors}, who="quantize_weights")
    except PreconditionError:
        return None


def _lm_head_node(model: ir.Model) -> ir.Node | None:
    value = _logits_value(model)
    for _ in range(8):
        node = value.producer() if value is not None else None
        if node is None:
            return None
        if node.op_type in ("MatMul", "Gemm"):
            return node
        if node.op_type not in _TO_LOGITS:
            return None
        value = node.inputs[0]
    return None


def find_targets(model: ir.Model, cfg: QuantizeWeightsConfig) -> tuple[list[_Target], list[str]]:
    """The nodes whose weights the config quantizes, and notes on the nodes skipped (why)."""
    lm_head = _lm_head_node(model)
    targets: list[_Target] = []
    skipped: list[str] = []
    matched_patterns: set[str] = set()
    for node in model.graph:
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm", "Gather"):
            continue
        label = node.name or f"<{node.op_type} -> {node.outputs[0].name}>"
        if node.op_type == "Gather":
            if node.attributes.get_int("axis", 0) != 0:
                continue
            weight = _resolve_weight(node.inputs[0])
            if weight is None or weight.transposed:
                continue
            target = _Target(node, "gather", weight, 0, nk=True)
        else:
            weight = _resolve_weight(node.inputs[1] if len(node.inputs) > 1 else None)
            if weight is None:
                continue
            kind: Literal["matmul", "gemm"] = "matmul" if node.op_type == "MatMul" else "gemm"
            nk = False
            if kind == "gemm":
                attrs = node.attributes
                plain = attrs.get_float("alpha", 1.0) == 1.0 and attrs.get_float("beta", 1.0) == 1.0
                if attrs.get_int("transA", 0) or not plain:
                    skipped.append(f"{label}: Gemm with transA/alpha/beta other than 0/1/1 is left in float")
                    continue
                nk = bool(attrs.get_int("transB", 0))
            target = _Target(node, kind, weight, 1, nk=nk, lm_head=node is lm_head)
        hit = [p for p in cfg.exclude if node.name and fnmatch.fnmatchcase(node.name, p)]
        if hit:
            matched_patterns.update(hit)
            skipped.append(f"{label}: excluded by {hit}")
            continue
        if target.lm_head and not cfg.lm_head:
            skipped.append(f"{label}: LM head (lm_head: false)")
            continue
        if target.kind == "gather" and not cfg.embedding:
            skipped.append(f"{label}: embedding Gather (embedding: false)")
            continue
        targets.append(target)
    for pattern in cfg.exclude:
        if pattern not in matched_patterns:
            skipped.append(f"exclude pattern {pattern!r} matched no quantizable node")
    return targets, skipped


# ----------------------------------------------------------------------------------- act-order folding


@dataclass
class _Fold:
    """How one activation's input-channel permutation reaches the graph.

    ``producers``: MatMul targets whose output channels are permuted instead (with the elementwise region
    between them and the activation, or by ``producer_perm`` when it differs: V within each head for o_proj);
    empty means a Gather on the activation. ``how``: what the report says.
    """

    activation: ir.Value
    perm: np.ndarray
    producers: list[_Target] = field(default_factory=list)
    region: list[ir.Node] = field(default_factory=list)
    bias_constants: list[tuple[ir.Node, int]] = field(default_factory=list)
    producer_perm: np.ndarray | None = None
    how: str = "by a Gather on the activation"

    @property
    def out_perm(self) -> np.ndarray:
        """The permutation of the producers' output channels."""
        return self.perm if self.producer_perm is None else self.producer_perm


def _split_reason(activation: ir.Value) -> str | None:
    """Why the producer fold cannot take ``activation`` when its elementwise region starts at a ``Split`` of a MatMul.

    ``fuse_matmuls`` leaves gate/up as one MatMul + Split: the permutation would have to go into two column
    ranges of one weight, which the fold does not do. Returns the report's reason, or None.
    """
    todo, seen = [activation], set()
    while todo:
        value = todo.pop()
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "Split" and node.inputs and node.inputs[0] is not None:
            source = node.inputs[0].producer()
            if source is not None and source.op_type in ("MatMul", "MatMulNBits"):
                return (
                    f"its producers are one fused MatMul '{source.name}' + Split (fuse_matmuls); to fold into "
                    "them, leave them apart (fuse_matmuls exclude)"
                )
        if node.op_type in _ELEMENTWISE:
            todo.extend(v for v in node.inputs if v is not None)
    return None


def _producer_region(
    activation: ir.Value, readers: set[int], by_node: dict[int, _Target], k: int
) -> tuple[list[_Target], list[ir.Node], list[tuple[ir.Node, int]]] | None:
    """The MatMul targets whose output channels can carry a permutation of ``activation``'s last axis, or None.

    ``activation`` must be an elementwise function (``_ELEMENTWISE``) of MatMul outputs ``(..., K)`` with
    constant weights (and scalars or ``(K,)`` constants); every value of that region is read only inside it
    (or, for ``activation``, by the nodes in ``readers``), so permuting the producers' columns permutes
    ``activation`` and nothing else.
    """
    producers: list[_Target] = []
    region: list[ir.Node] = []
    consts: list[tuple[ir.Node, int]] = []
    inside: set[int] = set()
    todo = [activation]
    seen: set[int] = set()
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        node = value.producer()
        if node is None:
            return None
        if id(node) in by_node and by_node[id(node)].kind == "matmul":
            target = by_node[id(node)]
            if target.node.inputs[0] is None:
                return None
            producers.append(target)
            inside.add(id(node))
            continue
        if node.op_type not in _ELEMENTWISE or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            return None
        region.append(node)
        inside.add(id(node))
        for i, inp in enumerate(node.inputs):
            if inp is None:
                continue
            tensor = _tensor_of(inp)
            if tensor is not None:
                size = int(np.prod(tensor.shape)) if tensor.shape else 1
                if size == 1:
                    continue
                if tensor.shape[-1] == k and size == k:
                    consts.append((node, i))
                    continue
                return None
            todo.append(inp)
    if not producers:
        return None
    # Every value made in the region is read only inside it (the activation also by its readers).
    for node in [*region, *(p.node for p in producers)]:
        out = node.outputs[0]
        if out.is_graph_output():
            return None
        for user, _ in out.uses():
            if id(user) in inside:
                continue
            if out is activation and id(user) in readers:
                continue
            return None
    return producers, region, consts


# ---------------------------------------------------------------------------------------- calibration


def _collect_statistics(
    model: ir.Model, activations: list[ir.Value], full: bool, context: PassContext, report: PassReport
) -> dict[str, np.ndarray]:
    """``X^T X`` (``full``) or ``diag(X^T X)`` float64 per activation, over the calibration tokens.

    The model is run through the context's decode loop (its contract, or the exporter convention) with the
    activations added as graph outputs; batch row 0 of every position fed is used.

    Args:
        model: the graph (not edited: a structural copy gets the extra outputs).
        activations: the values whose statistics are wanted (named).
        full: the whole ``X^T X`` (GPTQ) rather than its diagonal (act-order).
        context: calibration token ids, scratch folder and session factory.
        report: receives a line on the tokens used.

    Returns:
        Activation name -> float64 ``(K, K)`` or ``(K,)``.
    """
    names = [str(v.name) for v in activations]
    probe = pruned_copy(model, names, keep_outputs=True, shadow=False)
    header = stand_in_proto(model)
    contract = read_contract(model)
    stats: dict[str, np.ndarray] = {}
    count = 0
    with open_probe(probe, context, who="quantize_weights", what="the calibration model") as model_session:
        model_session.model = header  # the decode loop reads the graph's own outputs, not the probes
        # This graph alone (a graph set's siblings are not written here): its contract, or the exporter convention.
        decoder = calibration_decoder(context, model_session, contract, who="quantize_weights")
        decoder.extra_outputs = names
        chunk = contract.max_cache_len if contract is not None else CALIBRATION_CHUNK
        step = contract.step_len if contract is not None else 1
        chunk -= chunk % step
        for sequence in context.calibration:
            for start in range(0, len(sequence) - step + 1, chunk):
                piece = list(sequence[start : start + chunk])
                piece = piece[: len(piece) - len(piece) % step]
                decoder.reset()
                decoder.extra_results = []
                decoder.feed(piece)
                count += len(piece)
                for results in decoder.extra_results:
                    for name in names:
                        x = np.asarray(results[name], dtype=np.float64)
                        # (B, S, K): batch row 0 (rows are fed the same tokens); (B·S, K) as a Gemm reads it: all.
                        x = (x[0] if x.ndim >= 3 else x).reshape(-1, x.shape[-1])
                        part = x.T @ x if full else np.einsum("tk,tk->k", x, x)
                        stats[name] = stats[name] + part if name in stats else part
    release_weights(probe)
    report.changes.append(f"calibration: {count} tokens through {len(names)} activation(s)")
    return stats


# ------------------------------------------------------------------------------------------ emission


_QTYPES = {
    (4, True): ir.DataType.INT4,
    (4, False): ir.DataType.UINT4,
    (8, True): ir.DataType.INT8,
    (8, False): ir.DataType.UINT8,
}


def _np_qtype(bits: int, signed: bool) -> np.dtype:
    import ml_dtypes  # noqa: PLC0415

    if bits == 4:
        return np.dtype(ml_dtypes.int4 if signed else ml_dtypes.uint4)
    return np.dtype(np.int8 if signed else np.uint8)


@dataclass
class _Quantized:
    """A quantized weight's tensors, written once (graph-independent; shared by graphs and consumers).

    ``form`` ``nbits``: ``[B, scales, zero_points?]`` of MatMulNBits. ``form`` ``dq``: ``[q, scale,
    zero_point?]`` of a DequantizeLinear laid out ``(N, K)`` when ``nk`` else ``(K, N)``.
    """

    form: Literal["nbits", "dq"]
    tensors: list[ir.TensorProtocol]
    nk: bool
    block_size: int
    n: int
    k: int


@dataclass
class _Values:
    """A quantized weight's values in one graph: MatMulNBits inputs, or the dequantized weight per layout."""

    nbits: list[ir.Value] | None = None
    kn: ir.Value | None = None
    nk: ir.Value | None = None


@register_pass
class QuantizeWeightsPass(Pass):
    """Weight-only INT8/INT4 quantization of MatMul/Gemm (and embedding) weights; see the module docstring.

    Raises:
        ConfigError: from :meth:`check_settings` (act-order or GPTQ without calibration) or :meth:`check_model`
            (a QDQ request the opset cannot carry with ``raise_opset: false``).
        PreconditionError: the same refusals at run time, or no quantizable weight at all.
    """

    name = "quantize_weights"
    summary = "Weight-only INT8/INT4 (QDQ or MatMulNBits), act-order folded into the graph, RTN or GPTQ."
    config_model = QuantizeWeightsConfig
    config: QuantizeWeightsConfig
    in_place = True

    def output_opset(self, opset: int | None) -> int | None:
        """The output's ``ai.onnx`` opset given the input's (None: unknown), for the pass-order check.

        Unchanged unless QDQ raises it: 21 for blocked INT4; INT8's 13 or 19 depends on the weights' dtype, so
        unknown here.
        """
        cfg = self.config
        if opset is None or (cfg.format != "qdq" and not cfg.embedding) or not cfg.raise_opset:
            return opset
        return max(opset, 21) if cfg.bits == 4 else None

    def __init__(self, config: QuantizeWeightsConfig | None = None):
        super().__init__(config)
        self._factors: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # the last GPTQ factor (one at a time)

    # ------------------------------------------------------------------------------------ validation

    @property
    def _needs_calibration(self) -> bool:
        return self.config.act_order or self.config.method == "gptq"

    def check_settings(self, settings: PipelineSettings) -> None:
        """Refuse act-order or GPTQ without a ``calibration`` section.

        Raises:
            ConfigError: naming the key.
        """
        if self._needs_calibration and not settings.calibration_tokens:
            what = "act_order: true" if self.config.act_order else "method: gptq"
            raise ConfigError(
                f"{what} needs calibration data: add 'calibration: {{token_ids_file: ...}}' to the pipeline"
            )

    def _opset_need(self, model: ir.Model) -> tuple[int, int]:
        """(ai.onnx opset, IR version) the emitted DequantizeLinear nodes need ((0, 0) when none is emitted).

        Blocked INT4 needs 21 and IR 10; per-axis INT8 needs 13, or 19 when a dequantized weight is float16 or
        bfloat16 (its scale has the weight's dtype, which DequantizeLinear takes from opset 19).
        """
        cfg = self.config
        if cfg.format != "qdq" and not cfg.embedding:
            return 0, 0
        if cfg.bits == 4:
            return 21, 10
        half = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
        dequantized = [t for t in find_targets(model, cfg)[0] if cfg.format == "qdq" or t.kind == "gather"]
        return (19, 0) if any(t.weight.dtype in half for t in dequantized) else (13, 0)

    def _opset_refusal(self, model: ir.Model) -> str | None:
        need_opset, need_ir = self._opset_need(model)
        opset = _default_opset(model)
        if opset >= need_opset and model.ir_version >= need_ir:
            return None
        what = "blocked INT4 DequantizeLinear (block_size)" if self.config.bits == 4 else "per-axis DequantizeLinear"
        what += " with float16/bfloat16 scales" if need_opset == 19 else ""
        return (
            f"{what} needs ai.onnx opset >= {need_opset}"
            + (f" and IR >= {need_ir}" if need_ir else "")
            + f"; the model has opset {opset}, IR {model.ir_version}. Set raise_opset: true (converts the graph) "
            "or use format: matmulnbits"
        )

    def check_model(self, model: ir.Model, settings: PipelineSettings) -> None:
        """Refuse, from the graph alone, a QDQ request the opset cannot carry when ``raise_opset`` is false.

        Raises:
            ConfigError: the opset/IR is too low and may not be raised.
        """
        why = self._opset_refusal(model)
        if why is not None and not self.config.raise_opset:
            raise ConfigError(why)

    def requires(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Calibration tokens when act-order or GPTQ is asked for; an opset that can carry QDQ or may be raised.

        Raises:
            PreconditionError: naming what is missing.
        """
        if self._needs_calibration and not context.calibration:
            raise PreconditionError(self.name, "act_order / gptq need calibration token ids (PassContext.calibration)")
        why = self._opset_refusal(artifacts.primary)
        if why is not None and not self.config.raise_opset:
            raise PreconditionError(self.name, why)

    # ---------------------------------------------------------------------------------------- rewrite

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Quantize every target of every graph; see the module docstring."""
        if self._opset_refusal(artifacts.primary) is not None:
            need_opset, need_ir = self._opset_need(artifacts.primary)
            if _default_opset(artifacts.primary) < need_opset:
                from onnxdeploy.passes.pin_opset import PinOpsetConfig, PinOpsetPass  # noqa: PLC0415  (onnx's converter)

                artifacts, _ = PinOpsetPass(PinOpsetConfig(opset=need_opset)).call(artifacts, context, report)
            for model in artifacts.models():
                model.ir_version = max(model.ir_version, need_ir)
            report.changes.append(f"raised to ai.onnx opset {need_opset}" + (f", IR {need_ir}" if need_ir else ""))
        writer = ScratchWriter(context.scratch() / f"quantize_weights_{id(self):x}", INLINE_BYTES)
        written: dict[tuple, _Quantized] = {}
        layers: list[dict] = []
        stats: dict[str, np.ndarray] = {}
        total = 0
        for index, artifact in enumerate(artifacts.artifacts):
            total += self._quantize_graph(
                artifact.model, context, report, writer, written, layers, stats, first=index == 0, name=artifact.name
            )
        if not total:
            raise PreconditionError(self.name, "no MatMul/Gemm/Gather with a constant 2-D float weight to quantize")
        report.details["layers"] = layers
        rows = [r for r in layers if r["error_rtn_natural"] > 0]
        if rows:
            removed = 1 - sum(r["error"] for r in rows) / sum(r["error_rtn_natural"] for r in rows)
            report.details["weight_error_removed"] = removed
            report.changes.append(
                f"weight error vs RTN in natural order: {100 * removed:.1f}% removed over {len(rows)} weights"
                + (" (calibration-weighted)" if self._needs_calibration else " (plain MSE: no calibration)")
            )
        return artifacts, True

    def _quantize_graph(
        self,
        model: ir.Model,
        context: PassContext,
        report: PassReport,
        writer: ScratchWriter,
        written: dict[tuple, _Quantized],
        layers: list[dict],
        stats: dict[str, np.ndarray],
        *,
        first: bool,
        name: str = "",
    ) -> int:
        """Quantize one graph of the set; return how many weights were newly quantized.

        The calibration statistics are collected on the first (primary) graph into ``stats`` and reused by
        name for the others (structural copies of one export: same activation names), so every graph gets the
        same permutations and shares the same quantized tensors (``written``).
        """
        cfg = self.config
        graph = model.graph
        targets, skipped = find_targets(model, cfg)
        report.warnings += skipped
        if not targets:
            return 0
        taken = _names(graph)
        by_node = {id(t.node): t for t in targets}
        by_activation: dict[int, list[_Target]] = defaultdict(list)
        for t in targets:
            if t.activation is not None:
                by_activation[id(t.activation)].append(t)

        if self._needs_calibration and first and context.calibration:
            acts = []
            for group in by_activation.values():
                act = group[0].activation
                assert act is not None
                if not act.name:
                    act.name = _unique("quantize_weights_activation", taken)
                acts.append(act)
            stats.update(_collect_statistics(model, acts, cfg.method == "gptq", context, report))
        # Statistics by reader, taken before any fold re-points a reader at a Gather's output.
        hessians = {id(t.node): stats.get(str(t.activation.name)) for t in targets if t.activation is not None}
        perm_in: dict[int, np.ndarray] = {}
        perm_out: dict[int, np.ndarray] = {}
        if cfg.act_order and stats:
            for fold in self._plan_folds(model, name, by_activation, by_node, stats, report):
                readers = by_activation[id(fold.activation)]
                for t in readers:
                    perm_in[id(t.node)] = fold.perm
                for p in fold.producers:
                    perm_out[id(p.node)] = fold.out_perm
                _apply_fold(graph, fold, readers, taken)

        # A weight an embedding Gather also reads is dequantized by DequantizeLinear for every consumer, so
        # it is quantized once (MatMulNBits has no Gather form).
        gathered = {id(_tensor_of(t.weight.root)) for t in targets if t.kind == "gather"}
        count = 0
        in_graph: dict[tuple, _Values] = {}
        for t in targets:
            root_tensor = _tensor_of(t.weight.root)
            assert root_tensor is not None
            pin, pout = perm_in.get(id(t.node)), perm_out.get(id(t.node))
            nbits = cfg.format == "matmulnbits" and id(root_tensor) not in gathered
            key = (
                id(root_tensor),
                t.root_nk,
                str(t.weight.dtype),
                nbits,
                None if pin is None else pin.tobytes(),
                None if pout is None else pout.tobytes(),
            )
            if key not in written:
                hessian = hessians.get(id(t.node))
                written[key] = self._quantize_weight(t, root_tensor, pin, pout, hessian, writer, layers, nbits=nbits)
                count += 1
                if isinstance(root_tensor, ir.ExternalTensor):
                    root_tensor.release()
            if key not in in_graph:
                in_graph[key] = _graph_values(graph, written[key], t.weight.dtype, taken)
            self._rewire(graph, t, written[key], in_graph[key], taken)
        _remove_dead(graph)
        if any(n.domain == "com.microsoft" for n in graph):
            model.opset_imports.setdefault("com.microsoft", 1)
        report.changes.append(
            f"{count} weight(s) quantized to INT{cfg.bits} "
            + ("per output channel" if cfg.bits == 8 else f"in groups of {cfg.block_size}")
            + f" ({'symmetric' if cfg.symmetric else 'asymmetric'}, {cfg.format}, {cfg.method}"
            + (", act-order" if cfg.act_order else "")
            + f") for {len(targets)} node(s)"
        )
        return count

    def _plan_folds(
        self,
        model: ir.Model,
        name: str,
        by_activation: dict[int, list[_Target]],
        by_node: dict[int, _Target],
        stats: dict[str, np.ndarray],
        report: PassReport,
    ) -> list[_Fold]:
        """One act-order permutation per activation, folded into producers where the graph allows it.

        The MLP's down_proj input into gate/up's output channels (:func:`_producer_region`); o_proj's input into
        V's output channels within each head where V's channels stay inside the graph
        (:func:`~onnxdeploy.passes._value_fold.plan_value_fold`); else a Gather. ``details.act_order`` lists
        each activation's fold (and, for o_proj, why it is a Gather).
        """
        folds: list[_Fold] = []
        claimed: set[int] = set()
        dims: dict[int, dict] = {}

        def dims_of(probe: int) -> dict:
            if probe not in dims:
                dims[probe] = concrete_dims(model, PROBES[probe])
            return dims[probe]

        def is_producer(node: ir.Node) -> bool:
            return id(node) in by_node and by_node[id(node)].kind == "matmul" and id(node) not in claimed

        rows = report.details.setdefault("act_order", [])
        for group in by_activation.values():
            act = group[0].activation
            assert act is not None
            stat = stats.get(str(act.name))
            if stat is None:  # a graph of the set whose activation the primary does not have: natural order
                continue
            importance = np.diag(stat) if stat.ndim == 2 else stat
            perm = act_order_permutation(importance)
            readers = {id(t.node) for t in group}
            fold = _Fold(act, perm)
            found = _producer_region(act, readers, by_node, len(importance))
            reason, kind = None, "gather"
            # A producer may read a permuted activation itself (its rows and columns are permuted then);
            # one already carrying another fold's permutation may not.
            if found is not None and not any(id(p.node) in claimed for p in found[0]):
                fold.producers, fold.region, fold.bias_constants = found
                fold.how = f"folded into the output channels of {', '.join(str(p.node.name) for p in found[0])}"
                kind = "producers"
            else:
                plan = plan_value_fold(act, readers, is_producer, dims_of)
                if isinstance(plan, ValueFold) and plan.head_dim * len(plan.kv_of_head) == len(importance):
                    fold.producer_perm, fold.perm = plan.permutations(importance, act_order_permutation)
                    fold.producers, fold.bias_constants = [by_node[id(plan.producer)]], plan.constants
                    fold.how = (
                        f"folded into the output channels of {plan.producer.name} within each of its {plan.n_kv} KV "
                        f"heads (head dim {plan.head_dim}, {len(plan.kv_of_head)} query heads)"
                    )
                    kind = "value"
                elif isinstance(plan, str):
                    reason = plan
                    fold.how += f" ({plan}; V's channels keep their order)"
                elif (split := _split_reason(act)) is not None:
                    reason = split
                    fold.how += f" ({split})"
            claimed.update(id(p.node) for p in fold.producers)
            folds.append(fold)
            report.changes.append(f"act-order on '{act.name}' (K={len(importance)}) {fold.how}")
            rows.append(
                {
                    "graph": name,
                    "activation": str(act.name),
                    "readers": [str(t.node.name) for t in group],
                    "fold": kind,
                    "into": [str(p.node.name) for p in fold.producers],
                    "reason": reason,
                }
            )
        return folds

    def _quantize_weight(
        self,
        t: _Target,
        root_tensor: ir.TensorProtocol,
        pin: np.ndarray | None,
        pout: np.ndarray | None,
        hessian: np.ndarray | None,
        writer: ScratchWriter,
        layers: list[dict],
        *,
        nbits: bool,
    ) -> _Quantized:
        """Read one weight, quantize it (RTN or GPTQ, permuted as asked), write its tensors, report its error.

        ``nbits``: emit MatMulNBits tensors, else DequantizeLinear ones.
        """
        cfg = self.config
        base = str(t.weight.root.name or t.node.name or "weight")
        # What the consumer reads: an fp16 weight cast to float32 keeps its fp16 values; the reverse rounds.
        read = root_tensor.numpy().astype(t.weight.dtype.numpy(), copy=False)
        n, k = read.shape if t.root_nk else read.shape[::-1]
        block = cfg.block_size if cfg.bits == 4 else (max(16, 1 << (k - 1).bit_length()) if nbits else k)
        h = hessian
        if not t.root_nk and pout is None and pin is None and (h is None or h.ndim == 1) and (nbits or not t.nk):
            # What is emitted is this RTN (GPTQ needs a full H): quantized from the stored (K, N) layout straight
            # into the tensors the consumer stores, chunk by chunk (an fp16 weight is widened a chunk at a time).
            return self._emit_stored(t, read, block, h, writer, layers, nbits=nbits)
        wt = read.astype(np.float32, copy=False)
        wt = wt if t.root_nk else wt.T  # a view: RTN reads it in row chunks, so no full (N, K) copy is made
        if pout is not None:
            wt = wt[pout, :]
        if not t.root_nk and pout is None and (h is None or h.ndim == 1):
            # Stored (K, N), as MatMul weights are: read in contiguous K chunks, never transposed whole.
            natural = quantize_rtn_kn(
                wt.T, bits=cfg.bits, block_size=block, symmetric=cfg.symmetric, error_weights=_h_or_empty(h)
            )
        else:
            natural = quantize_rtn(
                wt, bits=cfg.bits, block_size=block, symmetric=cfg.symmetric, error_weights=_h_or_empty(h)
            )
        if natural.error is None:
            natural.error = output_error(wt, natural.dequantize(), _h_or_empty(h))
        row: dict = {"weight": base, "node": str(t.node.name), "n": n, "k": k}
        row["error_rtn_natural"] = natural.error
        qw = natural
        if pin is not None:
            wt = wt[:, pin]
            if h is not None:
                h = h[np.ix_(pin, pin)] if h.ndim == 2 else h[pin]
        if cfg.method == "gptq" and h is not None and h.ndim == 2:
            # Weights reading one activation (q/k/v, gate/up) share H and the permutation: factor it once.
            fkey = (id(hessian), None if pin is None else pin.tobytes())
            if fkey not in self._factors:
                self._factors = {fkey: inverse_hessian_factor(h, cfg.gptq_damp)}
            qw = gptq(wt, None, bits=cfg.bits, block_size=block, symmetric=cfg.symmetric, factor=self._factors[fkey])
        elif pin is not None:
            qw = quantize_rtn(
                wt, bits=cfg.bits, block_size=block, symmetric=cfg.symmetric, error_weights=_h_or_empty(h)
            )
        if qw.error is None:
            qw.error = output_error(wt, qw.dequantize(), _h_or_empty(h))
        row["error"] = qw.error
        row["method"] = cfg.method + (" act-order" if pin is not None else "")
        row["removed"] = 1 - row["error"] / row["error_rtn_natural"] if row["error_rtn_natural"] > 0 else 0.0
        layers.append(row)
        dtype = t.weight.dtype
        if nbits:
            packed, scales, zp = pack_matmulnbits(qw)
            tensors = [
                writer.tensor(packed, ir.DataType.UINT8, f"{base}_Q{qw.bits}"),
                writer.tensor(scales.astype(dtype.numpy()), dtype, f"{base}_scales"),
            ]
            if zp is not None:
                tensors.append(writer.tensor(zp, ir.DataType.UINT8, f"{base}_zero_points"))
            return _Quantized("nbits", tensors, False, block, n, k)
        signed = qw.zero_point is None
        q = qw.q.astype(_np_qtype(qw.bits, signed))
        per_channel = cfg.bits == 8
        scale = qw.scale[:, 0] if per_channel else qw.scale
        zp = None
        if qw.zero_point is not None:
            zp = (qw.zero_point[:, 0] if per_channel else qw.zero_point).astype(_np_qtype(qw.bits, False))
        # Laid out as the first consumer reads it: (K, N) for MatMul, (N, K) for Gemm transB=1 and Gather.
        if not t.nk:
            q = q.T
            scale = scale if per_channel else scale.T
            zp = None if zp is None else (zp if per_channel else zp.T)
        tensors = [
            writer.tensor(np.ascontiguousarray(q), _QTYPES[(qw.bits, signed)], f"{base}_Q{qw.bits}"),
            writer.tensor(np.ascontiguousarray(scale.astype(dtype.numpy())), dtype, f"{base}_scale"),
        ]
        if zp is not None:
            tensors.append(writer.tensor(np.ascontiguousarray(zp), _QTYPES[(qw.bits, False)], f"{base}_zero_point"))
        return _Quantized("dq", tensors, t.nk, block, n, k)

    def _emit_stored(
        self,
        t: _Target,
        w_kn: np.ndarray,
        block: int,
        h: np.ndarray | None,
        writer: ScratchWriter,
        layers: list[dict],
        *,
        nbits: bool,
    ) -> _Quantized:
        """RTN of a weight stored ``(K, N)`` that a MatMul reads, written as MatMulNBits or ``(K, N)`` DQ tensors."""
        cfg = self.config
        base = str(t.weight.root.name or t.node.name or "weight")
        k, n = w_kn.shape
        st = quantize_rtn_stored(
            w_kn,
            bits=cfg.bits,
            block_size=block,
            symmetric=cfg.symmetric,
            form="nbits" if nbits else "kn",
            error_weights=_h_or_empty(h),
        )
        row = {"weight": base, "node": str(t.node.name), "n": n, "k": k, "error_rtn_natural": st.error}
        layers.append(row | {"error": st.error, "method": cfg.method, "removed": 0.0})
        dtype = t.weight.dtype
        if nbits:
            tensors = [
                writer.tensor(st.values, ir.DataType.UINT8, f"{base}_Q{cfg.bits}"),
                writer.tensor(st.scale.astype(dtype.numpy()), dtype, f"{base}_scales"),
            ]
            if st.zero_point is not None:
                tensors.append(writer.tensor(st.zero_point, ir.DataType.UINT8, f"{base}_zero_points"))
            return _Quantized("nbits", tensors, False, block, n, k)
        signed = cfg.symmetric
        per_channel = cfg.bits == 8  # one block spanning K: per-axis scales (N,)
        scale = st.scale[0] if per_channel else st.scale
        q = st.values.astype(_np_qtype(cfg.bits, signed), copy=False)
        tensors = [
            writer.tensor(q, _QTYPES[(cfg.bits, signed)], f"{base}_Q{cfg.bits}"),
            writer.tensor(np.ascontiguousarray(scale.astype(dtype.numpy())), dtype, f"{base}_scale"),
        ]
        if st.zero_point is not None:
            zp = (st.zero_point[0] if per_channel else st.zero_point).astype(_np_qtype(cfg.bits, False), copy=False)
            tensors.append(writer.tensor(np.ascontiguousarray(zp), _QTYPES[(cfg.bits, False)], f"{base}_zero_point"))
        return _Quantized("dq", tensors, False, block, n, k)

    def _rewire(self, graph: ir.Graph, t: _Target, q: _Quantized, values: _Values, taken: set[str]) -> None:
        """Point ``t``'s node at the quantized weight, or replace it by MatMulNBits."""
        cfg = self.config
        node = t.node
        if values.nbits is not None:
            attrs: dict = {"K": q.k, "N": q.n, "bits": cfg.bits, "block_size": q.block_size}
            if cfg.accuracy_level:
                attrs["accuracy_level"] = cfg.accuracy_level
            mm = ir.node(
                "MatMulNBits",
                [node.inputs[0], *values.nbits],
                attributes=attrs,
                domain="com.microsoft",
                name=_unique(f"{node.name or 'MatMul'}_Q{cfg.bits}", taken),
            )
            result = mm.outputs[0]
            new_nodes = [mm]
            if t.kind == "gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
                add = ir.node("Add", [result, node.inputs[2]], name=_unique(f"{node.name}_bias", taken))
                new_nodes.append(add)
                result = add.outputs[0]
            graph.insert_before(node, new_nodes)
            old = node.outputs[0]
            name, shape, typ = old.name, old.shape, old.type
            mm.outputs[0].name = _unique(f"{name}_Q{cfg.bits}", taken) if result is not mm.outputs[0] else None
            old.replace_all_uses_with(result, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            result.name, result.shape, result.type = name, shape, typ
            return
        value = values.nk if t.nk else values.kn
        if value is None:  # the shared tensor is laid out for the other orientation: transpose it once
            src = values.kn if t.nk else values.nk
            assert src is not None and src.producer() is not None
            tr = ir.node("Transpose", [src], attributes={"perm": [1, 0]}, name=_unique(f"{src.name}_T", taken))
            tr.outputs[0].name = _unique(f"{src.name}_T", taken)
            tr.outputs[0].dtype = src.dtype
            graph.insert_after(src.producer(), tr)
            value = tr.outputs[0]
            if t.nk:
                values.nk = value
            else:
                values.kn = value
        node.replace_input_with(t.input_index, value)


def _h_or_empty(h: np.ndarray | None) -> np.ndarray:
    """The calibration statistics for :func:`output_error`, or an empty array (plain MSE) without them."""
    return np.array([]) if h is None else h


def _graph_values(graph: ir.Graph, q: _Quantized, dtype: ir.DataType, taken: set[str]) -> _Values:
    """Initializers for ``q``'s tensors in ``graph`` (and its DequantizeLinear, for the ``dq`` form)."""
    inits = []
    for tensor in q.tensors:
        value = ir.Value(
            name=_unique(str(tensor.name), taken),
            const_value=tensor,
            shape=ir.Shape(tensor.shape),
            type=ir.TensorType(tensor.dtype),
        )
        graph.register_initializer(value)
        inits.append(value)
    if q.form == "nbits":
        return _Values(nbits=inits)
    per_channel = len(q.tensors[1].shape) == 1
    attrs: dict = {"axis": (0 if q.nk else 1) if per_channel else (1 if q.nk else 0)}
    if not per_channel:
        attrs["block_size"] = q.block_size
    base = str(q.tensors[0].name)
    node = ir.node("DequantizeLinear", inits, attributes=attrs, name=_unique(f"{base}_DequantizeLinear", taken))
    out = node.outputs[0]
    out.name = _unique(f"{base}_dequantized", taken)
    out.dtype = dtype
    out.shape = ir.Shape([q.n, q.k] if q.nk else [q.k, q.n])
    if len(graph):
        graph.insert_before(graph.node(0), node)
    else:
        graph.append(node)
    return _Values(nk=out) if q.nk else _Values(kn=out)


def _apply_fold(graph: ir.Graph, fold: _Fold, readers: list[_Target], taken: set[str]) -> None:
    """Make the permuted activation reach its readers: permute the producers' constant operands, or Gather."""
    if fold.producers:
        for node, index in fold.bias_constants:
            value = node.inputs[index]
            assert value is not None
            tensor = _tensor_of(value)
            assert tensor is not None
            array = tensor.numpy()
            permuted = np.ascontiguousarray(array[..., fold.out_perm])
            new = ir.Value(
                name=_unique(f"{value.name}_act_order", taken),
                const_value=ir.Tensor(permuted, dtype=tensor.dtype),
                shape=ir.Shape(permuted.shape),
                type=ir.TensorType(tensor.dtype),
            )
            new.const_value.name = new.name  # type: ignore[union-attr]
            graph.register_initializer(new)
            node.replace_input_with(index, new)
        return
    perm = ir.Value(
        name=_unique(f"{fold.activation.name}_act_order_perm", taken),
        const_value=ir.Tensor(fold.perm),
        shape=ir.Shape(fold.perm.shape),
        type=ir.TensorType(ir.DataType.INT64),
    )
    perm.const_value.name = perm.name  # type: ignore[union-attr]
    graph.register_initializer(perm)
    name = _unique("act_order_Gather", taken)
    gather = ir.node("Gather", [fold.activation, perm], attributes={"axis": -1}, name=name)
    out = gather.outputs[0]
    out.name = _unique(f"{fold.activation.name}_act_order", taken)
    if fold.activation.dtype is not None:
        out.dtype = fold.activation.dtype
        out.shape = fold.activation.shape
    producer = fold.activation.producer()
    if producer is not None:
        graph.insert_after(producer, gather)
    else:
        graph.insert_before(graph.node(0), gather)
    for reader in readers:
        reader.node.replace_input_with(0, out)


def _remove_dead(graph: ir.Graph) -> None:
    """Remove Cast/Transpose/Identity/Constant nodes and initializers nothing reads any more."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph)):
            if node.op_type in (*_CHAIN_OPS, "Constant") and all(
                not o.uses() and not o.is_graph_output() for o in node.outputs
            ):
                graph.remove(node, safe=True)
                changed = True
    inputs = {id(v) for v in graph.inputs}
    for name, value in list(graph.initializers.items()):
        if not value.uses() and not value.is_graph_output() and id(value) not in inputs:
            graph.initializers.pop(name)
