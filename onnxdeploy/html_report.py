"""The run report as one self-contained HTML file (``report.html``): inline CSS and SVG, no script, no network.

It holds everything a person needs when a deployment breaks: summary, files with sha256, graphs' inputs and outputs,
passes, findings, plots of logit error and latency against position per graph and mode, other runtimes, accuracy.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

import yaml

from onnxdeploy.render import SET_NOTE, block_text, fmt_number, rows_with_blocks, weights_heading
from onnxdeploy.report import (
    FileRecord,
    ModeResult,
    RunReport,
    StepBlock,
    StepRecord,
    VerifyReport,
    spike_threshold_ms,
    summarise_steps,
)
from onnxdeploy.resources import format_bytes
from onnxdeploy.text_report import generations_html

__all__ = ["render_html"]


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:18px 28px 48px}
h1{font-size:22px;margin:8px 0 4px}
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d8dbe0;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
.badge{display:inline-block;padding:2px 10px;border-radius:12px;color:#fff;font-weight:600;
  font-size:14px;vertical-align:middle}
.passed{background:#2e7d32}.failed{background:#c62828}
table{border-collapse:collapse;margin:6px 0 10px;background:#fff;font-size:13px}
th,td{border:1px solid #d8dbe0;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef0f3;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;overflow-wrap:anywhere}
dl.summary{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
dl.summary dt{color:#555}dl.summary dd{margin:0;overflow-wrap:anywhere}
ul.fail li{color:#b71c1c}.error{color:#b71c1c;font-weight:600}.warning{color:#a15c00;font-weight:600}
.plots{display:flex;flex-wrap:wrap;gap:10px}
figure.plot{margin:0;background:#fff;border:1px solid #d8dbe0;border-radius:4px;padding:4px;
  flex:1 1 520px;max-width:580px}
figure.plot svg{width:100%;height:auto;display:block}
figure.plot figcaption{font-size:12px;color:#555;padding:2px 4px}
details{margin:6px 0}summary{cursor:pointer;color:#1f5fa8}
pre{background:#fff;border:1px solid #d8dbe0;padding:6px 10px;overflow-x:auto;font-size:12px}
tr.bad td{background:#fdecea}tr.omitted td{color:#555;font-style:italic;background:#fafafa}
table.findings{width:100%;table-layout:fixed}table.findings td{overflow-wrap:anywhere}
table.findings th:nth-child(1){width:5%}table.findings th:nth-child(2){width:6%}
table.findings th:nth-child(3){width:8%}table.findings th:nth-child(4){width:27%}
table.findings th:nth-child(5){width:20%}table.findings th:nth-child(6){width:19%}
table.findings th:nth-child(7){width:15%}
"""


class _Raw(str):
    """Markup already escaped (a cell that holds HTML)."""


def _h(value: object) -> str:
    return value if isinstance(value, _Raw) else html.escape(str(value))


def _table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], numeric: Sequence[int] = (), css_class: str = ""
) -> str:
    # the findings' node lists wrap anywhere: without a floor the column shrinks to a few characters
    opening = f'<table class="{css_class}">' if css_class else "<table>"
    out = [f"{opening}<thead><tr>", *(f"<th>{_h(h)}</th>" for h in headers), "</tr></thead><tbody>"]
    for row in rows:
        cls = ""
        if row and isinstance(row[0], _RowClass):
            cls, row = f' class="{row[0]}"', row[1:]
        cells = (f'<td class="num">{_h(c)}</td>' if i in numeric else f"<td>{_h(c)}</td>" for i, c in enumerate(row))
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


class _RowClass(str):
    """A row's first element naming its CSS class (consumed by :func:`_table`)."""


def _code(text: object) -> _Raw:
    return _Raw(f"<code>{html.escape(str(text))}</code>")


