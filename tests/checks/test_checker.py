from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxdeploy.checks.checker as checker_module
from onnxdeploy.checks import CheckContext, CheckerCheck
from tests.checks.checks_testutil import STATIC_MODEL, by_code, codes, parse


def test_valid_model_has_no_findings():
    assert CheckerCheck().run(parse(STATIC_MODEL)) == []


def test_unknown_op_names_the_node():
    model = parse("g (float[2] x) => (float[2] y) { [mystery] y = Frobnicate(x) }")
    findings = CheckerCheck().run(model)
    assert codes(findings) == ["OD101"]
    finding = findings[0]
    assert finding.level == "error" and finding.check == "checker"
    assert "Frobnicate" in finding.message
    assert finding.nodes == ["mystery"]
    assert "opset" in finding.hint


def test_unsorted_graph_names_node_and_tensor():
    model = parse(
        """
        g (float[2] x) => (float[2] y) {
            [late] y = Relu(t)
            [early] t = Relu(x)
        }
        """
    )
    findings = CheckerCheck().run(model)
    assert codes(findings) == ["OD101"]
    assert "topologically sorted" in findings[0].message
    assert findings[0].nodes == ["late", "t"]
    assert "TopologicalSortPass" in findings[0].hint


def test_strict_inference_errors_become_one_finding_per_node():
    model = parse(
        """
        g (float[2] x) => (float[3] a, float[3] b) {
            [r1] a = Relu(x)
            [r2] b = Relu(x)
        }
        """
    )
    findings = CheckerCheck().run(model)
    assert codes(findings) == ["OD102", "OD102"]
    assert [f.nodes for f in findings] == [["r1"], ["r2"]]
    assert all(f.level == "error" and "differ" in f.message for f in findings)


def test_type_error_is_inference_finding():
    model = parse("g (float[2] x, int64[2] z) => (float[2] y) { [add0] y = Add(x, z) }")
    findings = CheckerCheck().run(model)
    assert codes(findings) == ["OD102"]
    assert findings[0].nodes == ["add0"]


def _external_model(tmp_path: Path, *, write_data: bool) -> Path:
    weight = np.arange(8, dtype=np.float32).reshape(2, 4)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"], name="add")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "model.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    if not write_data:
        (tmp_path / "weights.bin").unlink()
    return path


def test_external_data_present_is_checked_by_path(tmp_path):
    path = _external_model(tmp_path, write_data=True)
    model = onnx.load(path, load_external_data=False)
    assert CheckerCheck().run(model, CheckContext(model_path=path)) == []


def test_external_data_missing_is_reported_with_real_folder(tmp_path):
    path = _external_model(tmp_path, write_data=False)
    model = onnx.load(path, load_external_data=False)
    findings = CheckerCheck().run(model, CheckContext(model_path=path))
    assert codes(findings) == ["OD101"]
    assert "weights.bin" in findings[0].message and "w" in findings[0].nodes
    assert "onnxdeploy-check-" not in findings[0].message


def test_external_data_without_context_is_a_warning(tmp_path):
    path = _external_model(tmp_path, write_data=True)
    model = onnx.load(path, load_external_data=False)
    findings = CheckerCheck().run(model)
    assert codes(findings) == ["OD103"]
    assert findings[0].level == "warning" and findings[0].nodes == ["w"]


def _model_with_big_weight(raw_bytes: int | None = None) -> onnx.ModelProto:
    weight = np.ones((128, 256), dtype=np.float32)  # 128 KiB: above the stub threshold
    model = parse(
        """
        g (float[2,128] x, float[128,256] w) => (float[2,256] y) { [mm] y = MatMul(x, w) }
        """
    )
    init = numpy_helper.from_array(weight, "w")
    if raw_bytes is not None:
        init.raw_data = init.raw_data[:raw_bytes]
    model.graph.initializer.append(init)
    return model


def test_model_too_large_for_memory_is_checked_by_path(monkeypatch):
    # Pretend the protobuf exceeds 2 GiB: the check must go through the path-based checker.
    monkeypatch.setattr(checker_module, "serialized_size", lambda model: None)
    model = _model_with_big_weight()
    before = model.SerializeToString()
    assert CheckerCheck().run(model) == []
    assert model.SerializeToString() == before


def test_path_route_still_checks_raw_data_size_of_stubbed_weights(monkeypatch):
    monkeypatch.setattr(checker_module, "serialized_size", lambda model: None)
    findings = CheckerCheck().run(_model_with_big_weight(raw_bytes=1000))
    assert codes(findings) == ["OD101"]
    assert findings[0].nodes == ["w"] and "1000 bytes" in findings[0].message


def test_path_route_reports_structural_errors(monkeypatch):
    monkeypatch.setattr(checker_module, "serialized_size", lambda model: None)
    model = _model_with_big_weight()
    model.graph.node[0].op_type = "Frobnicate"
    findings = CheckerCheck().run(model)
    assert codes(findings) == ["OD101"] and findings[0].nodes == ["mm"]


@pytest.mark.parametrize("location", ["/etc/passwd", "../outside.bin"])
def test_unsafe_external_location_is_reported(tmp_path, location):
    path = _external_model(tmp_path, write_data=True)
    model = onnx.load(path, load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    findings = by_code(CheckerCheck().run(model, CheckContext(model_path=path)), "OD101")
    assert len(findings) == 1 and "w" in findings[0].nodes


def test_ort_contrib_ops_in_the_default_domain_are_set_aside_not_rejected():
    # onnxruntime-genai's builder writes SimplifiedLayerNormalization into the default domain
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 4] x, float[4] w) => (float[2, 4] y) {
            n = SimplifiedLayerNormalization <axis = -1, epsilon = 0.00001> (x, w)
            y = Relu (n)
        }
        """
    )
    findings = CheckerCheck().run(model, CheckContext())
    assert [(f.code, f.level) for f in findings] == [("OD104", "info")]
    assert findings[0].nodes == ["SimplifiedLayerNormalization"]
