"""An output folder never mixes runs: a run removes what an earlier run wrote there that its own output does not
replace (known from that run's report.json), reports it, and never touches a user's other files (issue 16)."""

from __future__ import annotations

import json

import onnx
import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.errors import OutputError
from onnxdeploy.pipeline import run_pipeline
from tests.conftest import fixture_entry


def _run(tmp_path, out, static_kv: dict, name: str):
    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(out),
        "passes": [{"static_kv": static_kv}, {"externalize": {}}],
        "verify": None,
    }
    (tmp_path / name).write_text(yaml.safe_dump(cfg))
    messages: list[str] = []
    outcome = run_pipeline(load_pipeline(tmp_path / name), progress=messages.append)
    assert outcome.exit_code == 0, outcome.report.failures
    return outcome, messages


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A graph-set run, then a single-graph run into the same output_dir (with a user's own files beside)."""
    tmp = tmp_path_factory.mktemp("stale")
    out = tmp / "out"
    _run(tmp, out, {"batch": 1, "step_lens": [1, 4], "max_cache_lens": [16, 32]}, "set.yaml")
    first = sorted(p.name for p in out.iterdir())
    (out / "notes.txt").write_text("mine")
    onnx.save(onnx.load(str(fixture_entry("llama_gqa_optimum")["model_path"])), str(out / "mine.onnx"))
    outcome, messages = _run(tmp, out, {"batch": 1, "max_cache_len": 16}, "single.yaml")
    return out, first, outcome, messages


def test_a_single_graph_run_after_a_graph_set_leaves_no_member_of_the_set(two_runs):
    out, first, outcome, messages = two_runs
    members = [n for n in first if n.startswith("model.s")]
    assert "model.s1.c16.onnx" in members and len(members) == 3, first
    left = sorted(p.name for p in out.iterdir())
    assert [n for n in left if n.startswith("model.s")] == [], left
    report = json.loads((out / "report.json").read_text())
    assert sorted(report["removed_files"]) == sorted(str(out / n) for n in members)
    assert any(m.startswith("removed model.s1.c16.onnx") for m in messages), messages
    # what is left is this run's output and the user's files, and every graph reads only this run's data file
    assert {"model.onnx", "model.onnx.data", "notes.txt", "mine.onnx"} <= set(left)
    listed = {f["path"] for f in report["files"] if f["role"] == "output"}
    assert listed == {str(out / "model.onnx"), str(out / "model.onnx.data")}
    assert (out / "notes.txt").read_text() == "mine"


def test_an_earlier_output_changed_since_its_run_is_refused_before_any_pass(two_runs, tmp_path):
    out, _, _, _ = two_runs
    # the single-graph run's report lists model.onnx; the next run with another output_name would leave it behind
    (out / "model.onnx").write_bytes((out / "model.onnx").read_bytes() + b"\0")
    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(out),
        "output_name": "other.onnx",
        "passes": [{"static_kv": {"batch": 1, "max_cache_len": 16}}],
        "verify": None,
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(OutputError, match=r"model\.onnx changed since the onnxdeploy run recorded in .*report\.json"):
        run_pipeline(load_pipeline(tmp_path / "p.yaml"))
    assert (out / "model.onnx").exists() and not (out / "other.onnx").exists()


def test_a_data_file_in_a_folder_no_run_wrote_is_never_removed(tmp_path):
    """No report.json: the folder's ``model.onnx.data`` may be the user's, even beside a self-contained output."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx.data").write_bytes(b"mine!")
    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(out),
        "passes": [{"static_kv": {"batch": 1, "max_cache_len": 16}}],
        "verify": None,
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    outcome = run_pipeline(load_pipeline(tmp_path / "p.yaml"))
    assert outcome.exit_code == 0 and outcome.report.removed_files == []
    assert (out / "model.onnx.data").read_bytes() == b"mine!"


def test_a_report_json_that_is_not_onnxdeploys_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{not json")
    cfg = {"model": str(fixture_entry("llama_gqa_optimum")["model_path"]), "output_dir": str(out), "verify": None}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(OutputError, match="not a readable onnxdeploy run report"):
        run_pipeline(load_pipeline(tmp_path / "p.yaml"))
