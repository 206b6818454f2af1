"""The CLI end to end: run/inspect/passes/verify, exit codes, atomic outputs, untouched inputs."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from onnxdeploy.graph import tensor_dims
from tests.conftest import FIXTURE_NAMES, REPO, fixture_entry

runner = CliRunner()


def _save(model: onnx.ModelProto, path):
    onnx.save(model, path)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _invoke(*args: str):
    result = runner.invoke(app, list(args))
    return result, (result.stdout or "") + (result.stderr or "")


def _write_pipeline(tmp_path: Path, **overrides) -> Path:
    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(tmp_path / "out"),
        "passes": [{"static_kv": {"batch": 1, "step_len": 1, "max_cache_len": 64}}],
        "verify": {"prompt": [1, 17, 42, 99, 7, 3], "steps": 8},
    }
    cfg.update(overrides)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_run_example_pipeline_exits_0(tmp_path, name):
    example = REPO / "examples" / f"{name}.yaml"
    model_path = fixture_entry(name)["model_path"]
    before = _sha(model_path)
    result, out = _invoke("run", str(example), "--output-dir", str(tmp_path / "out"), "--json")
    assert result.exit_code == 0, out
    report = json.loads(result.stdout)
    assert report["schema_version"] == 3 and report["status"] == "passed"
    assert [p["name"] for p in report["passes"]][0] == "static_kv"
    assert not [f for f in report["findings"] if f["level"] == "error"]
    for mode in ("teacher_forced", "free_running"):
        v = report["verify"]["modes"][mode]
        assert v["top1_agreement"] == 1.0 and v["max_abs_logit_diff"] <= 1e-4
        assert v["first_divergent_step"] is None
        assert v["latency_ms"]["p50"] > 0 and v["latency_ms"]["p99"] >= v["latency_ms"]["p50"]
        assert len(v["steps"]) == 6 + 32
    written = onnx.load(tmp_path / "out" / "model.onnx")
    assert all(isinstance(d, int) for vi in written.graph.input for d in tensor_dims(vi))
    assert (tmp_path / "out" / "report.md").read_text().startswith("# onnxdeploy run report")
    assert _sha(model_path) == before


def test_run_prints_a_summary_table(tmp_path):
    result, out = _invoke("run", str(_write_pipeline(tmp_path)))
    assert result.exit_code == 0, out
    assert "PASSED" in out and "teacher_forced" in out and "static_kv" in out


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"bogus_key": 1}, "bogus_key"),
        ({"passes": [{"static_kv": {"max_cache_len": 64, "nonsense": 3}}]}, "passes[0].static_kv.nonsense"),
        ({"passes": [{"make_it_fast": {}}]}, "make_it_fast"),
        ({"model": "/nonexistent/model.onnx"}, "/nonexistent/model.onnx"),
        ({"checks": ["checker", "no_such_check"]}, "no_such_check"),
        ({"target": "no-such-npu"}, "no-such-npu"),
        ({"verify": {"steps": 100}}, "max_cache_len"),
    ],
)
def test_bad_pipeline_exits_2_naming_the_problem_and_writes_nothing(tmp_path, overrides, needle):
    result, out = _invoke("run", str(_write_pipeline(tmp_path, **overrides)))
    assert result.exit_code == 2, out
    assert needle in out
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_pin_opset_without_exact_lowering_exits_2_naming_op_node_and_opset(tmp_path):
    model = onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 18]>
        g (float[2,3] x, int64[2,3] i, float[2,3] u) => (float[2,3] y) {
            y = ScatterElements <axis = 1, reduction = "max"> (x, i, u) }"""
    )
    model.graph.node[0].name = "scatter_max"
    onnx.save(model, tmp_path / "m.onnx")
    path = _write_pipeline(tmp_path, model=str(tmp_path / "m.onnx"), passes=[{"pin_opset": {"opset": 17}}], verify=None)
    result, out = _invoke("run", str(path))
    assert result.exit_code == 2, out
    assert "ScatterElements" in out and "scatter_max" in out and "lowest reachable opset: 18" in out
    assert not (tmp_path / "out").exists()


def test_failure_after_temporary_write_leaves_no_new_file(tmp_path, monkeypatch):
    import onnxdeploy.pipeline as pipeline
    import onnxdeploy.run_report as run_report

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("pre-existing")

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure after the temporary write")

    monkeypatch.setattr(run_report, "render_markdown", boom)
    with pytest.raises(RuntimeError, match="injected"):
        pipeline.run_pipeline(__import__("onnxdeploy.config").config.load_pipeline(_write_pipeline(tmp_path)))
    assert sorted(p.name for p in out_dir.iterdir()) == ["keep.txt"]


