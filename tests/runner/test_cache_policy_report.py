"""``verify.accuracy`` on a ``cache_policy`` model: the policy's quality cost in report.json, on the console (during
the run and in the end summary) and in report.md / report.html beside the other accuracy figures.

The trained byte-level fixture's held-out text (``eval.txt``, 4× ``max_cache_len`` bytes) is the accuracy text of a
pipeline run; the usual figures are taken within the cache (where the policy evicts nothing) and
``accuracy.policy_quality`` holds KL(full ‖ policy) and top-1 over the evicting positions, the same figures as the
library call (:func:`onnxdeploy.runner.cache_policy.policy_quality`) on the written model.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from onnxdeploy.config import load_pipeline
from onnxdeploy.console_report import print_run, print_verify
from onnxdeploy.pipeline import RunOutcome, run_pipeline
from onnxdeploy.runner.cache_policy import evaluate_policy_accuracy, policy_quality
from onnxdeploy.runner.verify import verify
from tests.conftest import fixture_entry

NAME = "llama_bytes_torchscript"
M = 32
TEXT = list((Path(fixture_entry(NAME)["model_path"]).parent / "eval.txt").read_bytes()[: 4 * M])
TOKENIZER = Path(fixture_entry(NAME)["model_path"]).parents[1] / "tokenizer.json"  # the byte-level vocabulary
CUT = "original (cut past: sinks 4 + recent 20)"
NOTE = "reference: the original fed the same kept past (sinks 4 + recent 20 past max_cache_len 32), not the full "


def _run(tmp_path: Path, max_tokens: int, steps: int = 10) -> tuple[dict, list[str], RunOutcome]:
    (tmp_path / "held_out.json").write_text(json.dumps(TEXT))
    pipeline = {
        "model": str(fixture_entry(NAME)["model_path"]),
        "output_dir": str(tmp_path / "out"),
        "passes": [
            {"static_kv": {"max_cache_len": M, "cache_policy": {"sinks": 4, "recent": 20}}},
            {"mask_rewrite": {}},
        ],
        "verify": {
            "prompt": TEXT[:6],
            "steps": steps,
            "tokenizer": str(TOKENIZER),
            "modes": ["teacher_forced"],
            "accuracy": {"token_ids_file": "held_out.json", "max_tokens": max_tokens, "max_mean_kl": 1e-6},
        },
    }
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    said: list[str] = []
    outcome = run_pipeline(load_pipeline(tmp_path / "pipeline.yaml"), progress=said.append)
    assert outcome.exit_code == 0, outcome.report.failures
    return json.loads(outcome.report_json.read_text())["accuracy"], said, outcome


def test_the_policy_cost_on_the_accuracy_text_is_a_report_figure(tmp_path: Path) -> None:
    """verify past the cache too: every place showing the reference says it is the cut past, not the full context."""
    accuracy, said, outcome = _run(tmp_path, 4 * M, steps=4 * M - 6)
    assert accuracy["tokens"] == M and accuracy["weight_only"]["positions"] == M - 1  # within the cache
    assert accuracy["weight_only"]["mean_kl"] <= 1e-6 and accuracy["passed"]  # no eviction: the export's figures
    figures = accuracy["policy_quality"]
    want = policy_quality(fixture_entry(NAME)["model_path"], tmp_path / "out" / "model.onnx", TEXT)
    assert figures["sinks"] == 4 and figures["recent"] == 20 and figures["max_cache_len"] == M
    assert figures["tokens"] == 4 * M and figures["evicting_positions"] == 3 * M == want.evicting_positions
    assert figures["mean_kl"] == pytest.approx(want.mean_kl, rel=1e-6) and 0.0 < figures["mean_kl"] < 0.1
    assert figures["top1_agreement"] == want.top1_agreement and 0.8 < figures["top1_agreement"] < 1.0
    line = next(s for s in said if s.startswith("cache_policy sinks 4 + recent 20 past max_cache_len 32: "))
    assert f"over the {3 * M} evicting positions of {4 * M} held-out tokens" in line
    summary = io.StringIO()
    print_run(Console(file=summary, width=400, color_system=None), outcome)
    assert line in summary.getvalue()  # the end summary repeats it, after the accuracy line
    section = json.loads(outcome.report_json.read_text())["verify"]
    assert section["reference"] == {
        "kind": "cut_past",
        "sinks": 4,
        "recent": 20,
        "max_cache_len": M,
        "prompt_per_token": False,
    }
    note = f"{NOTE}context, so these figures leave out what the policy costs; its cost against the full context: see "
    assert f"{note}accuracy.policy_quality" in summary.getvalue() and CUT in summary.getvalue()  # generations column
    kl, top1 = f"{figures['mean_kl']:.4g}", f"{figures['top1_agreement']:.3f}"
    md, html = outcome.report_md.read_text(), outcome.report_html.read_text()
    assert f"| cache_policy vs full context | - | - | {3 * M} | {kl} | - | {top1} |" in md and line in md
    row = f'cache_policy vs full context</td><td class="num">{3 * M}</td><td class="num">{kl}</td>'
    assert row in html and f"{top1}</td>" in html and "policy_quality</code>" in html
    assert f"- **{note}accuracy.policy_quality**" in md and f"| {CUT} | candidate |" in md
    assert f'<p class="warning reference">{note}accuracy.policy_quality</p>' in html and f"<h3>{CUT}</h3>" in html


def test_a_text_within_the_cache_says_the_cost_was_not_measured(tmp_path: Path) -> None:
    accuracy, said, outcome = _run(tmp_path, M)
    figures = accuracy["policy_quality"]
    assert figures["evicting_positions"] == 0 and figures["mean_kl"] is None and figures["top1_agreement"] is None
    assert any("quality not measured: the 32 held-out tokens never pass max_cache_len" in s for s in said)
    md = outcome.report_md.read_text()
    assert "quality not measured" in md and "| cache_policy vs full context |" not in md  # no figures: no row
    section = json.loads(outcome.report_json.read_text())["verify"]  # within the cache: the original's whole past
    assert section["reference"]["kind"] == "full_context" and NOTE not in md and "| original | candidate |" in md
    # `onnxdeploy verify` on the same candidate past its cache: the reference line says the cost is not measured
    model = tmp_path / "out" / "model.onnx"
    result = verify(fixture_entry(NAME)["model_path"], model, prompt=TEXT[:6], steps=2 * M, modes=["teacher_forced"])
    assert result.passed and result.reference.kind == "cut_past"
    out = io.StringIO()
    print_verify(Console(file=out, width=400, color_system=None), result)
    assert f"{NOTE}context" in out.getvalue() and "not measured (verify.accuracy with held-out text" in out.getvalue()


def test_a_candidate_without_a_policy_is_left_to_the_usual_figures() -> None:
    model = fixture_entry(NAME)["model_path"]
    assert evaluate_policy_accuracy(model, model, TEXT) is None
