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

import numpy as np
import onnx
import onnx_ir as ir

from onnxdeploy import model_io
from onnxdeploy.contract import read_contract, write_contract
from onnxdeploy.graph import FLOAT_ELEM_TYPES, float32_shadow_graph, numpy_dtype_of
from onnxdeploy.report import NumericsReport

__all__ = ["compute_dtype", "float32_shadow", "numerics_report"]

_NATIVE_ON_CPU = {"float32", "float64"}


def _float_name(elem_type: int) -> str | None:
    """The numpy name (``float32``, ``float16``, ``bfloat16``, ``float64``) of a float element type, else None."""
    return str(numpy_dtype_of(ir.DataType(elem_type))) if elem_type in FLOAT_ELEM_TYPES else None


def compute_dtype(header: onnx.ModelProto) -> str:
    """The float type holding most weight elements of ``header`` (dims only, never data); else the first output's.

    Args:
        header: a model header (initializers may lack data).

    Returns:
        ``float32``, ``float16``, ``bfloat16`` or ``float64`` (``float32`` when nothing is a float).
    """
    elements: Counter[str] = Counter()
    for tensor in header.graph.initializer:
        name = _float_name(tensor.data_type)
        if name is not None:
            elements[name] += int(np.prod(tensor.dims)) if tensor.dims else 1
    if elements:
        return elements.most_common(1)[0][0]
    for out in header.graph.output:
        name = _float_name(out.type.tensor_type.elem_type)
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


def float32_shadow(path: str | Path, folder: str | Path) -> Path:
    """Write the float32 shadow of a bfloat16 model into ``folder``: same graph, every bfloat16 tensor float32.

    bfloat16 values are float32 values with the low 16 mantissa bits zero, so weights, inputs and outputs cast
    exactly; every bfloat16 value (graph I/O, intermediate, Constant/ConstantOfShape/initializer) and every
    ``Cast(to=bfloat16)`` becomes float32 (:func:`onnxdeploy.graph.float32_shadow_graph`), and a contract's
    ``kv_dtype`` says ``float32``. The shadow then computes what a bfloat16 device would compute with float32
    arithmetic and no intermediate rounding to bfloat16: it checks the graph (a rewrite is right or wrong in
    either type), not bfloat16 rounding. A model whose contract lists a graph set is shadowed with every graph
    of the set, under the same file names, sharing one data file (each weight converted once).

    Args:
        path: the bfloat16 model (the primary graph of a set).
        folder: where to write it (the graph(s) + one data file).

    Returns:
        The shadow's path (same file name as ``path``).
    """
    path = Path(path)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    contract = read_contract(model_io.read_model_header(path), source=str(path))
    files = [entry.file for entry in contract.graph_set] if contract is not None and contract.graph_set else []
    if contract is not None and contract.parts:  # a split model: every part of every graph (runner/parts.py)
        files = [
            part.file
            for name in files or [path.name]
            for part in read_contract(model_io.read_model_header(path.parent / name), source=name).parts  # type: ignore[union-attr]
        ]
    if len(files) <= 1:
        model = model_io.load_model(path).model
        _shadow(model, {}, str(path))
        return model_io.write_for_ort(model, folder, name=path.name)
    converted: dict[object, ir.Tensor] = {}
    graphs = []
    for name in files:
        model = model_io.load_model(path.parent / name).model
        _shadow(model, converted, name)
        graphs.append((name, model))
    model_io.stage_artifacts(graphs, folder, external=True, data_name=f"{files[0]}.data").commit()
    return folder / path.name


def _shadow(model: ir.Model, converted: dict[object, ir.Tensor], source: str) -> None:
    """:func:`float32_shadow_graph` plus the contract's ``kv_dtype``."""
    float32_shadow_graph(model, converted)
    contract = read_contract(model, source=source)
    if contract is not None and contract.kv_dtype == "bfloat16":
        write_contract(model, contract.model_copy(update={"kv_dtype": "float32"}))
