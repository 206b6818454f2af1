"""The run report as Markdown (``report.md``), and the helpers it shares with the HTML (:mod:`onnxdeploy.html_report`).

``report.md`` is short enough for a CI job summary (GitHub caps one at 1 MiB): per-position rows are the
report's (at most ``report.max_rows`` per mode, see :func:`onnxdeploy.report.summarise_steps`), folded in
``<details>``, findings and fixed dims capped. ``report.html`` holds everything a person needs when a deployment
breaks — summary, files with sha256, graphs' inputs and outputs, passes, findings, plots of logit error and
latency against position per graph and mode, accuracy — as one file with inline CSS and inline SVG (no script,
no network).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import yaml

from onnxdeploy.resources import format_bytes

if TYPE_CHECKING:  # the report's models are not needed to import this module: `onnxdeploy passes` uses yaml_inline
    from onnxdeploy.report import GraphReport, ModeResult, RunReport, StepBlock, StepRecord, VerifyReport

__all__ = ["SET_NOTE", "block_text", "fmt_number", "render_markdown", "rows_with_blocks", "yaml_inline"]

MARKDOWN_MAX_FINDINGS = 50
"""Findings listed in ``report.md`` at most (all are in ``report.json`` and ``report.html``)."""

MARKDOWN_MAX_DIMS = 12
"""Fixed dims listed per pass in ``report.md`` at most."""


SET_NOTE = "Nodes are summed over the graphs of the set; ops added and removed are the decode graph's."


def yaml_inline(value: Any) -> str:
    """``value`` as one line of YAML flow style (``{batch: 1, step_len: 1}``, ``64``, ``null``), for configs in text.

    A scalar document ends with YAML's document-end marker (a line ``...``), which is not part of the value.
    """
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9, allow_unicode=True)
    return text.removesuffix("\n...\n").strip()


def fmt_number(x: float | None) -> str:
    """A figure in three significant digits, ``—`` for none."""
    return "—" if x is None else f"{x:.3g}"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def block_text(b: StepBlock) -> str:
    """One line summing up a block of per-position rows left out of a table."""
    lat = "" if b.latency_ms_candidate_p50 is None else f", ms p50 {b.latency_ms_candidate_p50:.3f}"
    return (
        f"positions {b.first_position}–{b.last_position} ({b.positions} omitted): top-1 {b.top1_agreement:.3f}, "
        f"max abs diff {b.max_abs_logit_diff:.3g}, min cosine {b.min_cosine_similarity:.6f}{lat}"
    )


def render_markdown(report: RunReport) -> str:
    """Render ``report`` as Markdown: status, failures, per-pass tables, findings, verification.

    Per-position rows are the report's own (summarised beyond ``report.max_rows`` before this is called) and
    sit in ``<details>`` blocks; findings beyond :data:`MARKDOWN_MAX_FINDINGS` and fixed dims beyond
    :data:`MARKDOWN_MAX_DIMS` are counted, not listed.

    Returns:
        The Markdown text (UTF-8), one document.
    """
    lines = [f"# onnxdeploy run report — **{report.status.upper()}**", ""]
    lines += _markdown_summary(report)
    if report.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    if report.failures:
        lines += ["## Failures", ""] + [f"- {f}" for f in report.failures] + [""]
    lines += _markdown_passes(report)
    lines += _markdown_findings(report)
    if report.verify is None:
        lines += [
            "## Verification",
            "",
            "Skipped (`verify: null`): the output was **not** compared with the original.",
            "",
        ]
    else:
        lines += _markdown_verify(report.verify, report.verify.reference.note(report.accuracy))
        from onnxdeploy.text_report import generations_markdown  # noqa: PLC0415  (see the TYPE_CHECKING import)

        lines += generations_markdown(report.verify.generations, report.verify.reference.label())
        from onnxdeploy.batching_report import batching_markdown  # noqa: PLC0415  (verify.batching's section)

        lines += batching_markdown(report.verify.batching)
    lines += _markdown_runtimes(report)
    lines += _markdown_accuracy(report)
    from onnxdeploy.sdk_report import sdk_markdown  # noqa: PLC0415  (the SDK stage's section: sdk_report)

    lines += sdk_markdown(report.sdk)
    return "\n".join(lines) + "\n"


def _markdown_runtimes(report: RunReport) -> list[str]:
    """The candidate on each other runtime (``verify.runtimes``), as the console and the HTML show it."""
    if not report.runtimes:
        return []
    lines = [
        "## Other runtimes",
        "",
        "| runtime | device | passed | positions | top-1 agreement | max abs logit diff (allowed) | first divergent |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report.runtimes:
        diff = r.refused or f"{fmt_number(r.max_abs_logit_diff)} ({fmt_number(r.max_abs_logit_diff_allowed)})"
        first = "none" if r.first_divergent_step is None else r.first_divergent_step
        lines.append(
            f"| {r.runtime} | {r.device} {r.precision} | {r.passed} | {r.positions} | {r.top1_agreement:.3f} | "
            f"{_md_cell(diff)} | {first} |"
        )
    return [*lines, ""]


def weights_heading(graphs: list[GraphReport]) -> str:
    """The graphs table's heading: how many weights files the run truly wrote (``3 weights files``)."""
    n = len({g.weights_file for g in graphs if g.weights_file})
    return "Graphs (" + ("weights inline" if n == 0 else "one weights file" if n == 1 else f"{n} weights files") + ")"


