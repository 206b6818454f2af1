"""The one home for *reading* graphs: opsets, constants, node labels, walks, dims, dtypes, op histograms.

Every layer reads graphs through these helpers (the passes, checks, runner and core): the default opset,
a value's constant array, a node's label in messages, upstream/downstream walks, a tensor's dims, the one
dtype table (ONNX element type <-> numpy <-> ORT type string) and the float-type sets. Helpers take
``onnx_ir`` models and, where they only read, header protos. Writing graphs inside passes is
:mod:`onnxdeploy.passes._edit`'s.

Model files (loading, saving, external data, the protobuf limit) live in :mod:`onnxdeploy.model_io`.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

__all__ = [
    "FLOAT_ELEM_TYPES",
    "FLOAT_TYPES",
    "ORT_NUMPY_TYPES",
    "const_array",
    "const_ints",
    "const_tensor",
    "consumers",
    "default_opset",
    "downstream_nodes",
    "dtype_name",
    "float32_shadow_graph",
    "format_dims",
    "io_dims",
    "node_label",
    "numpy_dtype_of",
    "op_histogram",
    "opset_imports",
    "ort_numpy_dtype",
    "static_dims",
    "tensor_dims",
    "upstream_nodes",
    "value_dims",
]

FLOAT_TYPES: frozenset[ir.DataType] = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
)
"""The floating element types a decoder computes, caches or stores weights in (float8 types are not among them)."""

FLOAT_ELEM_TYPES: frozenset[int] = frozenset(int(t) for t in FLOAT_TYPES)
""":data:`FLOAT_TYPES` as ``onnx.TensorProto`` element type numbers, for readers of header protos."""

ORT_NUMPY_TYPES: dict[str, np.dtype] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(bool)": np.dtype(np.bool_),
}
"""ONNX Runtime's type strings (``NodeArg.type``) of the element types its Python API feeds and returns, as numpy
dtypes; bfloat16 is absent (ORT 1.32's Python API feeds no bfloat16 arrays)."""


def default_opset(model: ir.Model | ir.Graph | onnx.ModelProto, default: int = 0) -> int:
    """The ``ai.onnx`` opset a model or graph imports (the ``""`` or ``"ai.onnx"`` entry), else ``default``."""
    if isinstance(model, onnx.ModelProto):
        return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default)
    imports = model.opset_imports
    return imports.get("", imports.get("ai.onnx", default))


_CONSTANT_LISTS = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}


def const_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The constant tensor a value holds (an initializer, or a ``Constant`` node's output), else None.

    Reads what onnx_ir's :func:`onnx_ir.convenience.get_const_tensor` reads (``value``, ``value_float(s)``,
    ``value_int(s)``) but never writes: that function renames a ``Constant``'s tensor to its output's name, and after
    ``clone`` the tensor is shared with the pass's input. An external initializer stays memory-mapped.
    """
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value
    node = value.producer()
    if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attributes) != 1:
        return None
    name, attr = next(iter(node.attributes.items()))
    if attr.is_ref():
        return None
    if name == "value":
        return attr.as_tensor()
    if name in _CONSTANT_LISTS:
        return ir.tensor(np.array(attr.value, dtype=_CONSTANT_LISTS[name]), name=value.name)
    return None


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """:func:`const_tensor` as a numpy array (memory-mapped for an external initializer), else None."""
    tensor = const_tensor(value)
    return None if tensor is None else tensor.numpy()


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The values of a constant integer (or boolean) input, flattened, as Python ints; None when not constant."""
    array = const_array(value)
    if array is None or not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
        return None
    return [int(v) for v in np.asarray(array).reshape(-1)]


def node_label(node: ir.Node) -> str:
    """How a message names a node: ``Op 'name'``, or ``Op 'first output'`` for an unnamed node."""
    op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
    who = node.name or (node.outputs[0].name if node.outputs else None) or "?"
    return f"{op} '{who}'"


