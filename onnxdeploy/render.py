"""Human-readable renderings of the run report: Markdown (``report.md``)."""

from __future__ import annotations

import json

from onnxdeploy.report import RunReport

__all__ = ["render_markdown"]


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def render_markdown(report: RunReport) -> str:
    """Render ``report`` as Markdown: status, failures, per-pass tables, findings, verification.

    Returns:
        The Markdown text (UTF-8), one document.
    """
    lines = [f"# onnxdeploy run report — **{report.status.upper()}**", ""]
    lines += [
        f"- input model: `{report.input_model}`",
        f"- output model: `{report.output_model}`",
        "- files written: " + (", ".join(f"`{f}`" for f in report.output_files) or "—"),
        f"- pipeline: `{report.pipeline}`" if report.pipeline else "- pipeline: (none)",
        f"- target: {report.target or '(none)'}",
        f"- wall time: {report.wall_time_s:.2f} s; onnxdeploy {report.onnxdeploy_version}; "
        + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
        "",
    ]
    if len(report.graphs) > 1:
        lines += [
            "## Graphs (one weights file)",
            "",
            "| file | role | step_len | max_cache_len | logits |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| `{g.file}` | {g.role} | {g.step_len} | {g.max_cache_len} | {g.prefill_logits} |" for g in report.graphs
        ]
        lines.append("")
    if report.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    if report.failures:
        lines += ["## Failures", ""] + [f"- {f}" for f in report.failures] + [""]
    if report.passes:
        lines += [
            "## Passes",
            "",
            "| pass | modified | nodes | initializer bytes | ops added | ops removed | time (s) |",
        ]
        lines += ["|---|---|---|---|---|---|---|"]
        for p in report.passes:
            added = ", ".join(f"{k}+{v}" for k, v in p.ops_added.items()) or "—"
            removed = ", ".join(f"{k}−{v}" for k, v in p.ops_removed.items()) or "—"
            lines.append(
                f"| {p.name} | {p.modified} | {p.nodes_before} → {p.nodes_after} | "
                f"{p.initializer_bytes_before} → {p.initializer_bytes_after} | {added} | {removed} | "
                f"{p.wall_time_s:.2f} |"
            )
        lines.append("")
        for p in report.passes:
            lines += [f"### {p.name}", "", f"config: `{json.dumps(p.config)}`", ""]
            lines += [f"- {c}" for c in p.changes]
            if p.dims_fixed:
                lines += ["", "dims fixed: " + "; ".join(p.dims_fixed)]
            lines += [f"- warning: {w}" for w in p.warnings]
            lines.append("")
    lines += ["## Findings", "", "Checks run: " + (", ".join(report.checks_run) or "none"), ""]
    if report.findings:
        lines += ["| code | level | check | message | nodes | hint |", "|---|---|---|---|---|---|"]
        for f in report.findings:
            msg = f.message.replace("|", "\\|")
            lines.append(f"| {f.code} | {f.level} | {f.check} | {msg} | {', '.join(f.nodes[:5])} | {f.hint} |")
    else:
        lines.append("No findings.")
    lines.append("")
    if report.verify is None:
        lines += [
            "## Verification",
            "",
            "Skipped (`verify: null`): the output was **not** compared with the original.",
            "",
        ]
    else:
        v = report.verify
        lines += [
            "## Verification",
            "",
            f"Original `{v.original}` vs candidate `{v.candidate}`; providers requested {', '.join(v.providers)}, "
            f"used {', '.join(v.providers_active) or '?'}; prompt "
            f"{v.prompt}, {v.steps} steps; thresholds: max abs logit diff ≤ {v.max_abs_logit_diff_threshold:g}, "
            f"top-1 agreement ≥ {v.min_top1_agreement_threshold:g}.",
            "",
            *[f"- **provider fallback:** {line}" for line in v.provider_fallbacks],
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
            lines += [
                f"### {m.mode}: per position",
                "",
                "| pos | phase | graph | token in | top-1 ref | top-1 cand | max abs diff | cosine | ms cand |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for s in m.steps:
                mark = "" if s.top1_match and s.within_tolerance else " ⚠"
                ms = "—" if s.latency_ms_candidate is None else f"{s.latency_ms_candidate:.3f}"
                lines.append(
                    f"| {s.position}{mark} | {s.phase} | {s.graph or ''} | {s.token_in} | {s.top1_reference} | "
                    f"{s.top1_candidate} | {s.max_abs_logit_diff:.3g} | {s.cosine_similarity:.6f} | {ms} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"
