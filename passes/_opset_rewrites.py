"""Lowerings that replace the node by others: an op or form the target lacks, spelled in ops it has.

Each takes ``(node, current opset, target opset)`` and returns the nodes replacing it, the last one taking over
the node's outputs (:func:`onnxdeploy.passes._opset_adapters.restore_held`); it raises
:class:`~onnxdeploy.errors.PassError` (:func:`~onnxdeploy.passes._opset_schemas.refuse`) where no exact form
exists. Each replacement computes the same values, bit for bit; sources: ONNX ``docs/Operators.md``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.graph import const_ints, numpy_dtype_of
from onnxdeploy.passes._edit import constant_node, make_node
from onnxdeploy.passes._opset_schemas import check_types, copy_type, refuse, schema_at, stems

__all__ = ["lower_cast_like", "lower_pad_wrap", "lower_shape", "lower_softmax", "lower_trilu"]


def lower_shape(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Shape-15 ``start``/``end`` become a Slice of the full shape (Shape-13 has no such attributes)."""
    start = node.attributes.pop("start", None)
    end = node.attributes.pop("end", None)
    check_types(node, target)
    if start is None and end is None:
        return [node]
    out = node.outputs[0]
    node_stem, _ = stems(node)
    lo = constant_node(f"{out.name}__start", np.array([start.as_int() if start else 0], np.int64))
    stop = end.as_int() if end else np.iinfo(np.int64).max
    hi = constant_node(f"{out.name}__end", np.array([stop], np.int64))
    shape_node = make_node(
        "Shape", [node.inputs[0]], name=f"{node_stem}__shape", output=f"{out.name}__full_shape", dtype=ir.DataType.INT64
    )
    slice_node = ir.Node(
        "", "Slice", [shape_node.outputs[0], lo.outputs[0], hi.outputs[0]], num_outputs=1, name=node.name
    )
    return [lo, hi, shape_node, slice_node]


