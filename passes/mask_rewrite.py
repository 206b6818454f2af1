"""``mask_rewrite``: the exporter's mask construction becomes an O(max_cache_len) mask from ``cache_position``.

What the pass does (DESIGN.md, "Passes" → ``mask_rewrite``), on every graph of the artifact set (the decode
graph and prefill buckets; each carries its own contract):

* Finds each attention Softmax by data flow: its input comes from ``MatMul(Q, Kᵀ)`` (through scale
  Mul/Div) and reaches a cache buffer named by the contract; the exporter's mask is the other operand of the
  ``Add`` (additive 0 / large-negative mask) or the condition of the ``Where`` on that path.
* Builds one boolean mask ``(…, S, L)`` per window from ``cache_position`` (int64 ``[S]``): slot ``j`` is
  visible to the query at position ``p`` iff ``j <= p`` and, for sliding-window models, ``p - j < window``
  (this includes the causal triangle inside a chunk when ``step_len > 1``); with ``padding: true`` it is also
  ANDed with ``attention_mask`` ``(B, L)``. It costs an int64 ``[1, L]`` slot index and an ``(S, L)`` compare.
* Masks by **select**: ``Softmax(Where(mask, scores, lowest))`` with ``lowest`` the lowest finite value of
  the scores' dtype (``-3.40e38`` in fp32, ``-65504`` in fp16), so a NaN/inf/stale value in an unused K
  slot never reaches the output, a fully masked row stays finite (uniform) in fp16, and masked probabilities
  are exactly 0. The exporter's ``Add`` of the mask is bypassed, and its NaN guard on the probabilities
  (``Where(IsNaN(p), 0, p)``; RK3588 has no NPU lowering for IsNaN) is removed with it.
* The old mask subgraph becomes dead and is removed; ``attention_mask`` is removed from the inputs unless
  ``padding: true``; the graph is refolded (:func:`~onnxdeploy.passes._cache_edits.fold_and_infer`).

The window is read from the graph (integer constants the exporter compares query positions against) and
confirmed by running: the old mask and each candidate new mask are computed on ONNX Runtime for every
chunk start (sampled above 384 starts) with the contract's ``attention_mask`` (and random padding bits with
``padding: true``); a candidate is used only if it selects exactly the slots the old mask selected. A mask
that is not a plain 0 / large-negative mask (a bias such as ALiBi) or matches no candidate is refused.

A graph whose cache enters ``com.microsoft::GroupQueryAttention`` (onnxruntime-genai; ``static_kv`` already
feeds its ``seqlens_k`` / ``total_sequence_length`` from ``cache_position``, contract ``mask: cache_position``)
has no exporter mask to replace: the op masks by length inside and never reads a slot past the current
position. Such a graph passes through unchanged (reported); ``padding: true`` is refused there (the op takes
per-row lengths, not a padding mask).

Masked probabilities are exactly 0, and ``0 × NaN`` is still NaN: unused V slots must hold finite values.
Sanitising V would copy the cache every step, so the contract states instead that the host zeroes every
buffer once when it allocates it (``cache_init: zeros``); stale finite values from earlier use are harmless.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as ir_common
from pydantic import Field

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.contract import DecodeContract, read_contract, write_contract
from onnxdeploy.errors import PostconditionError, PreconditionError
from onnxdeploy.kv_cache import GQA_OP
from onnxdeploy.passes._attention_edits import decompose_attention
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import clone, fold_and_infer, infer_shapes
from onnxdeploy.passes._order import CONTRACT
from onnxdeploy.passes._pass_infra import Pass, PassConfig, register_pass
from onnxdeploy.passes._probe import open_probe, pruned_copy
from onnxdeploy.report import PassReport

__all__ = [
    "AttentionSite",
    "MaskRewriteConfig",
    "MaskRewritePass",
    "find_attention_sites",
    "lowest_finite",
    "masking_attention_op",
]

_PREFIX = "onnxdeploy/mask_rewrite"
_MASKED_BELOW = -1.0e4  # an additive mask value this negative hides its slot (exp underflows to 0)
_MAX_PROBE_STARTS = 384
_PROBE_SEED = 0
_COMPARE_OPS = frozenset({"Greater", "Less", "GreaterOrEqual", "LessOrEqual"})
_PASS_BACK_OPS = frozenset({"Identity", "Cast"})  # between the masked scores and the Softmax
_SCALE_OPS = frozenset({"Mul", "Div"})


class MaskRewriteConfig(PassConfig):
    """Config of ``mask_rewrite``."""

    padding: bool = Field(
        False,
        description="Keep the attention_mask input (int64 (B, max_cache_len), 1 = the slot may be attended) and "
        "AND it with the causal/window mask, for padded batches; false removes the input.",
    )


def lowest_finite(dtype: ir.DataType) -> np.ndarray:
    """The lowest finite value of a float dtype, as a 0-d array of that dtype.

    ``-3.4028235e38`` for float32, ``-65504`` for float16, ``-3.3895e38`` for bfloat16 (``ml_dtypes.finfo``).
    Never ``-inf``: a fully masked row of ``lowest`` gives a uniform Softmax, not NaN.

    Raises:
        ValueError: ``dtype`` is not a floating-point type.
    """
    np_dtype = np.dtype(dtype.numpy())
    if not (np.issubdtype(np_dtype, np.floating) or np_dtype == ml_dtypes.bfloat16):
        raise ValueError(f"{dtype} is not a floating-point type")
    return np.array(ml_dtypes.finfo(np_dtype).min, dtype=np_dtype)


# ------------------------------------------------------------------------------------------ finding sites


@dataclass
class AttentionSite:
    """One attention Softmax of a static graph and the exporter's mask feeding it.

    Shapes: ``scores`` ``(B, H, S, L)`` (any rank ≥ 2 whose last two axes are query and slot), float.

    Attributes:
        softmax: the Softmax over the slot axis.
        masked: the output of the node that applies the exporter's mask (None when there is none).
        scores: that node's operand computed from the cache (the unmasked scores).
        old_mask: the exporter's mask: the additive operand of an ``Add``, or the condition of a ``Where``.
        kind: ``add`` (visible where the mask is 0), ``where_true`` (scores kept where the condition is true)
            or ``where_false`` (kept where it is false).
        nan_guards: ``(IsNaN, Where)`` pairs that replace NaN probabilities by a constant.
    """

    softmax: ir.Node
    masked: ir.Value | None
    scores: ir.Value | None
    old_mask: ir.Value | None
    kind: Literal["add", "where_true", "where_false", "none"]
    nan_guards: list[tuple[ir.Node, ir.Node]] = field(default_factory=list)

    @property
    def scores_shape(self) -> tuple[int, ...]:
        """Static shape of the Softmax input."""
        shape = self.softmax.inputs[0].shape  # type: ignore[union-attr]
        return tuple(int(d) for d in shape)  # type: ignore[arg-type, union-attr]


def _downstream(values: list[ir.Value]) -> set[int]:
    """The ``id()`` of every value computed from ``values`` (``values`` included)."""
    seen = {id(v) for v in values}
    stack = list(values)
    while stack:
        value = stack.pop()
        for use in value.uses():
            for out in use.node.outputs:
                if id(out) not in seen:
                    seen.add(id(out))
                    stack.append(out)
    return seen


def _is_constant(value: ir.Value | None) -> bool:
    if value is None:
        return False
    if value.const_value is not None:
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"


def _constant_array(value: ir.Value) -> np.ndarray | None:
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant":
        attr = producer.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            return attr.as_tensor().numpy()
    return None


def _nan_guards(softmax: ir.Node) -> list[tuple[ir.Node, ir.Node]]:
    """``(IsNaN, Where)`` pairs computing ``Where(IsNaN(p), c, p)`` on the Softmax output ``p``."""
    probs = softmax.outputs[0]
    guards = []
    for use in probs.uses():
        isnan = use.node
        if isnan.op_type != "IsNaN":
            continue
        for guard_use in isnan.outputs[0].uses():
            where = guard_use.node
            if (
                where.op_type == "Where"
                and guard_use.idx == 0
                and where.inputs[2] is probs
                and _is_constant(where.inputs[1])
            ):
                guards.append((isnan, where))
    return guards


def _label(node: ir.Node) -> str:
    return f"'{node.name}' ({node.op_type})" if node.name else f"({node.op_type})"


def find_attention_sites(
    graph: ir.Graph, key_inputs: list[str], max_cache_len: int, *, who: str = "mask_rewrite"
) -> list[AttentionSite]:
    """Find every attention Softmax reached from the cache and the exporter's mask in front of it.

    A Softmax is an attention Softmax when its input is computed from a key cache input (data flow, not
    names) and its last axis has ``max_cache_len`` slots (a MoE router Softmax downstream of the first
    layer has ``num_experts``). Walking back from its input through Identity/Cast and scale Mul/Div by a
    constant, the first ``Add`` with exactly one operand computed from the cache is the additive mask, and
    the first ``Where`` whose condition is not computed from the cache and exactly one branch is, is the
    select mask.

    Args:
        graph: a static graph (shapes inferred).
        key_inputs: names of the key (or packed K/V) cache inputs, from the contract.
        max_cache_len: L, slots of the cache buffers.
        who: the pass named in errors.

    Returns:
        The sites in graph order.

    Raises:
        PreconditionError: a key input is missing, no attention Softmax is found, or one does not normalise
            over the last axis.
    """
    inputs = {str(v.name): v for v in graph.inputs}
    absent = [name for name in key_inputs if name not in inputs]
    if absent:
        raise PreconditionError(who, f"the contract names cache input(s) {absent} the graph lacks")
    from_cache = _downstream([inputs[name] for name in key_inputs])
    sites = []
    for node in graph:
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        x = node.inputs[0]
        if x is None or id(x) not in from_cache or x.shape is None or x.shape[-1] != max_cache_len:
            continue
        rank = len(x.shape)
        axis = node.attributes.get_int("axis", -1)
        if rank is None or axis not in (-1, rank - 1):
            raise PreconditionError(
                who, f"attention Softmax {_label(node)} normalises over axis {axis} of rank {rank}, not the slot axis"
            )
        sites.append(_site(node, from_cache))
    if not sites:
        raise PreconditionError(who, f"no Softmax is computed from the key cache inputs {key_inputs}")
    return sites


def _site(softmax: ir.Node, from_cache: set[int]) -> AttentionSite:
    value = softmax.inputs[0]
    while value is not None:
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            break
        ins = list(node.inputs)
        if node.op_type == "Add" and len(ins) == 2 and ins[0] is not None and ins[1] is not None:
            cached = [id(v) in from_cache for v in ins]
            if cached.count(True) == 1:
                scores, mask = (ins[0], ins[1]) if cached[0] else (ins[1], ins[0])
                return AttentionSite(softmax, value, scores, mask, "add", _nan_guards(softmax))
        if node.op_type == "Where" and len(ins) == 3 and all(v is not None for v in ins):
            cond, a, b = ins
            if id(cond) not in from_cache and (id(a) in from_cache) != (id(b) in from_cache):
                kind = "where_true" if id(a) in from_cache else "where_false"
                return AttentionSite(softmax, value, a if kind == "where_true" else b, cond, kind, _nan_guards(softmax))
        if node.op_type in _PASS_BACK_OPS and len(ins) == 1:
            value = ins[0]
            continue
        if node.op_type in _SCALE_OPS and len(ins) == 2 and _is_constant(ins[1]):
            value = ins[0]
            continue
        break
    return AttentionSite(softmax, None, None, None, "none", _nan_guards(softmax))


# ------------------------------------------------------------------------------------- window candidates


def _upstream_nodes(value: ir.Value) -> list[ir.Node]:
    seen: dict[int, ir.Node] = {}
    stack = [value]
    while stack:
        producer = stack.pop().producer()
        if producer is None or id(producer) in seen:
            continue
        seen[id(producer)] = producer
        stack.extend(v for v in producer.inputs if v is not None)
    return list(seen.values())


def window_candidates(mask: ir.Value) -> list[int]:
    """Windows the exporter's mask may compare against: integer scalar constants near a comparison.

    A constant ``c`` read by a comparison, or by a Sub/Add whose output a comparison reads, in the mask's
    upstream subgraph yields the candidates ``|c|`` and ``|c| + 1`` (``p - j < w`` and ``p - j <= w - 1``
    are both common). Running decides which one, if any, is the window.

    Args:
        mask: the exporter's mask operand.

    Returns:
        Positive candidates, ascending.
    """
    found: set[int] = set()
    for node in _upstream_nodes(mask):
        feeds_compare = node.op_type in _COMPARE_OPS or (
            node.op_type in ("Sub", "Add") and any(u.node.op_type in _COMPARE_OPS for u in node.outputs[0].uses())
        )
        if not feeds_compare:
            continue
        for operand in node.inputs:
            if operand is None:
                continue
            arr = _constant_array(operand)
            if arr is None or arr.size != 1 or not np.issubdtype(arr.dtype, np.integer):
                continue
            c = abs(int(arr.reshape(-1)[0]))
            if c >= 1:
                found |= {c, c + 1}
    return sorted(found)


# ------------------------------------------------------------------------------------------- mask builder


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Add an initializer ``name`` (once) holding ``array``."""
    if name in graph.initializers:
        return graph.initializers[name]
    tensor = ir.tensor(array, name=name)
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype))
    value.const_value = tensor
    graph.register_initializer(value)
    return value


