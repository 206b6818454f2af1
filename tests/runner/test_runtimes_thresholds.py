"""Thresholds for reduced precision (issue 19): relative bound, mean cosine, top-1; per runtime and per graph."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdeploy.config import load_pipeline
from onnxdeploy.errors import ConfigError
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner.thresholds import (
    FP16_DEFAULTS,
    LogitThresholds,
    default_thresholds,
    judge_positions,
    relative_logit_diff,
    runtime_thresholds,
)
from tests.conftest import fixture_entry


def _rows(noise: float, graphs=("a.onnx", "b.onnx"), positions: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(positions):
        ref = rng.standard_normal(64).astype(np.float32) * 4
        ref[p % 64] += 20  # a clear top-1
        rows.append((p, graphs[p % len(graphs)], ref, ref + noise * rng.standard_normal(64).astype(np.float32)))
    return rows


def test_relative_difference_is_against_the_largest_reference_logit():
    ref = np.array([10.0, -2.0, 0.0], dtype=np.float32)
    assert relative_logit_diff(ref, ref + np.array([0.0, 0.0, 0.5], dtype=np.float32)) == pytest.approx(0.05)
    assert relative_logit_diff(np.zeros(3), np.zeros(3)) == 0.0


def test_fp16_defaults_pass_an_fp16_sized_error_that_the_fp32_tolerance_fails():
    """0.04 of noise (the simulator's size of error) with top-1 kept: fp16 passes, max_abs 1e-4 does not."""
    rows = _rows(0.01)
    fp16 = judge_positions(rows, FP16_DEFAULTS)
    assert fp16.passed and fp16.overall.top1_agreement == 1.0 and fp16.overall.mean_cosine_similarity > 0.9999
    fp32 = judge_positions(rows, LogitThresholds(max_abs_logit_diff=1e-4), label="rknn-sim")
    assert not fp32.passed and fp32.failures[0].startswith("rknn-sim: max abs logit diff")
    assert fp32.overall.first_divergent_position == 0


def test_each_graph_of_a_set_is_judged_on_its_own_positions():
    rows = _rows(0.0)
    p, g, ref, _ = rows[3]  # b.onnx: one position far off
    rows[3] = (p, g, ref, -ref)
    judged = judge_positions(rows, FP16_DEFAULTS)
    assert set(judged.by_graph) == {"a.onnx", "b.onnx"} and judged.by_graph["a.onnx"].mean_cosine_similarity == 1.0
    assert any(line.startswith("graph b.onnx (4 positions): mean cosine") for line in judged.failures)
    assert not any("graph a.onnx" in line for line in judged.failures)


def test_defaults_by_precision_and_an_entry_on_top():
    fp32 = LogitThresholds(max_abs_logit_diff=1e-4, min_top1_agreement=1.0)
    assert default_thresholds("fp32", fp32).max_abs_logit_diff == 1e-4
    fp16 = default_thresholds("fp16", fp32)
    assert (fp16.max_abs_logit_diff, fp16.min_cosine_similarity, fp16.min_top1_agreement) == (None, 0.9999, 0.99)
    int8 = default_thresholds("int8", fp32)
    assert (int8.max_abs_logit_diff, int8.min_cosine_similarity, int8.min_top1_agreement) == (None, None, None)
    mixed = runtime_thresholds("fp16", fp32, {"max_abs_logit_diff": 0.05, "min_cosine_similarity": None})
    assert (mixed.max_abs_logit_diff, mixed.min_cosine_similarity, mixed.basis) == (
        0.05,
        0.9999,
        "fp16 defaults + configured",
    )
    with pytest.raises(ConfigError, match="min_cosine_similarity must be within"):
        LogitThresholds(min_cosine_similarity=1.5)


def _pipeline(tmp_path, verify: str):
    path = tmp_path / "p.yaml"
    path.write_text(
        f"model: {fixture_entry('llama_gqa_optimum')['model_path']}\noutput_dir: {tmp_path / 'out'}\n"
        "passes:\n  - static_kv: {step_lens: [1, 4], max_cache_len: 32, kv_dtype: float16}\n"
        f"verify: {verify}\n"
    )
    return load_pipeline(path)


def test_an_fp16_cache_is_judged_fairly_by_cosine_and_top1(tmp_path):
    """ORT on an fp16 KV cache (the issue's 0.014 on the trained fixture): mean cosine >= 0.9999 with top-1 passes it;
    a relative bound it breaks fails the mode and names each graph of the set."""
    loose = run_pipeline(_pipeline(tmp_path, "{steps: 6, max_abs_logit_diff: 1.0, min_cosine_similarity: 0.9999}"))
    assert loose.exit_code == 0, loose.report.failures
    mode = loose.report.verify.modes["teacher_forced"]
    assert mode.max_abs_logit_diff > 0 and mode.mean_cosine_similarity >= 0.9999
    strict = run_pipeline(_pipeline(tmp_path, "{steps: 6, max_abs_logit_diff: 1.0, max_rel_logit_diff: 1.0e-9}"))
    assert strict.exit_code == 1
    lines = [f for f in strict.report.failures if "max_rel_logit_diff=1e-09" in f]
    assert any(line.startswith("verify teacher_forced: max rel logit diff") for line in lines), strict.report.failures
    assert any("graph model.s4.c32.onnx" in line for line in lines), lines


def test_runtime_entries_take_the_new_bounds_and_refuse_bad_ones(tmp_path, monkeypatch):
    from onnxdeploy.runner import runtimes

    monkeypatch.setattr(runtimes, "installed_runtimes", lambda: ["onnxruntime", "openvino", "rknn-sim"])
    cfg = _pipeline(
        tmp_path,
        "{steps: 4, runtimes: [onnxruntime, {name: rknn-sim, min_cosine_similarity: 0.999, max_rel_logit_diff: 0.01}]}",
    )
    (spec,) = [s for s in cfg.verify.runtimes if s.name == "rknn-sim"]
    assert spec.bounds() == {
        "max_abs_logit_diff": None,
        "max_rel_logit_diff": 0.01,
        "min_cosine_similarity": 0.999,
        "min_top1_agreement": None,
    }
    with pytest.raises(ConfigError, match=r"verify\.runtimes\[1\]\.min_cosine_similarity"):
        _pipeline(tmp_path, "{steps: 4, runtimes: [onnxruntime, {name: rknn-sim, min_cosine_similarity: 2.0}]}")
    with pytest.raises(ConfigError, match=r"verify.min_cosine_similarity"):
        _pipeline(tmp_path, "{steps: 4, min_cosine_similarity: -3}")
