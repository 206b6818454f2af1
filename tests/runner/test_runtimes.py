"""Second verification runtime (OpenVINO CPU, f32), refusal of runtimes not installed, ORT node placement."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onnxdeploy import sdk
from onnxdeploy.cli import app
from onnxdeploy.config import load_pipeline
from onnxdeploy.errors import ConfigError, DecodeRunError
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner import runtimes
from onnxdeploy.runner.runtimes import check_runtimes, compare_on_runtime, node_providers
from tests.conftest import FIXTURE_NAMES, fixture_entry


def _static(tmp_path, name: str) -> tuple[str, str]:
    original = str(fixture_entry(name)["model_path"])
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        f"model: {original}\noutput_dir: {tmp_path / 'out'}\npasses:\n  - static_kv: {{max_cache_len: 32}}\n"
        "verify: null\n"
    )
    outcome = run_pipeline(load_pipeline(pipeline))
    return original, str(outcome.model_path)


def test_runtime_not_installed_is_refused_listing_the_installed_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(runtimes, "installed_runtimes", lambda: ["onnxruntime"])
    with pytest.raises(ConfigError, match=r"runtime 'openvino' is not installed; installed runtimes: onnxruntime"):
        check_runtimes(["onnxruntime", "openvino"])
    with pytest.raises(ConfigError, match="unknown runtime 'tvm'"):
        check_runtimes(["tvm"])
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        f"model: {fixture_entry('llama_gqa_optimum')['model_path']}\nverify: {{runtimes: [onnxruntime, openvino]}}\n"
    )
    with pytest.raises(ConfigError, match=r"key 'verify.runtimes': runtime 'openvino' is not installed"):
        load_pipeline(pipeline)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_static_fixture_decodes_on_openvino_cpu_like_the_original_on_ort(tmp_path, name):
    pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    original, static = _static(tmp_path, name)
    result = compare_on_runtime(
        original, static, "openvino", prompt=[1, 17, 42, 99, 7, 3], steps=10, max_abs_logit_diff=1e-4
    )
    assert result.refused is None and result.precision == "f32" and result.device == "openvino:CPU"
    assert result.passed and result.top1_agreement == 1.0 and result.positions == 16, result
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff <= 1e-4


def test_pipeline_reports_each_runtime_against_the_original(tmp_path):
    pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        f"model: {fixture_entry('llama_gqa_optimum')['model_path']}\noutput_dir: {tmp_path / 'out'}\n"
        "passes:\n  - static_kv: {max_cache_len: 32}\nverify: {steps: 4, runtimes: [onnxruntime, openvino]}\n"
    )
    result = CliRunner().invoke(app, ["run", str(pipeline)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (ov,) = report["runtimes"]
    assert ov["runtime"] == "openvino" and ov["passed"] and ov["max_abs_logit_diff"] <= 1e-4
    # the console and report.md show it as report.html does
    assert "other runtimes" in result.output and "openvino" in result.output.split("other runtimes")[1]
    assert "## Other runtimes" in (tmp_path / "out" / "report.md").read_text()


_FAKE_RKNN_WORKER = """
import json, os, sys
import numpy as np, onnxruntime as ort
_, mode, model, platform = sys.argv[:4]  # then the build options (RknnBuild JSON)
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
open("check0_base_optimize.onnx", "wb").close()  # the SDK dumps its stages into its working folder
print(json.dumps({"ok": True, "seconds": 0.0}), flush=True)
names = [i.name for i in session.get_inputs()]
for n, line in enumerate(sys.stdin, 1):
    request = json.loads(line)
    if n == int(os.environ["FAKE_RKNN_FAIL_AT"]):
        print(json.dumps({"ok": False, "error": "simulated"}), flush=True)
        continue
    with np.load(request["inputs"]) as data:
        outputs = session.run(None, {name: data[f"in{i}"] for i, name in enumerate(names)})
    np.savez(request["outputs"], **{f"out{i}": o for i, o in enumerate(outputs)})
    print(json.dumps({"ok": True}), flush=True)
