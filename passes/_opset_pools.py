"""MaxPool-22 / AveragePool-22 lowered below 22: the ``ceil_mode`` output size, made exact with a Slice.

MaxPool-22 and AveragePool-22 changed the output size with ``ceil_mode=1`` and explicit pads: "Sliding windows
that would start in the right padded region are ignored" (ONNX Operators.md, MaxPool-22 / AveragePool-22; the
sentence is absent from MaxPool-12 and AveragePool-19). So on an axis where the last ``ceil`` window starts in
the right padding, the opset-22 output is one element shorter than the earlier versions' output; every other
window is the same (same start, same extent). The exact lowering keeps the pool at the target and slices the
extra last window away on those axes (ONNX's shape inference of the earlier versions then agrees with the
opset-22 shape; a runtime that already drops such a window, as ONNX Runtime's pool kernels do, slices nothing).

Refused, naming the node and the reason: a window may start in the padding but the input's spatial dims are
not known (the size cannot be decided), or a MaxPool with an ``Indices`` output (one more Slice would be
needed for a second output; not worth its rarity). AveragePool below 19 also refuses ``dilations`` other than 1
(the attribute first exists at 19).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from onnxdeploy.passes._edit import constant_node, make_node
from onnxdeploy.passes._opset_schemas import check_types, node_since, refuse, schema_at, stems

__all__ = ["HELD_FROM", "lower_pool", "windows_in_right_pad"]

HELD_FROM = {"MaxPool": 22, "AveragePool": 22}
"""Op → the version from which its nodes are held for :func:`lower_pool` (earlier ones: onnx's converter)."""


def _ints(node: ir.Node, name: str, default: list[int]) -> list[int]:
    attr = node.attributes.get(name)
    return list(attr.as_ints()) if attr is not None else default


def windows_in_right_pad(node: ir.Node) -> list[int] | None:
    """The spatial axes (0-based, after N and C) whose last ``ceil_mode`` window starts in the right padding.

    Per axis ``i`` (input size ``D``, pads ``b``/``e``, kernel ``k``, stride ``s``, dilation ``d``): the ceil
    output size is ``O = ceil((D + b + e - d*(k-1) - 1) / s) + 1``; the last window starts at ``(O-1)*s``, in the
    right padding when ``(O-1)*s >= D + b`` (ONNX Operators.md, MaxPool-22 / AveragePool-22).

    Returns:
        ``[]`` when no window starts in the padding (or past the input: ``ceil_mode=0``, ``auto_pad`` set, or
        the sizes), the axes otherwise; None when a spatial dim is not a known int (undecidable).
    """
    ceil = node.attributes.get("ceil_mode")
    auto_pad = node.attributes.get("auto_pad")
    if ceil is None or ceil.as_int() == 0:
        return []
    if auto_pad is not None and auto_pad.as_string() not in ("", "NOTSET"):
        return []  # VALID has no pads; SAME_* pads so that every window starts inside the input
    kernel = _ints(node, "kernel_shape", [])
    n = len(kernel)
    pads = _ints(node, "pads", [0] * 2 * n)
    strides = _ints(node, "strides", [1] * n)
    dilations = _ints(node, "dilations", [1] * n)
    shape = node.inputs[0].shape
    if shape is None or len(shape) != n + 2:
        return None
    axes = []
    for i in range(n):
        dim = shape[i + 2]
        if not isinstance(dim, int):
            return None
        span = dim + pads[i] + pads[n + i] - dilations[i] * (kernel[i] - 1) - 1
        size = math.ceil(span / strides[i]) + 1
        if (size - 1) * strides[i] >= dim + pads[i]:
            axes.append(i)
    return axes


def lower_pool(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """MaxPool-22 / AveragePool-22 → the target's version, exact (see the module docstring).

    Raises:
        PassError: spatial dims unknown while a window may start in the right padding; an ``Indices`` output
            to slice; AveragePool ``dilations`` other than 1 below 19; a dtype the target's schema lacks.
    """
    if node.op_type == "AveragePool" and "dilations" not in (schema_at("AveragePool", target) or _NO).attributes:
        dilations = node.attributes.get("dilations")
        if dilations is not None and any(d != 1 for d in dilations.as_ints()):
            raise refuse(node, "dilations other than 1 first exist at opset 19", 19)
        node.attributes.pop("dilations", None)
    check_types(node, target)
    if node_since(node, current) < 22 or target >= 22:
        return [node]
    axes = windows_in_right_pad(node)
    if axes == []:
        return [node]
    why = "with ceil_mode=1 opset 22 drops a last window that starts in the right padding, earlier opsets keep it"
    if axes is None:
        raise refuse(node, f"{why}, and the input's spatial dims are not known to tell whether one does", 22)
    if len(node.outputs) > 1 and node.outputs[1] is not None and node.outputs[1].name:
        raise refuse(node, f"{why}, and it has an Indices output (only Y is sliced to the opset-22 size)", 22)
    return _sliced(node, axes)


def _sliced(node: ir.Node, axes: list[int]) -> list[ir.Node]:
    """The pool at the target (its output one longer on ``axes``) and a Slice back to the opset-22 size."""
    name, stem = stems(node)
    attributes = [a for a in node.attributes.values()]
    pool = ir.Node("", node.op_type, list(node.inputs), attributes=attributes, num_outputs=1, name=f"{name}__pool")
    pool.outputs[0].name = f"{stem}__pool"
    pool.outputs[0].dtype = node.outputs[0].dtype
    shape = node.inputs[0].shape
    assert shape is not None
    # the opset-22 output size on each sliced axis: the earlier size minus the dropped window
    kernel = _ints(node, "kernel_shape", [])
    n = len(kernel)
    pads = _ints(node, "pads", [0] * 2 * n)
    strides = _ints(node, "strides", [1] * n)
    dilations = _ints(node, "dilations", [1] * n)
    ends = []
    for i in axes:
        span = int(shape[i + 2]) + pads[i] + pads[n + i] - dilations[i] * (kernel[i] - 1) - 1
        ends.append(math.ceil(span / strides[i]))  # = earlier size - 1
    starts = constant_node(f"{stem}__ceil_starts", np.zeros(len(axes), np.int64))
    stops = constant_node(f"{stem}__ceil_ends", np.array(ends, np.int64))
    where = constant_node(f"{stem}__ceil_axes", np.array([a + 2 for a in axes], np.int64))
    inputs = [pool.outputs[0], starts.outputs[0], stops.outputs[0], where.outputs[0]]
    cut = make_node("Slice", inputs, name=node.name or f"{stem}__ceil_slice", output=f"{stem}__ceil_slice")
    cut.outputs[0].dtype = node.outputs[0].dtype
    return [pool, starts, stops, where, cut]


class _NoSchema:
    attributes: dict = {}


_NO = _NoSchema()
