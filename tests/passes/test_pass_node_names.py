"""Nodes a pass creates have unique, meaningful names: the tool's own names check (``OD304``/``OD305``) stays quiet.

onnx's version converter adds unnamed ``Constant`` nodes (the Reduce* ``axes`` it moves from attribute to input
when raising to 18+), function bodies expanded by ``pin_opset`` bring their constants, and the exact lowerings
add small subgraphs: on a graph whose nodes are all named, each of these must come out named, once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.checks import CheckContext
from onnxdeploy.checks.topo_order import TopoOrderCheck
from onnxdeploy.model_io import stand_in_proto
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.pin_opset import PinOpsetConfig, PinOpsetPass
from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig, QuantizeWeightsPass

RAISE_17 = """<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,4,6] x) => (float[2,1,4,1] y, float[2,3,4,1] z) {
    [mean_a] y = ReduceMean <axes = [1, -1]> (x)
    [mean_b] z = ReduceMean <axes = [-1]> (x)
}"""
LOWER_23 = """<ir_version: 10, opset_import: ["" : 23]>
g (float[2,3,4,6] x, float[6] s, int64 k) => (float[2,3,4,6] a, float[2,3,4,6] b, float[2,3,4,6] c,
                                              float[2,3,4,6] d, float[2,3,4,2] e, float[2,3,4,4] f) {
    [norm] a = LayerNormalization (x, s, s)
    [rms] b = RMSNormalization (x, s)
    [tri_a] c = Trilu (x, k)
    [tri_b] d = Trilu <upper = 0> (x)
    [split] e, f = Split <axis = -1, num_outputs = 2> (x)
}"""
SOFTMAX_13 = """<ir_version: 8, opset_import: ["" : 13]>
g (float[2,3,4,6] x) => (float[2,3,4,6] y, float[2,3,4,6] z) {
    [soft_a] y = Softmax <axis = 1> (x)
    [soft_b] z = LogSoftmax <axis = 2> (x)
}"""


def _name_findings(model: ir.Model) -> list[str]:
    proto = stand_in_proto(model, as_inputs=True)
    unnamed = [n.op_type for n in proto.graph.node if not n.name]
    findings = TopoOrderCheck().run(proto, CheckContext())
    return unnamed + [f"{f.code} {f.message}" for f in findings if f.code in ("OD304", "OD305")]


@pytest.mark.parametrize(
    ("text", "opset"),
    [(RAISE_17, 21), (LOWER_23, 16), (LOWER_23, 13), (SOFTMAX_13, 12)],
    ids=["raise-17-21", "lower-23-16", "lower-23-13", "lower-13-12"],
)
def test_pin_opset_names_every_node_it_creates(text: str, opset: int) -> None:
    model = ir.serde.deserialize_model(onnx.parser.parse_model(text))
    pinned = PinOpsetPass(PinOpsetConfig(opset=opset))(model, make_pass_context()).artifacts.primary
    assert len(list(pinned.graph)) > len(list(model.graph)), "nothing was created: the test would prove nothing"
    assert _name_findings(pinned) == []
    if text is RAISE_17:  # the converter's axes constants say what they are for
        axes = [n.name for n in pinned.graph if n.op_type == "Constant"]
        assert sorted(axes) == ["mean_a/axes", "mean_b/axes"], axes


def test_quantize_weights_raising_the_opset_names_every_node(tmp_path: Path) -> None:
    weight = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1], name="mean"),
            helper.make_node("Sub", ["x", "m"], ["c"], name="center"),
            helper.make_node("MatMul", ["c", "w"], ["y"], name="proj"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    config = QuantizeWeightsConfig(bits=4, block_size=32, format="qdq")  # blocked INT4 QDQ needs opset 21
    result = QuantizeWeightsPass(config)(ir.serde.deserialize_model(proto), make_pass_context(scratch_dir=tmp_path))
    quantized = result.artifacts.primary
    assert quantized.opset_imports[""] == 21 and "DequantizeLinear" in [n.op_type for n in quantized.graph]
    assert _name_findings(quantized) == []