class _MaskBuilder:
    """Builds the boolean masks ``(…, S, L)`` from ``cache_position``, each once per (window, rank).

    The nodes are inserted at the front of the graph (they read only graph inputs and initializers).
    """

    def __init__(
        self, graph: ir.Graph, cache_position: ir.Value, attention_mask: ir.Value | None, B: int, S: int, L: int
    ):
        self.graph = graph
        self.cache_position = cache_position
        self.attention_mask = attention_mask
        self.B, self.S, self.L = B, S, L
        self._anchor = graph[0]  # new nodes go before it, in creation order (producers first)
        self._cache: dict[Any, ir.Value] = {}

    def _node(self, op: str, inputs: list[ir.Value], name: str, **attrs: Any) -> ir.Value:
        node = ir.node(op, inputs, attrs or None, name=f"{_PREFIX}/{name}")
        node.outputs[0].name = f"{_PREFIX}/{name}"
        self.graph.insert_before(self._anchor, node)
        return node.outputs[0]

    def _query(self) -> ir.Value:
        if "q" not in self._cache:
            shape = _const(self.graph, f"{_PREFIX}/query_shape", np.array([self.S, 1], dtype=np.int64))
            q = self._node("Reshape", [self.cache_position, shape], "query_positions")
            q.dtype, q.shape = ir.DataType.INT64, ir.Shape([self.S, 1])
            self._cache["q"] = q
        return self._cache["q"]

    def _slots(self) -> ir.Value:
        return _const(self.graph, f"{_PREFIX}/slots", np.arange(self.L, dtype=np.int64).reshape(1, self.L))

    def visible(self, window: int | None, rank: int) -> ir.Value:
        """The bool mask, shape ``[1]*(rank-2) + [S, L]`` (``[B] + [1]*(rank-3) + [S, L]`` with padding)."""
        key = (window, rank)
        if key in self._cache:
            return self._cache[key]
        base_key = ("base", window)
        if base_key not in self._cache:
            q, slots = self._query(), self._slots()
            tag = "causal" if window is None else f"window{window}"
            if ("base", None) not in self._cache:
                self._cache[("base", None)] = self._node("LessOrEqual", [slots, q], "causal")  # (S, L): j <= p
            mask = self._cache[("base", None)]
            if window is not None:
                w = _const(self.graph, f"{_PREFIX}/window{window}", np.array(window, dtype=np.int64))
                oldest = self._node("Sub", [q, w], f"{tag}/past_edge")  # p - w
                inside = self._node("Greater", [slots, oldest], f"{tag}/inside")  # j > p - w
                mask = self._node("And", [mask, inside], f"{tag}/visible")
            self._cache[base_key] = mask
        mask = self._cache[base_key]
        tag = ("causal" if window is None else f"window{window}") + f"/rank{rank}"
        shape = _const(self.graph, f"{_PREFIX}/mask_shape{rank}", np.array([1] * (rank - 2) + [self.S, self.L]))
        mask = self._node("Reshape", [mask, shape], f"{tag}/mask")
        if self.attention_mask is not None:
            am = self._cache.get(("am", rank))
            if am is None:
                am_shape = _const(
                    self.graph, f"{_PREFIX}/padding_shape{rank}", np.array([self.B] + [1] * (rank - 2) + [self.L])
                )
                am_bool = self._node("Cast", [self.attention_mask], "padding_bool", to=int(ir.DataType.BOOL))
                am = self._node("Reshape", [am_bool, am_shape], f"padding_rank{rank}")
                self._cache[("am", rank)] = am
            mask = self._node("And", [mask, am], f"{tag}/padded")
        mask.dtype = ir.DataType.BOOL
        self._cache[key] = mask
        return mask


