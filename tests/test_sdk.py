"""RKNN-Toolkit2 as a subprocess SDK: build-log parsing always; the real SDK when its environment is installed.

The SDK tests need ``onnxdeploy sdk install rknn`` (RKNN-Toolkit2 2.5.0 in its own venv, ~5.6 GB) and are
skipped otherwise.
"""

from __future__ import annotations

import pytest

from onnxdeploy.config import load_pipeline
from onnxdeploy.model_check import check_model_file
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner.runtimes import compare_on_runtime
from onnxdeploy.sdk import parse_build_log, rknn_python
from tests.conftest import fixture_entry

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


def test_build_log_gives_one_verdict_per_graph_node():
    nodes = [("/m/Neg", "Neg"), ("/m/select", "Where"), ("/m/Softmax", "Softmax"), ("/m/Scatter", "ScatterElements")]
    nodes += [("/m/Gather", "Gather"), ("/m/MatMul", "MatMul"), ("/m/Shape", "Shape")]
    verdicts = {v.node: (v.verdict, v.rule) for v in parse_build_log(_LOG, nodes)}
    assert verdicts == {
        "/m/Neg": ("rewritten", "convert_neg_to_mul"),
        "/m/select": ("rewritten", "fuse_where_softmax_to_exsoftmaxmask"),
        "/m/Softmax": ("cpu", "fuse_where_softmax_to_exsoftmaxmask"),
        "/m/Scatter": ("no_npu_lowering", ""),
        "/m/Gather": ("cpu", ""),
        "/m/MatMul": ("npu", ""),
        "/m/Shape": ("folded", ""),
    }


@pytest.fixture(scope="module")
def rk3588_static(tmp_path_factory):
    """The optimum LLaMA export after static_kv + mask_rewrite + pin_opset 19 (what the RK3588 checks expect)."""
    root = tmp_path_factory.mktemp("rknn")
    (root / "pipeline.yaml").write_text(
        f"model: {fixture_entry('llama_gqa_optimum')['model_path']}\noutput_dir: {root / 'out'}\n"
        "passes:\n  - static_kv: {max_cache_len: 64}\n  - mask_rewrite: {}\n  - pin_opset: {opset: 19}\nverify: null\n"
    )
    outcome = run_pipeline(load_pipeline(root / "pipeline.yaml"))
    assert outcome.exit_code == 0, outcome.report.failures
    return root / "out" / "model.onnx"


@needs_sdk
def test_sdk_verdict_beside_the_matrix_node_by_node(rk3588_static):
    report = check_model_file(rk3588_static, target="rknn-rk3588", sdk=True)
    sdk = report.sdk
    assert sdk["built"] and sdk["sdk"] == "rknn-toolkit2 2.5.0", sdk["error"]
    rejected = {n["node"]: n for n in sdk["nodes"] if n["matrix"] == "OD510"}
    assert sorted(n["op"] for n in rejected.values()) == ["Neg"] * 4 + ["ScatterElements"] * 4
    for node in rejected.values():
        # The 2.1.0 table lacks both; the 2.5.0 SDK rewrites Neg to Mul and runs ScatterElements as a CPU op.
        expected = ("rewritten", "convert_neg_to_mul") if node["op"] == "Neg" else ("no_npu_lowering", "")
        assert (node["sdk"], node["rule"]) == expected, node
    no_lowering = sorted(n["op"] for n in sdk["nodes"] if n["sdk"] == "no_npu_lowering")
    assert no_lowering == ["ScatterElements"] * 4


@needs_sdk
def test_rknn_simulator_decodes_like_the_original(rk3588_static):
    comparison = compare_on_runtime(
        fixture_entry("llama_gqa_optimum")["model_path"],
        str(rk3588_static),
        "rknn-sim",
        prompt=[1, 17, 42, 99, 7, 3],
        steps=16,
        max_abs_logit_diff=1e-2,
    )
    assert comparison.passed and comparison.top1_agreement == 1.0, comparison
    assert comparison.positions == 22 and comparison.max_abs_logit_diff <= 1e-2