def test_verify_against_corrupted_copy_exits_1_naming_first_divergent_step(tmp_path):
    entry = fixture_entry("llama_gqa_optimum")
    model = onnx.load(entry["model_path"])
    # The weight read by layer 1's MLP down projection (found through its MatMul, names vary by exporter).
    weight = next(n.input[1] for n in model.graph.node if n.op_type == "MatMul" and "layers.1/mlp/down_proj" in n.name)
    target = next(t for t in model.graph.initializer if t.name == weight)
    arr = onnx.numpy_helper.to_array(target) * np.float32(1.05)
    target.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), target.name))
    bad = _save(model, tmp_path / "corrupted.onnx")
    report_path = tmp_path / "verify.json"
    result, out = _invoke("verify", str(entry["model_path"]), str(bad), "--steps", "32", "--report", str(report_path))
    assert result.exit_code == 1, out
    report = json.loads(report_path.read_text())
    assert report["passed"] is False
    step = report["modes"]["teacher_forced"]["first_divergent_step"]
    assert isinstance(step, int) and step >= 0
    assert "first divergent" in out


def test_verify_fixture_against_itself_exits_0():
    path = str(fixture_entry("gpt2_optimum")["model_path"])
    result, out = _invoke("verify", path, path, "--steps", "4")
    assert result.exit_code == 0, out
    assert "PASSED" in out


def test_inspect_prints_symbolic_dims_opsets_ops_and_contract(tmp_path):
    path = fixture_entry("llama_gqa_optimum")["model_path"]
    result, out = _invoke("inspect", str(path))
    assert result.exit_code == 0, out
    for needle in ("past_key_values.0.key", "past_sequence_length", "ai.onnx 18", "MatMul", "contract: none"):
        assert needle in out, needle
    run, run_out = _invoke("run", str(_write_pipeline(tmp_path)))
    assert run.exit_code == 0, run_out
    static, static_out = _invoke("inspect", str(tmp_path / "out" / "model.onnx"), "--json")
    info = json.loads(static.stdout)
    assert info["symbolic_dims"] == []
    assert info["contract"]["max_cache_len"] == 64 and info["contract"]["cache_update"] == "full_buffer"
    assert {i["name"] for i in info["inputs"]} >= {"cache_position", "input_ids", "past_key_values.1.value"}


def test_inspect_missing_file_exits_2(tmp_path):
    result, out = _invoke("inspect", str(tmp_path / "missing.onnx"))
    assert result.exit_code == 2
    assert "missing.onnx" in out


def test_passes_lists_every_pass_with_config_fields():
    result, out = _invoke("passes")
    assert result.exit_code == 0, out
    for needle in ("static_kv", "pin_opset", "max_cache_len", "cache_update", "new_token_only", "opset"):
        assert needle in out, needle
    listed = json.loads(_invoke("passes", "--json")[0].stdout)
    static = next(p for p in listed if p["name"] == "static_kv")
    assert {f["name"] for f in static["config"]} >= {"batch", "step_len", "max_cache_len", "cache_update"}
    assert all(f["description"] for f in static["config"])


def test_overflow_is_refused_naming_max_cache_len(tmp_path):
    # 6 prompt tokens + 34 steps = 40 positions fill max_cache_len 40 exactly; 35 steps is one too many.
    ok = _write_pipeline(
        tmp_path, passes=[{"static_kv": {"max_cache_len": 40}}], verify={"steps": 34, "modes": ["free_running"]}
    )
    result, out = _invoke("run", str(ok))
    assert result.exit_code == 0, out
    shutil.rmtree(tmp_path / "out")
    over = _write_pipeline(
        tmp_path, passes=[{"static_kv": {"max_cache_len": 40}}], verify={"steps": 35, "modes": ["free_running"]}
    )
    result, out = _invoke("run", str(over))
    assert result.exit_code == 2, out
    assert "max_cache_len=40" in out and "40" in out


def test_failed_checks_exit_1_and_still_write_model_and_report(tmp_path):
    # No passes but the static-decoder checks named: the export is still dynamic and has no contract, so they fail.
    checks = ["checker", "static_shapes", "topo_order", "contract"]
    result, out = _invoke("run", str(_write_pipeline(tmp_path, passes=[], checks=checks)), "--json")
    assert result.exit_code == 1, out
    report = json.loads(result.stdout)
    assert report["status"] == "failed"
    codes = {f["code"] for f in report["findings"] if f["level"] == "error"}
    assert "OD401" in codes  # no contract
    assert any(c.startswith("OD20") for c in codes)  # symbolic dims
    assert report["verify"]["passed"] is True
    assert any("OD401" in reason for reason in report["failures"])
    assert (tmp_path / "out" / "model.onnx").is_file()
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["status"] == "failed"


