"""What the registries do not say and the generators probe: kernel-refused attribute values, inlining reach, constants.

Each fact below was a misprediction of ``benchmarks/matrix_check.py`` on ONNX's node tests (issue 16): the
matrix said "supported" and the runtime refused. The tests build the node test's model shape by hand, ask the
target checks, and ask the runtime itself.
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxdeploy.checks.target import predict_supported
from onnxdeploy.matrices import get_target


def _opens(model: onnx.ModelProto) -> bool:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any refusal
        return False
    return True


def _gru(layout: int) -> onnx.ModelProto:
    """GRU-22, hidden 2, input 3, seq 4, batch 1 (``layout=1``: X is (batch, seq, input))."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3] if layout else [4, 1, 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [1, 6, 3], [0.1] * 18)
    r = helper.make_tensor("r", TensorProto.FLOAT, [1, 6, 2], [0.1] * 12)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("GRU", ["x", "w", "r"], ["y"], hidden_size=2, layout=layout)
    graph = helper.make_graph([node], "gru", [x], [y], initializer=[w, r])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)


def test_ort_cpu_refuses_batchwise_recurrent_ops_and_the_matrix_says_so():
    assert _opens(_gru(0)) and not _opens(_gru(1))
    assert predict_supported(_gru(0), "ort-cpu")[0]
    accepted, errors = predict_supported(_gru(1), "ort-cpu")
    assert not accepted and errors[0].code == "OD513" and "layout=1" in errors[0].message
    (entry,) = get_target("ort-cpu").ops_for("ai.onnx", "GRU", 22)
    assert entry.attributes == {"layout": [0]} and entry.source == "ort-attribute-probe"


def _swish(opset: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph([helper.make_node("Swish", ["x"], ["y"], alpha=1.0)], "swish", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def test_an_inlined_function_holds_only_up_to_the_opset_its_body_still_opens_at():
    """Swish-24 has no CPU kernel; ORT inlines its body at the model's opset, which at 25+ it cannot."""
    assert _opens(_swish(24)) and not _opens(_swish(28))
    assert predict_supported(_swish(24), "ort-cpu")[0]
    accepted, errors = predict_supported(_swish(28), "ort-cpu")
    assert not accepted and errors[0].code == "OD510" and "opset <= 24" in errors[0].rule
    (entry,) = get_target("ort-cpu").ops_for("ai.onnx", "Swish", 24)
    assert entry.via == "function" and entry.opset_max == 24


def _unsqueeze(axes_constant: bool) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    inputs = [x] if axes_constant else [x, helper.make_tensor_value_info("axes", TensorProto.INT64, [1])]
    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["x", "axes"], ["y"])],
        "unsqueeze",
        inputs,
        [y],
        initializer=[axes] if axes_constant else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)], ir_version=10)


def test_openvino_compiles_unsqueeze_with_constant_axes_only_and_the_matrix_says_so():
    ov = pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    core = ov.Core()

    def compiles(model: onnx.ModelProto) -> bool:
        try:
            core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU")
        except Exception:  # noqa: BLE001 - any refusal
            return False
        return True

    assert compiles(_unsqueeze(True)) and not compiles(_unsqueeze(False))
    assert predict_supported(_unsqueeze(True), "openvino")[0]
    accepted, errors = predict_supported(_unsqueeze(False), "openvino")
    assert not accepted and errors[0].code == "OD518" and "'axes' is not a constant" in errors[0].message


def _resize(mode: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    roi = helper.make_tensor("roi", TensorProto.FLOAT, [8], [0, 0, 0, 0, 1, 1, 1, 1])
    scales = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])
    node = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], coordinate_transformation_mode=mode, mode="linear")
    graph = helper.make_graph([node], "resize", [x], [y], initializer=[roi, scales])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def test_openvino_resize_modes_and_ops_no_one_node_probe_builds_follow_what_openvino_compiles():
    """Resize and GRU need inputs a generic probe cannot build: the frontend's table, plus a hand-built probe."""
    ov = pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    core = ov.Core()

    def compiles(model: onnx.ModelProto) -> bool:
        try:
            core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU")
        except Exception:  # noqa: BLE001 - any refusal
            return False
        return True

    for mode, expected in (("half_pixel", True), ("align_corners", True), ("tf_crop_and_resize", False)):
        assert compiles(_resize(mode)) is expected
        assert predict_supported(_resize(mode), "openvino")[0] is expected, mode
    gru = _gru(0)
    assert compiles(gru) and predict_supported(gru, "openvino")[0]
    matrix = get_target("openvino")
    (entry,) = matrix.ops_for("ai.onnx", "GRU", 22)
    assert entry.via == "listed" and entry.source == "ov-onnx-fe"
    # sequence values: the frontend lists the ops, the CPU plugin compiles none, the matrix lists none
    assert not matrix.ops_for("ai.onnx", "SequenceInsert", 11)


def test_ort_cpu_conv_integer_runs_a_per_tensor_weight_zero_point_only_and_the_matrix_says_so():
    """ORT's ConvInteger opens with a per-channel w_zero_point and fails at its first run (conv_integer.cc)."""
    import numpy as np

    from onnxdeploy.matrices._ort_probes import _conv_integer

    def runs(model: onnx.ModelProto) -> bool:
        try:
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            session.run(None, {"x": np.ones((1, 1, 3, 3), np.uint8)})
        except Exception:  # noqa: BLE001 - any refusal or run error
            return False
        return True

    per_tensor, per_channel = _conv_integer(10, 1), _conv_integer(10, 2)
    assert runs(per_tensor) and _opens(per_channel) and not runs(per_channel)
    assert predict_supported(per_tensor, "ort-cpu")[0]
    accepted, errors = predict_supported(per_channel, "ort-cpu")
    assert not accepted and errors[0].code == "OD518" and "'wz' (w_zero_point) has 2 elements" in errors[0].message