def _shape(shape: list[int | str] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def render_html(report: RunReport, *, max_rows: int = 200) -> str:
    """Render ``report`` as one self-contained HTML document.

    Plots use every per-position record of ``report`` (pass the report before summarising); the per-position
    tables list at most ``max_rows`` rows per mode (:func:`~onnxdeploy.report.summarise_steps`). One error plot
    and one latency plot per candidate graph and mode (``figure.plot`` elements with ``data-kind``,
    ``data-mode`` and ``data-graph``; their series hold one point per position, see :mod:`onnxdeploy.plots`).

    Args:
        report: the run report, with all per-position records.
        max_rows: per-position rows listed per mode at most.

    Returns:
        The HTML text (UTF-8): inline CSS and SVG, no script, no external resource.
    """
    status = report.status
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>onnxdeploy report — {status}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        f'<h1>onnxdeploy run report <span class="badge {status}">{status.upper()}</span></h1>',
    ]
    parts += _html_summary(report)
    parts += _html_files(report)
    parts += _html_passes(report)
    parts += _html_findings(report)
    if report.verify is not None:
        parts += _html_verify(report.verify, max_rows, report.verify.reference.note(report.accuracy))
        parts += generations_html(report.verify.generations, report.verify.reference.label())
        from onnxdeploy.batching_report import batching_html  # noqa: PLC0415  (verify.batching's section)

        parts += batching_html(report.verify.batching)
    else:
        parts += ["<h2>Verification</h2>", "<p><b>Skipped</b> (<code>verify: null</code>): not compared.</p>"]
    parts += _html_runtimes(report)
    parts += _html_accuracy(report)
    from onnxdeploy.sdk_report import sdk_html  # noqa: PLC0415  (the SDK stage's section: sdk_report)

    parts += sdk_html(report.sdk)
    parts.append("</main></body></html>")
    return "\n".join(parts) + "\n"


def _html_summary(report: RunReport) -> list[str]:
    rows = [
        ("pipeline", _code(report.pipeline) if report.pipeline else "(none)"),
        ("input model", _code(report.input_model)),
        ("output model", _code(report.output_model)),
        ("target", report.target or "(none)"),
        ("passes", " → ".join(p.name for p in report.passes) or "(none)"),
        ("checks", ", ".join(report.checks_run) or "(none)"),
        ("wall time", f"{report.wall_time_s:.2f} s"),
        (
            "versions",
            f"onnxdeploy {report.onnxdeploy_version}; " + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
        ),
    ]
    peak = report.peak_memory()
    if peak is not None:
        rows.append(("peak memory", f"{format_bytes(peak[0])} RSS (reached in phase {peak[1]})"))
    if report.removed_files:
        rows.append(
            ("removed", ", ".join(report.removed_files) + " (an earlier run's outputs this run does not replace)")
        )
    if report.verify is not None:
        v = report.verify
        verdicts = ", ".join(f"{m.mode} {'passed' if m.passed else 'FAILED'}" for m in v.modes.values())
        rows.append(("verification", f"{len(v.prompt)} prompt tokens + {v.steps} steps: {verdicts}"))
    out = ['<dl class="summary">', *(f"<dt>{_h(k)}</dt><dd>{_h(v)}</dd>" for k, v in rows), "</dl>"]
    if report.failures:
        out += ['<h2>Failures</h2><ul class="fail">', *(f"<li>{_h(f)}</li>" for f in report.failures), "</ul>"]
    if report.notes:
        out += ["<h3>Notes</h3><ul>", *(f"<li>{_h(n)}</li>" for n in report.notes), "</ul>"]
    if report.phases:
        out.append("<h3>Phases</h3>")
        out.append(
            _table(
                ["phase", "wall time (s)", "RSS at end", "peak RSS"],
                [
                    (p.name, f"{p.wall_time_s:.3f}", format_bytes(p.rss_bytes), format_bytes(p.peak_rss_bytes))
                    for p in report.phases
                ],
                numeric=(1, 2, 3),
            )
        )
    return out


def _io_table(record: FileRecord) -> str:
    rows = [("input", t.name, t.dtype, _shape(t.shape)) for t in record.inputs]
    rows += [("output", t.name, t.dtype, _shape(t.shape)) for t in record.outputs]
    return _table(["", "name", "dtype", "shape"], [(k, _code(n), d, _code(s)) for k, n, d, s in rows])


