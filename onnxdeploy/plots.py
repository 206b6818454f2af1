"""Static SVG plots for ``report.html``: logit error and latency against position, KL per position.

Drawn with matplotlib's SVG backend on a bare :class:`~matplotlib.figure.Figure` (no pyplot, no global state,
no display), as inline ``<svg>`` elements that need no script or network to show. Each plot's data series is
one ``Line2D`` whose SVG group id is ``{plot_id}-points`` and which draws one marker per point (path
simplification is off), so a reader — or a test — can count the points: one per position plotted.
Every SVG id is prefixed with the plot's ``plot_id`` (which also salts matplotlib's hashed ids), so several
plots share one HTML document without id clashes and the same data gives the same bytes.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

import matplotlib
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, NullFormatter

from onnxdeploy.report import CallTiming, StepRecord

__all__ = ["error_plot", "latency_plot", "kl_plot"]

_RC = {
    "svg.fonttype": "none",  # text stays text: smaller, selectable, searchable
    "path.simplify": False,  # every point stays a vertex (and a marker)
    "font.size": 8,
    "font.family": "sans-serif",
    "axes.grid": True,
    "grid.alpha": 0.35,
    "axes.spines.top": False,
    "axes.spines.right": False,
}
_SIZE = (5.4, 2.5)  # inches; 72 pt each in the SVG
_CANDIDATE = "#1f5fa8"
_REFERENCE = "#9a9a9a"
_BAD = "#c62828"


def _svg(fig: Figure, plot_id: str) -> str:
    """Serialise ``fig`` as an ``<svg>`` element for inline HTML (no XML prolog, DOCTYPE, metadata or namespaces).

    Every id (and every reference to one) is prefixed with ``plot_id``, so plots sharing a document stay unique.
    """
    buf = io.StringIO()
    FigureCanvasSVG(fig).print_svg(buf, metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    # Inline SVG in HTML needs no namespace declarations (the HTML parser maps svg and xlink:href itself).
    text = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", text, count=3)
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{plot_id}-{m[1]}"', text)
    text = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{plot_id}-{m[1]})", text)
    return re.sub(r'href="#([^"]+)"', lambda m: f'href="#{plot_id}-{m[1]}"', text)


def _new_figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, object]:
    fig = Figure(figsize=_SIZE, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, loc="left", fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(x=0.04, y=0.12)  # markers at the extremes stay inside the axes
    return fig, ax


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
    vertical line. A difference of exactly 0 is drawn at the axis floor (a log axis has no 0).

    Args:
        steps: the records to plot (e.g. one graph's positions in one mode), in position order.
        threshold: ``max_abs_logit_diff`` of the verification.
        title: plot title.
        plot_id: unique within the HTML document; prefixes the SVG ids.
        first_divergent: the mode's first divergent position, drawn when it is among ``steps``.

    Returns:
        The ``<svg>`` element (UTF-8 text).
    """
    with matplotlib.rc_context({**_RC, "svg.hashsalt": plot_id}):
        fig, ax = _new_figure(title, "position", "max |Δ logit|")
        x = [s.position for s in steps]
        raw = [s.max_abs_logit_diff for s in steps]
        positive = [v for v in raw if v > 0]
        floor = min([*positive, threshold]) / 10
        ax.plot(
            x,
            [max(v, floor) for v in raw],
            marker="o",
            markersize=2.5,
            linewidth=0.8,
            color=_CANDIDATE,
            gid="points",
            label="candidate vs original",
        )
        bad = [
            (s.position, max(s.max_abs_logit_diff, floor)) for s in steps if not (s.top1_match and s.within_tolerance)
        ]
        if bad:
            ax.plot(*zip(*bad, strict=True), "x", color=_BAD, markersize=6, gid="divergent", label="diverges")
        ax.axhline(threshold, color=_BAD, linestyle="--", linewidth=0.8, label=f"tolerance {threshold:g}")
        if first_divergent is not None and first_divergent in x:
            ax.axvline(first_divergent, color=_BAD, linestyle=":", linewidth=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())  # decades only: minor labels crowd a short axis
        ax.legend(loc="best", fontsize=7, frameon=False)
        return _svg(fig, plot_id)


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
        spike_ms: the spike threshold (:func:`onnxdeploy.report.spike_threshold_ms`).
        title: plot title.
        plot_id: unique within the HTML document; prefixes the SVG ids.
        calls: the mode's prompt calls made with this graph.

    Returns:
        The ``<svg>`` element (UTF-8 text).
    """
    with matplotlib.rc_context({**_RC, "svg.hashsalt": plot_id}):
        timed = [(s.position, s.latency_ms_candidate) for s in steps if s.latency_ms_candidate is not None]
        per_call = not timed
        ylabel = "ms per call (prompt)" if per_call else "ms per step"
        fig, ax = _new_figure(title, "position", ylabel)
        points = [(c.start, c.ms) for c in calls] if per_call else timed
        if points:
            x, y = zip(*points, strict=True)
            ax.plot(
                x,
                y,
                marker="s" if per_call else "o",
                markersize=3 if per_call else 2.5,
                linewidth=0 if per_call else 0.8,
                color=_CANDIDATE,
                gid="points",
                label=f"candidate ({len(points)} {'calls' if per_call else 'steps'})",
            )
            reference = (
                [] if per_call else [(s.position, s.latency_ms_reference) for s in steps if s.latency_ms_reference]
            )
            if reference:
                ax.plot(
                    *zip(*reference, strict=True),
                    linewidth=0.8,
                    color=_REFERENCE,
                    gid="reference",
                    label="original",
                )
            if not per_call:
                generated = {s.position for s in steps if s.phase == "generate"}
                spikes = [(p, v) for p, v in points if v > spike_ms and p in generated]
                if spikes:
                    ax.plot(
                        *zip(*spikes, strict=True),
                        "x",
                        color=_BAD,
                        markersize=6,
                        gid="spikes",
                        label=f"{len(spikes)} spike(s)",
                    )
                ax.axhline(spike_ms, color=_BAD, linestyle="--", linewidth=0.8, label=f"3× median ({spike_ms:.3g} ms)")
            drawn = [v for _, v in points] + [v for _, v in reference] + ([] if per_call else [spike_ms])
            ax.set_ylim(bottom=0, top=max(drawn) * 1.15)
            ax.legend(loc="best", fontsize=7, frameon=False)
        else:
            ax.text(0.5, 0.5, "no timed call", transform=ax.transAxes, ha="center", va="center")
        return _svg(fig, plot_id)


def kl_plot(series: dict[str, Sequence[float]], *, title: str, plot_id: str) -> str:
    """KL(original || candidate) per position (nats), one line per session setting, on a log axis.

    Args:
        series: label -> KL per position; the first series' group id is ``{plot_id}-points``, the others
            ``{plot_id}-points-{i}``.
        title: plot title.
        plot_id: unique within the HTML document; prefixes the SVG ids.

    Returns:
        The ``<svg>`` element (UTF-8 text).
    """
    with matplotlib.rc_context({**_RC, "svg.hashsalt": plot_id}):
        fig, ax = _new_figure(title, "position", "KL (nats)")
        values = [v for kl in series.values() for v in kl if v > 0]
        floor = min(values) / 10 if values else 1e-12
        for i, (label, kl) in enumerate(series.items()):
            ax.plot(
                range(len(kl)),
                [max(v, floor) for v in kl],
                marker="o",
                markersize=2,
                linewidth=0.8,
                gid="points" + (f"-{i}" if i else ""),
                label=label,
            )
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())  # decades only: minor labels crowd a short axis
        ax.legend(loc="best", fontsize=7, frameon=False)
        return _svg(fig, plot_id)
