"""``verify.batching`` in a pipeline file: the trace served on the candidate set, each request checked, refusals.

Real runs (``onnxdeploy run`` in-process, ONNX Runtime) on the ``llama_gqa_optimum`` fixture with a set of
``static_kv {batch: 3, row_positions: true, prefill_batch: 1, step_lens: [1, 4], max_cache_lens: [32, 64]}`` +
``mask_rewrite``: a trace file next to the pipeline passes (exit 0, per-request figures in ``report.json``, one
console line), so does ``examples/llama_gqa_batching.yaml``; a zero tolerance fails the run (exit 1, the request
named); a one-graph set (``static_kv {batch: 3, row_positions: true, step_len: 4}``) is served through its rows; and
what cannot be served is refused before any pass (exit 2, naming the key): no row-positions set, a missing trace
file, a request past ``max_cache_len`` (with the rows' padding slots) or whose padded prefill chunk passes every
prefill graph, two trace forms at once, a bad inline request, a prompt id outside the model's vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from tests.conftest import fixture_entry

STATIC_KV = {"batch": 3, "row_positions": True, "prefill_batch": 1, "step_lens": [1, 4], "max_cache_lens": [32, 64]}
TRACE = """\
seed: 2
requests:
  - {prompt_len: 7, max_new_tokens: 9, arrival: 0}
  - {prompt: [1, 17, 42], max_new_tokens: 6, arrival: 0, stop_token: 511}
  - {prompt_len: 19, max_new_tokens: 4, arrival: 1}
  - {prompt_len: 2, max_new_tokens: 11, arrival: 2}
  - {prompt_len: 11, max_new_tokens: 8, arrival: 3}
