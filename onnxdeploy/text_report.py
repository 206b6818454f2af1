"""The generations section of every report: the original's and the candidate's free-running text side by side.

One function per format, each called once by its report (``render.py``: report.md, ``html_report.py``:
report.html, ``console_report.py``: the console). The figures come from ``VerifyReport.generations``
(``onnxdeploy/text.py`` builds it); the first differing token is marked in both texts: ``**⟦…⟧**`` in Markdown,
``<mark>`` in HTML, reverse video on the console.
"""

from __future__ import annotations

import html

from rich.table import Table
from rich.text import Text

from onnxdeploy.report import GenerationsReport, GenerationText

__all__ = ["generations_html", "generations_markdown", "generations_table"]

_MD_SPECIAL = str.maketrans({c: f"\\{c}" for c in "\\`*_[]<>|#"})


def _parts(side: GenerationText) -> tuple[str, str, str]:
    """The text before the first differing token, that token, and the text after it."""
    if side.mark_start is None or side.mark_end is None:
        return side.text, "", ""
    return side.text[: side.mark_start], side.text[side.mark_start : side.mark_end], side.text[side.mark_end :]


def _ending(side: GenerationText) -> str:
    return " [stop]" if side.stopped else " […]"


def _heading(gen: GenerationsReport) -> str:
    """One line: where the generations differ (token index), how many tokens each has."""
    cand = gen.candidate
    if cand is None:
        return f"original: {len(gen.original.tokens)} tokens (no free_running mode: the candidate's text is not known)"
    if gen.first_differing_token is None:
        return f"identical: {len(gen.original.tokens)} generated tokens"
    return (
        f"first differing token: generated token {gen.first_differing_token} "
        f"(original {len(gen.original.tokens)} tokens, candidate {len(cand.tokens)})"
    )


def _md_text(side: GenerationText) -> str:
    def esc(t: str) -> str:
        return t.translate(_MD_SPECIAL).replace("\r", "").replace("\n", "<br>")

    before, token, after = _parts(side)
    mark = f"**⟦{esc(token) or '∅'}⟧**" if side.mark_start is not None else ""
    return esc(before) + mark + esc(after) + _ending(side)


def generations_markdown(gen: GenerationsReport | None, original: str = "original") -> list[str]:
    """report.md lines: a ``## Generations`` table, original and candidate side by side; [] without one.

    ``original`` heads the original's column (``VerifyReference.label``: it names a cache_policy's cut past).
    """
    if gen is None:
        return []
    prompt = gen.prompt_text.translate(_MD_SPECIAL).replace("\n", "<br>")
    chat = " (through the chat template)" if gen.chat_template else ""
    cand = _md_text(gen.candidate) if gen.candidate is not None else "—"
    return [
        "## Generations",
        "",
        f"Prompt{chat}: {prompt}",
        "",
        _heading(gen)
        + ("; the first differing token is marked **⟦…⟧**." if gen.first_differing_token is not None else "."),
        "",
        f"| {original} | candidate |",
        "|---|---|",
        f"| {_md_text(gen.original)} | {cand} |",
        "",
    ]


def _html_text(side: GenerationText) -> str:
    before, token, after = _parts(side)
    mark = f"<mark>{html.escape(token) or '∅'}</mark>" if side.mark_start is not None else ""
    return f'<div class="gen">{html.escape(before)}{mark}{html.escape(after)}<i>{_ending(side)}</i></div>'


def generations_html(gen: GenerationsReport | None, original: str = "original") -> list[str]:
    """report.html parts: a ``Generations`` section, two columns, the first differing token in ``<mark>``.

    ``original`` heads the original's column (``VerifyReference.label``: it names a cache_policy's cut past).
    """
    if gen is None:
        return []
    cand = _html_text(gen.candidate) if gen.candidate is not None else "<div>—</div>"
    chat = " (through the chat template)" if gen.chat_template else ""
    return [
        '<h2 id="generations">Generations</h2>',
        f"<p>Prompt{chat}: <code>{html.escape(gen.prompt_text)}</code></p>",
        f"<p>{html.escape(_heading(gen))}.</p>",
        '<div style="display:grid;grid-template-columns:1fr 1fr;gap:1em" class="generations">',
        f"<div><h3>{html.escape(original)}</h3>{_html_text(gen.original)}</div>",
        f"<div><h3>candidate</h3>{cand}</div>",
        "</div>",
        "<style>.gen{white-space:pre-wrap;overflow-wrap:anywhere;font-family:monospace}</style>",
    ]


def _rich_text(side: GenerationText) -> Text:
    before, token, after = _parts(side)
    out = Text(before)
    if side.mark_start is not None:
        out.append(token or "∅", style="bold reverse red")
    out.append(after)
    out.append(_ending(side), style="dim")
    return out


def generations_table(gen: GenerationsReport, original: str = "original") -> Table:
    """The console's table: original and candidate generations side by side, the first differing token marked.

    ``original`` heads the original's column (``VerifyReference.label``: it names a cache_policy's cut past).
    """
    table = Table(title=f"generations — {_heading(gen)}", show_lines=False)
    table.add_column(original, overflow="fold", ratio=1)
    table.add_column("candidate", overflow="fold", ratio=1)
    table.add_row(_rich_text(gen.original), _rich_text(gen.candidate) if gen.candidate is not None else Text("—"))
    return table