# ------------------------------------------------------------------------------------------------- probe


@contextlib.contextmanager
def _probe_session(model: ir.Model, outputs: list[ir.Value], context: PassContext, who: str) -> Iterator[Any]:
    """An ORT session on a copy of ``model`` pruned to what computes ``outputs`` (position arithmetic only).

    The copy shares ``model``'s tensors; :func:`onnxdeploy.model_io.write_for_ort` links rather than copies any
    large one (an export may keep a precomputed causal mask buffer as an initializer). A bfloat16 copy is made
    its float32 shadow (:func:`onnxdeploy.graph.float32_shadow_graph`): ORT's CPU EP has no bfloat16 kernels.

    Raises:
        PreconditionError: ONNX Runtime cannot load the probe.
    """
    # a bfloat16 mask runs on ORT's CPU EP as its float32 shadow (same 0/lowest pattern)
    probe = pruned_copy(model, [str(v.name) for v in outputs])
    with open_probe(probe, context, who=who, what="the mask probe") as opened:
        yield opened.session


def _probe_starts(S: int, L: int) -> list[int]:
    """Chunk starts ``p0`` (positions ``p0 .. p0 + S - 1``) the probe runs: all of them up to 384, else a sample."""
    starts = list(range(0, L - S + 1))
    if len(starts) <= _MAX_PROBE_STARTS:
        return starts
    third = _MAX_PROBE_STARTS // 3
    middle = np.linspace(third, len(starts) - third - 1, third).round().astype(int).tolist()
    return sorted(set(starts[:third] + [starts[i] for i in middle] + starts[-third:]))