def consumers(value: ir.Value) -> list[ir.Node]:
    """Distinct nodes reading ``value``, in use order."""
    seen: dict[int, ir.Node] = {}
    for use in value.uses():
        seen.setdefault(id(use.node), use.node)
    return list(seen.values())


def upstream_nodes(value: ir.Value, max_depth: int) -> list[ir.Node]:
    """The nodes within ``max_depth`` hops upstream of ``value`` (its producer first), each once."""
    found: dict[int, ir.Node] = {}
    frontier = [value]
    for _ in range(max_depth):
        nxt = []
        for v in frontier:
            p = v.producer()
            if p is not None and id(p) not in found:
                found[id(p)] = p
                nxt.extend(i for i in p.inputs if i is not None)
        frontier = nxt
    return list(found.values())


def downstream_nodes(value: ir.Value, max_depth: int) -> list[ir.Node]:
    """The nodes within ``max_depth`` hops downstream of ``value`` (its readers first), each once."""
    found: dict[int, ir.Node] = {}
    frontier = [value]
    for _ in range(max_depth):
        nxt = []
        for v in frontier:
            for c in consumers(v):
                if id(c) not in found:
                    found[id(c)] = c
                    nxt.extend(c.outputs)
        frontier = nxt
    return list(found.values())


def static_dims(value: ir.Value) -> list[int] | None:
    """A value's dims when every one is a known int, else None (no shape, a symbolic or an unknown dim)."""
    dims = value_dims(value)
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return [int(d) for d in dims]  # type: ignore[arg-type]


def numpy_dtype_of(dtype: ir.DataType) -> np.dtype:
    """The numpy dtype of an ONNX element type (bfloat16, float8 and int4 as ml_dtypes' types).

    Raises:
        TypeError: the element type has no numpy equivalent (UNDEFINED; STRING maps to numpy object).
    """
    return np.dtype(dtype.numpy())


def ort_numpy_dtype(ort_type: str) -> np.dtype | None:
    """The numpy dtype of an ORT type string such as ``tensor(float16)`` (:data:`ORT_NUMPY_TYPES`), else None."""
    return ORT_NUMPY_TYPES.get(ort_type)


def op_histogram(model: ir.Model | onnx.ModelProto) -> dict[str, int]:
    """Count nodes of the main graph by op type (``domain::Op`` for non-default domains).

    Args:
        model: an ``onnx_ir`` model or a ``ModelProto`` (weights are not read).

    Returns:
        Mapping op type -> count, sorted by op type.
    """
    nodes = model.graph if isinstance(model, ir.Model) else model.graph.node
    counts: collections.Counter[str] = collections.Counter()
    for node in nodes:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[key] += 1
    return dict(sorted(counts.items()))


def opset_imports(model: ir.Model | onnx.ModelProto) -> dict[str, int]:
    """Return opset version per domain (``ai.onnx`` for the default domain)."""
    if isinstance(model, ir.Model):
        return {(d or "ai.onnx"): v for d, v in model.opset_imports.items()}
    return {(o.domain or "ai.onnx"): o.version for o in model.opset_import}


