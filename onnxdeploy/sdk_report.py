"""The SDK build stage's section of a run's reports: the console, ``report.md`` and ``report.html``.

It lays out ``report.json`` → ``sdk`` (:func:`onnxdeploy.sdk_stage.sdk_stage`) and computes nothing: the mode and
the build, then one row per graph of the set: whether RKNN-Toolkit2 built it (else the SDK's reason), its
``.rknn`` file, how many nodes the SDK placed on the NPU and on the CPU, the nodes where the SDK and the matrix
disagree and the nodes the SDK lowers but places on the CPU, the tensors hybrid quantization kept in fp16 and,
when they were chosen from per-layer error, the bound and the worst single-layer cosine the SDK's
``accuracy_analysis`` measured. A stage that did not run (``sdk: off``, no SDK environment) is its note.
"""

from __future__ import annotations

import html
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["SDK_COLUMNS", "print_sdk_stage", "sdk_html", "sdk_markdown", "sdk_rows", "sdk_title"]

SDK_COLUMNS: tuple[str, ...] = (
    "graph",
    "built",
    ".rknn",
    "NPU / CPU nodes",
    "matrix disagrees / CPU-placed",
    "fp16 tensors (hybrid)",
    "worst layer cosine",
    "time (s)",
)
"""The per-graph columns, in the order :func:`sdk_rows` fills them."""

_NAMES_SHOWN = 3


def sdk_title(sdk: dict[str, Any]) -> str:
    """One line: the SDK, its platform, the mode and the build (``sdk: build · rknn-toolkit2 2.5.0 rk3588 · fp16``)."""
    head = f"sdk: {sdk['mode']} · {sdk['sdk']} ({sdk['target_platform']})"
    return head + (f" · {sdk['build']}" if sdk.get("ran") else f" · not run: {sdk.get('note', '')}")


def _hybrid_cells(graph: dict[str, Any]) -> tuple[str, str]:
    """The fp16 tensors cell (count and the first names) and the per-layer analysis cell, ``—`` where none."""
    hybrid = graph.get("hybrid") or {}
    chosen = hybrid.get("float_layers") or []
    names = ", ".join(chosen[:_NAMES_SHOWN]) + (f", … ({len(chosen) - _NAMES_SHOWN} more)" if len(chosen) > 3 else "")
    tensors = f"{len(chosen)}: {names}" if chosen else "—"
    analysis = hybrid.get("layer_errors")
    if not analysis or not analysis.get("worst"):
        return tensors, "—"
    name, cosine = analysis["worst"][0]
    return tensors, f"{cosine:.5f} ({name}; bound {analysis['min_cosine']:g}, {len(analysis['sensitive'])} below)"


def sdk_rows(sdk: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of :data:`SDK_COLUMNS` per graph (plain text); none when the stage did not run."""
    rows = []
    for g in sdk.get("graphs") or []:
        tensors, analysis = _hybrid_cells(g)
        rows.append(
            (
                g["graph"],
                "yes" if g["built"] else f"no: {g.get('error', '')}",
                g.get("rknn") or "—",
                f"{g['npu_nodes']} / {g['cpu_nodes']}",
                f"{len(g.get('disagreements') or [])} / {len(g.get('cpu_placed') or [])}",
                tensors,
                analysis,
                f"{g.get('seconds', 0):.1f}",
            )
        )
    return rows


def print_sdk_stage(out: Console, sdk: dict[str, Any] | None) -> None:
    """The stage on the console: its title line and, when it ran, one table row per graph (nothing for None)."""
    if sdk is None:
        return
    if not sdk.get("ran"):
        out.print(escape(sdk_title(sdk)), soft_wrap=True, highlight=False)
        return
    table = Table(title=sdk_title(sdk))
    for col in SDK_COLUMNS:
        table.add_column(col, no_wrap=col in ("graph", "built", "NPU / CPU nodes", "time (s)"))
    for row in sdk_rows(sdk):
        built = "[green]yes[/]" if row[1] == "yes" else f"[red]{escape(row[1])}[/]"
        table.add_row(escape(row[0]), built, *(escape(c) for c in row[2:]))
    out.print(table)
    for g in sdk.get("graphs") or []:
        for line in g.get("disagreements") or []:
            out.print(f"[yellow]  {escape(g['graph'])}: SDK and matrix disagree:[/] {escape(line)}", soft_wrap=True)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sdk_markdown(sdk: dict[str, Any] | None) -> list[str]:
    """``report.md``'s ``## SDK build`` section (lines, ending with a blank one); none for None."""
    if sdk is None:
        return []
    lines = ["## SDK build", "", _md(sdk_title(sdk)), ""]
    rows = sdk_rows(sdk)
    if rows:
        lines += ["| " + " | ".join(SDK_COLUMNS) + " |", "|" + "---|" * len(SDK_COLUMNS)]
        lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
        lines.append("")
    disagreements = [f"- {g['graph']}: {d}" for g in sdk.get("graphs") or [] for d in g.get("disagreements") or []]
    if disagreements:
        lines += ["SDK and matrix disagree on:", "", *(_md(d) for d in disagreements), ""]
    return lines


def sdk_html(sdk: dict[str, Any] | None) -> list[str]:
    """``report.html``'s ``SDK build`` section (HTML fragments, escaped); none for None."""
    if sdk is None:
        return []
    parts = ["<h2>SDK build</h2>", f"<p>{html.escape(sdk_title(sdk))}</p>"]
    rows = sdk_rows(sdk)
    if rows:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in SDK_COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        parts.append(f'<table class="sdk"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>')
    disagreements = [f"{g['graph']}: {d}" for g in sdk.get("graphs") or [] for d in g.get("disagreements") or []]
    if disagreements:
        items = "".join(f"<li>{html.escape(d)}</li>" for d in disagreements)
        parts.append(f"<p>SDK and matrix disagree on:</p><ul>{items}</ul>")
    return parts
