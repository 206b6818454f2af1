"""What the opset adapters read from ONNX's operator schemas, and how they refuse and hand a node over.

Every adapter of :mod:`onnxdeploy.passes._opset_adapters` asks the same questions of ``onnx.defs``: the op's
schema at an opset, the version it was introduced in, whether its inputs and outputs have types the target's
schema takes, whether only types changed between two versions. Where a node has no exact form at the target
the adapter raises :func:`refuse`, which names the op, the node and the lowest opset the node can reach.

A node that is replaced hands its outputs over to its replacement (:func:`hand_over`): name, dtype, shape and
every use.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnxdeploy.errors import PassError
from onnxdeploy.graph import dtype_name

__all__ = [
    "DEFAULT_DOMAINS",
    "check_types",
    "copy_type",
    "hand_over",
    "node_label",
    "node_since",
    "refuse",
    "schema_at",
    "since_version",
    "stems",
    "type_string",
    "types_only_change",
]

DEFAULT_DOMAINS = ("", "ai.onnx")
"""The two spellings of the default (``ai.onnx``) domain, the one onnx's version converter converts."""

_PASS = "pin_opset"


def node_label(node: ir.Node) -> str:
    """How a refusal names a node: ``node 'name'``, or ``node producing 'output'`` when it has no name."""
    if node.name:
        return f"node '{node.name}'"
    out = next((v.name for v in node.outputs if v is not None and v.name), None)
    return f"node producing '{out}'" if out else "node (unnamed)"


def refuse(node: ir.Node, why: str, lowest: int) -> PassError:
    """The error for a node with no exact form at the target: names op, node, why and the lowest opset reachable.

    ``pin_opset`` prefixes the opset pair (``converting ai.onnx opset 21 to 17: ...``).
    """
    return PassError(
        _PASS, f"{node.op_type} {node_label(node)} cannot be converted exactly: {why}; lowest reachable opset: {lowest}"
    )


def schema_at(op: str, opset: int) -> onnx.defs.OpSchema | None:
    """The ``ai.onnx`` schema of ``op`` that ``opset`` selects, else None (an op onnx does not know there)."""
    try:
        return onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return None


def since_version(op: str, opset: int) -> int | None:
    """The ``since_version`` of ``op``'s schema at ``opset``, else None (see :func:`schema_at`)."""
    s = schema_at(op, opset)
    return s.since_version if s is not None else None


def node_since(node: ir.Node, current: int) -> int:
    """The opset the node's op version was introduced in (the lowest opset it can stay as it is)."""
    return since_version(node.op_type, current) or current


def stems(node: ir.Node) -> tuple[str, str]:
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


def hand_over(old: ir.Value, new: ir.Value, suffix: str) -> None:
    """Make ``new`` stand for ``old``: its name (``old`` is renamed ``<name><suffix>``), dtype, shape and uses."""
    name = old.name
    old.name = f"{name}{suffix}"
    new.name = name
    copy_type(old, new)
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)


# ------------------------------------------------------------------------------------------ types


def type_string(value: ir.Value) -> str | None:
    """The value's type as ONNX schemas spell it: ``tensor(float)``, ``seq(tensor(int64))``, ``optional(...)``.

    None when the type (or its element type) is unknown. Source: onnx ``docs/IR.md``, "Type system"; the
    spelling is that of ``OpSchema.TypeConstraintParam.allowed_type_strs``.
    """
    return _spell(value.type) if value.type is not None else None


def _spell(t: ir.TypeProtocol) -> str | None:
    if isinstance(t, ir.SequenceType):
        inner = _spell(t.elem_type)
        return f"seq({inner})" if inner else None
    if isinstance(t, ir.OptionalType):
        inner = _spell(t.elem_type)
        return f"optional({inner})" if inner else None
    if t.dtype is None or t.dtype == ir.DataType.UNDEFINED:
        return None
    kind = "sparse_tensor" if isinstance(t, ir.SparseTensorType) else "tensor"
    return f"{kind}({dtype_name(t.dtype.value)})"


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


def check_types(node: ir.Node, target: int) -> None:
    """Refuse when an input or output dtype is outside the target schema's types (types-only changes).

    Raises:
        PassError: names the value, its type and the lowest opset whose schema takes it.
    """
    schema = schema_at(node.op_type, target)
    assert schema is not None
    formals = _formal_types(schema)
    ins = [f for f in formals if not f[1]]
    outs = [f for f in formals if f[1]]
    params = list(zip(ins, node.inputs, strict=False)) + list(zip(outs, node.outputs, strict=False))
    if ins and schema.inputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        params += [(ins[-1], v) for v in node.inputs[len(ins) :]]
    for (formal, is_output, allowed), value in params:
        name = type_string(value) if value is not None else None
        if name is None:
            continue
        if name not in allowed:
            lowest = _lowest_with_type(node.op_type, formal, is_output, name, target)
            raise refuse(
                node, f"opset {target}'s {node.op_type} does not take {name} as {formal} ('{value.name}')", lowest
            )


def _lowest_with_type(op: str, formal: str, is_output: bool, name: str, above: int) -> int:
    """The lowest opset above ``above`` whose ``op`` takes type ``name`` for the formal input/output ``formal``."""
    for opset in range(above + 1, onnx.defs.onnx_opset_version() + 1):
        s = schema_at(op, opset)
        if s is None:
            continue
        if any(f == formal and o == is_output and name in allowed for f, o, allowed in _formal_types(s)):
            return opset
    return onnx.defs.onnx_opset_version()


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

    Ops that changed meaning without changing their signature have their own entry in
    :data:`onnxdeploy.passes._opset_adapters.LOWERINGS` (Softmax family: the axis meaning; Scatter*: new
    reduction values).
    """
    a, b = schema_at(node.op_type, current), schema_at(node.op_type, target)
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
