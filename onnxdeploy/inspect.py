"""``onnxdeploy inspect``: what a model is, without running it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from onnxdeploy.contract import read_contract
from onnxdeploy.graph import numpy_dtype_of, op_histogram, opset_imports, tensor_dims
from onnxdeploy.model_io import check_external_data, read_model_header, tensor_nbytes

__all__ = ["inspect_model"]


def _tensor(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    elem = vi.type.tensor_type.elem_type
    dtype = numpy_dtype_of(ir.DataType(elem)).name if elem else "unknown"
    dims = tensor_dims(vi)
    text = "?" if dims is None else "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
    return {"name": vi.name, "dtype": dtype, "shape": dims, "shape_text": text}


def inspect_model(path: str | Path) -> dict[str, Any]:
    """Describe a model: I/O (dims: int static, str symbolic, None unknown), opsets, ops, sizes, contract.

    Args:
        path: the ``.onnx`` file; external data is not read, only checked (location, presence, length) and listed.

    Returns:
        A JSON-serialisable dict with keys ``path``, ``file_bytes``, ``ir_version``, ``producer``,
        ``opsets``, ``inputs``, ``outputs``, ``symbolic_dims``, ``op_histogram``, ``nodes``,
        ``initializers``, ``initializer_bytes``, ``external_data``, ``contract``.

    Raises:
        ModelLoadError: the file is missing, not ONNX or incomplete, or an external-data location is absolute,
            contains ``..``, leaves the folder through a symlink, or names a missing or short file.
        ContractError: the model's contract metadata is malformed.
    """
    p = Path(path)
    model = read_model_header(p)
    files = check_external_data(model, p)
    inits = {t.name for t in model.graph.initializer}
    inputs = [_tensor(v) for v in model.graph.input if v.name not in inits]
    outputs = [_tensor(v) for v in model.graph.output]
    symbolic = sorted({d for t in inputs + outputs for d in (t["shape"] or []) if isinstance(d, str)})
    contract = read_contract(model, source=str(p))
    return {
        "path": str(p),
        "file_bytes": p.stat().st_size,
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "opsets": opset_imports(model),
        "inputs": inputs,
        "outputs": outputs,
        "symbolic_dims": symbolic,
        "op_histogram": op_histogram(model),
        "nodes": len(model.graph.node),
        "initializers": len(model.graph.initializer),
        "initializer_bytes": sum(tensor_nbytes(t) or 0 for t in model.graph.initializer),
        "external_data": [
            {"location": f.location, "tensors": f.tensors, "bytes": f.bytes_needed, "present": True} for f in files
        ],
        "contract": contract.model_dump() if contract else None,
    }
