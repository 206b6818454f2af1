"""Console behaviour: plain flags, --quiet, verify --json status, verify --report folder, no wrapping off a terminal."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from tests.conftest import fixture_entry

runner = CliRunner()
MODEL = str(fixture_entry("llama_gqa_optimum")["model_path"])


def _pipeline(tmp_path: Path, out: Path) -> Path:
    cfg = {
        "model": MODEL,
        "output_dir": str(out),
        "passes": [{"static_kv": {"max_cache_len": 32}}],
        "verify": {"prompt": [1, 17, 42], "steps": 3},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_boolean_options_are_plain_flags_in_help():
    for command in (["run", "--help"], ["verify", "--help"], ["check", "--help"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        assert "--json" in result.output and "<bool>" not in result.output and "BOOLEAN" not in result.output
    assert "--quiet" in runner.invoke(app, ["run", "--help"]).output


def test_quiet_run_prints_nothing_and_a_long_output_path_stays_on_one_line(tmp_path):
    out = tmp_path / ("a-long-folder-name-that-would-be-wrapped-at-eighty-columns-" * 2) / "out"
    pipeline = _pipeline(tmp_path, out)
    quiet = runner.invoke(app, ["run", str(pipeline), "--quiet"])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stdout == "" and quiet.stderr == ""
    assert (out / "report.html").is_file()
    loud = runner.invoke(app, ["run", str(pipeline), "--no-cache"])
    assert loud.exit_code == 0, loud.output
    assert f"report {out / 'report.html'}" in loud.stdout.splitlines()[-1]  # the whole path, unbroken
    assert "• pass static_kv {max_cache_len: 32}" in loud.stderr  # configs in YAML, not Python dicts


def test_verify_json_carries_status_and_report_refuses_a_missing_folder(tmp_path):
    missing = tmp_path / "no" / "such" / "r.json"
    refused = runner.invoke(app, ["verify", MODEL, MODEL, "--steps", "2", "--report", str(missing)])
    assert refused.exit_code == 2 and "does not exist" in refused.output
    assert not (tmp_path / "no").exists()
    result = runner.invoke(
        app,
        ["verify", MODEL, MODEL, "--steps", "4", "--json", "--max-rows", "3", "--report", str(tmp_path / "r.json")],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["status"] == "passed" and payload["schema_version"] == 3
    assert json.loads((tmp_path / "r.json").read_text()) == payload
    mode = payload["modes"]["teacher_forced"]
    assert len(mode["steps"]) == 3 and sum(b["positions"] for b in mode["steps_omitted"]) == mode["positions"] - 3


def test_passes_listing_prints_defaults_as_yaml():
    result = runner.invoke(app, ["passes"], terminal_width=200)
    assert result.exit_code == 0
    defaults = [row.split("│")[3].strip() for row in result.stdout.splitlines() if row.count("│") == 5]
    assert "null" in defaults and "[]" in defaults and "None" not in defaults


def test_pass_warnings_are_on_the_console_and_counted(tmp_path):
    cfg = {
        "model": MODEL,
        "output_dir": str(tmp_path / "out"),
        "passes": [{"static_kv": {"max_cache_len": 32}}, {"fuse_matmuls": {"exclude": ["no_such_node*"]}}],
        "verify": None,
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["run", str(path), "--no-cache"])
    assert result.exit_code == 0, result.output
    assert "warning: pass fuse_matmuls: exclude pattern 'no_such_node*' matched no node" in result.output
    assert "; passes: 1 warning(s)" in result.output


def test_the_console_shows_accuracy_and_peak_memory_and_report_md_the_removed_files(tmp_path):
    """Accuracy figures with their thresholds and the peak RSS on the console; report.md|html: peak, removed files."""
    import numpy as np  # noqa: PLC0415

    np.save(tmp_path / "held_out.npy", np.arange(3, 3 + 30, dtype=np.int64) * 7 % 500)
    out = tmp_path / "out"
    pipeline = _pipeline(tmp_path, out)
    cfg = yaml.safe_load(pipeline.read_text())
    cfg["cache"] = None
    cfg["output_name"] = "first.onnx"
    pipeline.write_text(yaml.safe_dump(cfg))
    assert runner.invoke(app, ["run", str(pipeline)]).exit_code == 0
    cfg["output_name"] = "model.onnx"
    cfg["verify"]["accuracy"] = {"token_ids_file": "held_out.npy", "max_tokens": 30, "max_mean_kl": 0.01}
    pipeline.write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["run", str(pipeline)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    accuracy = next(line for line in lines if line.startswith("accuracy on 29 held-out positions (ok): weight-only"))
    assert "mean KL " in accuracy and " nats (max 0.01)" in accuracy and "top-1 1.000" in accuracy, accuracy
    assert "ORT default" not in accuracy  # a float candidate: one session, one measurement
    report = json.loads((out / "report.json").read_text())
    peak = max(p["peak_rss_bytes"] for p in report["phases"])
    memory = next(line for line in lines if line.startswith("wall time "))
    assert f"peak memory {peak / 2**20:.1f} MiB RSS (reached in phase " in memory, memory
    md = (out / "report.md").read_text()
    assert f"- peak memory: {peak / 2**20:.1f} MiB RSS (reached in phase " in md
    assert report["removed_files"] == [str(out / "first.onnx")]
    assert f"- removed (an earlier run's outputs this run does not replace): `{out / 'first.onnx'}`" in md
    html = (out / "report.html").read_text()
    assert f"<dt>peak memory</dt><dd>{peak / 2**20:.1f} MiB RSS" in html
    assert f"<dt>removed</dt><dd>{out / 'first.onnx'} (an earlier run" in html
