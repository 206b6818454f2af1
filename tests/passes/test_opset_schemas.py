"""The opset adapters' schema helpers: lookups, the type check and refusal name op and node, hand-over."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from onnxdeploy.errors import PassError
from onnxdeploy.passes._opset_schemas import (
    check_types,
    hand_over,
    node_since,
    refuse,
    schema_at,
    since_version,
    types_only_change,
)


def _model(text: str) -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(text))


def test_schema_lookups_and_an_op_onnx_does_not_know():
    assert since_version("Split", 18) == 18 and since_version("Split", 17) == 13
    assert schema_at("SimplifiedLayerNormalization", 18) is None
    assert since_version("Trilu", 13) is None  # Trilu first exists at 14


def test_refusal_names_op_node_and_lowest_opset():
    model = _model('<ir_version: 8, opset_import: ["" : 18]> g (float[2] x) => (float[2] y) { y = Relu (x) }')
    node = next(iter(model.graph))
    node.name = "act"
    error = refuse(node, "why", 14)
    assert isinstance(error, PassError)
    assert "Relu node 'act'" in str(error) and "why" in str(error) and "lowest reachable opset: 14" in str(error)
    assert node_since(node, 18) == 14


def test_check_types_refuses_a_type_the_target_schema_lacks():
    model = _model('<ir_version: 8, opset_import: ["" : 18]> g (int32[2] x) => (int32[2] y) { y = Relu (x) }')
    node = next(iter(model.graph))
    node.name = "act"
    check_types(node, 14)  # Relu-14 added the integer types
    with pytest.raises(PassError, match=r"Relu node 'act'.*tensor\(int32\) as X.*lowest reachable opset: 14"):
        check_types(node, 13)


def test_types_only_change_sees_a_changed_signature():
    model = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[4] x) => (float[2] a, float[2] b) '
        "{ a, b = Split <num_outputs: int = 2> (x) }"
    )
    split = next(iter(model.graph))
    assert not types_only_change(split, 18, 17)  # Split-18 added num_outputs
    relu = _model('<ir_version: 8, opset_import: ["" : 18]> g (float[2] x) => (float[2] y) { y = Relu (x) }')
    assert types_only_change(next(iter(relu.graph)), 18, 13)


def test_hand_over_moves_name_type_uses_and_graph_outputs():
    model = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[2] x) => (float[2] y, float[2] z) '
        "{ y = Relu (x)  z = Neg (y) }"
    )
    relu, neg = list(model.graph)
    old = relu.outputs[0]
    new = ir.node("Abs", [relu.inputs[0]]).outputs[0]
    model.graph.insert_before(relu, new.producer())
    hand_over(old, new, "__replaced")
    assert new.name == "y" and old.name == "y__replaced"
    assert new.dtype == ir.DataType.FLOAT and list(new.shape) == [2]
    assert neg.inputs[0] is new and model.graph.outputs[0] is new
    assert not old.uses()
