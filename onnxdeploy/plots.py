"""Static SVG plots for ``report.html``: logit error and latency against position, KL per position.

Each plot is an inline ``<svg>`` element (no script, no network) written directly as text: axes with ticks and
a grid, a title, axis labels, a legend row under the title (it never covers a point), and the data. Each plot's
data series is a group ``{plot_id}-points`` holding the series' line (one ``<path>``) and one ``<use>`` of the
plot's marker symbol per point, so a reader — or a test — can count the points: one per position plotted.
Divergent positions and latency spikes are crossed in groups ``{plot_id}-divergent`` / ``{plot_id}-spikes``,
the original's latency is ``{plot_id}-reference``. Every id is prefixed with ``plot_id``, so several plots
share one HTML document without id clashes, and the same data gives the same bytes.

Why not matplotlib (which drew these until issue 20): a figure costs it ≥ 0.17 s however little it holds (text
layout, tick and mathtext machinery) and ~0.6 s with 3,000 markers; a report plots two figures per graph and
mode, so a 3,000-step report took 2.4 s to render. Built as text with one join per series, the same plots take
a few milliseconds each (``benchmarks/render.py``).

Geometry is in points (1/72 in) like the earlier 5.4 × 2.5 in figures: 389 × 180 units, 8-unit text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

from onnxdeploy.report import CallTiming, StepRecord

__all__ = ["error_plot", "kl_plot", "latency_plot", "nice_ticks"]

_W, _H = 389.0, 180.0
"""The SVG's size in its own units (points)."""
_LEFT, _RIGHT, _TOP, _BOTTOM = 50.0, 8.0, 32.0, 30.0
"""Margins around the axes: tick labels and the y label (left), the x label (bottom), title and legend (top)."""
_PAD = 0.04
"""Fraction of each axis' span left empty at both ends, so markers at the extremes stay inside the axes."""
_CANDIDATE = "#1f5fa8"
_REFERENCE = "#9a9a9a"
_BAD = "#c62828"
_SERIES = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def nice_ticks(lo: float, hi: float, *, count: int = 6, integer: bool = False) -> list[float]:
    """Round tick values (steps of 1, 2, 2.5 or 5 × 10^k) inside ``[lo, hi]``, about ``count`` of them.

    Args:
        lo: the axis' lower end (data units).
        hi: its upper end (>= ``lo``).
        count: the number of intervals wanted (the result has up to about ``count + 1`` ticks).
        integer: ticks on whole numbers only (positions).

    Returns:
        Ascending tick values; empty when ``hi < lo`` or either end is not finite.
    """
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        return []
    raw = (hi - lo) / max(count, 1) or 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1.0, float(round(step)))
    first = math.ceil(lo / step - 1e-9)
    ticks = []
    i = first
    while i * step <= hi + step * 1e-9:
        ticks.append(round(i * step, 12))
        i += 1
    return ticks


def _tick_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass
class _Axis:
    """One axis: the data range drawn, linear or log10, and its ticks with their labels."""

    lo: float
    hi: float
    log: bool = False
    ticks: list[tuple[float, str]] = field(default_factory=list)

    def frac(self, value: float) -> float:
        """Where ``value`` falls between the ends, 0..1 (log axes in log10 space)."""
        if self.log:
            value, lo, hi = math.log10(value), math.log10(self.lo), math.log10(self.hi)
        else:
            lo, hi = self.lo, self.hi
        return (value - lo) / ((hi - lo) or 1.0)


def _linear_axis(values: Sequence[float], *, integer: bool = False, zero: bool = False, top: float = 1.0) -> _Axis:
    """A linear axis over ``values`` (padded by :data:`_PAD`; from 0 to ``max × top`` with ``zero``)."""
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if zero:
        lo, hi = 0.0, (hi * top if hi > 0 else 1.0)
    else:
        span = (hi - lo) or 1.0
        lo, hi = lo - _PAD * span, hi + _PAD * span
    ticks = nice_ticks(lo, hi, integer=integer)
    return _Axis(lo, hi, ticks=[(t, _tick_text(t)) for t in ticks])


def _log_axis(values: Sequence[float]) -> _Axis:
    """A log10 axis over positive ``values``, widened to whole decades, labelled at decades (at most ~7 labels)."""
    lo_exp = math.floor(math.log10(min(values)))
    hi_exp = math.ceil(math.log10(max(values)))
    if hi_exp == lo_exp:
        hi_exp += 1
    stride = max(1, math.ceil((hi_exp - lo_exp) / 6))
    pad = _PAD * (hi_exp - lo_exp)
    ticks = [(10.0**e, "10" + str(e).translate(_SUPERSCRIPT)) for e in range(lo_exp, hi_exp + 1, stride)]
    return _Axis(10 ** (lo_exp - pad), 10 ** (hi_exp + pad), log=True, ticks=ticks)


