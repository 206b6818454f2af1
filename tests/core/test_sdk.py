"""RKNN-Toolkit2 as a subprocess SDK: build-log parsing always; the real SDK when its environment is installed.

The SDK tests need ``onnxdeploy sdk install rknn`` (RKNN-Toolkit2 2.5.0 in its own venv, ~5.6 GB) and are
skipped otherwise.
"""

from __future__ import annotations

import tempfile

import onnx
import pytest

from onnxdeploy.config import load_pipeline
from onnxdeploy.model_check import check_model_file
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.report import Finding
from onnxdeploy.sdk import SdkReport, beside_matrix, parse_build_log, rknn_build_reports, rknn_python
from tests.conftest import ALL_FIXTURE_NAMES, fixture_entry

needs_sdk = pytest.mark.skipif(rknn_python() is None, reason="RKNN-Toolkit2 env absent: onnxdeploy sdk install rknn")

_LOG = """\
D     convert_neg_to_mul: remove node = ['/m/Neg'], add node = ['/m/Neg#1']
D     fuse_where_softmax_to_exsoftmaxmask: remove node = ['/m/select', '/m/Softmax'], add node = ['/m/Softmax']
No lowering found for: /m/Scatter, node type = ScatterElements, use CustomOperatorLower instead.
D RKNN: [11:28:34.237] ID   OpType  DataType Target InputShape  OutputShape  Cycles(DDR/NPU/Total)  RW(KB)  FullName
D RKNN: [11:28:34.237] 9    Gather  FLOAT16  CPU    (512,64),(1,1)  (1,1,64)  0/0/0  64  Gather:/m/Gather
D RKNN: [11:28:34.237] 12   Conv    FLOAT16  NPU    (1,64,1,1)  (1,64,1,1)  0/0/0  8  Conv:/m/MatMul
D RKNN: [11:28:34.237] 43   exSoftmaxMask FLOAT16 CPU (1,4,1,64),(1,1,1,64) (1,4,1,64) 0/0/0 1 exSoftmaxMask:/m/Softmax
"""


_NODES = [("/m/Neg", "Neg"), ("/m/select", "Where"), ("/m/Softmax", "Softmax"), ("/m/Scatter", "ScatterElements")]
_NODES += [("/m/Gather", "Gather"), ("/m/MatMul", "MatMul"), ("/m/Shape", "Shape")]


def test_build_log_gives_one_verdict_per_graph_node():
    verdicts = {v.node: (v.verdict, v.rule) for v in parse_build_log(_LOG, _NODES)}
    assert verdicts == {
        "/m/Neg": ("rewritten", "convert_neg_to_mul"),
        "/m/select": ("rewritten", "fuse_where_softmax_to_exsoftmaxmask"),
        "/m/Softmax": ("cpu", "fuse_where_softmax_to_exsoftmaxmask"),
        "/m/Scatter": ("no_npu_lowering", ""),
        "/m/Gather": ("cpu", ""),
        "/m/MatMul": ("npu", ""),
        "/m/Shape": ("folded", ""),
    }


def test_matrix_and_sdk_agreement_rule():
    """Support disagreements are findings; a lowered op the compiler places on the CPU is listed apart."""
    report = SdkReport("rknn-toolkit2 2.5.0", "rk3588", True, 1.0, nodes=parse_build_log(_LOG, _NODES))
    findings = [Finding(code="OD510", level="error", check="target_ops", message="", nodes=["/m/Scatter", "/m/Neg"])]
    findings += [Finding(code="OD515", level="warning", check="target_ops", message="", nodes=["/m/MatMul"])]
    beside = beside_matrix(report, findings)
    assert beside["disagreements"] == [
        "/m/Neg (Neg): matrix OD510, SDK rewritten (convert_neg_to_mul)",  # the SDK converts what the matrix rejects
        "/m/MatMul (MatMul): matrix cpu_fallback, SDK npu",  # the SDK lowers what the matrix calls CPU-only
    ]
    assert beside["cpu_placed"] == [
        "/m/Softmax (Softmax): matrix supported, SDK cpu (fuse_where_softmax_to_exsoftmaxmask)",
        "/m/Gather (Gather): matrix supported, SDK cpu",
    ]