"""


def _pipeline(tmp: Path, batching: dict[str, Any], *, static_kv: dict | None = None) -> Path:
    """A pipeline in ``tmp/p`` (the trace file, if any, beside it) on the fixture; a short main verification."""
    folder = tmp / "p"
    folder.mkdir(exist_ok=True)
    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(tmp / "out"),
        "passes": [{"static_kv": static_kv or STATIC_KV}, {"mask_rewrite": {}}],
        "checks": ["checker", "contract"],
        "verify": {"prompt": [1, 17, 42], "steps": 4, "modes": ["teacher_forced"], "batching": batching},
    }
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _run(path: Path, monkeypatch, cwd: Path) -> tuple[int, str]:
    monkeypatch.chdir(cwd)  # the trace is found beside the pipeline file, not in the working directory
    result = CliRunner().invoke(app, ["run", str(path)])
    return result.exit_code, " ".join(((result.stdout or "") + (result.stderr or "")).split())


def test_a_trace_file_is_served_and_each_request_equals_its_batch1_decode(tmp_path: Path, monkeypatch) -> None:
    path = _pipeline(tmp_path, {"trace": "trace.yaml"})
    (path.parent / "trace.yaml").write_text(TRACE)
    code, out = _run(path, monkeypatch, tmp_path)
    assert code == 0, out
    assert "pass static_kv" in out  # the progress line the refusals must not reach
    assert "batching (continuous, B=3, trace trace.yaml): 5/5 requests equal to their batch-1 decode" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    b = report["verify"]["batching"]
    assert b["passed"] and b["batch"] == 3 and b["max_abs_logit_diff_threshold"] == 1e-4
    assert [(r["id"], r["prompt_len"]) for r in b["requests"]] == [(0, 7), (1, 3), (2, 19), (3, 2), (4, 11)]
    assert [r["new_tokens"] for r in b["requests"]] == [9, 6, 4, 11, 8]  # token 511 never produced: no early stop
    for r in b["requests"]:
        assert r["passed"] and r["equal_tokens"] == r["new_tokens"] and r["top1_agreement"] == 1.0, r
        assert r["max_abs_logit_diff"] <= 1e-4
    assert {r["row"] for r in b["requests"]} == {0, 1, 2}  # every row used, one refilled mid-stream
    assert b["decode_steps"] < sum(r["new_tokens"] - 1 for r in b["requests"])  # calls carried several rows
    assert [r["arrival"] for r in b["requests"]] == [0, 0, 1, 2, 3]  # the trace's, beside admitted/finished
    md = (tmp_path / "out" / "report.md").read_text()  # the same figures, a row per request
    assert "## Continuous batching (continuous, B=3, prefill graphs, trace trace.yaml)" in md
    for r in b["requests"]:
        row = (f"| {r['id']} | {r['prompt_len']} | {r['arrival']} | {r['admitted']} | {r['finished']} | {r['row']} | "
               f"{r['equal_tokens']}/{r['new_tokens']} | {r['max_abs_logit_diff']:.3g} | 1.000 | passed |")  # fmt: skip
        assert row in md, row
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<h2>Continuous batching (continuous, B=3, prefill graphs, trace trace.yaml)</h2>" in page
    assert page.count('<table class="batching">') == 1 and page.count('<td class="num">9/9</td>') == 1


def test_a_one_graph_set_is_served_through_its_rows(tmp_path: Path, monkeypatch) -> None:
    one = {"batch": 3, "row_positions": True, "step_len": 4, "max_cache_len": 64}
    path = _pipeline(tmp_path, {"trace": "trace.yaml"}, static_kv=one)
    (path.parent / "trace.yaml").write_text(TRACE)
    code, out = _run(path, monkeypatch, tmp_path)
    assert code == 0, out
    b = json.loads((tmp_path / "out" / "report.json").read_text())["verify"]["batching"]
    assert b["passed"] and b["prefill"] == "rows" and len(b["requests"]) == 5
    assert all(r["equal_tokens"] == r["new_tokens"] and r["max_abs_logit_diff"] <= 1e-4 for r in b["requests"])
    assert (
        "## Continuous batching (continuous, B=3, prefill rows, trace trace.yaml)"
        in (tmp_path / "out" / "report.md").read_text()
    )


def test_the_example_pipeline_passes(tmp_path: Path) -> None:
    example = Path(__file__).parents[2] / "examples" / "llama_gqa_batching.yaml"
    result = CliRunner().invoke(app, ["run", str(example), "--output-dir", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.stdout
    b = json.loads(result.stdout)["verify"]["batching"]
    assert b["passed"] and b["trace"] == "inline" and len(b["requests"]) == 7
    assert all(r["equal_tokens"] == r["new_tokens"] for r in b["requests"])


def test_a_request_off_its_batch1_decode_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    path = _pipeline(
        tmp_path, {"policy": "static", "max_abs_logit_diff": 0.0, "requests": yaml.safe_load(TRACE)["requests"]}
    )
    code, out = _run(path, monkeypatch, tmp_path)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    b = report["verify"]["batching"]
    broken = [r for r in b["requests"] if r["max_abs_logit_diff"] > 0]
    assert broken, "every logit bit-equal: a zero tolerance does not fail here"
    assert code == 1 and not b["passed"] and b["policy"] == "static", out
    for r in broken:
        assert f"verify batching: request {r['id']} " in " ".join(report["failures"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**Failed**: batching (static, B=3" in md and md.count("| **failed** |") == len(broken)
    assert (tmp_path / "out" / "report.html").read_text().count('<tr class="error">') == len(broken)


@pytest.mark.parametrize(
    ("batching", "static_kv", "needles"),
    [
        (
            {"trace": "trace.yaml"},
            {"batch": 3, "step_lens": [1, 4], "max_cache_lens": [32, 64]},
            ["key 'verify.batching'", "row_positions: true", "passes[0].static_kv has row_positions: false"],
        ),
        ({"trace": "missing.yaml"}, None, ["key 'verify.batching.trace': file not found", "p/missing.yaml"]),
        (
            {"requests": [{"prompt_len": 4, "max_new_tokens": 3}, {"prompt_len": 60, "max_new_tokens": 6}]},
            None,
            ["key 'verify.batching': request 1: 60 prompt + 6 new tokens need 65 cache slots", "max_cache_len 64"],
        ),
        (
            {
                "trace": "trace.yaml",
                "poisson": {"count": 3, "prompt_lens": [2, 4], "new_tokens": [2, 3], "mean_gap": 1},
            },
            None,
            ["key 'verify.batching'", "give exactly one of trace (a file), requests (listed) and poisson (drawn)"],
        ),
        (
            {"requests": [{"max_new_tokens": 3}]},
            None,
            ["key 'verify.batching.requests[0]'", "give exactly one of prompt (token ids) and prompt_len"],
        ),
        (
            {"requests": [{"prompt_len": 50, "max_new_tokens": 13}]},  # 62 slots fit, the last call's 65 not
            {"batch": 3, "row_positions": True, "step_len": 4, "max_cache_len": 64},
            ["key 'verify.batching': request 0: 50 prompt + 13 new tokens need 65 cache slots (+ 3 padding slots"],
        ),
        (
            {"requests": [{"prompt_len": 30, "max_new_tokens": 2}]},  # 12 + 12, then 6 padded to 12: slots 24..35
            {**STATIC_KV, "step_lens": [1, 12], "max_cache_lens": [32]},
            ["key 'verify.batching': request 0: a prompt of 30 tokens fits no prefill graph", "(needs 36 slots)"],
        ),
        (
            {"requests": [{"prompt": [1, 99999], "max_new_tokens": 2}]},
            None,
            ["key 'verify.batching': requests[0].prompt: token id 99999 is outside the vocabulary 0.."],
        ),
    ],
    ids=[
        "no_row_positions",
        "missing_trace",
        "past_max_cache_len",
        "two_traces",
        "bad_request",
        "prefill_batch",
        "prefill_padding",
        "vocabulary",
    ],
)
def test_what_cannot_be_served_is_refused_before_any_pass(
    tmp_path: Path, monkeypatch, batching: dict, static_kv: dict | None, needles: list[str]
) -> None:
    path = _pipeline(tmp_path, batching, static_kv=static_kv)
    (path.parent / "trace.yaml").write_text(TRACE)
    code, out = _run(path, monkeypatch, tmp_path)
    assert code == 2, out
    for needle in needles:
        assert needle in out, (needle, out)
    assert "pass static_kv" not in out  # refused before the first pass ran
    assert not (tmp_path / "out").exists()
