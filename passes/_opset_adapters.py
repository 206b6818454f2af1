"""Exact opset adapters onnx's version converter lacks or gets wrong, on onnx_ir: the registry and its dispatch.

``pin_opset`` lowers a graph in three steps (function expansion, then :func:`hold_nodes` → onnx's converter
→ :func:`restore_held`):

1. Ops that do not exist at the target opset but have an ONNX function definition are replaced by their
   function body (:mod:`onnxdeploy.passes._opset_functions`).
2. Nodes whose op changes between the graph's opset and the target in a way onnx 1.23 has no (or a wrong)
   adapter for are moved to a private domain, so the converter passes them by; so are default-domain ops
   onnx has no schema for (ORT's ``SimplifiedLayerNormalization``), which are kept as they are.
3. After the converter ran, every held node is rewritten for the target (:data:`LOWERINGS`: the lowerings
   that keep the node are in :mod:`onnxdeploy.passes._opset_lowerings`, those that replace it by other ops
   in :mod:`onnxdeploy.passes._opset_rewrites`) and moved back; nodes the converter made without a name are
   named (:func:`name_created_nodes`).

Each lowering is exact (same values, bit for bit, on a runtime that implements both opsets); where none is,
:class:`~onnxdeploy.errors.PassError` names the op, the node and the lowest opset the node can reach
(:mod:`onnxdeploy.passes._opset_schemas`). Sources: ONNX ``docs/Changelog.md`` (what each op version changed)
and ``docs/Operators.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from onnxdeploy.passes._opset_lowerings import (
    lower_cast,
    lower_constant,
    lower_dequantize_linear,
    lower_mod,
    lower_pad,
    lower_reduce,
    lower_reshape,
    lower_scatter,
    lower_split,
    same_semantics,
)
from onnxdeploy.passes._opset_pools import HELD_FROM, lower_pool
from onnxdeploy.passes._opset_rewrites import lower_cast_like, lower_shape, lower_softmax, lower_trilu
from onnxdeploy.passes._opset_schemas import (
    DEFAULT_DOMAINS,
    hand_over,
    refuse,
    schema_at,
    since_version,
    types_only_change,
)

__all__ = [
    "HELD_DOMAIN",
    "LOWERINGS",
    "RAISE_REFUSALS",
    "Lowering",
    "hold_nodes",
    "name_created_nodes",
    "refuse_unraisable",
    "restore_held",
]

HELD_DOMAIN = "onnxdeploy.held"
"""Domain a node is parked in while onnx's version converter runs (it converts ``ai.onnx`` only)."""

Lowering = Callable[[ir.Node, int, int], list[ir.Node]]
"""``(node, current opset, target opset)`` → the nodes replacing it (the node itself, edited, when it stays)."""

_REDUCE_OPS = (
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
)

LOWERINGS: dict[str, Lowering] = {
    **dict.fromkeys(
        ["Pow", "Identity", "Add", "Sub", "Mul", "Div", "Relu", "GatherElements", "Gather", "Range"], same_semantics
    ),
    "Shape": lower_shape,
    "Reshape": lower_reshape,
    "CastLike": lower_cast_like,
    "Trilu": lower_trilu,
    "Cast": lower_cast,
    "Constant": lower_constant,
    "ScatterElements": lower_scatter,
    "ScatterND": lower_scatter,
    "Split": lower_split,
    "Pad": lower_pad,
    "DequantizeLinear": lower_dequantize_linear,
    "Mod": lower_mod,
    **dict.fromkeys(_REDUCE_OPS, lower_reduce),
    **dict.fromkeys(["Softmax", "LogSoftmax", "Hardmax"], lower_softmax),
    **dict.fromkeys(HELD_FROM, lower_pool),
}
"""Op → its exact lowering from the graph's opset to a lower target, applied after onnx's converter ran."""


RAISE_REFUSALS: dict[str, tuple[int, str]] = {
    "Scan": (9, "Scan-8 scans behind a leading batch axis that Scan-9 and later do not have"),
}
"""Op → (opset where its meaning changed, why) for raises no exact adapter exists for. Source: ONNX Changelog.md."""