def _markdown_summary(report: RunReport) -> list[str]:
    """Files, pipeline, target, versions; the graphs of a set."""
    html_file = next((f for f in report.output_files if f.endswith("report.html")), None)
    lines = [
        f"- input model: `{report.input_model}`",
        f"- output model: `{report.output_model}`",
        "- files written: " + (", ".join(f"`{f}`" for f in report.output_files) or "—"),
        f"- pipeline: `{report.pipeline}`" if report.pipeline else "- pipeline: (none)",
        f"- target: {report.target or '(none)'}",
        f"- wall time: {report.wall_time_s:.2f} s; onnxdeploy {report.onnxdeploy_version}; "
        + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
    ]
    peak = report.peak_memory()
    if peak is not None:
        lines.append(f"- peak memory: {format_bytes(peak[0])} RSS (reached in phase {peak[1]})")
    if report.removed_files:
        lines.append(
            "- removed (an earlier run's outputs this run does not replace): "
            + ", ".join(f"`{f}`" for f in report.removed_files)
        )
    if html_file:
        lines.append(f"- plots of error and latency per position, files with sha256: `{html_file}`")
    lines.append("")
    if len(report.graphs) > 1:
        split = any(g.part is not None for g in report.graphs)
        lines += [
            f"## {weights_heading(report.graphs)}",
            "",
            "| file | role | " + ("part | " if split else "") + "step_len | max_cache_len | outputs | weights file |",
            "|---|---|" + ("---|" if split else "") + "---|---|---|---|",
        ]
        for g in report.graphs:
            part = f"{g.part} | " if split else ""
            weights = f"`{g.weights_file}`" if g.weights_file else "inline"
            lines.append(
                f"| `{g.file}` | {g.role} | {part}{g.step_len} | {g.max_cache_len} | {g.output_text()} | {weights} |"
            )
        lines.append("")
    return lines