def _old_visible(site: AttentionSite, value: np.ndarray, who: str, source: str) -> np.ndarray:
    """The slots the exporter's mask leaves visible, as bool (any broadcastable shape)."""
    if site.kind == "where_true":
        return value.astype(bool)
    if site.kind == "where_false":
        return ~value.astype(bool)
    as_float = value.astype(np.float64)
    visible = as_float == 0
    if not np.all(visible | (as_float <= _MASKED_BELOW)):
        odd = as_float[~visible & (as_float > _MASKED_BELOW)].reshape(-1)[:3]
        raise PreconditionError(
            who,
            f"{source}: the mask added before Softmax {_label(site.softmax)} holds values other than 0 and a large "
            f"negative (e.g. {odd.tolist()}): a position bias such as ALiBi, which mask_rewrite does not rebuild",
        )
    return visible


# -------------------------------------------------------------------------------------------------- pass


def masking_attention_op(model: ir.Model, contract: DecodeContract) -> ir.Node | None:
    """The GroupQueryAttention node a key cache input of ``contract`` feeds (it masks inside), or None."""
    inputs = {str(v.name): v for v in model.graph.inputs}
    for entry in contract.cache:
        value = inputs.get(entry.key_in or entry.kv_in or "")
        for use in value.uses() if value is not None else []:
            if f"{use.node.domain}::{use.node.op_type}" == GQA_OP:
                return use.node
    return None