def _run_yaml(tmp_path: Path, text: str, *extra: str):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return _invoke("run", str(path), *extra)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"output_name": "report.json"}, "output_name"),
        ({"output_name": "../escape.onnx"}, "output_name"),
        ({"passes": [{"static_kv": {"max_cache_len": "64"}}]}, "passes[0].static_kv.max_cache_len"),
        ({"passes": [{"static_kv": {"max_cache_len": True}}]}, "passes[0].static_kv.max_cache_len"),
        ({"verify": {"prompt": [1, 512]}}, "vocabulary"),
        ({"verify": {"providers": ["FooExecutionProvider"]}}, "FooExecutionProvider"),
        ({"passes": [{"static_kv": {"max_cache_len": 64, "step_len": 2, "step_lens": [1, 2]}}]}, "step_lens"),
    ],
)
def test_more_bad_input_exits_2(tmp_path, overrides, needle):
    result, out = _invoke("run", str(_write_pipeline(tmp_path, **overrides)))
    assert result.exit_code == 2, out
    assert needle in out
    assert "Traceback" not in out
    assert not (tmp_path / "out").exists()


def test_output_onto_the_input_model_is_refused(tmp_path):
    model = tmp_path / "in" / "model.onnx"
    model.parent.mkdir()
    shutil.copy(fixture_entry("llama_gqa_optimum")["model_path"], model)
    before = _sha(model)
    result, out = _invoke("run", str(_write_pipeline(tmp_path, model=str(model), output_dir=str(model.parent))))
    assert result.exit_code == 2, out
    assert "never overwritten" in out
    assert _sha(model) == before


def test_output_dir_that_is_a_file_exits_2(tmp_path):
    (tmp_path / "out").write_text("a file")
    result, out = _invoke("run", str(_write_pipeline(tmp_path)))
    assert result.exit_code == 2, out
    assert "not a folder" in out


def test_duplicate_key_and_non_yaml_pipeline_exit_2(tmp_path):
    model = fixture_entry("llama_gqa_optimum")["model_path"]
    result, out = _run_yaml(tmp_path, f"model: {model}\nmodel: {model}\n")
    assert result.exit_code == 2 and "duplicate key 'model'" in out, out
    result, out = _invoke("run", str(model))  # the model instead of the pipeline: a likely slip
    assert result.exit_code == 2 and "not a text file" in out, out


def test_json_mode_prints_a_json_error_on_exit_2(tmp_path):
    result, out = _invoke("run", str(_write_pipeline(tmp_path, bogus=1)), "--json")
    assert result.exit_code == 2, out
    payload = json.loads(result.stdout)
    assert payload["status"] == "error" and payload["exit_code"] == 2 and "bogus" in payload["error"]


def test_verify_rejects_bad_thresholds_and_prompts(tmp_path):
    path = str(fixture_entry("gpt2_optimum")["model_path"])
    for args, needle in (
        (["--min-top1-agreement", "2"], "min_top1_agreement"),
        (["--max-abs-logit-diff", "-1"], "max_abs_logit_diff"),
        (["--prompt", "1,-1"], ">= 0"),
        (["--prompt", "1,600"], "vocabulary"),
    ):
        result, out = _invoke("verify", path, path, "--steps", "2", *args)
        assert result.exit_code == 2, (args, out)
        assert needle in out, (args, out)


