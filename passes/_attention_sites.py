"""Attention sites of a static graph: each attention Softmax, the exporter's mask in front of it, its NaN guards.

``mask_rewrite`` replaces the exporter's mask at every site it finds here. A Softmax is found by data flow
(its input is computed from a key cache input the contract names), never by node names; the mask is the
operand of the ``Add`` (additive 0 / large-negative mask) or the condition of the ``Where`` on the path back
from the Softmax input through Identity/Cast and a scale Mul/Div. A graph whose cache enters
``com.microsoft::GroupQueryAttention`` has no such site: the op masks inside (:func:`masking_attention_op`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import onnx_ir as ir

from onnxdeploy.contract import DecodeContract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import const_array, downstream_nodes, node_label
from onnxdeploy.kv_cache import GQA_OP

__all__ = ["AttentionSite", "find_attention_sites", "key_cache_inputs", "masking_attention_op"]

_PASS_BACK_OPS = frozenset({"Identity", "Cast"})  # between the masked scores and the Softmax
_SCALE_OPS = frozenset({"Mul", "Div"})


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


def key_cache_inputs(contract: DecodeContract) -> list[str]:
    """The names of the key cache inputs (or packed K/V inputs) the contract binds, one per layer."""
    return [name for entry in contract.cache for name in (entry.key_in or entry.kv_in,) if name]


def masking_attention_op(model: ir.Model, contract: DecodeContract) -> ir.Node | None:
    """The GroupQueryAttention node a key cache input of ``contract`` feeds (it masks inside), or None."""
    inputs = {str(v.name): v for v in model.graph.inputs}
    for entry in contract.cache:
        value = inputs.get(entry.key_in or entry.kv_in or "")
        for use in value.uses() if value is not None else []:
            if f"{use.node.domain}::{use.node.op_type}" == GQA_OP:
                return use.node
    return None


def _computed_from(graph: ir.Graph, values: list[ir.Value]) -> set[int]:
    """The ``id()`` of every value computed from ``values`` (``values`` included)."""
    depth = len(graph)  # no path is longer than the graph: the walks reach everything downstream
    seen = {id(v) for v in values}
    for value in values:
        seen |= {id(out) for node in downstream_nodes(value, depth) for out in node.outputs}
    return seen


def _is_constant(value: ir.Value | None) -> bool:
    return const_array(value) is not None


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
    from_cache = _computed_from(graph, [inputs[name] for name in key_inputs])
    sites = []
    for node in graph:
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        x = node.inputs[0]
        if x is None or id(x) not in from_cache or x.shape is None or x.shape[-1] != max_cache_len:
            continue
        rank = len(x.shape)
        axis = node.attributes.get_int("axis", -1)
        if axis not in (-1, rank - 1):
            raise PreconditionError(
                who,
                f"attention Softmax {node_label(node)} normalises over axis {axis} of rank {rank}, not the slot axis",
            )
        sites.append(_site(node, from_cache))
    if not sites:
        raise PreconditionError(who, f"no Softmax is computed from the key cache inputs {key_inputs}")
    return sites


def _masking_node(node: ir.Node, value: ir.Value, softmax: ir.Node, from_cache: set[int]) -> AttentionSite | None:
    """The site when ``node`` (producing ``value``) applies the exporter's mask: an ``Add`` or a ``Where``."""
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
    return None


def _site(softmax: ir.Node, from_cache: set[int]) -> AttentionSite:
    """The site of ``softmax``: the first masking node back through pass-through and scale ops, if any."""
    value = softmax.inputs[0]
    while value is not None:
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            break
        site = _masking_node(node, value, softmax, from_cache)
        if site is not None:
            return site
        ins = list(node.inputs)
        if node.op_type in _PASS_BACK_OPS and len(ins) == 1:
            value = ins[0]
        elif node.op_type in _SCALE_OPS and len(ins) == 2 and _is_constant(ins[1]):
            value = ins[0]
        else:
            break
    return AttentionSite(softmax, None, None, None, "none", _nan_guards(softmax))
