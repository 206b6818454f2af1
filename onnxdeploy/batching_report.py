"""``verify.batching``'s section of a run's ``report.md`` and ``report.html``: the trace, request by request.

It lays out ``report.json`` → ``verify.batching`` (:class:`~onnxdeploy.report_verify.BatchingReport`, filled by
:func:`onnxdeploy.batching_stage.batching_report`) and computes nothing but the totals of the summary line (the
console's one line, :meth:`BatchingReport.summary`): one row per request of the trace in request order — its prompt
length, the step it arrived at, was admitted at (prefilled) and finished at, the decode row it ran in, tokens
generated and how many equal the original's batch-1 greedy tokens, max abs Δ logit against the allowed one, top-1
agreement and its verdict. A failed request's row is marked (Markdown: **failed**; HTML: the report's ``error`` class).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from onnxdeploy.report_verify import BatchingReport, BatchRequestReport

__all__ = ["BATCHING_COLUMNS", "batching_html", "batching_markdown", "batching_rows"]

BATCHING_COLUMNS: tuple[str, ...] = (
    "request",
    "prompt",
    "arrival",
    "admitted",
    "finished",
    "row",
    "tokens equal",
    "max abs Δ logit",
    "top-1",
    "verdict",
)
"""The per-request columns, in the order :func:`batching_rows` fills them."""


def _step(value: int | None) -> str:
    return "—" if value is None else str(value)


def batching_rows(b: BatchingReport) -> list[list[str]]:
    """One row of :data:`BATCHING_COLUMNS` per request (figures formatted as the console formats them)."""
    return [_row(r) for r in b.requests]


def _row(r: BatchRequestReport) -> list[str]:
    return [
        str(r.id),
        str(r.prompt_len),
        _step(r.arrival),
        str(r.admitted),
        str(r.finished),
        str(r.row),
        f"{r.equal_tokens}/{r.new_tokens}",
        f"{r.max_abs_logit_diff:.3g}",
        f"{r.top1_agreement:.3f}",
        "passed" if r.passed else "failed",
    ]


def _title(b: BatchingReport) -> str:
    prefill = f", prefill {b.prefill}" if b.prefill else ""
    return f"Continuous batching ({b.policy}, B={b.batch}{prefill}, trace {b.trace})"


def batching_markdown(b: BatchingReport | None) -> list[str]:
    """The Markdown section (a heading, the summary line, the per-request table); none without ``verify.batching``."""
    if b is None:
        return []
    lines = [f"## {_title(b)}", "", f"{'Passed' if b.passed else '**Failed**'}: {b.summary()}.", ""]
    lines += ["| " + " | ".join(BATCHING_COLUMNS) + " |", "|" + "---|" * len(BATCHING_COLUMNS)]
    for r, cells in zip(b.requests, batching_rows(b), strict=True):
        if not r.passed:
            cells = [*cells[:-1], "**failed**"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- **failed:** {line}" for line in b.failures()] + [""]
    return lines


def batching_html(b: BatchingReport | None) -> list[str]:
    """The HTML section (``h2``, the summary, a table of ``td.num`` figures); none without ``verify.batching``."""
    if b is None:
        return []
    numeric: Sequence[int] = range(1, 9)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in BATCHING_COLUMNS)
    body = []
    for r, cells in zip(b.requests, batching_rows(b), strict=True):
        tds = "".join(
            f'<td class="num">{html.escape(c)}</td>' if i in numeric else f"<td>{html.escape(c)}</td>"
            for i, c in enumerate(cells)
        )
        body.append(f"<tr>{tds}</tr>" if r.passed else f'<tr class="error">{tds}</tr>')
    verdict = "" if b.passed else '<p class="error">failed: ' + "<br>".join(map(html.escape, b.failures())) + "</p>"
    return [
        f"<h2>{html.escape(_title(b))}</h2>",
        f"<p>{html.escape(b.summary())}.</p>",
        verdict,
        f'<table class="batching"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>',
    ]