def test_empty_model_file_exits_2(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    result, out = _invoke("inspect", str(empty))
    assert result.exit_code == 2 and "empty" in out, out
    result, out = _invoke("run", str(_write_pipeline(tmp_path, model=str(empty))))
    assert result.exit_code == 2 and "empty" in out, out


def test_target_opset_out_of_range_exits_1_with_findings(tmp_path):
    path = _write_pipeline(
        tmp_path,
        target="rknn-rk3588",
        passes=[{"static_kv": {"max_cache_len": 64}}, {"pin_opset": {"opset": 21}}],
        verify=None,
    )
    result, out = _invoke("run", str(path), "--json")
    assert result.exit_code == 1, out
    findings = json.loads(result.stdout)["findings"]
    opset = [f for f in findings if f["code"] == "OD501"]
    assert len(opset) == 1 and "pin_opset: {opset: 19}" in opset[0]["hint"], opset
    assert "CHANGELOG.md" in opset[0]["source"] and opset[0]["rule"] == "ai.onnx opset within 12..19"


def test_ort_cpu_target_takes_opset_23_models_the_installed_ort_runs(tmp_path):
    path = _write_pipeline(
        tmp_path,
        target="ort-cpu",
        passes=[{"static_kv": {"max_cache_len": 64}}, {"pin_opset": {"opset": 23}}],
        verify=None,
    )
    result, out = _invoke("run", str(path), "--json")
    assert result.exit_code == 0, out
    report = json.loads(result.stdout)
    assert {"target_opset", "target_ops", "target_tensors"} <= set(report["checks_run"])
    assert not [f for f in report["findings"] if f["check"].startswith("target")], report["findings"]
    model = onnx.load(report["output_model"], load_external_data=False)
    assert model.opset_import[0].version == 23 and model.ir_version >= 10
    import onnxruntime

    onnxruntime.InferenceSession(report["output_model"])  # the installed ORT runs what the matrix accepts


def test_outputs_are_readable_by_others(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        result, out = _invoke("run", str(_write_pipeline(tmp_path)))
    finally:
        os.umask(old)
    assert result.exit_code == 0, out
    for name in ("model.onnx", "report.json", "report.md", "report.html"):
        assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == 0o644, name


def test_model_without_kv_cache_exits_2_saying_what_was_looked_for(tmp_path):
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        lm (int64[B, S] input_ids) => (float[B, S, 4] logits) {
            table = Constant <value = float[3, 4] {0,1,2,3,4,5,6,7,8,9,10,11}> ()
            logits = Gather (table, input_ids)
        }
        """
    )
    path = _save(model, tmp_path / "no_cache.onnx")
    result, out = _invoke("run", str(_write_pipeline(tmp_path, model=str(path))))
    assert result.exit_code == 2, out
    assert "no KV cache found" in out and "Looked for" in out and "Found" in out
    assert not (tmp_path / "out").exists()


def test_verify_report_onto_an_input_is_refused(tmp_path):
    original = tmp_path / "orig.onnx"
    shutil.copy(fixture_entry("gpt2_optimum")["model_path"], original)
    before = _sha(original)
    result, out = _invoke("verify", str(original), str(original), "--steps", "1", "--report", str(original))
    assert result.exit_code == 2, out
    assert "input file" in out
    assert _sha(original) == before


def test_pipeline_file_inside_output_dir_named_like_a_report_is_refused(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    pipeline = _write_pipeline(tmp_path)
    moved = out_dir / "report.json"
    pipeline.rename(moved)
    text = moved.read_text()
    result, out = _invoke("run", str(moved), "--output-dir", str(out_dir))
    assert result.exit_code == 2, out
    assert "input file" in out
    assert moved.read_text() == text


def test_a_second_run_into_a_locked_output_dir_is_refused(tmp_path):
    import fcntl
    import os

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    fd = os.open(out_dir, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        result, out = _invoke("run", str(_write_pipeline(tmp_path)))
    finally:
        os.close(fd)
    assert result.exit_code == 2, out
    assert "another onnxdeploy run" in out
    assert list(out_dir.iterdir()) == []


def test_report_says_which_checks_ran_and_when_verification_was_skipped(tmp_path):
    result, out = _invoke("run", str(_write_pipeline(tmp_path, checks=["checker"], verify=None)), "--json")
    assert result.exit_code == 0, out
    report = json.loads(result.stdout)
    assert report["checks_run"] == ["checker"] and report["verify"] is None
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Checks run: checker" in md and "not** compared" in md


def test_the_phases_account_for_the_whole_run_from_the_process_start(tmp_path):
    """wall_time_s counts from the process's start (imports included) and the phases, render included, sum to it."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(tmp_path / "out"),
        "passes": [{"static_kv": {"max_cache_len": 32}}],
        "verify": {"prompt": [1, 2, 3], "steps": 3},
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    code = "import sys; from onnxdeploy.cli import main; sys.argv = ['onnxdeploy', 'run', sys.argv[1]]; main()"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.yaml")], check=True, capture_output=True)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    names = [p["name"] for p in report["phases"]]
    assert names == ["startup", "load", "passes", "write", "checks", "verify", "report"]
    total = sum(p["wall_time_s"] for p in report["phases"])
    assert report["phases"][0]["wall_time_s"] > 0.1  # the interpreter and the imports happened before the pipeline
    assert abs(total - report["wall_time_s"]) < 0.05, (total, report["wall_time_s"])


def test_a_late_exec_into_the_cli_does_not_count_the_shell_before_it(tmp_path):
    """``bash -c "...; exec onnxdeploy run"`` keeps the shell's PID and start time: its work is not the run's."""
    import shlex  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    cfg = {"model": str(fixture_entry("llama_gqa_optimum")["model_path"]), "output_dir": str(tmp_path / "out")}
    cfg |= {"passes": [{"static_kv": {"max_cache_len": 32}}], "verify": None}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    code = "import sys; from onnxdeploy.cli import main; sys.argv = ['onnxdeploy', 'run', sys.argv[1]]; main()"
    python = shlex.join([sys.executable, "-c", code, str(tmp_path / "p.yaml")])
    subprocess.run(["bash", "-c", f"sleep 4; exec {python}"], check=True, capture_output=True)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["phases"][0]["name"] == "startup" and report["phases"][0]["wall_time_s"] < 3.5, report["phases"]
    assert abs(sum(p["wall_time_s"] for p in report["phases"]) - report["wall_time_s"]) < 0.05
