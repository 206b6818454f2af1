"""Shared graph helpers: op histograms, dims and opsets of models (``onnx_ir`` models and header protos).

Model files (loading, saving, external data, the protobuf limit) live in :mod:`onnxdeploy.model_io`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import onnx
import onnx_ir as ir

__all__ = ["op_histogram", "opset_imports", "tensor_dims", "io_dims", "value_dims"]


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
