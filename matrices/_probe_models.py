"""One-node probe models from an op's ONNX schema, and the search for the element types a runtime takes.

Shared by the matrix generators that probe a runtime (``generate_openvino_cpu``, and ``generate_ort_cpu`` for
the function bodies ORT inlines).

A probe of an op schema version is a one-node model at the opset that introduced that version: its required
inputs as graph inputs (a variadic one twice when the op needs two), required attributes at plain values, input
shapes from a few plans (:data:`PLANS`). :func:`probe_op` finds a plan that the runtime takes with the op's
default element types, then asks once per element-type class (:data:`CLASSES`) of each type parameter.
A prober is any object with ``compiles(model) -> bool`` and ``all_compile(models) -> list[bool]``.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

__all__ = ["CLASSES", "PLANS", "SequentialProber", "classes", "merged", "probe_model", "probe_op"]

DEFAULT_TYPES = ("float", "int64", "int32", "bool", "string", "float16", "uint8", "int8", "double")
PLANS = (
    (4,),
    (2,),
    (3,),
    (1,),
    (0,),
    (4, 1),
    (4, 0),
    (2, 1),
    (3, 1),
    (1, 0),
    (None,),
    ("const", 4, 1),
    ("const", 4, 0),
    ("const", 2, 1),
    ("const", 3, 1),
)
"""Rank of the first input and of the rest (one entry: every input); None: rank unknown."""


def _elem(type_str: str) -> int | None:
    """``tensor(float)`` -> ``TensorProto.FLOAT``; None for non-tensor types."""
    if not (type_str.startswith("tensor(") and type_str.endswith(")")):
        return None
    name = type_str[len("tensor(") : -1]
    return {
        "float": TensorProto.FLOAT,
        "double": TensorProto.DOUBLE,
        "float16": TensorProto.FLOAT16,
        "bfloat16": TensorProto.BFLOAT16,
        "string": TensorProto.STRING,
        "bool": TensorProto.BOOL,
        "complex64": TensorProto.COMPLEX64,
        "complex128": TensorProto.COMPLEX128,
        "float8e4m3fn": TensorProto.FLOAT8E4M3FN,
        "float8e4m3fnuz": TensorProto.FLOAT8E4M3FNUZ,
        "float8e5m2": TensorProto.FLOAT8E5M2,
        "float8e5m2fnuz": TensorProto.FLOAT8E5M2FNUZ,
        "float8e8m0": getattr(TensorProto, "FLOAT8E8M0", -1),
        "float4e2m1": getattr(TensorProto, "FLOAT4E2M1", -1),
    }.get(name, getattr(TensorProto, name.upper(), None))


def _type_proto(type_str: str, rank: int | None, dim: int = 2) -> onnx.TypeProto | None:
    """A TypeProto for ``tensor(x)``, ``seq(tensor(x))`` or ``optional(...)`` with ``rank`` dims of ``dim``."""
    if type_str.startswith("seq(") and type_str.endswith(")"):
        inner = _type_proto(type_str[4:-1], rank, dim)
        return helper.make_sequence_type_proto(inner) if inner is not None else None
    if type_str.startswith("optional(") and type_str.endswith(")"):
        inner = _type_proto(type_str[9:-1], rank, dim)
        return helper.make_optional_type_proto(inner) if inner is not None else None
    elem = _elem(type_str)
    if elem is None or elem < 0:
        return None
    return helper.make_tensor_type_proto(elem, None if rank is None else [dim] * rank)


def _attribute(attr: onnx.defs.OpSchema.Attribute, rank: int | None, types: dict[str, str]):
    """A plain value for a required attribute (None: the probe cannot make one)."""
    kind = attr.type
    spatial = max((rank or 4) - 2, 1)
    if attr.name == "to":
        return _elem(types.get("T2", "tensor(float)")) or TensorProto.FLOAT
    if kind == onnx.defs.OpSchema.AttrType.INT:
        return 0 if attr.name == "axis" else 1
    if kind == onnx.defs.OpSchema.AttrType.FLOAT:
        return 1.0
    if kind == onnx.defs.OpSchema.AttrType.STRING:
        return {"direction": "LEFT"}.get(attr.name, "")
    if kind == onnx.defs.OpSchema.AttrType.INTS:
        return [2] * spatial if attr.name == "kernel_shape" else ([0] if attr.name == "axes" else [1] * spatial)
    if kind == onnx.defs.OpSchema.AttrType.FLOATS:
        return [1.0]
    if kind == onnx.defs.OpSchema.AttrType.STRINGS:
        return ["a"]
    if kind == onnx.defs.OpSchema.AttrType.TENSOR:
        return helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])
    return None


def _formal_type(formal, types: dict[str, str]) -> str:
    """The concrete type string of a formal input/output: its type parameter's chosen type, or its fixed type."""
    return types.get(formal.type_str, formal.type_str)


