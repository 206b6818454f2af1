from __future__ import annotations

import numpy as np
import pytest

from onnxdeploy.errors import OnnxDeployError
from onnxdeploy.runner import latency_summary, step_record, summarize_mode


def _record(position: int, reference: list[float], candidate: list[float], tolerance: float = 1e-4):
    return step_record(
        position=position,
        phase="generate",
        token_in=0,
        reference=np.asarray(reference, dtype=np.float32),
        candidate=np.asarray(candidate, dtype=np.float32),
        latency_ms_reference=1.0,
        latency_ms_candidate=2.0,
        max_abs_logit_diff=tolerance,
    )


def test_step_record_metrics() -> None:
    reference = [4.0, 3.0, 2.0, 1.0, 0.0, -1.0, 0.5]
    candidate = [3.0, 4.0, 2.0, 1.0, 0.0, -1.0, 0.5]  # top-1 swapped, same top-5 set
    record = _record(3, reference, candidate)
    assert record.max_abs_logit_diff == pytest.approx(1.0)
    assert record.max_rel_logit_diff == pytest.approx(1 / 3)
    ref, cand = np.asarray(reference), np.asarray(candidate)
    assert record.cosine_similarity == pytest.approx(ref @ cand / np.linalg.norm(ref) / np.linalg.norm(cand))
    assert (record.top1_reference, record.top1_candidate, record.top1_match) == (0, 1, False)
    assert record.topk_overlap == 1.0
    assert not record.within_tolerance


def test_step_record_identical_logits() -> None:
    record = _record(0, [0.0, 1.0, 2.0], [0.0, 1.0, 2.0])
    assert record.max_abs_logit_diff == 0.0 and record.max_rel_logit_diff == 0.0
    assert record.cosine_similarity == pytest.approx(1.0)
    assert record.top1_match and record.within_tolerance and record.topk_overlap == 1.0


def test_step_record_nan_is_never_within_tolerance() -> None:
    assert not _record(0, [0.0, 1.0], [float("nan"), 1.0]).within_tolerance


def test_step_record_refuses_different_vocabularies() -> None:
    with pytest.raises(OnnxDeployError, match="vocabulary"):
        _record(0, [0.0, 1.0], [0.0, 1.0, 2.0])


def test_latency_summary_counts_spikes_over_three_times_the_median() -> None:
    summary = latency_summary([1.0, 1.0, 1.0, 2.0, 3.5])
    assert summary.p50 == 1.0 and summary.max == 3.5 and summary.mean == pytest.approx(1.7)
    assert summary.spikes == 1
    assert summary.p99 == pytest.approx(np.percentile([1.0, 1.0, 1.0, 2.0, 3.5], 99))


def test_summarize_mode_names_thresholds_and_first_divergent_position() -> None:
    steps = [
        _record(0, [0.0, 1.0], [0.0, 1.0]),
        _record(1, [0.0, 1.0], [0.0, 1.001]),  # diff 1e-3: over tolerance, top-1 still agrees
        _record(2, [0.0, 1.0], [1.0, 0.0]),  # top-1 differs
    ]
    result = summarize_mode(
        "teacher_forced",
        steps,
        candidate_latencies_ms=[2.0, 2.0, 2.0],
        reference_latencies_ms=[1.0],
        max_abs_logit_diff=1e-4,
        min_top1_agreement=1.0,
    )
    assert not result.passed
    assert result.first_divergent_step == 1
    assert result.top1_agreement == pytest.approx(2 / 3)
    assert result.max_abs_logit_diff == pytest.approx(1.0)
    assert len(result.failures) == 2
    assert "max_abs_logit_diff=0.0001" in result.failures[0] and "first at position 1" in result.failures[0]
    assert "min_top1_agreement=1" in result.failures[1] and "first at position 2" in result.failures[1]
    assert result.latency_ms.p50 == 2.0 and result.reference_latency_ms.p50 == 1.0


def test_summarize_mode_passes_within_thresholds() -> None:
    steps = [_record(0, [0.0, 1.0], [0.0, 1.0]), _record(1, [0.0, 1.0], [1.0, 0.0], tolerance=2.0)]
    result = summarize_mode(
        "free_running",
        steps,
        candidate_latencies_ms=[1.0],
        reference_latencies_ms=[1.0],
        max_abs_logit_diff=2.0,
        min_top1_agreement=0.5,
    )
    assert result.passed and result.failures == []
    assert result.first_divergent_step == 1  # a top-1 change is a divergence even when allowed