def lower_cast_like(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """CastLike-19/21/24/25 → CastLike-15 (15 and up) or Cast(x, to=dtype(like)) below 15 (CastLike-15 is the first).

    ``saturate`` (CastLike/Cast-19: float8 outputs only) is kept where the target's schema has it, else dropped
    (the type check then refuses a float8 output, the only type it affects). Every node written is type-checked
    against the target's schema (float8 below 19, 4-bit below 21, 2-bit below 25 are refused).
    Source: ONNX Operators.md, CastLike-15/19/21/24/25 and Cast-13/19/21/24/25.
    """
    saturate = node.attributes.get("saturate")
    if target >= 15:
        schema = schema_at("CastLike", target)
        if saturate is not None and schema is not None and "saturate" not in schema.attributes:
            node.attributes.pop("saturate")
        check_types(node, target)
        return [node]
    like = node.inputs[1]
    dtype = like.dtype if like is not None else None
    if dtype is None:
        raise refuse(node, f"the dtype of '{like.name if like else 'target_type'}' is unknown", 15)
    attributes = [ir.AttrInt64("to", dtype.value)]
    cast = ir.Node("", "Cast", [node.inputs[0]], attributes=attributes, num_outputs=1, name=node.name)
    copy_type(node.outputs[0], cast.outputs[0])
    check_types(cast, target)
    return [cast]


class _Chain:
    """The nodes of a replacement, in order, each named ``<stem>__<Op>_<position>``."""

    def __init__(self, node: ir.Node) -> None:
        self.name, self.value_stem = stems(node)
        self.nodes: list[ir.Node] = []

    def add(self, op: str, inputs: list[ir.Value], **attrs: object) -> ir.Value:
        at = len(self.nodes)
        node = make_node(op, inputs, name=f"{self.name}__{op}_{at}", output=f"{self.value_stem}__{op}_{at}", **attrs)
        self.nodes.append(node)
        return node.outputs[0]

    def constant(self, suffix: str, array: np.ndarray) -> ir.Value:
        node = constant_node(f"{self.value_stem}__{suffix}", array)
        self.nodes.append(node)
        return node.outputs[0]


def lower_trilu(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Trilu → Where(drop, 0, x) with ``drop`` from Range over the last two dims (Trilu first exists at opset 14).

    Keeps ``x[..., i, j]`` where ``j - i >= k`` (upper) or ``j - i <= k`` (lower), as Operators.md defines; a bool
    ``x`` (a mask) becomes And(Not(drop), x) instead, since ONNX Runtime has no bool Where kernel.
    """
    x = node.inputs[0]
    if x.dtype is None:
        raise refuse(node, f"the dtype of '{x.name}' is unknown", 14)
    upper = node.attributes.get("upper")
    upper = upper.as_int() if upper is not None else 1
    chain = _Chain(node)
    shape = chain.add("Shape", [x])
    rows = chain.add("Gather", [shape, chain.constant("m2", np.array(-2, np.int64))], axis=0)
    cols = chain.add("Gather", [shape, chain.constant("m1", np.array(-1, np.int64))], axis=0)
    zero = chain.constant("zero_i", np.array(0, np.int64))
    one = chain.constant("one_i", np.array(1, np.int64))
    r = chain.add(
        "Reshape", [chain.add("Range", [zero, rows, one]), chain.constant("col", np.array([-1, 1], np.int64))]
    )
    c = chain.add("Range", [zero, cols, one])
    diff = chain.add("Sub", [c, r])
    k = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1] is not None else zero
    if k is not zero:
        k = chain.add("Reshape", [k, chain.constant("scalar", np.array([], np.int64))])
    drop = chain.add("Less" if upper else "Greater", [diff, k])
    if x.dtype == ir.DataType.BOOL:
        keep = chain.add("Not", [drop])
        return [*chain.nodes, ir.Node("", "And", [keep, x], num_outputs=1, name=chain.name)]
    fill = chain.constant("fill", np.zeros((), dtype=numpy_dtype_of(x.dtype)))
    return [*chain.nodes, ir.Node("", "Where", [drop, fill, x], num_outputs=1, name=chain.name)]


def lower_softmax(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Softmax/LogSoftmax/Hardmax-13 (one axis) → -11 (flattens at ``axis``): exact on the last axis.

    For another axis the tensor is transposed so that axis is last and back afterwards. onnx 1.23's own
    13 → 12 adapter only copies ``axis``, which changes the result for a non-last axis.
    """
    axis = node.attributes.get("axis")
    axis = axis.as_int() if axis is not None else -1
    x = node.inputs[0]
    rank = len(x.shape) if x.shape is not None else None
    if rank is None:
        raise refuse(node, f"the rank of '{x.name}' is unknown", 13)
    axis %= rank
    node.attributes["axis"] = ir.AttrInt64("axis", rank - 1)
    check_types(node, target)
    if axis == rank - 1:
        return [node]
    perm = [d for d in range(rank) if d != axis] + [axis]
    inverse = [perm.index(d) for d in range(rank)]
    name, p = stems(node)
    before = make_node("Transpose", [x], name=f"{name}__to_last", output=f"{p}__to_last", perm=perm)
    inner = make_node(node.op_type, [before.outputs[0]], name=f"{name}__inner", output=f"{p}__inner", axis=rank - 1)
    after = ir.node("Transpose", [inner.outputs[0]], attributes={"perm": inverse}, name=name)
    return [before, inner, after]


def lower_pad_wrap(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Pad-19+ ``mode='wrap'`` below 19 → per padded axis, a Gather of ``Mod(Range(-begin, dim + end), dim)``.

    Operators.md (Pad-19) defines wrap as the input repeated around itself: output index ``j`` on an axis reads
    input index ``(j - begin) mod dim``; negative pads crop, as they do in Pad. ``pads`` may be computed at run
    time; the input's rank and ``axes`` (when given) must be known, else refused naming why.
    """
    x = node.inputs[0]
    pads = node.inputs[1] if len(node.inputs) > 1 else None
    axes_value = node.inputs[3] if len(node.inputs) > 3 else None
    axes = const_ints(axes_value) if axes_value is not None else None
    shape = x.shape
    why = "mode='wrap' first exists at opset 19"
    if pads is None or (axes_value is not None and axes is None) or shape is None:
        raise refuse(node, f"{why}, and its axes are not constant or its input's rank is unknown", 19)
    rank = len(shape)
    axes = [a % rank for a in axes] if axes is not None else list(range(rank))
    n = len(axes)
    chain = _Chain(node)
    dims = chain.add("Shape", [x])
    one = chain.constant("wrap_one", np.array(1, np.int64))
    cur = x
    for i, axis in enumerate(axes):
        begin = chain.add("Gather", [pads, chain.constant(f"wrap_ib{axis}", np.array(i, np.int64))], axis=0)
        end = chain.add("Gather", [pads, chain.constant(f"wrap_ie{axis}", np.array(n + i, np.int64))], axis=0)
        dim = chain.add("Gather", [dims, chain.constant(f"wrap_axis{axis}", np.array(axis, np.int64))], axis=0)
        positions = chain.add("Range", [chain.add("Neg", [begin]), chain.add("Add", [dim, end]), one])
        cur = chain.add("Gather", [cur, chain.add("Mod", [positions, dim])], axis=axis)
    last = chain.nodes[-1]
    last.name = chain.name
    return chain.nodes
