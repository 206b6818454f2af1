"""report.html's SVG plots: one marker per point, divergent positions and spikes crossed, round ticks, same bytes."""

from __future__ import annotations

import re

from onnxdeploy.plots import error_plot, kl_plot, latency_plot, nice_ticks
from onnxdeploy.report import StepRecord


def _step(position: int, diff: float, ms: float | None, *, match: bool = True) -> StepRecord:
    return StepRecord(
        position=position,
        phase="prompt" if position < 2 else "generate",
        token_in=1,
        top1_reference=2,
        top1_candidate=2 if match else 3,
        top1_match=match,
        topk_overlap=1.0,
        max_abs_logit_diff=diff,
        max_rel_logit_diff=0.0,
        cosine_similarity=1.0,
        within_tolerance=match,
        latency_ms_candidate=ms,
        latency_ms_reference=ms,
    )


def _markers(svg: str, group: str) -> int:
    """``<use>`` elements inside the group ``group`` (its own nested groups included)."""
    start = svg.index(f'<g id="{group}">')
    depth, count = 0, 0
    for tag in re.finditer(r"<(/?)(g|use)\b[^>]*?(/?)>", svg[start:]):
        closing, name, empty = tag.groups()
        if name == "use":
            count += 1
        elif closing:
            depth -= 1
            if depth == 0:
                return count
        elif not empty:
            depth += 1
    raise AssertionError(f"group {group} is not closed")


def test_error_plot_has_a_marker_per_position_and_crosses_each_divergent_one():
    steps = [_step(p, 0.0 if p == 3 else 1e-6 * (p + 1), 1.0, match=p != 7) for p in range(40)]
    svg = error_plot(steps, threshold=1e-4, title="t <graph>", plot_id="e0", first_divergent=7)
    assert _markers(svg, "e0-points") == 40
    assert _markers(svg, "e0-divergent") == 1
    assert "t &lt;graph&gt;" in svg and "tolerance 0.0001" in svg
    assert error_plot(steps, threshold=1e-4, title="t <graph>", plot_id="e0", first_divergent=7) == svg


def test_latency_plot_counts_spikes_on_generated_steps_and_draws_prefill_calls():
    steps = [_step(p, 0.0, 50.0 if p in (1, 6, 8) else 1.0) for p in range(10)]
    svg = latency_plot(steps, spike_ms=3.0, title="t", plot_id="l0")
    assert _markers(svg, "l0-points") == 10 and _markers(svg, "l0-spikes") == 2 and "2 spike(s)" in svg
    assert 'id="l0-reference"' in svg
    empty = latency_plot([_step(0, 0.0, None)], spike_ms=3.0, title="t", plot_id="l1")
    assert "no timed call" in empty


def test_kl_plot_has_a_group_per_series():
    svg = kl_plot({"weight_only": [0.0, 1e-3, 2e-3], "default_optimized": [1e-4, 1e-4]}, title="kl", plot_id="kl")
    assert _markers(svg, "kl-points") == 3 and _markers(svg, "kl-points-1") == 2


def test_nice_ticks_are_round_and_inside_the_range():
    assert nice_ticks(-120.0, 3119.0, integer=True) == [0, 1000, 2000, 3000]
    assert nice_ticks(-0.4, 9.4, integer=True) == [0, 2, 4, 6, 8]
    assert nice_ticks(0.0, 2.3) == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert nice_ticks(0.0, 0.0) == [0.0]
    assert nice_ticks(1.0, 0.0) == []
