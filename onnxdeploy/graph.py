"""Shared graph helpers: op histograms, dims, opsets, and the float32 shadow of a bfloat16 graph.

Helpers take ``onnx_ir`` models and, where they only read, header protos.

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

__all__ = ["float32_shadow_graph", "op_histogram", "opset_imports", "tensor_dims", "io_dims", "value_dims"]


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
    """What identifies a weight across separately loaded graphs: its file bytes when external, else the object."""
    if isinstance(tensor, ir.ExternalTensor):
        return (os.path.realpath(tensor.path), tensor.offset, tensor.length)
    return id(tensor)


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
            weight is converted once and the shadows share it too (keyed by file, offset and length, or by
            object for in-memory tensors).

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