def _html_files(report: RunReport) -> list[str]:
    out = ["<h2>Artifacts</h2>"]
    if report.graphs:
        out.append(f"<h3>{_h(weights_heading(report.graphs))}</h3>")
        out.append(
            _table(
                ["graph", "role", "part", "step_len", "max_cache_len", "outputs", "weights file"],
                [
                    (
                        _code(g.file),
                        g.role,
                        "—" if g.part is None else g.part,
                        g.step_len,
                        g.max_cache_len,
                        g.output_text(),
                        _code(g.weights_file) if g.weights_file else "inline",
                    )
                    for g in report.graphs
                ],
                numeric=(3, 4),
            )
        )
    if report.files:
        out.append(
            _table(
                ["role", "file", "size", "sha256"],
                [(f.role, _code(f.path), format_bytes(f.bytes), _code(f.sha256)) for f in report.files],
                numeric=(2,),
            )
        )
        for f in report.files:
            if f.inputs or f.outputs:
                out.append(
                    f"<details><summary>{_h(f.role)} graph <code>{_h(f.path)}</code>: {len(f.inputs)} inputs, "
                    f"{len(f.outputs)} outputs</summary>{_io_table(f)}</details>"
                )
    reports = [f for f in report.output_files if not any(r.path == f for r in report.files)]
    if reports:
        out.append("<p>Also written: " + ", ".join(f"<code>{_h(f)}</code>" for f in reports) + "</p>")
    return out


