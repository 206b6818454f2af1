"""Which float type a model computes in, and whether an execution provider runs it natively or emulates it.

ONNX Runtime's CPU EP (1.32) has float16 kernels for few ops: its graph transformer ``InsertCastTransformer``
wraps every float16 node that has no float16 CPU kernel (MatMul, Add, Softmax, … on x86) in Casts to and from
float32, so a float16 graph computes in float32 between float16 tensors. It has no bfloat16 kernels at all:
a bfloat16 graph does not run there, and is verified on its float32 shadow (:func:`float32_shadow`). Results
on the CPU EP for either type are therefore labelled *emulated*, never native (``report.json`` →
``verify.numerics``): they show the graph is right, not how a float16/bfloat16 device rounds. float16 hazards
that the float32 detour hides (a fully masked row: ``-inf`` fill makes NaN in float16 arithmetic) are checked
with ``onnx.reference``, which computes float16 in float16 (tests/passes/test_attention_ops.py).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from onnxdeploy import model_io
from onnxdeploy.contract import read_contract, write_contract
from onnxdeploy.report import NumericsReport

__all__ = ["compute_dtype", "float32_shadow", "numerics_report"]

_FLOATS = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
}
_NATIVE_ON_CPU = {"float32", "float64"}


def compute_dtype(header: onnx.ModelProto) -> str:
    """The float type holding most weight elements of ``header`` (dims only, never data); else the first output's.

    Args:
        header: a model header (initializers may lack data).

    Returns:
        ``float32``, ``float16``, ``bfloat16`` or ``float64`` (``float32`` when nothing is a float).
    """
    elements: Counter[str] = Counter()
    for tensor in header.graph.initializer:
        name = _FLOATS.get(tensor.data_type)
        if name is not None:
            elements[name] += int(np.prod(tensor.dims)) if tensor.dims else 1
    if elements:
        return elements.most_common(1)[0][0]
    for out in header.graph.output:
        name = _FLOATS.get(out.type.tensor_type.elem_type)
        if name is not None:
            return name
    return "float32"


def numerics_report(header: onnx.ModelProto, provider: str, *, shadowed: bool = False) -> NumericsReport:
    """Label how ``provider`` computed a model: native, or emulated (module docstring).

    Args:
        header: the candidate's header.
        provider: the execution provider that ran it (e.g. ``CPUExecutionProvider``).
        shadowed: the candidate ran as its float32 shadow (bfloat16 on the CPU EP).

    Returns:
        The report's ``numerics`` entry.
    """
    dtype = compute_dtype(header)
    if shadowed:
        detail = (
            f"{dtype} graph run as its float32 shadow on {provider} (weights and I/O cast to float32 exactly, "
            "every value and op in float32): no bfloat16 kernels"
        )
        return NumericsReport(compute_dtype=dtype, provider=provider, execution="emulated", detail=detail)  # type: ignore[arg-type]
    if provider == "CPUExecutionProvider" and dtype not in _NATIVE_ON_CPU:
        detail = (
            f"{dtype} tensors, but ONNX Runtime's CPU EP computes MatMul/Add/Softmax and most other ops in float32 "
            "between Casts (InsertCastTransformer): rounding differs from a native float16 device"
        )
        return NumericsReport(compute_dtype=dtype, provider=provider, execution="emulated", detail=detail)  # type: ignore[arg-type]
    return NumericsReport(
        compute_dtype=dtype,  # type: ignore[arg-type]
        provider=provider,
        execution="native",
        detail=f"{dtype} computed by {provider}",
    )


def _bf16_to_f32(tensor: ir.TensorProtocol) -> ir.Tensor:
    array = tensor.numpy()
    return ir.tensor(np.asarray(array, dtype=ml_dtypes.bfloat16).astype(np.float32), name=tensor.name)


def float32_shadow(path: str | Path, folder: str | Path) -> Path:
    """Write the float32 shadow of a bfloat16 model into ``folder``: same graph, every bfloat16 tensor float32.

    bfloat16 values are float32 values with the low 16 mantissa bits zero, so weights, inputs and outputs cast
    exactly; every bfloat16 value (graph I/O, intermediate, Constant/ConstantOfShape/initializer) and every
    ``Cast(to=bfloat16)`` becomes float32, and a contract's ``kv_dtype`` says ``float32``. The shadow then
    computes what a bfloat16 device would compute with float32 arithmetic and no intermediate rounding to
    bfloat16: it checks the graph (a rewrite is right or wrong in either type), not bfloat16 rounding.

    Args:
        path: the bfloat16 model.
        folder: where to write it (``model.onnx`` + its data file).

    Returns:
        The shadow's path.
    """
    model = model_io.load_model(path).model
    bf16, f32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    for value in model.graph.initializers.values():
        if value.const_value is not None and value.const_value.dtype == bf16:
            value.const_value = _bf16_to_f32(value.const_value)
    values = [*model.graph.inputs, *model.graph.initializers.values()]
    for node in model.graph:
        values += list(node.outputs)
        if node.op_type == "Cast" and node.attributes.get_int("to") == bf16:
            node.attributes["to"] = ir.AttrInt64("to", f32)
        for key in ("value", "to") if node.op_type in ("Constant", "ConstantOfShape") else ():
            attr = node.attributes.get(key)
            if attr is not None and attr.type == ir.AttributeType.TENSOR and attr.as_tensor().dtype == bf16:
                node.attributes[key] = ir.AttrTensor(key, _bf16_to_f32(attr.as_tensor()))
    for value in values:
        if value.dtype == bf16:
            value.dtype = f32
    contract = read_contract(model, source=str(path))
    if contract is not None and contract.kv_dtype == "bfloat16":
        write_contract(model, contract.model_copy(update={"kv_dtype": "float32"}))
    Path(folder).mkdir(parents=True, exist_ok=True)
    return model_io.write_for_ort(model, folder)
