"""Exact opset adapters onnx's version converter lacks or gets wrong, and function-op expansion, on onnx_ir.

``pin_opset`` lowers a graph in three steps (:func:`expand_function_ops`, then :func:`hold_nodes` →
onnx's converter → :func:`restore_held`):

1. Ops that do not exist at the target opset but have an ONNX function definition (``LayerNormalization``
   below 17; ``RMSNormalization``, ``RotaryEmbedding`` and ``Attention`` below 23) are replaced by their
   function body (``OpSchema.get_context_dependent_function`` / ``function_body``, ONNX's own definition,
   built for the node's attributes and input types). The body is made a small model, raised to the graph's
   opset by the converter, its shape arithmetic folded (onnxsim: the node's input shapes are known) and its
   empty tensors dropped (the pass-through half of a full rotation is a zero-size ``Split``/``Slice`` output
   fed to a ``Concat``), then spliced in.
2. Nodes whose op changes between the graph's opset and the target in a way onnx 1.23 has no (or a wrong)
   adapter for are moved to a private domain, so the converter passes them by; so are default-domain ops
   onnx has no schema for (ORT's ``SimplifiedLayerNormalization``), which are kept as they are.
3. After the converter ran, every held node is rewritten for the target (:data:`LOWERINGS`) and moved back.

Each lowering is exact (same values, bit for bit, on a runtime that implements both opsets); where none is,
:class:`~onnxdeploy.errors.PassError` names the op, the node and the lowest opset the node can reach.
Sources: ONNX ``docs/Changelog.md`` (what each op version changed) and ``docs/Operators.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
from onnx import version_converter

from onnxdeploy.errors import PassError

__all__ = [
    "HELD_DOMAIN",
    "types_only_change",
    "LOWERINGS",
    "expand_function_ops",
    "fold_empty_tensors",
    "function_ops_to_expand",
    "hold_nodes",
    "restore_held",
]

HELD_DOMAIN = "onnxdeploy.held"
"""Domain a node is parked in while onnx's version converter runs (it converts ``ai.onnx`` only)."""

_PASS = "pin_opset"
_DEFAULT = ("", "ai.onnx")


def _refuse(node: ir.Node, why: str, lowest: int) -> PassError:
    return PassError(
        _PASS, f"{node.op_type} node '{node.name}' cannot be lowered exactly: {why}; lowest reachable opset: {lowest}"
    )