def probe_model(
    schema: onnx.defs.OpSchema, types: dict[str, str], plan: tuple, extra: dict | None = None
) -> onnx.ModelProto | None:
    """The one-node model of ``schema``: type parameters bound to ``types``, input ranks from ``plan``.

    ``extra``: optional attributes to set as well (name -> value).
    """
    option = onnx.defs.OpSchema.FormalParameterOption
    const = plan[0] == "const"  # the inputs after the first are constants (axes, shapes, pads as an exporter writes)
    plan = plan[1:] if const else plan
    inputs, names, initializers = [], [], []
    for index, formal in enumerate(schema.inputs):
        if formal.option == option.Optional:
            continue
        rank = plan[0] if index == 0 or len(plan) == 1 else plan[1]
        tp = _type_proto(_formal_type(formal, types), rank)
        if tp is None:
            return None
        name = f"i{index}"
        if const and index > 0:
            value = _constant(name, tp)
            if value is None:
                return None
            initializers.append(value)
        else:
            inputs.append(helper.make_value_info(name, tp))
        names.append(name)
        if formal.option == option.Variadic and schema.min_input > len(names):
            inputs.append(helper.make_value_info(f"{name}b", tp))
            names.append(f"{name}b")
    outputs, out_names = [], []
    for index, formal in enumerate(schema.outputs):
        if formal.option == option.Optional and index > 0:
            continue
        tp = _type_proto(_formal_type(formal, types), None)
        if tp is None:
            return None
        outputs.append(helper.make_value_info(f"o{index}", tp))
        out_names.append(f"o{index}")
    attrs = {}
    for name, attr in schema.attributes.items():
        if attr.required:
            value = _attribute(attr, plan[0], types)
            if value is None:
                return None
            attrs[name] = value
    if schema.name == "Constant" and schema.domain == "":
        attrs = {"value": helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])}
    attrs.update(extra or {})
    node = helper.make_node(schema.name, names, out_names, domain=schema.domain, **attrs)
    opsets = [helper.make_opsetid(schema.domain, schema.since_version)]
    if schema.domain:
        opsets.append(helper.make_opsetid("", 21))
    graph = helper.make_graph([node], "probe", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _constant(name: str, tp: onnx.TypeProto) -> onnx.TensorProto | None:
    """A constant for a tensor type: zeros (0 as an axis, a pad, a start), ones for floats; None otherwise."""
    if not tp.HasField("tensor_type") or tp.tensor_type.elem_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return None
    elem = tp.tensor_type.elem_type
    dims = [d.dim_value for d in tp.tensor_type.shape.dim]
    count = 1
    for d in dims:
        count *= d
    floats = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    value = 1.0 if elem in floats else 0
    try:
        return helper.make_tensor(name, elem, dims, [value] * count)
    except (TypeError, ValueError):
        return None


def merged(models: list[onnx.ModelProto]) -> onnx.ModelProto:
    """One model holding every model's graph side by side (values prefixed ``m{index}_``)."""
    nodes, inputs, outputs = [], [], []
    for index, model in enumerate(models):
        prefixed = onnx.compose.add_prefix(model, f"m{index}_")
        nodes += prefixed.graph.node
        inputs += prefixed.graph.input
        outputs += prefixed.graph.output
    merged = helper.make_model(
        helper.make_graph(nodes, "probe", inputs, outputs), opset_imports=list(models[0].opset_import)
    )
    merged.ir_version = models[0].ir_version
    return merged


def _params(schema: onnx.defs.OpSchema) -> dict[str, list[str]]:
    """Type parameter -> allowed type strings, for the parameters the probe can build."""
    return {tc.type_param_str: list(tc.allowed_type_strs) for tc in schema.type_constraints}


CLASSES = (
    ("float",),
    ("double",),
    ("float16",),
    ("bfloat16",),
    ("int8", "uint8"),
    ("int16", "uint16"),
    ("int32", "uint32"),
    ("int64", "uint64"),
    ("bool",),
    ("string",),
    ("float8e4m3fn", "float8e5m2"),
    ("float8e4m3fnuz", "float8e5m2fnuz"),
    ("float8e8m0",),
    ("int4", "uint4"),
    ("int2", "uint2"),
    ("float4e2m1",),
    ("complex64", "complex128"),
)
"""Element-type classes: one allowed member of each is compiled and stands for the class's allowed members."""


def classes(allowed: list[str]) -> list[list[str]]:
    """``allowed`` (type strings) grouped by :data:`CLASSES`; a type outside them (``seq(...)``) alone."""
    groups, seen = [], set()
    for members in CLASSES:
        group = [f"tensor({m})" for m in members if f"tensor({m})" in allowed]
        if group:
            groups.append(group)
            seen.update(group)
    groups += [[t] for t in allowed if t not in seen]
    return groups


def _default(allowed: list[str]) -> str:
    for name in DEFAULT_TYPES:
        if f"tensor({name})" in allowed:
            return f"tensor({name})"
    return allowed[0]


def probe_op(
    schema: onnx.defs.OpSchema, prober, chosen: list | None = None
) -> tuple[dict[str, list[str]], list[tuple[str, list[str], dict]]] | None:
    """The element types per type parameter that compile for ``schema``; None when no probe compiles.

    ``chosen``: when given, the plan (:data:`PLANS`) the types were probed with is appended to it.

    Returns:
        ``({param: [type names]}, flipped)``: the types (``float``, ``int64``, ``seq(tensor(float))`` ...) that
        compiled with the attribute defaults (``{}`` for an op without type parameters), and the types that
        compile only with an optional flag attribute flipped (:func:`_flipped`).
    """
    params = _params(schema)
    base = {p: _default(a) for p, a in params.items()}
    plan = next((p for p in PLANS if prober.compiles(probe_model(schema, base, p))), None)
    if plan is None:  # the defaults may be what fails: one more try per type class of each parameter
        for param, allowed in params.items():
            for group in classes(allowed):
                trial = {**base, param: group[0]}
                plan = next((p for p in PLANS[:2] if prober.compiles(probe_model(schema, trial, p))), None)
                if plan is not None:
                    base = trial
                    break
            if plan is not None:
                break
    if plan is None:
        return None
    if chosen is not None:
        chosen.append(plan)
    trials = [
        (param, group, {**base, param: base[param] if base[param] in group else group[0]})
        for param, allowed in params.items()
        for group in classes(allowed)
    ]
    verdicts = prober.all_compile([probe_model(schema, b, plan) for _, _, b in trials])
    # parameters bound together (Attention's Q and K): the same type on every parameter that allows it
    joints = []
    for i, (param, _, b) in enumerate(trials):
        shared = [p for p, a in params.items() if b[param] in a]
        if not verdicts[i] and len(shared) > 1:
            joints.append((i, {**base, **dict.fromkeys(shared, b[param])}))
    for (i, _), ok in zip(joints, prober.all_compile([probe_model(schema, j, plan) for _, j in joints]), strict=True):
        verdicts[i] = ok
    found: dict[str, list[str]] = {p: [] for p in params}
    for (param, group, _), ok in zip(trials, verdicts, strict=True):
        if ok:
            found[param] += group
    return {p: _names(ts) for p, ts in found.items()}, _flipped(schema, plan, trials, verdicts, prober)


def _names(type_strs: list[str]) -> list[str]:
    return sorted(t[len("tensor(") : -1] if t.startswith("tensor(") else t for t in type_strs)


def _flipped(schema, plan, trials, verdicts, prober) -> list[tuple[str, list[str], dict]]:
    """Types refused with the defaults that compile with one optional 0/1 INT attribute flipped (Mod ``fmod=1``).

    Returns:
        ``(param, type names, {attribute: [value]})`` per type class that compiles only so.
    """
    flags = {
        name: 1 - attr.default_value.i
        for name, attr in schema.attributes.items()
        if not attr.required
        and attr.type == onnx.defs.OpSchema.AttrType.INT
        and attr.default_value.i in (0, 1)
        and attr.default_value.type == onnx.AttributeProto.INT
    }
    combos = [(i, name, value) for i, ok in enumerate(verdicts) if not ok for name, value in flags.items()]
    models = [probe_model(schema, trials[i][2], plan, {name: value}) for i, name, value in combos]
    found = []
    for (i, name, value), ok in zip(combos, prober.all_compile(models), strict=True):
        if ok:
            found.append((trials[i][0], _names(trials[i][1]), {name: [value]}))
    return found


class SequentialProber:
    """A prober over a ``takes(model) -> bool`` callable (ORT session creation), one model at a time."""

    def __init__(self, takes) -> None:
        self.takes = takes

    def compiles(self, model: onnx.ModelProto | None) -> bool:
        """Whether the runtime takes ``model`` (None: a probe that could not be built)."""
        return model is not None and self.takes(model)

    def all_compile(self, models: list) -> list[bool]:
        """:meth:`compiles` of each model."""
        return [self.compiles(m) for m in models]
