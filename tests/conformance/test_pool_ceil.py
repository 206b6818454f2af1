"""MaxPool-22 / AveragePool-22 with ``ceil_mode=1`` lowered below 22: exact where the sizes are known, else named.

Opset 22 drops a last pooling window that would start in the right padding (Operators.md, MaxPool-22); the
earlier versions keep it, so their output is one longer on that axis. ``pin_opset`` keeps the pool and slices
the extra window off (checked on ORT against onnx's own node tests), and refuses in user terms where the input's
spatial dims are unknown.
"""

from __future__ import annotations

import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxdeploy.errors import PassError
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.pin_opset import PinOpsetConfig, PinOpsetPass
from tests.conformance import harness
from tests.conformance.node_cases import load_node_cases

CEIL_TESTS = ("test_maxpool_2d_ceil_output_size_reduce_by_one", "test_averagepool_2d_ceil_last_window_starts_on_pad")


@pytest.mark.parametrize("name", CEIL_TESTS)
@pytest.mark.parametrize("target", [21, 12])
def test_ceil_mode_window_in_the_padding_lowers_exactly(name, target):
    (case,) = [c for c in load_node_cases() if c.name == name]
    assert case.opset == 22 and harness.in_baseline(case)
    assert harness.outcome(case, target, "onnx").status == "invalid"  # onnx's converter keeps the longer shape
    model, written = harness.convert_with_pin_opset(case, target)
    assert model is not None, written.detail
    assert [n.op_type for n in model.graph.node][-1] == "Slice"
    assert harness.judge(model, case).status == "correct"


def test_unknown_spatial_dims_are_refused_naming_the_reason():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, "h", "w"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node(
        "MaxPool", ["x"], ["y"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1
    )
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y]), opset_imports=[helper.make_opsetid("", 22)], ir_version=10
    )
    with pytest.raises(PassError) as raised:
        PinOpsetPass(PinOpsetConfig(opset=21, prove=False))(ir.serde.deserialize_model(model), make_pass_context())
    message = raised.value.detail
    assert "MaxPool node 'pool'" in message and "opset 22 to 21" in message
    assert "drops a last window that starts in the right padding" in message and "spatial dims are not known" in message
    assert harness.user_terms_refusal(message)