def _markdown_passes(report: RunReport) -> list[str]:
    """One table row per pass, then each pass's config, changes, fixed dims (capped) and warnings."""
    if not report.passes:
        return []
    lines = [
        "## Passes",
        "",
        "| pass | modified | nodes | initializer bytes | ops added | ops removed | time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in report.passes:
        added = ", ".join(f"{k}+{v}" for k, v in p.ops_added.items()) or "—"
        removed = ", ".join(f"{k}−{v}" for k, v in p.ops_removed.items()) or "—"
        if p.moved_to_parts():  # split: the decode graph's ops went to the other parts, not away
            removed = f"moved to {p.moved_to_parts()}: " + ", ".join(f"{k} {v}" for k, v in p.ops_removed.items())
        lines.append(
            f"| {p.name} | {p.modified} | {p.nodes_text()} | "
            f"{p.initializer_bytes_before} → {p.initializer_bytes_after} | {added} | {removed} | "
            f"{p.wall_time_s:.2f} |"
        )
    if any(max(p.graphs_before, p.graphs_after) > 1 for p in report.passes):
        lines += ["", SET_NOTE]
    lines.append("")
    for p in report.passes:
        lines += [f"### {p.name}", "", f"config: `{yaml_inline(p.config)}`", ""]
        lines += [f"- {c}" for c in p.changes]
        if p.dims_fixed:
            more = len(p.dims_fixed) - MARKDOWN_MAX_DIMS
            listed = "; ".join(p.dims_fixed[:MARKDOWN_MAX_DIMS]) + (f"; … ({more} more)" if more > 0 else "")
            lines += ["", f"dims fixed ({len(p.dims_fixed)}): {listed}"]
        lines += [f"- warning: {w}" for w in p.warnings]
        lines.append("")
    return lines


def _markdown_findings(report: RunReport) -> list[str]:
    """The checks run and their findings (at most :data:`MARKDOWN_MAX_FINDINGS` listed)."""
    lines = ["## Findings", "", "Checks run: " + (", ".join(report.checks_run) or "none"), ""]
    if report.findings:
        lines += ["| code | level | check | message | nodes | hint |", "|---|---|---|---|---|---|"]
        for f in report.findings[:MARKDOWN_MAX_FINDINGS]:
            lines.append(
                f"| {f.code} | {f.level} | {f.check} | {_md_cell(f.message)} | {_md_cell(', '.join(f.nodes[:5]))} | "
                f"{_md_cell(f.hint)} |"
            )
        if len(report.findings) > MARKDOWN_MAX_FINDINGS:
            lines += ["", f"… and {len(report.findings) - MARKDOWN_MAX_FINDINGS} more findings (report.json)."]
    else:
        lines.append("No findings.")
    lines.append("")
    return lines


def _markdown_accuracy(report: RunReport) -> list[str]:
    """``verify.accuracy``'s figures per session, the ``cache_policy``'s cost against the full context, failures."""
    a = report.accuracy
    if a is None:
        return []
    lines = [
        "## Accuracy (teacher-forced, held-out tokens)",
        "",
        "| session | accuracy_level | prepacking | positions | mean KL | max KL | top-1 | ppl original | "
        "ppl candidate | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, fig in (("weight_only", a.weight_only), ("default_optimized", a.default_optimized)):
        level = ("/".join(str(x) for x in fig.session.accuracy_level) or "-") if fig.session else "?"
        packed = ("on" if fig.session.prepacking else "off") if fig.session else "?"
        lines.append(
            f"| {name} | {level} | {packed} | {fig.positions} | {fig.mean_kl:.4g} | {fig.max_kl:.4g} | "
            f"{fig.top1_agreement:.3f} | {fig.ppl_original:.4g} | {fig.ppl_candidate:.4g} | {fig.ppl_ratio:.4f} |"
        )
    q = a.policy_quality
    if q is not None and q.mean_kl is not None and q.top1_agreement is not None:  # beside the figures, its own row
        lines.append(
            f"| cache_policy vs full context | - | - | {q.evicting_positions} | {q.mean_kl:.4g} | - | "
            f"{q.top1_agreement:.3f} | - | - | - |"
        )
    same = ["", "- both rows are one measurement: the two settings open the same session"]
    policy = [] if q is None else ["", f"- {q.text()} (the policy's cost, not a threshold: `accuracy.policy_quality`)"]
    return (
        lines
        + (same if a.default_is_weight_only else [])
        + policy
        + [""]
        + [f"- **failed:** {line}" for line in a.failures]
        + [""]
    )


def _markdown_verify(v: VerifyReport, reference: str | None = None) -> list[str]:
    """The verification section; ``reference``: a line saying the original was not fed the full context."""
    from onnxdeploy.report import StepBlock  # noqa: PLC0415  (see the TYPE_CHECKING import)

    lines = [
        "## Verification",
        "",
        f"Original `{v.original}` vs candidate `{v.candidate}`; providers requested {', '.join(v.providers)}, "
        f"used {', '.join(v.providers_active) or '?'}; prompt "
        f"{v.prompt}, {v.steps} steps; thresholds: max abs logit diff ≤ {v.max_abs_logit_diff_threshold:g}, "
        f"top-1 agreement ≥ {v.min_top1_agreement_threshold:g}.",
        "",
        *([f"- **{reference}**"] if reference else []),
        *[f"- **provider fallback:** {line}" for line in v.provider_fallbacks],
        *([f"- {v.graphs_driven_text()}"] if v.graphs_driven_text() else []),
        *[
            f"- {who} session (its latencies): {settings.text()}"
            for who, settings in (("original", v.original_session), ("candidate", v.candidate_session))
            if settings is not None
        ],
        "",
        "| mode | passed | positions | top-1 agreement | max abs logit diff | first divergent step | "
        "p50 ms (cand / orig) | p99 ms (cand / orig) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in v.modes.values():
        lines.append(
            f"| {m.mode} | {m.passed} | {m.positions} | {m.top1_agreement:.3f} | {m.max_abs_logit_diff:.3g} | "
            f"{m.first_divergent_step if m.first_divergent_step is not None else 'none'} | "
            f"{m.latency_ms.p50:.3f} / {m.reference_latency_ms.p50:.3f} | "
            f"{m.latency_ms.p99:.3f} / {m.reference_latency_ms.p99:.3f} |"
        )
    lines.append("")
    lines += [f"- **failed:** {line}" for line in v.failures]
    for m in v.modes.values():
        lines += [f"- **failed:** {line}" for line in m.failures]
        for who, pre in (("candidate", m.prefill), ("original", m.reference_prefill)):
            if pre is not None:
                lines.append(
                    f"- {m.mode} prefill ({who}): {pre.tokens} tokens in {pre.calls} call(s), "
                    f"{pre.total_ms:.3f} ms ({pre.tokens_per_s:.0f} tokens/s)"
                )
        lat = m.latency_ms
        lines.append(
            f"- {m.mode} steps (candidate): {lat.calls} calls, p50 {lat.p50:.3f} ms, p99 {lat.p99:.3f} ms, "
            f"IQR {lat.iqr:.3f} ms, {lat.spikes} spike(s) > 3× median"
        )
    lines.append("")
    for m in v.modes.values():
        listed = f"{len(m.steps)} of {m.positions}" if m.steps_omitted else f"{m.positions}"
        diverging = sum(1 for s in m.steps if not (s.top1_match and s.within_tolerance))
        legend = [f"⚠ marks the {diverging} diverging" if diverging else "none diverges"]
        if m.steps_omitted:
            legend.append("rows beyond report.max_rows summarised")
        lines += [
            f"### {m.mode}: per position",
            "",
            f"<details><summary>{listed} positions ({'; '.join(legend)})</summary>",
            "",
            "| pos | phase | graph | token in | top-1 ref | top-1 cand | max abs diff | cosine | ms cand |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows_with_blocks(m):
            if isinstance(row, StepBlock):
                lines.append(f"| … | {block_text(row)} ||||||||")
                continue
            s = row
            mark = "" if s.top1_match and s.within_tolerance else " ⚠"
            ms = "—" if s.latency_ms_candidate is None else f"{s.latency_ms_candidate:.3f}"
            lines.append(
                f"| {s.position}{mark} | {s.phase} | {s.graph or ''} | {s.token_in} | {s.top1_reference} | "
                f"{s.top1_candidate} | {s.max_abs_logit_diff:.3g} | {s.cosine_similarity:.6f} | {ms} |"
            )
        lines += ["", "</details>", ""]
    return lines


def rows_with_blocks(m: ModeResult) -> Iterable[StepRecord | StepBlock]:
    """The mode's kept rows with each omitted block in its place, in position order."""
    blocks = list(m.steps_omitted)
    for s in m.steps:
        while blocks and blocks[0].first_position < s.position:
            yield blocks.pop(0)
        yield s
    yield from blocks


# ----------------------------------------------------------------------------------------------------------- HTML
