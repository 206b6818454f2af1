"""``onnxdeploy inspect``: what a model is, without running it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from onnxdeploy.contract import read_contract
from onnxdeploy.graph import initializer_bytes, load_model, op_histogram, opset_imports, tensor_dims

__all__ = ["inspect_model"]


def _tensor(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    elem = vi.type.tensor_type.elem_type
    dtype = helper.tensor_dtype_to_np_dtype(elem).name if elem else "unknown"
    dims = tensor_dims(vi)
    text = "?" if dims is None else "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
    return {"name": vi.name, "dtype": dtype, "shape": dims, "shape_text": text}


def inspect_model(path: str | Path) -> dict[str, Any]:
    """Describe a model: I/O (dims: int static, str symbolic, None unknown), opsets, ops, sizes, contract.

    Args:
        path: the ``.onnx`` file; external data is not loaded, only listed.

    Returns:
        A JSON-serialisable dict with keys ``path``, ``file_bytes``, ``ir_version``, ``producer``,
        ``opsets``, ``inputs``, ``outputs``, ``symbolic_dims``, ``op_histogram``, ``nodes``,
        ``initializers``, ``initializer_bytes``, ``external_data``, ``contract``.

    Raises:
        ModelLoadError: the file is missing or not ONNX.
        ContractError: the model's contract metadata is malformed.
    """
    p = Path(path)
    model = load_model(p, load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    inputs = [_tensor(v) for v in model.graph.input if v.name not in inits]
    outputs = [_tensor(v) for v in model.graph.output]
    symbolic = sorted({d for t in inputs + outputs for d in (t["shape"] or []) if isinstance(d, str)})
    ext: dict[str, int] = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), "?")
            ext[loc] = ext.get(loc, 0) + 1
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
        "initializer_bytes": initializer_bytes(model),
        "external_data": [
            {"location": k, "tensors": v, "present": (p.parent / k).is_file()} for k, v in sorted(ext.items())
        ],
        "contract": contract.model_dump() if contract else None,
    }
