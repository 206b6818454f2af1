"""The graph-writing toolkit of the passes (passes/_edit.py): each helper on a tiny graph, with a negative case."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy.passes import _edit

TEXT = """
<ir_version: 9, opset_import: ["" : 17]>
g (float[2, 3] x) => (float[2, 3] y) <float[3] bias = {1, 2, 3}, float[3] unused = {0, 0, 0}> {
    a = Add (x, bias)
    dead = Neg (a)
    y = Relu (a)
}
"""


def _model() -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(TEXT))


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_add_initializer_registers_once_and_refuses_a_taken_name():
    graph = _model().graph
    value = _edit.add_initializer(graph, "scale", np.array([2.0], np.float32))
    assert value.dtype == ir.DataType.FLOAT and list(value.shape) == [1] and graph.initializers["scale"] is value
    assert _edit.add_initializer(graph, "scale", np.array([9.0], np.float32), reuse=True) is value
    with pytest.raises(ValueError):
        _edit.add_initializer(graph, "scale", np.array([9.0], np.float32))


def test_make_node_and_constant_node_build_typed_nodes_that_run():
    model = _model()
    graph = model.graph
    relu = next(n for n in graph if n.op_type == "Relu")
    two = _edit.constant_node("two", np.array(2.0, np.float32))
    mul = _edit.make_node(
        "Mul", [relu.outputs[0], two.outputs[0]], name="double", dtype=ir.DataType.FLOAT, shape=[2, 3]
    )
    graph.extend([two, mul])
    graph.outputs[0] = mul.outputs[0]
    assert mul.outputs[0].name == "double" and two.outputs[0].dtype == ir.DataType.FLOAT
    x = np.array([[-5, 0, 1], [2, -9, 4]], np.float32)
    np.testing.assert_array_equal(_run(model, x), 2 * np.maximum(x + [1, 2, 3], 0))
    split = _edit.make_node("Split", [relu.outputs[0]], name="halves", num_outputs=2, axis=0)
    assert [o.name for o in split.outputs] == ["halves", "halves:1"]


def test_fresh_name_skips_every_name_in_use():
    graph = _model().graph
    assert _edit.fresh_name(graph, "new") == "new"
    assert _edit.fresh_name(graph, "a") == "a_1"  # a node output
    assert _edit.fresh_name(graph, "bias") == "bias_1"  # an initializer
    taken = _edit.names_in_use(graph)
    assert _edit.fresh_name(graph, "x", taken) == "x_1" and _edit.fresh_name(graph, "x", taken) == "x_2"


def test_remove_dead_nodes_drops_unread_nodes_and_initializers_only():
    model = _model()
    assert _edit.remove_dead_nodes(model)
    assert [n.op_type for n in model.graph] == ["Add", "Relu"] and list(model.graph.initializers) == ["bias"]
    assert not _edit.remove_dead_nodes(model)  # nothing left to remove


def test_remove_dead_chain_stops_at_a_value_still_read():
    model = _model()
    graph = model.graph
    neg = next(n for n in graph if n.op_type == "Neg")
    _edit.remove_dead_chain(graph, neg.outputs[0])
    assert [n.op_type for n in graph] == ["Add", "Relu"]  # Add is still read by Relu


def test_clone_is_a_new_graph_over_the_same_tensors():
    model = _model()
    copy = _edit.clone(model)
    copy.graph.remove(next(n for n in copy.graph if n.op_type == "Neg"), safe=True)
    assert len(model.graph) == 3 and len(copy.graph) == 2
    assert copy.graph.initializers["bias"].const_value is model.graph.initializers["bias"].const_value
    for value in [*copy.graph.inputs, *(o for n in copy.graph for o in n.outputs)]:
        value.dtype = ir.DataType.DOUBLE  # onnx_ir's clone shares type objects: a dtype set here must not leak back
    dtypes = {o.dtype for n in model.graph for o in n.outputs} | {model.graph.inputs[0].dtype}
    assert ir.DataType.DOUBLE not in dtypes and ir.DataType.FLOAT in dtypes


def test_infer_shapes_and_fold_and_infer():
    text = """
    <ir_version: 9, opset_import: ["" : 17]>
    g (float[2, 3] x) => (float[6] y) {
        s = Shape (x)
        n = ReduceProd <keepdims = 1> (s)
        y = Reshape (x, n)
    }
    """
    model = ir.serde.deserialize_model(onnx.parser.parse_model(text))
    folded = _edit.fold_and_infer(model)
    assert [n.op_type for n in folded.graph] == ["Reshape"]  # the shape arithmetic folded away
    assert [n.op_type for n in model.graph] == ["Shape", "ReduceProd", "Reshape"]  # input unchanged
    _edit.forget_shapes(folded.graph)
    assert list(folded.graph.outputs[0].shape) == [None]  # graph outputs keep their rank only
    _edit.infer_shapes(folded)
    assert list(folded.graph.outputs[0].shape) == [6]
