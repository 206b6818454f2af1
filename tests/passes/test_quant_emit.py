"""Quantized tensors put into a graph: DequantizeLinear per layout read, or MatMulNBits keeping the output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.artifacts import ScratchWriter
from onnxdeploy.passes._edit import names_in_use
from onnxdeploy.passes._quant_emit import graph_values, rewire
from onnxdeploy.passes._quant_targets import find_targets
from onnxdeploy.passes._quant_tensors import WeightQuantizer
from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig

RNG = np.random.default_rng(0)
K, N = 32, 16


def _model() -> ir.Model:
    """One weight ``w`` (K, N) read by a MatMul and, transposed, by a Gemm with transB=1."""
    w = RNG.standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
            helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0], name="t"),
            helper.make_node("Gemm", ["x", "w_t"], ["z"], transB=1, name="fc"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, N]),
        ],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def test_one_dequantized_weight_and_one_transpose_serve_both_layouts(tmp_path: Path) -> None:
    model = _model()
    graph = model.graph
    targets, _ = find_targets(model, exclude=[], lm_head=True, embedding=False)
    quantizer = WeightQuantizer(QuantizeWeightsConfig(bits=4, block_size=16), ScratchWriter(tmp_path / "w", 1024))
    taken = names_in_use(graph)
    q = quantizer.quantize(targets[0], None, None, None, nbits=False)
    values = graph_values(graph, q, ir.DataType.FLOAT, taken)
    for t in targets:
        rewire(graph, t, q, values, taken, accuracy_level=0)
    dq = next(n for n in graph if n.op_type == "DequantizeLinear")
    assert (dq.name, dq.outputs[0].name) == ("w_Q4_DequantizeLinear", "w_Q4_dequantized")
    assert dq.attributes.get_int("axis") == 0 and dq.attributes.get_int("block_size") == 16
    assert list(dq.outputs[0].shape) == [K, N]
    transposes = [n for n in graph if n.op_type == "Transpose" and n.inputs[0] is dq.outputs[0]]
    assert len(transposes) == 1
    fc = next(n for n in graph if n.name == "fc")
    assert fc.inputs[1] is transposes[0].outputs[0]
    assert next(n for n in graph if n.name == "mm").inputs[1] is dq.outputs[0]


def test_matmulnbits_replaces_the_matmul_and_keeps_its_output(tmp_path: Path) -> None:
    model = _model()
    graph = model.graph
    y = graph.outputs[0]
    mm = next(t for t in find_targets(model, exclude=[], lm_head=True, embedding=False)[0] if t.kind == "matmul")
    quantizer = WeightQuantizer(QuantizeWeightsConfig(bits=8, format="matmulnbits"), ScratchWriter(tmp_path / "w"))
    taken = names_in_use(graph)
    q = quantizer.quantize(mm, None, None, None, nbits=True)
    rewire(graph, mm, q, graph_values(graph, q, ir.DataType.FLOAT, taken), taken, accuracy_level=4)
    node = next(n for n in graph if n.op_type == "MatMulNBits")
    assert node.domain == "com.microsoft" and node.name == "mm_Q8"
    attrs = {k: node.attributes.get_int(k) for k in ("K", "N", "bits", "block_size", "accuracy_level")}
    assert attrs == {"K": K, "N": N, "bits": 8, "block_size": 32, "accuracy_level": 4}
    assert graph.outputs[0] is node.outputs[0] is not y and node.outputs[0].name == "y"
    assert "mm" not in {n.name for n in graph}