@dataclass
class _Legend:
    label: str
    color: str
    line: str | None = None  # a stroke-dasharray, "" for a solid line, None for no line
    marker: str | None = None  # a marker kind of _MARKERS


_MARKERS = {
    "o": lambda r: f'<circle r="{r:g}"/>',
    "s": lambda r: f'<rect x="{-r:g}" y="{-r:g}" width="{2 * r:g}" height="{2 * r:g}"/>',
    "x": lambda r: f'<path d="M{-r:g},{-r:g}L{r:g},{r:g}M{-r:g},{r:g}L{r:g},{-r:g}" fill="none"/>',
}
"""Marker symbols by kind (a circle, a square, a cross), ``r`` the half width in points."""


class _Plot:
    """One plot being written: its frame (title, axes, grid, labels) and its series as SVG text."""

    def __init__(self, plot_id: str, title: str, xlabel: str, ylabel: str, x: _Axis, y: _Axis) -> None:
        self.id, self.x, self.y = plot_id, x, y
        self.x0, self.x1, self.y0, self.y1 = _LEFT, _W - _RIGHT, _H - _BOTTOM, _TOP
        self.defs: list[str] = []
        self.body: list[str] = []
        self.legend: list[_Legend] = []
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel

    def px(self, value: float) -> float:
        return self.x0 + self.x.frac(value) * (self.x1 - self.x0)

    def py(self, value: float) -> float:
        return self.y0 - self.y.frac(value) * (self.y0 - self.y1)

    def symbol(self, kind: str, r: float) -> str:
        """Define marker ``kind`` of half width ``r`` once; return its id."""
        sid = f"{self.id}-m{kind}{r:g}".replace(".", "_")
        markup = f'<g id="{sid}">{_MARKERS[kind](r)}</g>'
        if markup not in self.defs:
            self.defs.append(markup)
        return sid

    def series(
        self,
        points: Sequence[tuple[float, float]],
        *,
        gid: str,
        color: str,
        label: str,
        width: float = 0.8,
        marker: str | None = "o",
        r: float = 1.25,
    ) -> None:
        """A group ``{plot_id}-{gid}``: the line through ``points`` (``width`` 0: none) and one marker per point."""
        xy = [(self.px(a), self.py(b)) for a, b in points]
        parts = [f'<g id="{self.id}-{gid}">']
        if width and xy:
            d = "M" + "L".join(f"{a:.2f},{b:.2f}" for a, b in xy)
            parts.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{width:g}"/>')
        if marker is not None:
            href = self.symbol(marker, r)
            stroke = 'stroke-width="1"' if marker == "x" else 'stroke="none"'
            parts.append(f'<g fill="{color}" stroke="{color}" {stroke}>')
            parts.append("".join(f'<use href="#{href}" x="{a:.2f}" y="{b:.2f}"/>' for a, b in xy))
            parts.append("</g>")
        parts.append("</g>")
        self.body.append("".join(parts))
        self.legend.append(_Legend(label, color, "" if width else None, marker))

    def hline(self, value: float, *, color: str, dash: str, label: str | None = None) -> None:
        y = self.py(value)
        self.body.append(
            f'<path d="M{self.x0:.2f},{y:.2f}H{self.x1:.2f}" stroke="{color}" stroke-width="0.8" '
            f'stroke-dasharray="{dash}"/>'
        )
        if label is not None:
            self.legend.append(_Legend(label, color, dash))

    def vline(self, value: float, *, color: str, dash: str) -> None:
        x = self.px(value)
        self.body.append(
            f'<path d="M{x:.2f},{self.y0:.2f}V{self.y1:.2f}" stroke="{color}" stroke-width="0.8" '
            f'stroke-dasharray="{dash}"/>'
        )

    def note(self, text: str) -> None:
        """A line of text in the middle of the axes (e.g. nothing to draw)."""
        cx, cy = (self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2
        self.body.append(f'<text x="{cx:.2f}" y="{cy:.2f}" text-anchor="middle">{escape(text)}</text>')

    def _frame(self) -> list[str]:
        width, height = self.x1 - self.x0, self.y0 - self.y1
        out = [f'<rect x="{self.x0}" y="{self.y1}" width="{width:g}" height="{height:g}" fill="#fff"/>']
        grid, labels = [], []
        for value, text in self.x.ticks:
            x = self.px(value)
            grid.append(f"M{x:.2f},{self.y0:.2f}V{self.y1:.2f}")
            labels.append(f'<text x="{x:.2f}" y="{self.y0 + 10:.2f}" text-anchor="middle">{text}</text>')
        for value, text in self.y.ticks:
            y = self.py(value)
            grid.append(f"M{self.x0:.2f},{y:.2f}H{self.x1:.2f}")
            labels.append(f'<text x="{self.x0 - 4:.2f}" y="{y + 2.8:.2f}" text-anchor="end">{text}</text>')
        out.append(f'<path d="{"".join(grid)}" stroke="#b0b0b0" stroke-opacity="0.35" stroke-width="0.8"/>')
        axes = f"M{self.x0},{self.y1}V{self.y0}H{self.x1}"
        out.append(f'<path d="{axes}" fill="none" stroke="#000" stroke-width="0.8"/>')
        out += labels
        mid_x, mid_y = (self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2
        out.append(f'<text x="{mid_x:.2f}" y="{_H - 6:.2f}" text-anchor="middle">{escape(self.xlabel)}</text>')
        out.append(
            f'<text transform="translate(16,{mid_y:.2f}) rotate(-90)" text-anchor="middle">{escape(self.ylabel)}</text>'
        )
        out.append(f'<text x="{self.x0}" y="11" font-size="9">{escape(self.title)}</text>')
        return out

    def _legend(self) -> list[str]:
        out, x, y = [], self.x0, 24.0
        for entry in self.legend:
            if entry.line is not None:
                dash = f' stroke-dasharray="{entry.line}"' if entry.line else ""
                out.append(f'<path d="M{x:.2f},{y - 2.5:.2f}h14" stroke="{entry.color}" stroke-width="0.8"{dash}/>')
            if entry.marker is not None:
                stroke = 'stroke-width="1"' if entry.marker == "x" else 'stroke="none"'
                out.append(
                    f'<use href="#{self.symbol(entry.marker, 2)}" x="{x + 7:.2f}" y="{y - 2.5:.2f}" '
                    f'fill="{entry.color}" stroke="{entry.color}" {stroke}/>'
                )
            out.append(f'<text x="{x + 17:.2f}" y="{y:.2f}">{escape(entry.label)}</text>')
            x += 17 + 4.1 * len(entry.label) + 10  # ~0.58 em per character of 7-unit text, then a gap
        return [f'<g font-size="7">{"".join(out)}</g>'] if out else []

    def svg(self) -> str:
        """The whole ``<svg>`` element: frame, series, legend (title in ``aria-label`` too)."""
        frame, legend = self._frame(), self._legend()
        return "".join(
            [
                f'<svg viewBox="0 0 {_W:g} {_H:g}" width="{_W:g}pt" height="{_H:g}pt" role="img" '
                f'aria-label="{escape(self.title)}" font-family="sans-serif" font-size="8">',
                f"<defs>{''.join(self.defs)}</defs>",
                *frame,
                *self.body,
                *legend,
                "</svg>",
            ]
        )


def error_plot(
    steps: Sequence[StepRecord],
    *,
    threshold: float,
    title: str,
    plot_id: str,
    first_divergent: int | None = None,
) -> str:
    """Max abs logit difference against position, one point per step, on a log axis.

    A position whose top-1 differs or whose difference breaks ``threshold`` is also marked with a red cross
    (group ``{plot_id}-divergent``); ``threshold`` is a dashed line; the first divergent position a dotted
    vertical line. A difference of exactly 0 is drawn at the axis floor (a log axis has no 0): a tenth of the
    smallest positive difference or of ``threshold``, whichever is smaller.

    Args:
        steps: the records to plot (e.g. one graph's positions in one mode), in position order.
        threshold: ``max_abs_logit_diff`` of the verification (> 0).
        title: plot title.
        plot_id: unique within the HTML document; prefixes the SVG ids.
        first_divergent: the mode's first divergent position, drawn when it is among ``steps``.

    Returns:
        The ``<svg>`` element (UTF-8 text).
    """
    x = [s.position for s in steps]
    positive = [s.max_abs_logit_diff for s in steps if s.max_abs_logit_diff > 0]
    floor = min([*positive, threshold]) / 10
    y = [max(s.max_abs_logit_diff, floor) for s in steps]
    plot = _Plot(plot_id, title, "position", "max |Δ logit|", _linear_axis(x, integer=True), _log_axis([*y, threshold]))
    plot.series(list(zip(x, y, strict=True)), gid="points", color=_CANDIDATE, label="candidate vs original")
    bad = [(s.position, max(s.max_abs_logit_diff, floor)) for s in steps if not (s.top1_match and s.within_tolerance)]
    if bad:
        plot.series(bad, gid="divergent", color=_BAD, label="diverges", width=0, marker="x", r=3)
    plot.hline(threshold, color=_BAD, dash="3 1.5", label=f"tolerance {threshold:g}")
    if first_divergent is not None and first_divergent in x:
        plot.vline(first_divergent, color=_BAD, dash="1 1.5")
    return plot.svg()


def latency_plot(
    steps: Sequence[StepRecord],
    *,
    spike_ms: float,
    title: str,
    plot_id: str,
    calls: Sequence[CallTiming] = (),
) -> str:
    """Candidate latency against position (ms), spikes marked, the original's in grey for comparison.

    One point per position that has a single-token call (``latency_ms_candidate``). A graph that computed
    none (a prefill bucket) shows its multi-token ``calls`` instead, one point per call at its first position.
    Generated steps above ``spike_ms`` are crossed in red (group ``{plot_id}-spikes``) under a dashed line at
    ``spike_ms``; prompt positions are drawn but never counted as spikes, as the verification's ``spikes`` counts
    only the steps after the prompt.

    Args:
        steps: one graph's records in one mode, in position order.
        spike_ms: the spike threshold (:func:`onnxdeploy.report.spike_threshold_ms`), ms.
        title: plot title.
        plot_id: unique within the HTML document; prefixes the SVG ids.
        calls: the mode's prompt calls made with this graph.

    Returns:
        The ``<svg>`` element (UTF-8 text).
    """
    timed = [(s.position, s.latency_ms_candidate) for s in steps if s.latency_ms_candidate is not None]
    per_call = not timed
    points = [(c.start, c.ms) for c in calls] if per_call else timed
    reference = [] if per_call else [(s.position, s.latency_ms_reference) for s in steps if s.latency_ms_reference]
    drawn = [v for _, v in points] + [v for _, v in reference] + ([] if per_call else [spike_ms])
    x_axis = _linear_axis([p for p, _ in points] or [s.position for s in steps], integer=True)
    ylabel = "ms per call (prompt)" if per_call else "ms per step"
    plot = _Plot(plot_id, title, "position", ylabel, x_axis, _linear_axis(drawn, zero=True, top=1.15))
    if not points:
        plot.note("no timed call")
        return plot.svg()
    label = f"candidate ({len(points)} {'calls' if per_call else 'steps'})"
    if per_call:
        plot.series(points, gid="points", color=_CANDIDATE, label=label, width=0, marker="s", r=1.5)
        return plot.svg()
    plot.series(points, gid="points", color=_CANDIDATE, label=label)
    if reference:
        plot.series(reference, gid="reference", color=_REFERENCE, label="original", marker=None)
    generated = {s.position for s in steps if s.phase == "generate"}
    spikes = [(p, v) for p, v in points if v > spike_ms and p in generated]
    if spikes:
        plot.series(spikes, gid="spikes", color=_BAD, label=f"{len(spikes)} spike(s)", width=0, marker="x", r=3)
    plot.hline(spike_ms, color=_BAD, dash="3 1.5", label=f"3× median ({spike_ms:.3g} ms)")
    return plot.svg()


def kl_plot(series: dict[str, Sequence[float]], *, title: str, plot_id: str) -> str:
    """KL(original || candidate) per position (nats), one line per session setting, on a log axis.

    A KL of 0 is drawn at the axis floor (a tenth of the smallest positive KL).

    Args:
        series: label -> KL per position; the first series' group id is ``{plot_id}-points``, the others
            ``{plot_id}-points-{i}``.
        title: plot title.
        plot_id: unique within the HTML document; prefixes the SVG ids.

    Returns:
        The ``<svg>`` element (UTF-8 text).
    """
    values = [v for kl in series.values() for v in kl if v > 0]
    floor = min(values) / 10 if values else 1e-12
    longest = max((len(kl) for kl in series.values()), default=1)
    y_axis = _log_axis([max(v, floor) for kl in series.values() for v in kl] or [floor])
    plot = _Plot(plot_id, title, "position", "KL (nats)", _linear_axis([0, longest - 1], integer=True), y_axis)
    for i, (label, kl) in enumerate(series.items()):
        points = [(p, max(v, floor)) for p, v in enumerate(kl)]
        color = _SERIES[i % len(_SERIES)]
        plot.series(points, gid="points" + (f"-{i}" if i else ""), color=color, label=label, r=1.0)
    return plot.svg()