@dataclass
class _GraphResult:
    model: ir.Model
    contract: DecodeContract
    windows: set[int | None]
    sites: int
    guards: int
    decomposed: list[str] = field(default_factory=list)


@register_pass
class MaskRewritePass(Pass):
    """Replace the exporter's mask by a select on the scores from ``cache_position`` (see the module docstring).

    Input: static graphs with a decode contract (``static_kv`` ran first), each with a ``cache_position``
    input. Output: per graph, ``Softmax(Where(mask, scores, lowest))`` at every attention, no
    ``attention_mask`` input unless ``padding: true``, no exporter mask or IsNaN guard, and the contract
    updated (``mask: cache_position``, ``sliding_window``, ``cache_init: zeros``, ``inputs.attention_mask``).
    The pass is functional: it rewrites structural copies (weights shared) and returns a new set.

    Raises:
        PreconditionError: a graph without a contract or ``cache_position``, already rewritten, opset < 12
            (LessOrEqual), no attention Softmax found, a mask that is not a position mask (a bias, weights, an
            unknown input) or whose window cannot be confirmed, or ``attention_mask`` still read by other nodes
            without ``padding``.
        PostconditionError: an exporter mask, IsNaN guard or unwanted ``attention_mask`` input is left.
    """

    name = "mask_rewrite"
    summary = (
        "Exporter mask -> Where(mask from cache_position, scores, lowest) before each Softmax; drops attention_mask."
    )
    config_model = MaskRewriteConfig
    config: MaskRewriteConfig
    in_place = False
    needs = frozenset({CONTRACT})
    keeps_opset = True

    def min_opset(self, model: ir.Model | None) -> tuple[int, str] | None:
        """ai.onnx opset 12 for the select mask (LessOrEqual); none for a graph whose GroupQueryAttention masks.

        Unknown (None) without the graph: a ``com.microsoft::GroupQueryAttention`` cache graph is left as it is
        (:meth:`requires` checks the opset only for the other graphs).
        """
        if model is None or any(f"{n.domain}::{n.op_type}" == GQA_OP for n in model.graph):
            return None
        return 12, "the mask it writes uses LessOrEqual-12"

    def requires(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Every graph carries a contract with ``cache_position``, not rewritten yet, ai.onnx opset ≥ 12.

        Raises:
            PreconditionError: naming the graph and what is missing.
        """
        for artifact, contract in artifacts.contracts(self.name):
            if contract.inputs.cache_position is None:
                raise PreconditionError(self.name, f"{artifact.name}: the contract names no cache_position input")
            op = masking_attention_op(artifact.model, contract)
            if op is not None and self.config.padding:
                raise PreconditionError(
                    self.name,
                    f"{artifact.name}: padding: true, but {GQA_OP} node '{op.name}' holds the cache and masks by "
                    "per-row lengths (seqlens_k), not by a padding mask; use padding: false",
                )
            if op is not None:
                continue
            if contract.mask == "cache_position":
                raise PreconditionError(self.name, f"{artifact.name}: the mask was already rewritten")
            opset = artifact.model.opset_imports.get("", artifact.model.opset_imports.get("ai.onnx", 0))
            if opset < 12:
                raise PreconditionError(self.name, f"{artifact.name}: ai.onnx opset {opset} < 12 (LessOrEqual)")

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Rewrite the mask of every graph of the set; see the class docstring."""
        models = []
        for artifact in artifacts.artifacts:
            contract = read_contract(artifact.model, source=artifact.name)
            op = masking_attention_op(artifact.model, contract) if contract is not None else None
            if op is not None:
                models.append(artifact.model)
                report.changes.append(
                    f"{artifact.name}: unchanged: {GQA_OP} node '{op.name}' masks inside the op by seqlens_k, "
                    "computed from cache_position (no exporter mask, no attention_mask input)"
                )
                continue
            result = self._rewrite(clone(artifact.model), artifact.name, context)
            models.append(result.model)
            report.changes += [f"{artifact.name}: {line}" for line in result.decomposed]
            windows = sorted(w for w in result.windows if w is not None)
            report.changes.append(
                f"{artifact.name}: {result.sites} attention Softmax(es) masked by select from cache_position "
                f"(step_len {result.contract.step_len}, {'sliding window ' + str(windows) if windows else 'causal'}"
                f"{', padding' if self.config.padding else ''}); {result.guards} IsNaN guard(s) removed"
            )
        if not self.config.padding:
            report.changes.append("input attention_mask removed; contract inputs.attention_mask = null")
        return artifacts.with_models(models), True

    def _rewrite(self, model: ir.Model, source: str, context: PassContext) -> _GraphResult:
        contract = read_contract(model, source=source)
        assert contract is not None  # requires() checked
        g = model.graph
        decomposed = decompose_attention(g, who=self.name)  # opset-23 Attention: its scores become reachable
        infer_shapes(model)  # the sites are told apart by their static shapes; an earlier pass may have dropped them
        inputs = {str(v.name): v for v in g.inputs}
        key_inputs = [name for entry in contract.cache for name in (entry.key_in or entry.kv_in,) if name]
        sites = find_attention_sites(g, key_inputs, contract.max_cache_len, who=self.name)
        S, L = contract.step_len, contract.max_cache_len
        for site in sites:
            shape = site.softmax.inputs[0].shape  # type: ignore[union-attr]
            dims = list(shape) if shape is not None else []
            if len(dims) < 2 or dims[-1] != L or dims[-2] != S or not all(isinstance(d, int) for d in dims):
                raise PreconditionError(
                    self.name,
                    f"{source}: Softmax {_label(site.softmax)} input has shape {dims}; expected static (…, {S}, {L}) "
                    "(step_len, max_cache_len)",
                )
        cache_position = inputs[contract.inputs.cache_position]  # type: ignore[index]
        am_name = contract.inputs.attention_mask
        attention_mask = inputs.get(am_name) if am_name else None
        if self.config.padding and attention_mask is None:
            attention_mask = ir.Value(
                name="attention_mask", shape=ir.Shape([contract.batch, L]), type=ir.TensorType(ir.DataType.INT64)
            )
            g.inputs.append(attention_mask)
        builder = _MaskBuilder(g, cache_position, attention_mask if self.config.padding else None, contract.batch, S, L)

        # candidate masks per site; the old mask of each site decides among them by running
        candidates: dict[int, list[int | None]] = {}
        for i, site in enumerate(sites):
            windows: list[int | None] = [] if site.old_mask is None else list(window_candidates(site.old_mask))
            candidates[i] = [*windows, None]
            for w in candidates[i]:
                builder.visible(w, len(site.scores_shape))
        chosen = self._choose_windows(model, sites, candidates, builder, contract, source, context)

        guards = 0
        for i, site in enumerate(sites):
            if site.masked is not None and site.scores is not None:
                site.masked.replace_all_uses_with(site.scores)
            x = site.softmax.inputs[0]
            assert x is not None
            if x.dtype is None:
                raise PreconditionError(self.name, f"{source}: Softmax {_label(site.softmax)} input has no dtype")
            lowest = _const(g, f"{_PREFIX}/lowest_{x.dtype.name.lower()}", lowest_finite(x.dtype))
            where = ir.node(
                "Where",
                [builder.visible(chosen[i], len(site.scores_shape)), x, lowest],
                name=f"{_PREFIX}/{site.softmax.name or i}/select",
            )
            where.outputs[0].name = f"{_PREFIX}/{site.softmax.name or i}/masked_scores"
            where.outputs[0].dtype = x.dtype
            g.insert_before(site.softmax, where)
            site.softmax.replace_input_with(0, where.outputs[0])
            for _isnan, guard in site.nan_guards:
                guard.outputs[0].replace_all_uses_with(site.softmax.outputs[0], replace_graph_outputs=True)
                guards += 1
        ir_common.RemoveUnusedNodesPass()(model)

        if attention_mask is not None and not self.config.padding:
            readers = sorted({_label(u.node) for u in attention_mask.uses()})
            if readers:
                raise PreconditionError(
                    self.name,
                    f"{source}: attention_mask is still read by {readers[:3]} after the exporter's mask was removed; "
                    "use padding: true to keep it",
                )
            g.inputs.remove(attention_mask)
        folded = fold_and_infer(model)
        windows = {chosen[i] for i in range(len(sites))}
        windowed = sorted(w for w in windows if w is not None)
        new_contract = contract.model_copy(
            update={
                "contract_version": max(contract.contract_version, 2),
                "mask": "cache_position",
                "sliding_window": windowed[0] if len(windowed) == 1 else None,
                "cache_init": "zeros",
                "inputs": contract.inputs.model_copy(
                    update={"attention_mask": str(attention_mask.name) if self.config.padding else None}
                ),
            }
        )
        write_contract(folded, new_contract)
        return _GraphResult(folded, new_contract, windows, len(sites), guards, decomposed)

    def _choose_windows(
        self,
        model: ir.Model,
        sites: list[AttentionSite],
        candidates: dict[int, list[int | None]],
        builder: _MaskBuilder,
        contract: DecodeContract,
        source: str,
        context: PassContext,
    ) -> dict[int, int | None]:
        """Run the old masks and the candidates at every chunk start; per site, the first candidate that agrees.

        Raises:
            PreconditionError: the old mask reads an input other than cache_position / attention_mask /
                position_ids, is not a 0 / large-negative mask, or no candidate agrees with it.
        """
        S, L, B = contract.step_len, contract.max_cache_len, contract.batch
        outputs: dict[str, ir.Value] = {}
        for i, site in enumerate(sites):
            if site.old_mask is not None:
                outputs[str(site.old_mask.name)] = site.old_mask
            for w in candidates[i]:
                value = builder.visible(w, len(site.scores_shape))
                outputs[str(value.name)] = value
        chosen: dict[int, int | None] = {i: None for i in range(len(sites))}
        todo = [i for i, site in enumerate(sites) if site.old_mask is not None]
        if not todo:
            return chosen
        rng = np.random.default_rng(_PROBE_SEED)
        agree: dict[int, set[int | None]] = {i: set(candidates[i]) for i in todo}
        with _probe_session(model, list(outputs.values()), context, self.name) as sess:
            fed = {arg.name for arg in sess.get_inputs()}
            known = {contract.inputs.cache_position, contract.inputs.attention_mask, contract.inputs.position_ids}
            unknown = sorted(fed - {n for n in known if n})
            if unknown:
                raise PreconditionError(
                    self.name, f"{source}: the exporter's mask reads input(s) {unknown}, not only positions"
                )
            names = list(outputs)
            for p0 in _probe_starts(S, L):
                positions = np.arange(p0, p0 + S, dtype=np.int64)
                contract_mask = np.zeros((B, L), dtype=np.int64)
                contract_mask[:, : p0 + S] = 1
                masks = [contract_mask]
                if self.config.padding:
                    padded = contract_mask * rng.integers(0, 2, size=(B, L), dtype=np.int64)
                    masks.append(padded)
                for am in masks:
                    feeds: dict[str, np.ndarray] = {}
                    for role, array in (
                        ("cache_position", positions),
                        ("attention_mask", am),
                        ("position_ids", np.broadcast_to(positions, (B, S)).copy()),
                    ):
                        name = getattr(contract.inputs, role)
                        if name in fed:
                            feeds[name] = array
                    if builder.attention_mask is not None and str(builder.attention_mask.name) in fed:
                        feeds[str(builder.attention_mask.name)] = am
                    got = dict(zip(names, sess.run(names, feeds), strict=True))
                    for i in todo:
                        site = sites[i]
                        shape = site.scores_shape
                        old = np.broadcast_to(
                            _old_visible(site, got[str(site.old_mask.name)], self.name, source), shape
                        )
                        for w in list(agree[i]):
                            new = np.broadcast_to(got[str(builder.visible(w, len(shape)).name)], shape)
                            if not np.array_equal(old, new):
                                agree[i].discard(w)
                                if not agree[i]:
                                    row = np.argwhere((old != new).reshape(-1, S, L).any(axis=2))[0]
                                    seen = np.flatnonzero(old.reshape(-1, S, L)[row[0], row[1]]).tolist()
                                    raise PreconditionError(
                                        self.name,
                                        f"{source}: the exporter's mask before Softmax {_label(site.softmax)} lets "
                                        f"the query at position {p0 + row[1]} see slots {seen[:12]}"
                                        f"{'…' if len(seen) > 12 else ''}: it selects slots no causal or "
                                        f"sliding-window mask from cache_position reproduces (windows tried: "
                                        f"{candidates[i]}); refusing rather than changing what attention sees",
                                    )
        for i in todo:
            chosen[i] = next(w for w in candidates[i] if w in agree[i])  # graph constants before None
        return chosen

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Each graph: every attention Softmax reads this pass's select, no NaN guard, attention_mask as asked.

        Raises:
            PostconditionError: naming the graph and the node or input.
        """
        for artifact in artifacts.artifacts:
            g = artifact.model.graph
            contract = read_contract(artifact.model, source=artifact.name)
            assert contract is not None
            names = {str(v.name) for v in g.inputs}
            kept = contract.inputs.attention_mask
            if self.config.padding != (kept is not None and kept in names):
                raise PostconditionError(
                    self.name, f"{artifact.name}: attention_mask input {'missing' if self.config.padding else 'left'}"
                )
            if not self.config.padding and "attention_mask" in names:
                raise PostconditionError(self.name, f"{artifact.name}: the attention_mask input is still there")
            if masking_attention_op(artifact.model, contract) is not None:
                continue
            keys = [name for entry in contract.cache for name in (entry.key_in or entry.kv_in,) if name]
            for site in find_attention_sites(g, keys, contract.max_cache_len, who=self.name):
                x = site.softmax.inputs[0]
                producer = x.producer() if x is not None else None
                if producer is None or producer.op_type != "Where" or not producer.name.startswith(_PREFIX):
                    raise PostconditionError(
                        self.name,
                        f"{artifact.name}: Softmax {_label(site.softmax)} is not masked by this pass's select",
                    )
                if site.nan_guards:
                    raise PostconditionError(
                        self.name, f"{artifact.name}: an IsNaN guard is left after Softmax {_label(site.softmax)}"
                    )
