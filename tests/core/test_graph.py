"""The graph-reading toolkit (onnxdeploy/graph.py): each helper on a tiny inline graph, with a negative case."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnxdeploy import graph

TEXT = """
<ir_version: 9, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[N, 4] x) => (float[N, 4] y) <int64[2] shape = {-1, 4}> {
    c = Constant <value_ints = [1, 2, 3]> ()
    f = Constant <value = float[2] {0.5, 1.5}> ()
    r = Reshape (x, shape)
    named_relu = Relu (r)
    y = Identity (named_relu)
}
"""


def _model() -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(TEXT))


def test_default_opset_of_model_graph_and_proto():
    model = _model()
    assert graph.default_opset(model) == 17
    assert graph.default_opset(model.graph) == 17
    assert graph.default_opset(onnx.parser.parse_model(TEXT)) == 17
    bare = ir.Model(ir.Graph([], [], nodes=[], opset_imports={"com.microsoft": 1}), ir_version=9)
    assert graph.default_opset(bare) == 0 and graph.default_opset(bare, 13) == 13


def test_const_array_reads_initializers_and_constant_nodes_but_not_computed_values():
    model = _model()
    values = ir.convenience.create_value_mapping(model.graph)
    np.testing.assert_array_equal(graph.const_array(values["shape"]), [-1, 4])
    np.testing.assert_array_equal(graph.const_array(values["f"]), np.array([0.5, 1.5], np.float32))
    assert graph.const_ints(values["c"]) == [1, 2, 3]
    assert graph.const_array(values["r"]) is None  # computed, not a constant
    assert graph.const_array(values["x"]) is None  # a graph input
    assert graph.const_array(None) is None
    assert graph.const_ints(values["f"]) is None  # float constants are not ints


def test_node_label_names_the_node_or_its_output():
    model = _model()
    nodes = {n.outputs[0].name: n for n in model.graph}
    assert graph.node_label(nodes["named_relu"]) == "Relu 'named_relu'"  # unnamed node: its first output
    contrib = ir.node("GroupQueryAttention", [], domain="com.microsoft", name="attn")
    assert graph.node_label(contrib) == "com.microsoft::GroupQueryAttention 'attn'"
    assert graph.node_label(ir.node("Relu", [])) == "Relu '?'"


def test_walks_up_and_down_stop_at_their_depth():
    model = _model()
    values = ir.convenience.create_value_mapping(model.graph)
    up = graph.upstream_nodes(values["y"], 2)
    assert [n.op_type for n in up] == ["Identity", "Relu"]
    assert [n.op_type for n in graph.upstream_nodes(values["y"], 9)] == ["Identity", "Relu", "Reshape"]
    down = graph.downstream_nodes(values["x"], 2)
    assert [n.op_type for n in down] == ["Reshape", "Relu"]
    assert graph.upstream_nodes(values["x"], 3) == []  # a graph input has no producer
    assert [n.op_type for n in graph.consumers(values["r"])] == ["Relu"]


def test_dims_static_symbolic_and_unknown():
    model = _model()
    x = model.graph.inputs[0]
    assert graph.value_dims(x) == ["N", 4]
    assert graph.static_dims(x) is None  # a symbolic dim
    assert graph.static_dims(ir.Value(name="v", shape=ir.Shape([2, 3]))) == [2, 3]
    assert graph.value_dims(ir.Value(name="v")) is None and graph.static_dims(ir.Value(name="v")) is None


def test_one_dtype_table():
    assert graph.numpy_dtype_of(ir.DataType.FLOAT16) == np.float16
    assert graph.numpy_dtype_of(ir.DataType.BFLOAT16).name == "bfloat16"
    assert graph.ort_numpy_dtype("tensor(float)") == np.float32
    assert graph.ort_numpy_dtype("tensor(bfloat16)") is None  # ORT's Python API feeds no bfloat16
    assert ir.DataType.BFLOAT16 in graph.FLOAT_TYPES and ir.DataType.INT8 not in graph.FLOAT_TYPES
    assert onnx.TensorProto.FLOAT16 in graph.FLOAT_ELEM_TYPES and onnx.TensorProto.INT64 not in graph.FLOAT_ELEM_TYPES
    with pytest.raises(TypeError):
        graph.numpy_dtype_of(ir.DataType.UNDEFINED)


def test_reading_a_constant_never_renames_its_tensor():
    """onnx_ir's get_const_tensor renames a Constant's tensor; after clone() that tensor is the input's too."""
    model = _model()
    f = next(n for n in model.graph if n.outputs[0].name == "f")
    tensor = f.attributes["value"].as_tensor()
    before = tensor.name
    copy = model.clone()
    value = next(n for n in copy.graph if n.outputs[0].name == "f").outputs[0]
    value.name = "renamed_in_the_copy"
    assert graph.const_tensor(value) is tensor  # shared with the input
    assert tensor.name == before
