"""Lowerings that keep the node: attributes dropped or rewritten, sizes and axes moved between input and attribute.

Each takes ``(node, current opset, target opset)``, edits the node for the target and returns the nodes that
replace it (the node itself, after a ``Constant`` it now reads where one was needed); it raises
:class:`~onnxdeploy.errors.PassError` (:func:`~onnxdeploy.passes._opset_schemas.refuse`) where the node has no
exact form at the target. Sources: ONNX ``docs/Changelog.md`` and ``docs/Operators.md``, per op below.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir

from onnxdeploy.graph import const_ints, dtype_name, numpy_dtype_of
from onnxdeploy.passes._edit import constant_node, make_node
from onnxdeploy.passes._opset_rewrites import lower_pad_wrap
from onnxdeploy.passes._opset_schemas import check_types, refuse, schema_at, stems

__all__ = [
    "lower_cast",
    "lower_constant",
    "lower_dequantize_linear",
    "lower_mod",
    "lower_pad",
    "lower_reduce",
    "lower_reshape",
    "lower_scatter",
    "lower_split",
    "same_semantics",
]


def _target_schema(node: ir.Node, target: int) -> onnx.defs.OpSchema:
    schema = schema_at(node.op_type, target)
    assert schema is not None
    return schema


def _drop_attributes_not_in(node: ir.Node, schema: onnx.defs.OpSchema) -> None:
    for name in [a for a in node.attributes if a not in schema.attributes]:
        node.attributes.pop(name)


def same_semantics(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Versions that only added types (Pow-15, Identity-14/16, Add/Sub/Mul/Div/Relu-14, GatherElements-13, …).

    Attributes the target's schema lacks were checked to be at their default
    (:func:`~onnxdeploy.passes._opset_schemas.types_only_change`).
    """
    _drop_attributes_not_in(node, _target_schema(node, target))
    check_types(node, target)
    return [node]


def lower_scatter(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """ScatterElements/ScatterND-18 added ``reduction`` max/min; add/mul/none mean the same at 16."""
    reduction = node.attributes.get("reduction")
    if reduction is not None and reduction.as_string() in ("max", "min") and target < 18:
        raise refuse(node, f"reduction='{reduction.as_string()}' first exists at opset 18", 18)
    if reduction is not None and reduction.as_string() != "none" and target < 16:
        raise refuse(node, f"reduction='{reduction.as_string()}' first exists at opset 16", 16)
    if target < 16:
        node.attributes.pop("reduction", None)
    check_types(node, target)
    return [node]


def lower_cast(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Cast-19 ``saturate`` only affects float8 outputs (which the type check refuses below 19): dropped."""
    schema = schema_at("Cast", target)
    if schema is not None and "saturate" not in schema.attributes:
        node.attributes.pop("saturate", None)
    check_types(node, target)
    return [node]


def lower_constant(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Constant-12 ``value_float(s)``/``value_int(s)`` become a ``value`` tensor where the target lacks them."""
    schema = _target_schema(node, target)
    forms = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    for name, dtype in forms.items():
        attr = node.attributes.get(name)
        if attr is not None and name not in schema.attributes:
            node.attributes.pop(name)
            data = np.array(attr.value, dtype=dtype)
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(data))
    unsupported = [a for a in node.attributes if a not in schema.attributes]
    if unsupported:
        raise refuse(node, f"attribute {unsupported[0]} is not in Constant-{schema.since_version}", current)
    value = node.attributes.get("value")
    if value is not None:
        dtype = value.as_tensor().dtype
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}["T"]
        if f"tensor({dtype_name(dtype.value)})" not in allowed:
            raise refuse(node, f"Constant-{schema.since_version} cannot hold {dtype.name}", current)
    return [node]