@pytest.fixture(scope="module")
def rk3588_statics(tmp_path_factory) -> dict[str, object]:
    """Every committed fixture after static_kv (64 slots) + mask_rewrite + pin_opset 19 (genai: no pin_opset, its
    contrib ops have no opset-19 form), the default cache write (ScatterElements)."""
    root = tmp_path_factory.mktemp("rknn")
    paths = {}
    for name in ALL_FIXTURE_NAMES:
        pin = "" if fixture_entry(name)["expect"].cache_op == "GroupQueryAttention" else "  - pin_opset: {opset: 19}\n"
        (root / f"{name}.yaml").write_text(
            f"model: {fixture_entry(name)['model_path']}\noutput_dir: {root / name}\n"
            f"passes:\n  - static_kv: {{max_cache_len: 64}}\n  - mask_rewrite: {{}}\n{pin}checks: [topo_order]\n"
            "verify: null\n"
        )
        outcome = run_pipeline(load_pipeline(root / f"{name}.yaml"))
        assert outcome.exit_code == 0, (name, outcome.report.failures)
        paths[name] = root / name / "model.onnx"
    return paths


@needs_sdk
def test_rk3588_matrix_agrees_with_the_sdk_build_log_node_by_node_on_every_static_fixture(rk3588_statics):
    names = list(rk3588_statics)
    reports = dict(zip(names, rknn_build_reports([rk3588_statics[n] for n in names]), strict=True))
    for name, report in reports.items():
        findings = check_model_file(rk3588_statics[name], target="rknn-rk3588").findings
        if fixture_entry(name)["expect"].cache_op == "GroupQueryAttention":
            # both refuse: the matrix has no com.microsoft domain, the SDK does not build the graph
            contrib = [f for f in findings if f.code == "OD510" and "domain com.microsoft" in f.message]
            assert contrib and not report.built and report.error, (name, report.error)
            continue
        assert report.built and report.sdk == "rknn-toolkit2 2.5.0", (name, report.error)
        beside = beside_matrix(report, findings)
        graph = [n.name for n in onnx.load(rk3588_statics[name], load_external_data=False).graph.node]
        assert [n["node"] for n in beside["nodes"]] == graph  # one verdict per node
        assert beside["disagreements"] == [], (name, beside["disagreements"])
        by_op = {}
        for n in beside["nodes"]:
            by_op.setdefault(n["op"], set()).add((n["matrix"], n["sdk"], n["rule"]))
        # the 2.1.0 table's Not Supported ops the SDK converts: accepted now (source rknn-sdk-build)
        assert by_op.get("Neg", {("supported", "rewritten", "convert_neg_to_mul")}) == {
            ("supported", "rewritten", "convert_neg_to_mul")
        }
        assert by_op.get("Reciprocal", {("supported", "rewritten", "convert_reciprocal_to_div")}) == {
            ("supported", "rewritten", "convert_reciprocal_to_div")
        }
        # what the SDK truly lacks (no NPU lowering) is what the matrix rejects: the cache writes
        layers = fixture_entry(name)["config"]["layers"]
        assert by_op["ScatterElements"] == {("OD510", "no_npu_lowering", "")}, name
        assert sum(n["op"] == "ScatterElements" for n in beside["nodes"]) == 2 * layers
    assert {"Neg", "Reciprocal"} <= {n.op for r in reports.values() for n in r.nodes if n.verdict == "rewritten"}


@needs_sdk
def test_rknn_simulator_verifies_a_static_fixture_within_its_own_tolerance(tmp_path, monkeypatch):
    """rknn-sim is fp16: held to 1e-2 by its verify.runtimes entry while ORT keeps 1e-4; 100% top-1 over 16 steps.

    The simulator's worker folder (the SDK's check*.onnx dumps) is gone once the run ends."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "p.yaml").write_text(
        f"model: {fixture_entry('llama_gqa_optimum')['model_path']}\noutput_dir: {tmp_path / 'out'}\n"
        "passes:\n  - static_kv: {max_cache_len: 64}\n  - mask_rewrite: {}\n  - pin_opset: {opset: 19}\n"
        "verify:\n  steps: 16\n  max_abs_logit_diff: 1.0e-4\n"
        "  runtimes: [onnxruntime, {name: rknn-sim, max_abs_logit_diff: 1.0e-2}]\n"
    )
    outcome = run_pipeline(load_pipeline(tmp_path / "p.yaml"))
    assert outcome.exit_code == 0, outcome.report.failures
    (sim,) = outcome.report.runtimes
    assert (sim.runtime, sim.passed, sim.positions, sim.top1_agreement) == ("rknn-sim", True, 22, 1.0), sim
    assert sim.max_abs_logit_diff_allowed == 1e-2 and 0 < sim.max_abs_logit_diff <= 1e-2
    assert sim.max_abs_logit_diff > 1e-4  # fp16: the fp32 tolerance would have failed it
    assert list((tmp_path / "tmp").glob("onnxdeploy-rknn-*")) == []