def refuse_unraisable(model: ir.Model, current: int, target: int) -> None:
    """Refuse a raise across a change of meaning in :data:`RAISE_REFUSALS` (before onnx's converter runs).

    Raises:
        PassError: names the op, the node and the reason (the lowest opset reachable is the change's minus one).
    """
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        change = RAISE_REFUSALS.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        if change is not None and current < change[0] <= target:
            raise refuse(node, change[1], change[0] - 1)


def hold_nodes(model: ir.Model, current: int, target: int) -> dict[str, int]:
    """Park nodes the converter must not touch in :data:`HELD_DOMAIN`; return ``{op: count}`` held.

    Held are default-domain nodes onnx has no schema for (kept as they are) and, when lowering, nodes whose
    op changes between ``target`` and ``current`` and has an entry in :data:`LOWERINGS` (MaxPool/AveragePool only
    from version 22: ``_opset_pools.HELD_FROM``; onnx's converter has the earlier adapters).
    """
    held: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):  # subgraphs too: onnx's converter skips them
        if node.domain not in DEFAULT_DOMAINS:
            continue
        since = since_version(node.op_type, current)
        if since is not None:
            if not (target < current and since > target) or since < HELD_FROM.get(node.op_type, 0):
                continue
            if node.op_type not in LOWERINGS and not types_only_change(node, current, target):
                continue  # onnx's converter has the adapter
        node.domain = HELD_DOMAIN
        held[node.op_type] = held.get(node.op_type, 0) + 1
    if held:
        model.opset_imports[HELD_DOMAIN] = 1
    return held


def restore_held(model: ir.Model, current: int, target: int) -> list[str]:
    """Rewrite every held node for ``target`` (:data:`LOWERINGS`) and move it back; return what changed.

    ``model`` is the converter's output (a fresh graph): foreign ops are recognised by having no schema.

    Raises:
        PassError: a node has no exact form at ``target`` (names op, node and the lowest reachable opset).
    """
    changes: list[str] = []
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.domain != HELD_DOMAIN:
            continue
        graph = node.graph
        assert graph is not None
        node.domain = ""
        if since_version(node.op_type, current) is None:
            continue
        new_nodes = LOWERINGS.get(node.op_type, same_semantics)(node, current, target)
        if new_nodes == [node]:
            continue
        graph.insert_before(node, [n for n in new_nodes if n is not node])
        if node in new_nodes:
            continue
        for old, new in zip(node.outputs, new_nodes[-1].outputs, strict=True):
            hand_over(old, new, "__replaced")
        graph.remove(node, safe=True)
        changes.append(f"{node.op_type} '{node.name}' -> {'/'.join(n.op_type for n in new_nodes)}")
    model.opset_imports.pop(HELD_DOMAIN, None)
    return changes


def _name_for(node: ir.Node, target: int) -> str:
    """What a converter-made node is named after: ``<consumer>/<formal input>`` it feeds, else ``<op>/<output>``."""
    out = node.outputs[0]
    uses = list(out.uses())
    if not uses:
        return f"{node.op_type}/{out.name}"
    consumer, index = uses[0].node, uses[0].idx
    schema = schema_at(consumer.op_type, target) if consumer.domain in DEFAULT_DOMAINS else None
    formals = [f.name for f in schema.inputs] if schema is not None else []
    formal = formals[min(index, len(formals) - 1)] if formals else f"input{index}"
    return f"{consumer.name or consumer.op_type}/{formal}"


def name_created_nodes(model: ir.Model, unnamed_before: set[str], target: int) -> list[str]:
    """Name the nodes onnx's converter created without one (the ``Constant`` axes of Reduce*-18, …); return the names.

    A node is named after what it feeds, ``<consumer>/<formal input>`` (``.../ReduceMean/axes``), else after its op
    and output; a suffix ``_2``, ``_3``, … keeps names unique. Nodes that had no name in the input (their first
    output is in ``unnamed_before``) are the input's own and stay as they are.
    """
    graph = model.graph
    taken = {n.name for n in graph if n.name}
    named = []
    for node in graph:
        if node.name or not node.outputs or node.outputs[0].name in unnamed_before:
            continue
        base = _name_for(node, target)
        name, k = base, 2
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        node.name = name
        taken.add(name)
        named.append(name)
    return named