def _ops(ops: dict[str, int], sign: str) -> str:
    return ", ".join(f"{k}{sign}{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])) or "—"


def _html_passes(report: RunReport) -> list[str]:
    if not report.passes:
        return ["<h2>Passes</h2><p>No passes.</p>"]
    rows = [
        (
            p.name,
            "yes" if p.modified else "no",
            p.nodes_text(),
            len(p.dims_fixed),
            _ops(p.ops_added, "+"),
            _ops(p.ops_removed, "−")
            if not p.moved_to_parts()
            else f"moved to {p.moved_to_parts()}: " + _ops(p.ops_removed, " "),
            f"{format_bytes(p.initializer_bytes_before)} → {format_bytes(p.initializer_bytes_after)}",
            f"{p.wall_time_s:.2f}",
        )
        for p in report.passes
    ]
    out = [
        "<h2>Passes</h2>",
        _table(
            ["pass", "modified", "nodes", "dims fixed", "ops added", "ops removed", "initializer bytes", "time (s)"],
            rows,
            numeric=(3, 7),
        ),
    ]
    if any(max(p.graphs_before, p.graphs_after) > 1 for p in report.passes):
        out.append(f"<p>{_h(SET_NOTE)}</p>")
    for p in report.passes:
        body = [f"<pre>{_h(yaml.safe_dump({p.name: p.config}, sort_keys=False, allow_unicode=True))}</pre>"]
        body += ["<ul>", *(f"<li>{_h(c)}</li>" for c in p.changes)]
        body += [f'<li class="warning">warning: {_h(w)}</li>' for w in p.warnings] + ["</ul>"]
        if p.dims_fixed:
            body.append("<p>Dims fixed:</p><ul>" + "".join(f"<li><code>{_h(d)}</code></li>" for d in p.dims_fixed))
            body.append("</ul>")
        out.append(f"<details><summary>{_h(p.name)}: config, changes, dims</summary>{''.join(body)}</details>")
    return out


def _html_findings(report: RunReport) -> list[str]:
    out = ["<h2>Findings</h2>", f"<p>Checks run: {_h(', '.join(report.checks_run) or 'none')}</p>"]
    if not report.findings:
        return [*out, "<p>No findings.</p>"]
    rows = [
        (
            f.code,
            _Raw(f'<span class="{f.level}">{_h(f.level)}</span>'),
            f.check,
            f.message,
            _code(", ".join(f.nodes[:8]) + (f" … (+{len(f.nodes) - 8})" if len(f.nodes) > 8 else "")),
            f.hint,
            _rule_and_source(f.rule, f.source),
        )
        for f in report.findings
    ]
    headers = ["code", "level", "check", "message", "nodes", "hint", "rule / source"]
    return [*out, _table(headers, rows, css_class="findings")]


def _rule_and_source(rule: str | None, source: str | None) -> _Raw | str:
    """The rule, and the source behind it folded in a ``<details>``.

    A matrix citation runs to ~900 characters, which in its column grew each row to several hundred pixels.
    """
    if not source:
        return rule or ""
    return _Raw(f"{_h(rule or '')}<details><summary>source</summary>{_h(source)}</details>")


def _graphs_of(m: ModeResult, fallback: str) -> list[tuple[str, list[StepRecord]]]:
    """The mode's steps grouped by candidate graph file, graphs in order of first position."""
    groups: dict[str, list[StepRecord]] = {}
    for s in m.steps:
        groups.setdefault(s.graph or fallback, []).append(s)
    return list(groups.items())


def _html_verify(v: VerifyReport, max_rows: int, reference: str | None = None) -> list[str]:
    """The verification section; ``reference``: a line saying the original was not fed the full context."""
    out = [
        "<h2>Verification</h2>",
        f"<p>Original <code>{_h(v.original)}</code> against candidate <code>{_h(v.candidate)}</code>; providers "
        f"{_h(', '.join(v.providers))} (active: {_h(', '.join(v.providers_active) or '?')}); prompt of "
        f"{len(v.prompt)} tokens, {v.steps} steps; thresholds: max |Δ logit| ≤ {v.max_abs_logit_diff_threshold:g}, "
        f"top-1 agreement ≥ {v.min_top1_agreement_threshold:g}.</p>",
        *([f'<p class="warning reference">{_h(reference)}</p>'] if reference else []),
    ]
    if v.numerics is not None:
        out.append(
            f"<p>Numerics: {_h(v.numerics.compute_dtype)} {_h(v.numerics.execution)} — {_h(v.numerics.detail)}</p>"
        )
    out += [f'<p class="warning">provider fallback: {_h(line)}</p>' for line in v.provider_fallbacks]
    out += [f'<p class="error">failed: {_h(line)}</p>' for line in v.failures]
    out.append(_html_modes_table(v))
    for m in v.modes.values():
        out += [f'<p class="error">failed: {_h(line)}</p>' for line in m.failures]
    index = 0
    for m in v.modes.values():
        out.append(f"<h3>{_h(m.mode)}: logit error and latency against position</h3>")
        for graph, steps in _graphs_of(m, fallback=v.candidate.rsplit("/", 1)[-1]):
            index += 1
            out += _html_plots(v, m, graph, steps, index)
        out.append(_html_step_table(summarise_steps(m, max_rows)))
    return out


def _html_modes_table(v: VerifyReport) -> str:
    """One row per mode: verdict, agreement, error, latency against the original, prefill."""
    rows = []
    for m in v.modes.values():
        lat, ref = m.latency_ms, m.reference_latency_ms
        rows.append(
            (
                _RowClass("" if m.passed else "bad"),
                m.mode,
                "yes" if m.passed else "NO",
                m.positions,
                f"{m.top1_agreement:.3f}",
                f"{m.max_abs_logit_diff:.3g}",
                "none" if m.first_divergent_step is None else m.first_divergent_step,
                f"{lat.p50:.3f} / {ref.p50:.3f}",
                f"{lat.p99:.3f} / {ref.p99:.3f}",
                f"{lat.spikes}",
                "—" if m.prefill is None else f"{m.prefill.total_ms:.2f} ({m.prefill.calls} calls)",
            )
        )
    headers = [
        "mode",
        "passed",
        "positions",
        "top-1",
        "max |Δ logit|",
        "first divergent",
        "p50 ms cand / orig",
        "p99 ms cand / orig",
        "spikes",
        "prefill ms",
    ]
    return _table(headers, rows, numeric=(2, 3, 4, 6, 7, 8, 9))


def _html_plots(v: VerifyReport, m: ModeResult, graph: str, steps: list[StepRecord], index: int) -> list[str]:
    """The error plot and the latency plot of one candidate graph in one mode, side by side."""
    from onnxdeploy.plots import error_plot, latency_plot

    calls = [c for c in (m.prefill.per_call if m.prefill else []) if c.graph == graph]
    caption = f"{graph} — {m.mode}: {len(steps)} positions ({steps[0].position}–{steps[-1].position})"
    error = error_plot(
        steps,
        threshold=v.max_abs_logit_diff_threshold,
        title=f"max |Δ logit| · {graph}",
        plot_id=f"e{index}",
        first_divergent=m.first_divergent_step,
    )
    spike = spike_threshold_ms(m)
    latency = latency_plot(steps, spike_ms=spike, title=f"latency · {graph}", plot_id=f"l{index}", calls=calls)
    attrs = f'data-mode="{_h(m.mode)}" data-graph="{_h(graph)}"'
    return [
        '<div class="plots">',
        f'<figure class="plot" data-kind="error" {attrs}>{error}<figcaption>{_h(caption)}</figcaption>',
        "</figure>",
        f'<figure class="plot" data-kind="latency" {attrs}>{latency}<figcaption>{_h(caption)}</figcaption>',
        "</figure>",
        "</div>",
    ]


def _html_step_table(m: ModeResult) -> str:
    rows: list[Sequence[object]] = []
    for row in rows_with_blocks(m):
        if isinstance(row, StepBlock):
            rows.append(
                (
                    _RowClass("omitted"),
                    "…",
                    _Raw(f"<span>{_h(block_text(row))}</span>"),
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                )
            )
            continue
        s = row
        rows.append(
            (
                _RowClass("" if s.top1_match and s.within_tolerance else "bad"),
                s.position,
                s.phase,
                s.graph or "",
                s.token_in,
                s.top1_reference,
                s.top1_candidate,
                f"{s.max_abs_logit_diff:.3g}",
                f"{s.cosine_similarity:.6f}",
                fmt_number(s.latency_ms_candidate),
                fmt_number(s.latency_ms_reference),
            )
        )
    listed = f"{len(m.steps)} of {m.positions}" if m.steps_omitted else f"all {m.positions}"
    table = _table(
        ["pos", "phase", "graph", "token in", "top-1 ref", "top-1 cand", "max |Δ|", "cosine", "ms cand", "ms orig"],
        rows,
        numeric=(0, 3, 4, 5, 6, 7, 8, 9),
    )
    return f"<details><summary>{_h(m.mode)}: per-position rows ({listed})</summary>{table}</details>"


def _html_runtimes(report: RunReport) -> list[str]:
    if not report.runtimes:
        return []
    rows = [
        (
            r.runtime,
            r.device,
            r.precision,
            "yes" if r.passed else "NO",
            r.positions,
            f"{r.top1_agreement:.3f}",
            fmt_number(r.max_abs_logit_diff),
            r.refused or "",
        )
        for r in report.runtimes
    ]
    headers = ["runtime", "device", "precision", "passed", "positions", "top-1", "max |Δ logit|", "refused"]
    return ["<h2>Other runtimes</h2>", _table(headers, rows, numeric=(4, 5, 6))]


def _html_accuracy(report: RunReport) -> list[str]:
    """``verify.accuracy``'s figures per session and the ``cache_policy``'s cost against the full context."""
    a = report.accuracy
    if a is None:
        return []
    from onnxdeploy.plots import kl_plot

    figures = (("weight_only", a.weight_only), ("default_optimized", a.default_optimized))
    rows = [
        (
            name,
            f.positions,
            f"{f.mean_kl:.4g}",
            f"{f.max_kl:.4g}",
            f"{f.top1_agreement:.3f}",
            f"{f.ppl_original:.4g}",
            f"{f.ppl_candidate:.4g}",
            f"{f.ppl_ratio:.4f}",
        )
        for name, f in figures
    ]
    q = a.policy_quality
    if q is not None and q.mean_kl is not None and q.top1_agreement is not None:  # beside the figures, its own row
        rows.append(
            ("cache_policy vs full context", q.evicting_positions, f"{q.mean_kl:.4g}", "-", f"{q.top1_agreement:.3f}")
            + ("-",) * 3
        )
    limits = ", ".join(
        f"{k} {val:g}"
        for k, val in (
            ("max_mean_kl", a.max_mean_kl),
            ("min_top1_agreement", a.min_top1_agreement),
            ("max_ppl_ratio", a.max_ppl_ratio),
        )
        if val is not None
    )
    out = [
        "<h2>Accuracy</h2>",
        f"<p>Teacher-forced on {a.tokens} held-out tokens: {'passed' if a.passed else '<b>FAILED</b>'}"
        + (f" (thresholds on weight_only: {_h(limits)})" if limits else "")
        + ".</p>",
        _table(
            ["session", "positions", "mean KL", "max KL", "top-1", "ppl orig", "ppl cand", "ratio"],
            rows,
            (1, 2, 3, 4, 5, 6, 7),
        ),
    ]
    if q is not None:
        out.append(f"<p>{_h(q.text())} (the policy's cost, not a threshold: <code>accuracy.policy_quality</code>).</p>")
    out += [f'<p class="error">failed: {_h(line)}</p>' for line in a.failures]
    series = {name: f.kl_per_position for name, f in figures if f.kl_per_position}
    if series:
        svg = kl_plot(series, title="KL(original ‖ candidate) per position", plot_id="kl")
        out.append(f'<div class="plots"><figure class="plot" data-kind="kl">{svg}</figure></div>')
    return out