"""


@pytest.mark.parametrize("fail_at", [0, 3])
def test_rknn_sim_verification_removes_its_folder_also_when_the_simulator_fails(tmp_path, monkeypatch, fail_at):
    """RKNNSimSession's worker folder goes with the decoder, whatever ends the decode; the worker is a stand-in (ORT
    behind the SDK worker's protocol, so no SDK is needed)."""
    original, static = _static(tmp_path, "llama_gqa_optimum")
    worker = tmp_path / "fake_rknn_worker.py"
    worker.write_text(_FAKE_RKNN_WORKER)
    monkeypatch.setattr(sdk, "_WORKER", worker)
    monkeypatch.setattr(sdk, "_require_python", lambda: Path(sys.executable))
    monkeypatch.setattr(runtimes, "rknn_python", lambda: Path(sys.executable))
    monkeypatch.setenv("FAKE_RKNN_FAIL_AT", str(fail_at))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    def compare():
        return compare_on_runtime(original, static, "rknn-sim", prompt=[1, 17, 42], steps=2, max_abs_logit_diff=1e-4)

    if fail_at:
        with pytest.raises(DecodeRunError, match="RKNN simulator run failed: simulated"):
            compare()
    else:
        result = compare()
        assert result.passed and result.positions == 5 and result.device == "rknn-sim:rk3588", result
    assert list((tmp_path / "tmp").glob("onnxdeploy-rknn-*")) == []


def test_node_providers_names_the_provider_of_every_node_and_leaves_no_profile(tmp_path, monkeypatch):
    _, static = _static(tmp_path, "llama_gqa_optimum")
    monkeypatch.chdir(tmp_path / "out")
    before = sorted(os.listdir("."))
    placement = node_providers(static)
    assert placement["nodes"] and set(placement["nodes"].values()) == {"CPUExecutionProvider"}
    assert placement["per_provider"]["CPUExecutionProvider"] == len(placement["nodes"])
    assert sorted(os.listdir(".")) == before


