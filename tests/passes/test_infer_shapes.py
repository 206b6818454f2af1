"""Shape inference of a graph with an op onnx has no schema for, whose weights carry no data while it runs."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.passes._edit import infer_shapes


def test_ort_symbolic_inference_never_reads_a_weight_above_the_stand_in_threshold() -> None:
    # a 2,304-byte float weight (SmolLM2's RMSNorm: 576 floats) next to a com.microsoft op: ORT's inference reads
    # initializer data, and a stand-in (data-less) initializer failed with "should be stored in onnxdeploy-stand-in"
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 3, 576]))
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([576]))
    w.const_value = ir.tensor(np.linspace(0.5, 1.5, 576, dtype=np.float32), name="w")
    scaled = ir.node("Mul", [x, w])
    gelu = ir.node("FastGelu", [scaled.outputs[0]], domain="com.microsoft")
    gelu.outputs[0].name = "y"
    graph = ir.Graph(
        [x], gelu.outputs, nodes=[scaled, gelu], initializers=[w], opset_imports={"": 18, "com.microsoft": 1}
    )
    model = ir.Model(graph, ir_version=10)
    infer_shapes(model)
    assert scaled.outputs[0].shape == ir.Shape([1, 3, 576]) and gelu.outputs[0].dtype == ir.DataType.FLOAT
    assert model.graph.initializers["w"].const_value is not None  # the weight is still the model's, untouched