def lower_reshape(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Reshape-14 ``allowzero``: kept where the target has it (14 and up), else dropped when that is exact.

    Below 14 it is dropped when 0, or when the shape is a constant without zeros (then allowzero changes
    nothing). Source: ONNX Operators.md, Reshape-14.
    """
    if "allowzero" in _target_schema(node, target).attributes:
        check_types(node, target)
        return [node]
    flag = node.attributes.pop("allowzero", None)
    if flag is not None and flag.as_int() == 1:
        dims = const_ints(node.inputs[1])
        if dims is None or 0 in dims:
            raise refuse(node, "allowzero=1 with a shape that may hold 0", 14)
    check_types(node, target)
    return [node]


def lower_pad(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Pad-18 added the optional ``axes`` input and Pad-19 the ``wrap`` mode; without them Pad-13/11 mean the same.

    ``wrap`` below 19 is spelled with Slice and Concat (``_opset_rewrites.lower_pad_wrap``).

    ``axes`` is kept for targets 18 and up; below 18 a constant ``axes`` on an input of known rank becomes full
    ``pads`` (a Gather of ``[pads..., 0]``: pad 0 on every axis not listed). Source: ONNX Operators.md,
    Pad-11/13/18/19.
    """
    mode = node.attributes.get("mode")
    if mode is not None and mode.as_string() == "wrap" and target < 19:
        return lower_pad_wrap(node, current, target)
    axes = node.inputs[3] if len(node.inputs) > 3 else None
    if target >= 18 or axes is None:
        if len(node.inputs) > 3 and axes is None:
            node.resize_inputs(3)
        check_types(node, target)
        return [node]
    extra = _full_pads(node, axes)
    node.resize_inputs(3)
    check_types(node, target)
    return [*extra, node]


def _full_pads(node: ir.Node, axes_value: ir.Value) -> list[ir.Node]:
    """Rewire Pad-18's ``pads`` (for ``axes``) to full-rank pads below 18; return the nodes that compute them.

    Raises:
        PassError: ``axes`` is not constant or the input's rank is unknown (no exact form below 18).
    """
    axes = const_ints(axes_value)
    shape = node.inputs[0].shape
    if axes is None or shape is None:
        what = f"its axes '{axes_value.name}' are not constant" if axes is None else "its input's rank is unknown"
        raise refuse(node, f"the axes input first exists at opset 18 and {what}", 18)
    rank, n = len(shape), len(axes)
    where = {a % rank: i for i, a in enumerate(axes)}
    zero_slot = 2 * n  # the 0 appended after the given pads
    index = [where[d] if d in where else zero_slot for d in range(rank)]
    index += [where[d] + n if d in where else zero_slot for d in range(rank)]
    _, stem = stems(node)
    pads = node.inputs[1]
    zero = constant_node(f"{stem}__pad_zero", np.zeros(1, np.int64))
    joined = make_node("Concat", [pads, zero.outputs[0]], name=f"{stem}__pads_ext", output=f"{stem}__pads_ext", axis=0)
    idx = constant_node(f"{stem}__pads_index", np.array(index, np.int64))
    full = make_node(
        "Gather", [joined.outputs[0], idx.outputs[0]], name=f"{stem}__pads_full", output=f"{stem}__pads_full", axis=0
    )
    full.outputs[0].dtype = ir.DataType.INT64
    full.outputs[0].shape = ir.Shape([2 * rank])
    node.replace_input_with(1, full.outputs[0])
    return [zero, joined, idx, full]


def lower_mod(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Mod-28 ``fmod=0`` on floats (``A - floor(A/B)*B``, the sign of ``B``) → Mod ``fmod=1`` and a correction.

    Below 28 a float Mod must have ``fmod=1`` (C ``fmod``, the sign of ``A``); the floor form is
    ``r = fmod(A, B); Where(r != 0 and (r < 0) != (B < 0), r + B, r)``, which also gives the special cases
    Mod-28 lists (``±inf`` divisor: ``B`` where signs differ). Zeros keep ``fmod``'s sign (a signed-zero
    difference only). Source: ONNX Operators.md, Mod-13 and Mod-28.
    """
    flag = node.attributes.get("fmod")
    x = node.inputs[0]
    floats = x.dtype is not None and x.dtype.is_floating_point()
    if not floats or (flag is not None and flag.as_int() == 1):
        check_types(node, target)
        return [node]
    if x.dtype is None:
        raise refuse(node, f"fmod=0 and the dtype of '{x.name}' is unknown", 28)
    name, stem = stems(node)
    b = node.inputs[1]
    mod = make_node("Mod", [x, b], name=f"{name}__fmod", output=f"{stem}__fmod", dtype=x.dtype, fmod=1)
    check_types(mod, target)
    zero = constant_node(f"{stem}__zero", np.zeros((), dtype=numpy_dtype_of(x.dtype)))
    steps: list[ir.Node] = [mod, zero]

    def add(op: str, inputs: list[ir.Value], dtype: ir.DataType) -> ir.Value:
        at = len(steps)
        step = make_node(op, inputs, name=f"{name}__{op}_{at}", output=f"{stem}__{op}_{at}", dtype=dtype)
        steps.append(step)
        return step.outputs[0]

    r = mod.outputs[0]
    bool_ = ir.DataType.BOOL
    nonzero = add("Not", [add("Equal", [r, zero.outputs[0]], bool_)], bool_)
    differ = add("Xor", [add("Less", [r, zero.outputs[0]], bool_), add("Less", [b, zero.outputs[0]], bool_)], bool_)
    fix = add("And", [nonzero, differ], bool_)
    shifted = add("Add", [r, b], x.dtype)
    result = ir.Node("", "Where", [fix, shifted, r], num_outputs=1, name=f"{name}__floor")
    return [*steps, result]


def lower_dequantize_linear(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """DequantizeLinear: per-axis scales need opset 13, ``block_size`` (blocked INT4) opset 21.

    Source: ONNX Operators.md, DequantizeLinear-10/13/19/21 (below 13 ``x_scale`` must be a scalar).
    """
    block = node.attributes.get("block_size")
    if block is not None and block.as_int() != 0 and target < 21:
        raise refuse(node, "blocked quantization (block_size) first exists at opset 21", 21)
    scale = node.inputs[1] if len(node.inputs) > 1 else None
    shape = (
        scale.const_value.shape
        if scale is not None and scale.const_value is not None
        else (scale.shape if scale else None)
    )
    per_axis = shape is None or math.prod(int(d) if isinstance(d, int) else 2 for d in shape) > 1
    if per_axis and target < 13:
        raise refuse(node, "a per-axis (non-scalar) x_scale first exists at opset 13", 13)
    _drop_attributes_not_in(node, _target_schema(node, target))
    check_types(node, target)
    return [node]


def _split_sizes(node: ir.Node, num: ir.Attr | None, target: int) -> list[int] | None:
    """The Split's sizes when they must be spelled out: its constant ``split`` input, or from ``num_outputs``.

    None when every output has the same size (Split-11..17 then split evenly by themselves) or the sizes
    are an input that stays one (target 13 and up).
    """
    sizes = node.inputs[1] if len(node.inputs) > 1 else None
    if sizes is not None:
        split = const_ints(sizes)
        if split is None and target < 13:
            raise refuse(node, f"its split sizes '{sizes.name}' are not constant", 13)
        return split
    if num is None:
        return None
    n_out = len(node.outputs)
    axis = node.attributes.get("axis")
    axis = axis.as_int() if axis is not None else 0
    shape = node.inputs[0].shape
    dim = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
    if not isinstance(dim, int):
        raise refuse(node, "num_outputs on an axis of unknown size", 18)
    if dim % n_out == 0:
        return None
    chunk = -(-dim // n_out)
    return [chunk] * (n_out - 1) + [dim - chunk * (n_out - 1)]


def lower_split(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Split-18 ``num_outputs`` → sizes; the sizes go to the input (13–17) or the attribute (11–12)."""
    num = node.attributes.pop("num_outputs", None)
    sizes = node.inputs[1] if len(node.inputs) > 1 else None
    split = _split_sizes(node, num, target)
    if target < 13:
        if split is not None:
            node.attributes["split"] = ir.AttrInt64s("split", split)
        if sizes is not None:
            node.resize_inputs(1)
    elif split is not None and sizes is None:
        constant = constant_node(f"{stems(node)[1]}__split", np.array(split, np.int64))
        node.resize_inputs(2)
        node.replace_input_with(1, constant.outputs[0])
        check_types(node, target)
        return [constant, node]
    check_types(node, target)
    return [node]


def lower_reduce(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Reduce* ``axes`` input ↔ attribute (ReduceSum at 13, the others at 18); ``noop_with_empty_axes`` kept or dropped.

    With ``noop_with_empty_axes=1`` and no axes the node reduces nothing: it becomes an Identity.
    """
    schema = _target_schema(node, target)
    axes_value = node.inputs[1] if len(node.inputs) > 1 else None
    axes_attr = node.attributes.get("axes")
    axes = const_ints(axes_value) if axes_value is not None else (list(axes_attr.as_ints()) if axes_attr else None)
    if axes_value is not None and axes is None and "axes" in schema.attributes:
        lowest = 13 if node.op_type == "ReduceSum" else 18  # where axes became an input
        raise refuse(node, f"its axes '{axes_value.name}' are not constant", lowest)
    noop = node.attributes.get("noop_with_empty_axes")
    if noop is not None and noop.as_int() == 1 and not axes:
        return [ir.Node("", "Identity", [node.inputs[0]], num_outputs=1, name=node.name)]
    if "noop_with_empty_axes" not in schema.attributes:
        node.attributes.pop("noop_with_empty_axes", None)
    extra: list[ir.Node] = []
    if "axes" in schema.attributes:  # attribute form
        node.attributes.pop("axes", None)
        if axes:
            node.attributes["axes"] = ir.AttrInt64s("axes", axes)
        node.resize_inputs(1)
    elif axes_attr is not None:  # input form, from an attribute
        node.attributes.pop("axes")
        extra.append(constant_node(f"{stems(node)[1]}__axes", np.array(axes, np.int64)))
        node.resize_inputs(2)
        node.replace_input_with(1, extra[0].outputs[0])
    check_types(node, target)
    return [*extra, node]