def test_each_runtime_entry_may_carry_its_own_tolerance(tmp_path):
    pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")  # the config checks it
    verify = load_pipeline_text(
        tmp_path,
        "verify: {max_abs_logit_diff: 1.0e-4, runtimes: [onnxruntime, {name: openvino, max_abs_logit_diff: 1.0e-2}]}",
    ).verify
    assert [(s.name, s.max_abs_logit_diff) for s in verify.runtime_specs()] == [
        ("onnxruntime", 1e-4),
        ("openvino", 1e-2),
    ]
    for bad, message in [
        ("[openvino, {name: openvino}]", "each runtime may appear once"),
        ("[{name: openvino, tolerance: 1.0e-2}]", r"verify\.runtimes\[0\]\.tolerance"),
        ("[{name: openvino, max_abs_logit_diff: -1.0}]", r"verify\.runtimes\[0\]\.max_abs_logit_diff"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_pipeline_text(tmp_path, f"verify: {{runtimes: {bad}}}")


def test_a_runtime_is_held_to_its_own_tolerance(tmp_path):
    """OpenVINO differs from ORT by a few ulp: 0.0 of its own fails the run while verify's 1e-4 passes ORT."""
    pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    config = load_pipeline_text(
        tmp_path,
        f"output_dir: {tmp_path / 'out'}\npasses:\n  - static_kv: {{max_cache_len: 32}}\n"
        "verify: {steps: 4, runtimes: [onnxruntime, {name: openvino, max_abs_logit_diff: 0.0}]}",
    )
    outcome = run_pipeline(config)
    (ov,) = outcome.report.runtimes
    assert (ov.max_abs_logit_diff_allowed, outcome.report.verify.passed) == (0.0, True)
    assert not ov.passed and ov.max_abs_logit_diff > 0 and outcome.exit_code == 1
    assert any("verify on openvino" in f and "> max_abs_logit_diff=0" in f for f in outcome.report.failures), (
        outcome.report.failures
    )


def load_pipeline_text(tmp_path, text: str):
    """A pipeline on the optimum LLaMA export with ``text`` appended, loaded (and validated)."""
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"model: {fixture_entry('llama_gqa_optimum')['model_path']}\n{text}\n")
    return load_pipeline(pipeline)


_SET = "{step_lens: [1, 4], max_cache_lens: [16, 32]}"  # 4 graphs: two step lengths x two caches


def _fake_rknn(tmp_path, monkeypatch):
    """The SDK worker's protocol served by ORT (no SDK needed): every graph of a set starts its own worker."""
    worker = tmp_path / "fake_rknn_worker.py"
    worker.write_text(_FAKE_RKNN_WORKER)
    monkeypatch.setattr(sdk, "_WORKER", worker)
    monkeypatch.setattr(sdk, "_require_python", lambda: Path(sys.executable))
    monkeypatch.setattr(runtimes, "rknn_python", lambda: Path(sys.executable))
    monkeypatch.setenv("FAKE_RKNN_FAIL_AT", "0")


@pytest.mark.parametrize("runtime", ["openvino", "rknn-sim"])
@pytest.mark.parametrize("static", [_SET, "{step_len: 4, max_cache_len: 32}"])
def test_another_runtime_drives_a_graph_set_and_a_chunk_graph_like_onnx_runtime(tmp_path, monkeypatch, runtime, static):
    """Issue 19: openvino and rknn-sim open every graph of a set (or a step_len 4 graph, fed in padded chunks),
    decode the prompt through the buckets and the steps through the step-1 graphs, drive apart any graph left, and
    say which graphs they drove; the run passes with every graph judged."""
    if runtime == "openvino":
        pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    else:
        _fake_rknn(tmp_path, monkeypatch)
    config = load_pipeline_text(
        tmp_path,
        f"output_dir: {tmp_path / 'out'}\npasses:\n  - static_kv: {static}\n"
        f"verify: {{prompt: [1, 17, 42, 99, 7, 3, 5], steps: 10, runtimes: [onnxruntime, {runtime}]}}",
    )
    outcome = run_pipeline(config)
    assert outcome.exit_code == 0, outcome.report.failures
    (other,) = outcome.report.runtimes
    assert other.runtime == runtime and other.passed and not other.failures, other
    graphs = outcome.report.verify.graphs
    assert other.graphs == graphs and set(other.graphs_driven) == set(graphs)
    assert all(calls > 0 for calls in other.graphs_driven.values()), other.graphs_driven
    if len(graphs) > 1:  # every graph judged apart too
        assert set(other.by_graph) == set(graphs) and all(g["positions"] > 0 for g in other.by_graph.values())
    # the decode's positions as on ORT (a prefill_logits: last bucket computes one per call), plus those apart
    assert other.positions >= outcome.report.verify.modes["teacher_forced"].positions
    assert other.thresholds["basis"] == ("fp32 (verify section)" if runtime == "openvino" else "fp16 defaults")


def test_a_graph_the_runtime_cannot_drive_fails_naming_it(tmp_path, monkeypatch):
    """A bucket longer than the prompt and steps whose contract declares no padding is named, not skipped."""
    _fake_rknn(tmp_path, monkeypatch)
    _, static = _static(tmp_path, "llama_gqa_optimum")
    monkeypatch.setattr(
        runtimes, "drive_every_graph", lambda *a, **k: runtimes.GraphCoverage({"model.onnx": 0}, failures=["graph X"])
    )
    original = str(fixture_entry("llama_gqa_optimum")["model_path"])
    result = compare_on_runtime(original, static, "rknn-sim", prompt=[1, 2, 3], steps=2, max_abs_logit_diff=1.0)
    assert not result.passed and result.failures == ["graph X"] and result.graphs_driven == {"model.onnx": 0}


def test_an_int8_build_on_rknn_sim_is_judged_by_held_out_accuracy(tmp_path, monkeypatch):
    """sdk.quantization: rknn-sim builds each graph with its own calibration dataset (made through the decode
    contract) and is judged by verify.accuracy's tokens on the simulator (stood in by ORT), not by logit bounds."""
    from onnxdeploy import sdk_stage

    _fake_rknn(tmp_path, monkeypatch)
    monkeypatch.setattr(sdk_stage, "rknn_python", lambda: None)  # the build stage notes it; rknn-sim still runs
    seen = []
    real = sdk_stage.rknn_build_for
    monkeypatch.setattr(sdk_stage, "rknn_build_for", lambda path, *a: seen.append(path.name) or real(path, *a))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(1, 65))))
    config = load_pipeline_text(
        tmp_path,
        f"output_dir: {tmp_path / 'out'}\ntarget: rknn-rk3588\npasses:\n  - static_kv: {_SET}\n  - mask_rewrite: {{}}\n"
        f"sdk: {{quantization: {{dtype: w8a8, max_samples: 4, max_mean_kl: 0.01}}}}\n"
        f"calibration: {{token_ids_file: {ids}}}\n"
        f"verify: {{steps: 6, runtimes: [onnxruntime, rknn-sim], accuracy: {{token_ids_file: {ids}, max_tokens: 24}}}}",
    )
    outcome = run_pipeline(config)
    assert outcome.exit_code == 0, outcome.report.failures
    (sim,) = outcome.report.runtimes
    assert sim.thresholds["basis"].startswith("int8 defaults") and sim.thresholds["min_cosine_similarity"] is None
    assert sim.accuracy["positions"] == 23 and sim.accuracy["mean_kl"] < 1e-6 and sim.accuracy["bounds"]["max_mean_kl"]
    assert sorted(set(seen)) == sorted(outcome.report.verify.graphs)  # one dataset per graph of the set