def tensor_dims(value_info: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """Return the dims of a tensor value info: int for static, str for symbolic, None for unknown.

    Returns:
        The dims, or ``None`` when the rank is unknown (no shape).
    """
    ttype = value_info.type.tensor_type
    if not ttype.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def value_dims(value: ir.Value) -> list[int | str | None] | None:
    """Return the dims of an ``onnx_ir`` value: int for static, str for symbolic, None for unknown (or no shape)."""
    if value.shape is None:
        return None
    dims: list[int | str | None] = []
    for d in value.shape:
        if isinstance(d, int):
            dims.append(d)
        else:
            dims.append(d.value if isinstance(d, ir.SymbolicDim) else None)
    return dims


def io_dims(values: Iterable[onnx.ValueInfoProto]) -> dict[str, list[int | str | None] | None]:
    """Map each value info's name to its dims (see :func:`tensor_dims`)."""
    return {v.name: tensor_dims(v) for v in values}


def _weight_key(tensor: ir.TensorProtocol) -> object:
    """What identifies a weight across separately loaded graphs: its file bytes when external, else None.

    An in-memory tensor has no identity that outlives it: keyed by ``id()``, a tensor freed once its value
    points at the converted copy lets the next graph's tensor reuse that id and pick up the wrong weight (a
    graph set's shadow then computed with another initializer: seen as a 0.12 logit difference that came and
    went with the memory layout). In-memory tensors are small (inline in each graph file) and are converted
    per graph.
    """
    if isinstance(tensor, ir.ExternalTensor):
        return (os.path.realpath(tensor.path), tensor.offset, tensor.length)
    return None


def _as_float32(tensor: ir.TensorProtocol) -> ir.Tensor:
    array = np.asarray(tensor.numpy(), dtype=ml_dtypes.bfloat16).astype(np.float32)
    return ir.tensor(array, name=tensor.name)


def float32_shadow_graph(model: ir.Model, converted: dict[object, ir.Tensor] | None = None) -> bool:
    """Make ``model`` its float32 shadow, in place: every bfloat16 tensor, value and ``Cast`` becomes float32.

    ONNX Runtime's CPU EP has no bfloat16 kernels (1.32) and its Python API neither feeds nor returns
    bfloat16 arrays, so a bfloat16 graph runs there only as this shadow (verification, and the passes' ORT
    probes of a bfloat16 export). bfloat16 values are float32 values whose low 16 mantissa bits are zero, so
    weights, inputs and outputs convert exactly; the shadow computes in float32 with no rounding to bfloat16
    between ops: it checks what a graph computes, not how a bfloat16 device rounds. Converted: initializers,
    ``Constant`` / ``ConstantOfShape`` tensor attributes, ``Cast(to=bfloat16)`` and the element type of every
    graph input, output and node output of the main graph. The contract (if any) is left as it is.

    Args:
        model: the model, edited in place.
        converted: weights converted so far, shared by the graphs of a set that map one data file, so each
            weight is converted once and the shadows share it too (keyed by file, offset and length; in-memory
            tensors are converted per graph).

    Returns:
        Whether anything was bfloat16 (False: ``model`` is unchanged).
    """
    memo: dict[object, ir.Tensor] = {} if converted is None else converted
    bf16, f32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    changed = False
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and tensor.dtype == bf16:
            key = _weight_key(tensor)
            if key is None:
                value.const_value = _as_float32(tensor)
            else:
                if key not in memo:
                    memo[key] = _as_float32(tensor)
                value.const_value = memo[key]
            changed = True
    values = [*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()]
    for node in model.graph:
        values += list(node.outputs)
        if node.op_type == "Cast" and node.attributes.get_int("to") == bf16:
            node.attributes["to"] = ir.AttrInt64("to", f32)
            changed = True
        for key in ("value",) if node.op_type in ("Constant", "ConstantOfShape") else ():
            attr = node.attributes.get(key)
            if attr is not None and attr.type == ir.AttributeType.TENSOR and attr.as_tensor().dtype == bf16:
                node.attributes[key] = ir.AttrTensor(key, _as_float32(attr.as_tensor()))
                changed = True
    for value in values:
        if value.dtype == bf16:
            value.dtype = f32
            changed = True
    return changed


def format_dims(dims: tuple[int | str | None, ...] | list[int | str | None] | None) -> str:
    """Format dims for a message as ``(1, batch, ?)``; ``<unknown rank>`` for ``None``."""
    if dims is None:
        return "<unknown rank>"
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


def dtype_name(elem_type: int) -> str:
    """The lower-case ONNX name of a ``TensorProto.DataType`` number (``1`` -> ``"float"``), for messages."""
    try:
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return f"dtype({elem_type})"
