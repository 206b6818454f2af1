"""``quantize_weights`` on the trained byte-level fixture: accuracy that means something (issue 7, "Done when").

Teacher-forced over 128 positions of the fixture's held-out text (``eval.txt``; 1023 where one top-1 flip
must not decide), against the float export, with the runner's weight-only figures (``runner.accuracy``).
Calibration tokens are another part of the same held-out file (bytes 1024..2047), disjoint from the
positions evaluated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.model_io import load_model, write_for_ort
from onnxdeploy.passes import PassContext
from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig, QuantizeWeightsPass
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner.accuracy import evaluate_accuracy
from tests.conftest import REPO, fixture_entry

ENTRY = fixture_entry("llama_bytes_torchscript")
TEXT = (REPO / ENTRY["eval_text"]).read_bytes()
EVAL = list(TEXT[:129])  # 128 positions with a next token
EVAL_LONG = list(TEXT[:1024])  # where single top-1 flips must not decide (0.1% each)
CALIBRATION = [list(TEXT[1024:2048])]


def _quantized(tmp_path: Path, **config) -> tuple[Path, object]:
    context = PassContext(scratch_dir=tmp_path / "scratch", calibration=CALIBRATION)
    result = QuantizeWeightsPass(QuantizeWeightsConfig(**config))(load_model(ENTRY["model_path"]).model, context)
    return write_for_ort(result.artifacts.primary, tmp_path), result.report


@pytest.mark.parametrize("fmt", ["qdq", "matmulnbits"])
def test_int8_per_channel_keeps_top1_and_perplexity(fmt: str, tmp_path: Path) -> None:
    path, report = _quantized(tmp_path, bits=8, format=fmt)
    assert len(report.details["layers"]) == 4 * 7 + 1  # every projection and the LM head
    accuracy = evaluate_accuracy(ENTRY["model_path"], path, EVAL)
    figures = accuracy.weight_only
    assert figures.positions == 128
    assert figures.top1_agreement >= 0.99, figures
    assert abs(figures.ppl_ratio - 1) <= 0.01, figures
    assert accuracy.default_optimized.top1_agreement >= 0.98  # ORT's int8-activation path, reported beside


def test_int4_group32_symmetric_keeps_90_percent_top1(tmp_path: Path) -> None:
    path, _ = _quantized(tmp_path, bits=4, block_size=32, symmetric=True, format="matmulnbits")
    figures = evaluate_accuracy(ENTRY["model_path"], path, EVAL_LONG).weight_only
    assert figures.top1_agreement >= 0.90, figures
    assert figures.mean_kl > 0  # INT4 is not free: the figures see it


def test_gptq_act_order_beats_the_natural_column_order(tmp_path: Path) -> None:
    natural, natural_report = _quantized(tmp_path / "natural", bits=4, method="gptq", format="matmulnbits")
    ordered, ordered_report = _quantized(
        tmp_path / "ordered", bits=4, method="gptq", act_order=True, format="matmulnbits"
    )
    kl_natural = evaluate_accuracy(ENTRY["model_path"], natural, EVAL_LONG).weight_only.mean_kl
    kl_ordered = evaluate_accuracy(ENTRY["model_path"], ordered, EVAL_LONG).weight_only.mean_kl
    assert kl_ordered < kl_natural, (kl_ordered, kl_natural)
    # The per-layer report: GPTQ removes weight error against RTN in natural order, act-order more of it.
    assert 0 < natural_report.details["weight_error_removed"] < ordered_report.details["weight_error_removed"]
    assert all({"node", "error", "error_rtn_natural", "removed"} <= set(r) for r in ordered_report.details["layers"])
    # The MLP's permutation went into gate/up's output channels; others are a Gather on the activation.
    changes = " ".join(ordered_report.changes)
    assert "into the output channels of" in changes and "by a Gather on the activation" in changes


def test_static_kv_then_quantize_weights_through_the_pipeline(tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.npy"
    np.save(calibration, np.frombuffer(TEXT[1024:1280], dtype=np.uint8).astype(np.int64))
    held_out = tmp_path / "held_out.json"
    held_out.write_text(str(EVAL))
    pipeline = {
        "model": str(ENTRY["model_path"]),
        "output_dir": str(tmp_path / "out"),
        "passes": [
            {"static_kv": {"max_cache_len": 160, "kv_dtype": "float16"}},
            {"quantize_weights": {"bits": 8, "format": "qdq", "act_order": True}},
        ],
        "calibration": {"token_ids_file": "calibration.npy", "max_tokens": 256},
        "verify": {
            "prompt": EVAL[:6],
            "steps": 26,
            "modes": ["teacher_forced"],
            "max_abs_logit_diff": 1.0,
            "min_top1_agreement": 0.95,
            "accuracy": {"token_ids_file": "held_out.json", "max_mean_kl": 0.01, "max_ppl_ratio": 1.02},
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    outcome = run_pipeline(load_pipeline(path))
    report = outcome.report
    assert outcome.exit_code == 0, report.failures
    assert report.contract is not None and report.contract["kv_dtype"] == "float16"
    quantize = report.passes[1]
    assert quantize.name == "quantize_weights" and any("calibration: 256 tokens" in c for c in quantize.changes)
    assert report.accuracy is not None and report.accuracy.passed
    assert report.accuracy.weight_only.positions == 128 and report.accuracy.weight_only.top1_agreement >= 0.97