def _schema(op: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return None


def _since(op: str, opset: int) -> int | None:
    s = _schema(op, opset)
    return s.since_version if s is not None else None


def _const_ints(value: ir.Value | None) -> list[int] | None:
    """The int values of a constant input (initializer or Constant node), else None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None and value.producer() is not None and value.producer().op_type == "Constant":
        attr = value.producer().attributes.get("value")
        tensor = attr.as_tensor() if attr is not None else None
    if tensor is None:
        return None
    return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def _constant(graph_nodes: list[ir.Node], name: str, array: np.ndarray) -> ir.Value:
    node = ir.node("Constant", [], attributes={"value": ir.tensor(array, name=name)}, name=name)
    node.outputs[0].name = name
    node.outputs[0].dtype = ir.DataType.from_numpy(array.dtype)
    node.outputs[0].shape = ir.Shape(array.shape)
    graph_nodes.append(node)
    return node.outputs[0]


def _stems(node: ir.Node) -> tuple[str, str]:
    """Stems for what replaces ``node``: ``(node names, value names)``.

    Value names come from the node's first output, unique in the graph (SSA), so two unnamed nodes of one op
    never produce the same name; node names from the node's name where it has one (meaningful), else the same.
    """
    value = node.outputs[0].name or node.op_type
    return (node.name or value), value


def copy_type(src: ir.Value, dst: ir.Value) -> None:
    """Give ``dst`` the dtype and shape ``src`` knows (unknown ones are left as they are)."""
    if src.dtype is not None:
        dst.dtype = src.dtype
    if src.shape is not None:
        dst.shape = src.shape


def _formal_types(schema: onnx.defs.OpSchema) -> list[tuple[str, bool, set[str]]]:
    """Per formal input, then output: ``(name, is_output, allowed types)``.

    A formal's ``type_str`` is a type parameter (``T2``, allowed types in ``type_constraints``) or one concrete
    type (DequantizeLinear-13's ``x_scale`` is ``tensor(float)``).
    """
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return [
        (p.name, is_output, allowed.get(p.type_str, {p.type_str}))
        for is_output, formals in ((False, schema.inputs), (True, schema.outputs))
        for p in formals
    ]


def _check_types(node: ir.Node, target: int) -> None:
    """Refuse when an input or output dtype is outside the target schema's types (types-only changes).

    Raises:
        PassError: names the value, its type and the lowest opset whose schema takes it.
    """
    schema = _schema(node.op_type, target)
    assert schema is not None
    formals = _formal_types(schema)
    ins = [f for f in formals if not f[1]]
    outs = [f for f in formals if f[1]]
    params = list(zip(ins, node.inputs, strict=False)) + list(zip(outs, node.outputs, strict=False))
    if ins and schema.inputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        params += [(ins[-1], v) for v in node.inputs[len(ins) :]]
    for (formal, is_output, allowed), value in params:
        if value is None or value.dtype is None:
            continue
        name = f"tensor({_onnx_type_name(value.dtype)})"
        if name not in allowed:
            lowest = _lowest_with_type(node.op_type, formal, is_output, name, target)
            raise _refuse(
                node, f"opset {target}'s {node.op_type} does not take {name} as {formal} ('{value.name}')", lowest
            )


def _onnx_type_name(dtype: ir.DataType) -> str:
    return onnx.helper.tensor_dtype_to_string(dtype.value).removeprefix("TensorProto.").lower()


def _lowest_with_type(op: str, formal: str, is_output: bool, name: str, above: int) -> int:
    """The lowest opset above ``above`` whose ``op`` takes type ``name`` for the formal input/output ``formal``."""
    for opset in range(above + 1, onnx.defs.onnx_opset_version() + 1):
        s = _schema(op, opset)
        if s is None:
            continue
        if any(f == formal and o == is_output and name in allowed for f, o, allowed in _formal_types(s)):
            return opset
    return onnx.defs.onnx_opset_version()


# ------------------------------------------------------------------------------------------ lowerings
# Each takes (node, current opset, target opset) and returns the nodes replacing it (the node itself,
# edited, when it stays); it raises PassError where no exact form exists at the target.

Lowering = Callable[[ir.Node, int, int], list[ir.Node]]


def _same_semantics(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Versions that only added types (Pow-15, Identity-14/16, Add/Sub/Mul/Div/Relu-14, GatherElements-13, …).

    Attributes the target's schema lacks were checked to be at their default (:func:`types_only_change`).
    """
    schema = _schema(node.op_type, target)
    assert schema is not None
    for name in [a for a in node.attributes if a not in schema.attributes]:
        node.attributes.pop(name)
    _check_types(node, target)
    return [node]


def _scatter(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """ScatterElements/ScatterND-18 added ``reduction`` max/min; add/mul/none mean the same at 16."""
    reduction = node.attributes.get("reduction")
    if reduction is not None and reduction.as_string() in ("max", "min") and target < 18:
        raise _refuse(node, f"reduction='{reduction.as_string()}' first exists at opset 18", 18)
    if reduction is not None and reduction.as_string() != "none" and target < 16:
        raise _refuse(node, f"reduction='{reduction.as_string()}' first exists at opset 16", 16)
    if target < 16:
        node.attributes.pop("reduction", None)
    _check_types(node, target)
    return [node]


def _cast(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Cast-19 ``saturate`` only affects float8 outputs (which the type check refuses below 19): dropped."""
    if _schema("Cast", target) is not None and "saturate" not in _schema("Cast", target).attributes:
        node.attributes.pop("saturate", None)
    _check_types(node, target)
    return [node]


def _constant_op(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Constant-12 ``value_float(s)``/``value_int(s)`` become a ``value`` tensor where the target lacks them."""
    schema = _schema("Constant", target)
    assert schema is not None
    forms = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    for name, dtype in forms.items():
        attr = node.attributes.get(name)
        if attr is not None and name not in schema.attributes:
            node.attributes.pop(name)
            data = np.array(attr.value, dtype=dtype)
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(data))
    unsupported = [a for a in node.attributes if a not in schema.attributes]
    if unsupported:
        raise _refuse(node, f"attribute {unsupported[0]} is not in Constant-{schema.since_version}", current)
    value = node.attributes.get("value")
    if value is not None:
        dtype = value.as_tensor().dtype
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}["T"]
        if f"tensor({_onnx_type_name(dtype)})" not in allowed:
            raise _refuse(node, f"Constant-{schema.since_version} cannot hold {dtype.name}", current)
    return [node]


def _signature(schema: onnx.defs.OpSchema) -> tuple:
    """Formal inputs, outputs and attributes (with defaults) of a schema: what a types-only change keeps."""
    return (
        [(p.name, p.option) for p in schema.inputs],
        [(p.name, p.option) for p in schema.outputs],
        sorted((a.name, a.type, a.required, a.default_value.SerializeToString()) for a in schema.attributes.values()),
    )


def types_only_change(node: ir.Node, current: int, target: int) -> bool:
    """Whether the node means the same at ``target`` as at ``current``, so only types differ.

    Same inputs and outputs, and every attribute the target's schema lacks is unset or at the current
    schema's default (e.g. GatherND ``batch_dims=0``).

    Ops that changed meaning without changing their signature have their own entry in :data:`LOWERINGS`
    (Softmax family: the axis meaning; Scatter*: new reduction values).
    """
    a, b = _schema(node.op_type, current), _schema(node.op_type, target)
    if a is None or b is None:
        return False
    sa, sb = _signature(a), _signature(b)
    if sa[:2] != sb[:2] or not set(sb[2]) <= set(sa[2]):
        return False
    for name in set(a.attributes) - set(b.attributes):
        attr = node.attributes.get(name)
        if attr is None:
            continue
        default = a.attributes[name].default_value
        given = ir.serde.serialize_attribute(attr)
        given.ClearField("doc_string")
        if not default.type or given.SerializeToString() != default.SerializeToString():
            return False
    return True


def _shape(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Shape-15 ``start``/``end`` become a Slice of the full shape (Shape-13 has no such attributes)."""
    start = node.attributes.pop("start", None)
    end = node.attributes.pop("end", None)
    _check_types(node, target)
    if start is None and end is None:
        return [node]
    out = node.outputs[0]
    node_stem, _ = _stems(node)
    full = ir.Value(name=f"{out.name}__full_shape", type=ir.TensorType(ir.DataType.INT64))
    extra: list[ir.Node] = []
    lo = _constant(extra, f"{out.name}__start", np.array([start.as_int() if start else 0], np.int64))
    hi = _constant(extra, f"{out.name}__end", np.array([end.as_int() if end else np.iinfo(np.int64).max], np.int64))
    shape_node = ir.Node("", "Shape", [node.inputs[0]], outputs=[full], name=f"{node_stem}__shape")
    slice_node = ir.Node("", "Slice", [full, lo, hi], num_outputs=1, name=node.name)
    return [*extra, shape_node, slice_node]


def _reshape(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Reshape-14 ``allowzero``: dropped when 0, or when the shape is a constant without zeros."""
    flag = node.attributes.pop("allowzero", None)
    if flag is not None and flag.as_int() == 1:
        dims = _const_ints(node.inputs[1])
        if dims is None or 0 in dims:
            raise _refuse(node, "allowzero=1 with a shape that may hold 0", 14)
    _check_types(node, target)
    return [node]


def _cast_like(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """CastLike(x, like) → Cast(x, to=dtype(like)) (CastLike first exists at opset 15)."""
    dtype = node.inputs[1].dtype if node.inputs[1] is not None else None
    if dtype is None:
        raise _refuse(node, f"the dtype of '{node.inputs[1].name}' is unknown", 15)
    cast = ir.Node("", "Cast", [node.inputs[0]], attributes=[ir.AttrInt64("to", dtype.value)], num_outputs=1)
    cast.name = node.name
    return [cast]


def _trilu(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Trilu → Where(drop, 0, x) with ``drop`` from Range over the last two dims (Trilu first exists at opset 14).

    Keeps ``x[..., i, j]`` where ``j - i >= k`` (upper) or ``j - i <= k`` (lower), as Operators.md defines; a bool
    ``x`` (a mask) becomes And(Not(drop), x) instead, since ONNX Runtime has no bool Where kernel.
    """
    x = node.inputs[0]
    if x.dtype is None:
        raise _refuse(node, f"the dtype of '{x.name}' is unknown", 14)
    upper = node.attributes.get("upper")
    upper = upper.as_int() if upper is not None else 1
    name, p = _stems(node)
    out: list[ir.Node] = []

    def add(op: str, inputs: list[ir.Value], **attrs) -> ir.Value:
        n = ir.node(op, inputs, attributes=attrs, name=f"{name}__{op}_{len(out)}")
        n.outputs[0].name = f"{p}__{op}_{len(out)}"
        out.append(n)
        return n.outputs[0]

    shape = add("Shape", [x])
    rows = add("Gather", [shape, _constant(out, f"{p}__m2", np.array(-2, np.int64))], axis=0)
    cols = add("Gather", [shape, _constant(out, f"{p}__m1", np.array(-1, np.int64))], axis=0)
    zero = _constant(out, f"{p}__zero_i", np.array(0, np.int64))
    one = _constant(out, f"{p}__one_i", np.array(1, np.int64))
    r = add("Reshape", [add("Range", [zero, rows, one]), _constant(out, f"{p}__col", np.array([-1, 1], np.int64))])
    c = add("Range", [zero, cols, one])
    diff = add("Sub", [c, r])
    k = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1] is not None else zero
    if k is not zero:
        k = add("Reshape", [k, _constant(out, f"{p}__scalar", np.array([], np.int64))])
    drop = add("Less" if upper else "Greater", [diff, k])
    if x.dtype == ir.DataType.BOOL:
        keep = add("Not", [drop])
        return [*out, ir.Node("", "And", [keep, x], num_outputs=1, name=name)]
    fill = _constant(out, f"{p}__fill", np.zeros((), dtype=x.dtype.numpy()))
    where = ir.Node("", "Where", [drop, fill, x], num_outputs=1, name=name)
    return [*out, where]


def _split(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Split-18 ``num_outputs`` → sizes; the sizes go to the input (13–17) or the attribute (11–12)."""
    n_out = len(node.outputs)
    num = node.attributes.pop("num_outputs", None)
    axis = node.attributes.get("axis")
    axis = axis.as_int() if axis is not None else 0
    sizes = node.inputs[1] if len(node.inputs) > 1 else None
    split: list[int] | None = None
    if sizes is not None:
        split = _const_ints(sizes)
        if split is None and target < 13:
            raise _refuse(node, f"its split sizes '{sizes.name}' are not constant", 13)
    elif num is not None:
        shape = node.inputs[0].shape
        dim = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
        if not isinstance(dim, int):
            raise _refuse(node, "num_outputs on an axis of unknown size", 18)
        if dim % n_out:
            chunk = -(-dim // n_out)
            split = [chunk] * (n_out - 1) + [dim - chunk * (n_out - 1)]
    if target < 13:
        if split is not None:
            node.attributes["split"] = ir.AttrInt64s("split", split)
        if sizes is not None:
            node.resize_inputs(1)
    elif split is not None and sizes is None:
        extra: list[ir.Node] = []
        node.resize_inputs(2)
        node.replace_input_with(1, _constant(extra, f"{_stems(node)[1]}__split", np.array(split, np.int64)))
        _check_types(node, target)
        return [*extra, node]
    _check_types(node, target)
    return [node]


def _reduce(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Reduce* ``axes`` input ↔ attribute (ReduceSum at 13, the others at 18); ``noop_with_empty_axes`` kept or dropped.

    With ``noop_with_empty_axes=1`` and no axes the node reduces nothing: it becomes an Identity.
    """
    schema = _schema(node.op_type, target)
    assert schema is not None
    axes_value = node.inputs[1] if len(node.inputs) > 1 else None
    axes_attr = node.attributes.get("axes")
    axes = _const_ints(axes_value) if axes_value is not None else (list(axes_attr.as_ints()) if axes_attr else None)
    if axes_value is not None and axes is None and "axes" in schema.attributes:
        raise _refuse(node, f"its axes '{axes_value.name}' are not constant", current)
    noop = node.attributes.get("noop_with_empty_axes")
    if noop is not None and noop.as_int() == 1 and not axes:
        ident = ir.Node("", "Identity", [node.inputs[0]], num_outputs=1, name=node.name)
        return [ident]
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
        node.resize_inputs(2)
        node.replace_input_with(1, _constant(extra, f"{_stems(node)[1]}__axes", np.array(axes, np.int64)))
    _check_types(node, target)
    return [*extra, node]


def _softmax(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Softmax/LogSoftmax/Hardmax-13 (one axis) → -11 (flattens at ``axis``): exact on the last axis.

    For another axis the tensor is transposed so that axis is last and back afterwards. onnx 1.23's own
    13 → 12 adapter only copies ``axis``, which changes the result for a non-last axis.
    """
    axis = node.attributes.get("axis")
    axis = axis.as_int() if axis is not None else -1
    x = node.inputs[0]
    rank = len(x.shape) if x.shape is not None else None
    if rank is None:
        raise _refuse(node, f"the rank of '{x.name}' is unknown", 13)
    axis %= rank
    node.attributes["axis"] = ir.AttrInt64("axis", rank - 1)
    _check_types(node, target)
    if axis == rank - 1:
        return [node]
    perm = [d for d in range(rank) if d != axis] + [axis]
    inverse = [perm.index(d) for d in range(rank)]
    name, p = _stems(node)
    before = ir.node("Transpose", [x], attributes={"perm": perm}, name=f"{name}__to_last")
    before.outputs[0].name = f"{p}__to_last"
    inner = ir.node(node.op_type, [before.outputs[0]], attributes={"axis": rank - 1}, name=f"{name}__inner")
    inner.outputs[0].name = f"{p}__inner"
    after = ir.node("Transpose", [inner.outputs[0]], attributes={"perm": inverse}, name=name)
    return [before, inner, after]


def _pad(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """Pad-18 added the optional ``axes`` input and Pad-19 the ``wrap`` mode; without them Pad-13/11 mean the same.

    Source: ONNX Operators.md, Pad-11/13/18/19.
    """
    mode = node.attributes.get("mode")
    if mode is not None and mode.as_string() == "wrap" and target < 19:
        raise _refuse(node, "mode='wrap' first exists at opset 19", 19)
    if len(node.inputs) > 3 and node.inputs[3] is not None and target < 18:
        raise _refuse(node, "the axes input first exists at opset 18", 18)
    if target < 11:
        raise _refuse(node, "pads became an input at opset 11", 11)
    if len(node.inputs) > 3:
        node.resize_inputs(3)
    _check_types(node, target)
    return [node]


def _dequantize_linear(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """DequantizeLinear: per-axis scales need opset 13, ``block_size`` (blocked INT4) opset 21.

    Source: ONNX Operators.md, DequantizeLinear-10/13/19/21 (below 13 ``x_scale`` must be a scalar).
    """
    block = node.attributes.get("block_size")
    if block is not None and block.as_int() != 0 and target < 21:
        raise _refuse(node, "blocked quantization (block_size) first exists at opset 21", 21)
    scale = node.inputs[1] if len(node.inputs) > 1 else None
    shape = (
        scale.const_value.shape
        if scale is not None and scale.const_value is not None
        else (scale.shape if scale else None)
    )
    per_axis = shape is None or math.prod(int(d) if isinstance(d, int) else 2 for d in shape) > 1
    if per_axis and target < 13:
        raise _refuse(node, "a per-axis (non-scalar) x_scale first exists at opset 13", 13)
    schema = _schema(node.op_type, target)
    assert schema is not None
    for name in [a for a in node.attributes if a not in schema.attributes]:
        node.attributes.pop(name)
    _check_types(node, target)
    return [node]


LOWERINGS: dict[str, Lowering] = {
    **dict.fromkeys(
        ["Pow", "Identity", "Add", "Sub", "Mul", "Div", "Relu", "GatherElements", "Gather", "Range"], _same_semantics
    ),
    "Shape": _shape,
    "Reshape": _reshape,
    "CastLike": _cast_like,
    "Trilu": _trilu,
    "Cast": _cast,
    "Constant": _constant_op,
    "ScatterElements": _scatter,
    "ScatterND": _scatter,
    "Split": _split,
    "Pad": _pad,
    "DequantizeLinear": _dequantize_linear,
    **dict.fromkeys(
        [
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
        ],
        _reduce,
    ),
    **dict.fromkeys(["Softmax", "LogSoftmax", "Hardmax"], _softmax),
}
"""Op → its exact lowering from the graph's opset to a lower target, applied after onnx's converter ran."""


def hold_nodes(model: ir.Model, current: int, target: int) -> dict[str, int]:
    """Park nodes the converter must not touch in :data:`HELD_DOMAIN`; return ``{op: count}`` held.

    Held are default-domain nodes onnx has no schema for (kept as they are) and, when lowering, nodes whose
    op changes between ``target`` and ``current`` and has an entry in :data:`LOWERINGS`.
    """
    held: dict[str, int] = {}
    for node in model.graph:
        if node.domain not in _DEFAULT:
            continue
        since = _since(node.op_type, current)
        if since is not None:
            if not (target < current and since > target):
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
    graph = model.graph
    changes: list[str] = []
    for node in list(graph):
        if node.domain != HELD_DOMAIN:
            continue
        node.domain = ""
        if _since(node.op_type, current) is None:
            continue
        new_nodes = LOWERINGS.get(node.op_type, _same_semantics)(node, current, target)
        if new_nodes == [node]:
            continue
        last = new_nodes[-1]
        others = [n for n in new_nodes if n is not node]
        graph.insert_before(node, others)
        if node in new_nodes:
            continue
        for old, new in zip(node.outputs, last.outputs, strict=True):
            new.name, old.name = old.name, f"{old.name}__replaced"
            copy_type(old, new)
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        changes.append(f"{node.op_type} '{node.name}' -> {'/'.join(n.op_type for n in new_nodes)}")
    model.opset_imports.pop(HELD_DOMAIN, None)
    return changes


# ---------------------------------------------------------------------------------- function expansion


def function_ops_to_expand(model: ir.Model, current: int, target: int) -> list[ir.Node]:
    """Default-domain nodes whose op does not exist at ``target`` but has an ONNX function definition."""
    found = []
    for node in model.graph:
        if node.domain not in _DEFAULT:
            continue
        schema = _schema(node.op_type, current)
        if schema is None or schema.since_version <= target:
            continue
        if _since(node.op_type, target) is None and (schema.has_function or schema.has_context_dependent_function):
            found.append(node)
    return found


def _type_proto(value: ir.Value | None) -> onnx.TypeProto:
    if value is None:
        return onnx.TypeProto()
    dims = None if value.shape is None else [d if isinstance(d, int) else None for d in value.shape]
    return onnx.helper.make_tensor_type_proto(value.dtype.value if value.dtype else 0, dims)


def _function_body(node: ir.Node, current: int) -> onnx.FunctionProto:
    schema = _schema(node.op_type, current)
    assert schema is not None
    node_proto = ir.serde.serialize_node(node)
    if schema.has_context_dependent_function:
        for value in node.inputs:
            if value is not None and value.dtype is None:
                raise _refuse(
                    node, f"the dtype of '{value.name}' is unknown (its function body depends on it)", current
                )
        types = [_type_proto(v).SerializeToString() for v in node.inputs]
        body = onnx.FunctionProto()
        body.ParseFromString(schema.get_context_dependent_function(node_proto.SerializeToString(), types))
        return body
    return schema.function_body


def _resolve_attribute_refs(body: onnx.FunctionProto, node: ir.Node, schema: onnx.defs.OpSchema) -> None:
    """Replace ``ref_attr_name`` attributes of body nodes by the node's value (or the schema's default)."""
    given = {a.name: a for a in ir.serde.serialize_node(node).attribute}
    for inner in body.node:
        kept = []
        for attr in inner.attribute:
            if not attr.ref_attr_name:
                kept.append(attr)
                continue
            source = given.get(attr.ref_attr_name)
            if source is None and attr.ref_attr_name in schema.attributes:
                default = schema.attributes[attr.ref_attr_name].default_value
                source = default if default.type else None
            if source is not None:
                copy = onnx.AttributeProto()
                copy.CopyFrom(source)
                copy.name = attr.name
                kept.append(copy)
        del inner.attribute[:]
        inner.attribute.extend(kept)


def _body_model(node: ir.Node, current: int, fold: Callable[[onnx.ModelProto], onnx.ModelProto]) -> ir.Model:
    """The node's function body as a model at opset ``current``, shape arithmetic folded, empty tensors gone."""
    schema = _schema(node.op_type, current)
    assert schema is not None
    body = _function_body(node, current)
    _resolve_attribute_refs(body, node, schema)
    inputs = []
    for formal, value in zip(body.input, node.inputs, strict=False):
        if value is not None:
            inputs.append(onnx.helper.make_value_info(formal, _type_proto(value)))
    outputs = [
        onnx.helper.make_value_info(formal, _type_proto(value))
        for formal, value in zip(body.output, node.outputs, strict=False)
        if value is not None and value.name
    ]
    graph = onnx.helper.make_graph(list(body.node), f"{node.op_type}_body", inputs, outputs)
    opsets = [onnx.helper.make_opsetid(o.domain, o.version) for o in body.opset_import]
    mini = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=10)
    body_opset = next((o.version for o in body.opset_import if o.domain in _DEFAULT), current)
    if body_opset != current:
        mini = version_converter.convert_version(mini, current)
    mini = onnx.shape_inference.infer_shapes(mini, data_prop=True)
    mini = fold(mini)
    model = ir.serde.deserialize_model(mini)
    fold_empty_tensors(model)
    return model


def expand_function_ops(
    model: ir.Model, nodes: list[ir.Node], current: int, fold: Callable[[onnx.ModelProto], onnx.ModelProto]
) -> list[str]:
    """Replace each of ``nodes`` by its ONNX function body (see the module docstring), in place.

    Args:
        model: the graph (its values' dtypes and shapes inferred).
        nodes: from :func:`function_ops_to_expand`.
        current: the graph's ``ai.onnx`` opset.
        fold: a weightless constant folder (onnxsim) for the body's shape arithmetic.

    Returns:
        One line per expanded node.

    Raises:
        PassError: a body cannot be built (an input dtype is unknown) or the converter cannot raise it.
    """
    graph = model.graph
    changes = []
    for i, node in enumerate(nodes):
        prefix = f"{node.name or node.op_type}#{i}"
        try:
            body = _body_model(node, current, fold)
        except PassError:
            raise
        except Exception as exc:  # onnx's function builder, converter or onnxsim: name the node
            raise _refuse(node, f"its function body could not be built: {exc}", node_since(node, current)) from exc
        mapping: dict[ir.Value, ir.Value] = {}
        formal_in = [v for v, actual in zip(body.graph.inputs, [v for v in node.inputs if v is not None], strict=False)]
        for formal, actual in zip(formal_in, [v for v in node.inputs if v is not None], strict=True):
            mapping[formal] = actual
        for init in body.graph.initializers.values():
            c = ir.node("Constant", [], attributes={"value": init.const_value}, name=f"{prefix}/{init.name}")
            c.outputs[0].name = f"{prefix}/{init.name}"
            mapping[init] = c.outputs[0]
            graph.insert_before(node, c)
        added = []
        for inner in body.graph:
            copy = ir.Node(
                inner.domain,
                inner.op_type,
                [mapping.get(v, v) if v is not None else None for v in inner.inputs],
                attributes=list(inner.attributes.values()),
                num_outputs=len(inner.outputs),
                name=f"{prefix}/{inner.name or inner.op_type}",
                version=inner.version,
            )
            for old, new in zip(inner.outputs, copy.outputs, strict=True):
                new.name = f"{prefix}/{old.name}"
                copy_type(old, new)
                mapping[old] = new
            added.append(copy)
        graph.insert_before(node, added)
        outs = [v for v in node.outputs if v is not None and v.name]
        for old, formal in zip(outs, body.graph.outputs, strict=True):
            new = mapping[formal]
            if new.producer() is None or new in [v for v in node.inputs if v is not None]:
                ident = ir.node("Identity", [new], name=f"{prefix}/out")
                graph.insert_before(node, ident)
                new = ident.outputs[0]
            name = old.name
            old.name = f"{name}__expanded"
            new.name = name
            copy_type(old, new)
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        changes.append(f"{node.op_type} '{node.name}' expanded to {len(added)} nodes (ONNX function body)")
    return changes


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
        out = node.outputs[0]
        uses = list(out.uses())
        if uses:
            consumer, index = uses[0].node, uses[0].idx
            schema = _schema(consumer.op_type, target) if consumer.domain in _DEFAULT else None
            formals = [f.name for f in schema.inputs] if schema is not None else []
            formal = formals[min(index, len(formals) - 1)] if formals else f"input{index}"
            base = f"{consumer.name or consumer.op_type}/{formal}"
        else:
            base = f"{node.op_type}/{out.name}"
        name, k = base, 2
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        node.name = name
        taken.add(name)
        named.append(name)
    return named


def node_since(node: ir.Node, current: int) -> int:
    """The opset the node's op version was introduced in (the lowest opset it can stay as it is)."""
    return _since(node.op_type, current) or current


def fold_empty_tensors(model: ir.Model) -> int:
    """Drop statically empty inputs of Concat nodes and Split nodes left with one non-empty output; return count.

    An input with a 0 in its (inferred) shape contributes nothing to a Concat whose output is non-empty;
    many runtimes and NPU compilers refuse zero-size tensors. Producers left without users are removed.
    """
    graph = model.graph
    removed = 0

    def empty(value: ir.Value | None) -> bool:
        return value is not None and value.shape is not None and any(d == 0 for d in value.shape)

    for node in list(graph):
        if node.op_type == "Concat" and node.domain in _DEFAULT and not empty(node.outputs[0]):
            keep = [v for v in node.inputs if not empty(v)]
            if keep and len(keep) < len(node.inputs):
                removed += len(node.inputs) - len(keep)
                for i, v in enumerate(keep):
                    node.replace_input_with(i, v)
                node.resize_inputs(len(keep))
    for node in list(graph):
        if node.op_type == "Split" and node.domain in _DEFAULT:
            full = [v for v in node.outputs if not empty(v)]
            if len(full) == 1 and all(not v.uses() and not v.is_graph_output() for v in node.outputs if empty(v)):
                ident = ir.node("Identity", [node.inputs[0]], name=node.name)
                graph.insert_before(node, ident)
                out = full[0]
                name = out.name
                out.name = f"{name}__split"
                ident.outputs[0].name = name
                copy_type(out, ident.outputs[0])
                ir.convenience.replace_all_uses_with(out, ident.outputs[0], replace_graph_outputs=True)
                graph.remove(node, safe=True)
                removed += 1
    for node in reversed(list(graph)):
        if all(not v.uses() and not v.is_graph_output() for v in node.outputs):
            graph.remove(node, safe=True)
    return removed
