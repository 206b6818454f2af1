"""Per-position logit comparison and per-mode summaries (docs/ARCHITECTURE.md, "Runner").

All logit metrics compare one position's vocabulary row of the candidate against the reference
(the original model); latencies are per ``session.run`` call, in ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from onnxdeploy.errors import OnnxDeployError
from onnxdeploy.report import LatencySummary, ModeResult, PrefillSummary, StepRecord

__all__ = ["REL_EPS", "SPIKE_FACTOR", "TOP_K", "latency_summary", "step_record", "summarize_mode"]

TOP_K = 5
"""k of the top-k overlap."""

REL_EPS = 1e-6
"""Floor of ``|reference|`` in the relative difference ``|a - b| / max(|a|, eps)``."""

SPIKE_FACTOR = 3.0
"""A call slower than this multiple of the median call is a latency spike."""


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    # Stable sort so ties resolve to the lower token id, like np.argmax.
    return np.argsort(-logits, kind="stable")[:k]


def step_record(
    *,
    position: int,
    phase: Literal["prompt", "generate"],
    token_in: int,
    reference: np.ndarray,
    candidate: np.ndarray,
    latency_ms_reference: float | None,
    latency_ms_candidate: float | None,
    max_abs_logit_diff: float,
    graph: str | None = None,
) -> StepRecord:
    """Compare the reference and candidate logits at one position.

    Args:
        position: 0-based absolute token position.
        phase: ``prompt`` for prompt positions, ``generate`` for generated ones.
        token_in: token fed to the candidate at this position.
        reference: float32 ``(V,)`` logits of the original model.
        candidate: float32 ``(V,)`` logits of the candidate.
        latency_ms_reference: wall time of the reference ``session.run`` that fed this position alone (ms), or
            None (a multi-token call fed it).
        latency_ms_candidate: the same for the candidate.
        max_abs_logit_diff: the tolerance deciding ``within_tolerance``.
        graph: file name of the candidate graph that computed this position.

    Returns:
        The record: max abs diff, max relative diff ``max(|a - b| / max(|a|, REL_EPS))``, cosine
        similarity (float64 accumulation), top-1 of each, top-5 overlap fraction. A NaN diff is
        never within tolerance.

    Raises:
        OnnxDeployError: the two logit rows have different vocabulary sizes.
    """
    if reference.shape != candidate.shape:
        raise OnnxDeployError(
            f"position {position}: reference logits {reference.shape} and candidate logits "
            f"{candidate.shape} differ in shape; the models do not share a vocabulary"
        )
    ref = reference.astype(np.float64)
    cand = candidate.astype(np.float64)
    diff = np.abs(ref - cand)
    max_abs = float(diff.max())
    max_rel = float((diff / np.maximum(np.abs(ref), REL_EPS)).max())
    norms = float(np.linalg.norm(ref) * np.linalg.norm(cand))
    if norms > 0:
        cosine = float(np.dot(ref, cand) / norms)
    else:
        cosine = 1.0 if not ref.any() and not cand.any() else 0.0
    top1_ref = int(np.argmax(reference))
    top1_cand = int(np.argmax(candidate))
    k = min(TOP_K, reference.shape[0])
    overlap = len(set(_top_k(reference, k).tolist()) & set(_top_k(candidate, k).tolist())) / k
    return StepRecord(
        position=position,
        phase=phase,
        token_in=token_in,
        top1_reference=top1_ref,
        top1_candidate=top1_cand,
        top1_match=top1_ref == top1_cand,
        topk_overlap=overlap,
        max_abs_logit_diff=max_abs,
        max_rel_logit_diff=max_rel,
        cosine_similarity=cosine,
        within_tolerance=bool(max_abs <= max_abs_logit_diff),
        latency_ms_reference=latency_ms_reference,
        latency_ms_candidate=latency_ms_candidate,
        graph=graph,
    )


def latency_summary(latencies_ms: Sequence[float]) -> LatencySummary:
    """Summarize per-call latencies.

    Args:
        latencies_ms: wall time of each ``session.run`` call (ms).

    Returns:
        The number of calls; p50, p99 (linear interpolation), max, mean, min, standard deviation and the
        interquartile range in ms; and ``spikes`` = calls slower than ``SPIKE_FACTOR`` x the median. All zero
        for no calls.
    """
    if not latencies_ms:
        return LatencySummary(p50=0.0, p99=0.0, max=0.0, mean=0.0, spikes=0)
    values = np.asarray(latencies_ms, dtype=np.float64)
    median = float(np.median(values))
    p25, p75 = np.percentile(values, [25, 75])
    return LatencySummary(
        calls=len(values),
        p50=median,
        p99=float(np.percentile(values, 99)),
        max=float(values.max()),
        mean=float(values.mean()),
        min=float(values.min()),
        std=float(values.std()),
        iqr=float(p75 - p25),
        spikes=int((values > SPIKE_FACTOR * median).sum()),
    )


def summarize_mode(
    mode: Literal["teacher_forced", "free_running"],
    steps: list[StepRecord],
    *,
    candidate_latencies_ms: Sequence[float],
    reference_latencies_ms: Sequence[float],
    max_abs_logit_diff: float,
    min_top1_agreement: float,
    prefill: PrefillSummary | None = None,
    reference_prefill: PrefillSummary | None = None,
) -> ModeResult:
    """Summarize one mode's step records against the thresholds.

    Args:
        mode: the decode mode.
        steps: one record per position, in position order (at least one).
        candidate_latencies_ms: the candidate's per-step latencies (single-token calls, ms).
        reference_latencies_ms: the reference's per-step latencies (ms).
        max_abs_logit_diff: the largest max-abs logit difference allowed at any position.
        min_top1_agreement: the smallest fraction of positions whose top-1 must agree.
        prefill: the candidate's prompt calls, reported apart.
        reference_prefill: the reference's prompt calls.

    Returns:
        The mode result. ``first_divergent_step`` is the first position whose top-1 differs or whose
        diff breaks the tolerance; ``passed`` requires every position within the tolerance and the
        agreement at least ``min_top1_agreement``; ``failures`` name each threshold and value.
    """
    agreement = sum(s.top1_match for s in steps) / len(steps)
    worst = float(np.max([s.max_abs_logit_diff for s in steps]))
    divergent = [s.position for s in steps if not (s.top1_match and s.within_tolerance)]
    failures: list[str] = []
    off = [s.position for s in steps if not s.within_tolerance]
    if off:
        failures.append(
            f"{mode}: max abs logit diff {worst:.3g} exceeds max_abs_logit_diff={max_abs_logit_diff:g} "
            f"at {len(off)} of {len(steps)} positions (first at position {off[0]})"
        )
    if agreement < min_top1_agreement:
        mismatched = [s.position for s in steps if not s.top1_match]
        failures.append(
            f"{mode}: top-1 agreement {agreement:.4f} is below min_top1_agreement={min_top1_agreement:g} "
            f"({len(mismatched)} of {len(steps)} positions differ, first at position {mismatched[0]})"
        )
    return ModeResult(
        mode=mode,
        passed=not failures,
        positions=len(steps),
        top1_agreement=agreement,
        max_abs_logit_diff=worst,
        mean_cosine_similarity=float(np.mean([s.cosine_similarity for s in steps])),
        first_divergent_step=divergent[0] if divergent else None,
        latency_ms=latency_summary(candidate_latencies_ms),
        reference_latency_ms=latency_summary(reference_latencies_ms),
        prefill=prefill,
        reference_prefill=reference_prefill,
        positions_by_graph={
            graph: sum(1 for s in steps if s.graph == graph) for graph in dict.fromkeys(s.graph for s in steps) if graph
        },
        failures=failures,
        steps=steps,
    )
