"""What the CLI prints of a run, a verification and an SDK build: rich tables and summary lines.

The commands in :mod:`onnxdeploy.cli` parse, call the library and hand its results here; nothing here computes a
figure, it lays out the reports' own (:mod:`onnxdeploy.report`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from onnxdeploy.resources import format_bytes

if TYPE_CHECKING:
    from onnxdeploy.pipeline import RunOutcome
    from onnxdeploy.report import AccuracyFigures, AccuracyReport, PassReport, RunReport, VerifyReport

__all__ = [
    "accuracy_text",
    "ops_text",
    "passes_table",
    "print_first_divergent",
    "print_run",
    "print_sdk",
    "print_verify",
    "resources_text",
    "runtimes_table",
    "verify_table",
]


def runtimes_table(runtimes: list[Any]) -> Table:
    """The candidate on each other runtime (``verify.runtimes``) against the original on ONNX Runtime."""
    table = Table(title="other runtimes (teacher-forced on the original's tokens)")
    for col in ("runtime", "device", "ok", "positions", "top-1", "max |Δ| (allowed)", "1st div"):
        table.add_column(col, no_wrap=True)
    for r in runtimes:
        diff = "—" if r.max_abs_logit_diff is None else f"{r.max_abs_logit_diff:.2g}"
        allowed = "" if r.max_abs_logit_diff_allowed is None else f" ({r.max_abs_logit_diff_allowed:.2g})"
        table.add_row(
            r.runtime,
            r.device + (f" {r.precision}" if r.precision else ""),
            "[green]yes[/]" if r.passed else "[red]no[/]",
            str(r.positions),
            f"{r.top1_agreement:.3f}",
            (escape(r.refused) if r.refused else diff + allowed),
            "none" if r.first_divergent_step is None else str(r.first_divergent_step),
        )
    return table


def verify_table(verify: Any) -> Table:
    """Per decode mode: passed, top-1 agreement, max |Δ logit|, first divergent step, p50/p99 latency (ms)."""
    first = next(iter(verify.modes.values()))
    table = Table(
        title=f"verification over {first.positions} positions",
        caption=f"original p50/p99: {first.reference_latency_ms.p50:.2f}/{first.reference_latency_ms.p99:.2f} ms",
    )
    for col in ("mode", "ok", "top-1", "max |Δ|", "1st div", "p50 ms", "p99 ms"):
        table.add_column(col, no_wrap=True)
    for m in verify.modes.values():
        table.add_row(
            m.mode,
            "[green]yes[/]" if m.passed else "[red]no[/]",
            f"{m.top1_agreement:.3f}",
            f"{m.max_abs_logit_diff:.2g}",
            "none" if m.first_divergent_step is None else str(m.first_divergent_step),
            f"{m.latency_ms.p50:.2f}",
            f"{m.latency_ms.p99:.2f}",
        )
    return table


def ops_text(ops: dict[str, int], sign: str, most: int = 4) -> str:
    """``Op+n`` entries, largest first, the first ``most`` of them (``—`` for none)."""
    items = sorted(ops.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{k}{sign}{v}" for k, v in items[:most])
    return (text + f", … ({len(items) - most} more)" if len(items) > most else text) or "—"


def print_run(out: Console, outcome: RunOutcome) -> None:
    """The run's summary on ``out``: passes, checks and findings, verification, failures, the verdict."""
    report = outcome.report
    out.print(passes_table(report.passes))
    pass_warnings = [(p.name, w) for p in report.passes for w in p.warnings]
    for name, warning in pass_warnings:
        out.print(f"[yellow]warning:[/] pass {name}: {escape(warning)}", soft_wrap=True)
    out.print("checks run: " + (", ".join(report.checks_run) or "[yellow]none[/]"))
    if report.verify is None:
        out.print("[yellow]verification skipped (verify: null): the output was not compared with the original[/]")
    levels = [f.level for f in report.findings]
    out.print(
        f"findings: {levels.count('error')} error(s), {levels.count('warning')} warning(s), {levels.count('info')} info"
        + (f"; passes: {len(pass_warnings)} warning(s)" if pass_warnings else "")
    )
    for f in report.findings:
        if f.level != "info":
            out.print(f"  {f.code} [{f.level}] {f.message}", highlight=False, markup=False)
    if report.verify is not None:
        for line in report.verify.provider_fallbacks:
            out.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)
        out.print(verify_table(report.verify))
        if (reference := report.verify.reference.note(report.accuracy)) is not None:  # a cache_policy's cut past
            out.print(f"[yellow]{escape(reference)}[/]", soft_wrap=True)
        if report.verify.graphs_driven_text():
            out.print(report.verify.graphs_driven_text(), highlight=False, markup=False)
        if report.runtimes:
            out.print(runtimes_table(report.runtimes))
        print_first_divergent(out, report.verify)
        if report.verify.batching is not None:  # verify.batching: one line of its figures
            out.print(report.verify.batching.summary(), highlight=False, markup=False, soft_wrap=True)
        if report.verify.generations is not None:
            from onnxdeploy.text_report import generations_table  # noqa: PLC0415  (report models)

            out.print(generations_table(report.verify.generations, report.verify.reference.label()))
    if report.accuracy is not None:
        out.print(accuracy_text(report.accuracy), highlight=False, markup=False, soft_wrap=True)
        if report.accuracy.policy_quality is not None:  # the cache_policy's cost against the full context
            out.print(report.accuracy.policy_quality.text(), highlight=False, markup=False, soft_wrap=True)
    out.print(resources_text(report), highlight=False, markup=False)
    from onnxdeploy.sdk_report import print_sdk_stage  # noqa: PLC0415  (the SDK stage's section: sdk_report)

    print_sdk_stage(out, report.sdk)
    shown = 10
    for reason in report.failures[:shown]:
        out.print(f"[red]FAILED:[/] {escape(reason)}", soft_wrap=True)
    if len(report.failures) > shown:
        out.print(f"[red]FAILED:[/] … and {len(report.failures) - shown} more (see {outcome.report_md})")
    colour = "green" if report.status == "passed" else "red"
    out.print(f"[bold {colour}]{report.status.upper()}[/]: {outcome.model_path}; report {outcome.report_html}")


def _figures(fig: AccuracyFigures, a: AccuracyReport, *, bounds: bool) -> str:
    """``mean KL …, top-1 …, ppl ratio …`` of one session, each with its threshold when ``bounds``."""

    def bound(limit: float | None, word: str) -> str:
        return f" ({word} {limit:g})" if bounds and limit is not None else ""

    return (
        f"mean KL {fig.mean_kl:.3g} nats{bound(a.max_mean_kl, 'max')}, "
        f"top-1 {fig.top1_agreement:.3f}{bound(a.min_top1_agreement, 'min')}, "
        f"ppl ratio {fig.ppl_ratio:.4f}{bound(a.max_ppl_ratio, 'max')}"
    )


def accuracy_text(a: AccuracyReport) -> str:
    """One line: ``verify.accuracy``'s weight-only figures with their thresholds, then ORT's default levels'."""
    verdict = "ok" if a.passed else "FAILED"
    line = f"accuracy on {a.weight_only.positions} held-out positions ({verdict}): weight-only "
    line += _figures(a.weight_only, a, bounds=True)
    if not a.default_is_weight_only:
        line += "; ORT default accuracy levels: " + _figures(a.default_optimized, a, bounds=False)
    return line


def resources_text(report: RunReport) -> str:
    """One line: the run's wall time (from process start) and its peak memory (RSS) with the phase that reached it."""
    line = f"wall time {report.wall_time_s:.2f} s"
    peak = report.peak_memory()
    if peak is not None:
        line += f"; peak memory {format_bytes(peak[0])} RSS (reached in phase {peak[1]})"
    return line


def passes_table(passes: list[PassReport]) -> Table:
    """Per pass: nodes (summed over a graph set's graphs), ops added/removed (decode graph), dims fixed, time (s)."""
    table = Table(title="passes")
    several = any(max(p.graphs_before, p.graphs_after) > 1 for p in passes)
    ops = ("ops added (decode graph)", "ops removed (decode graph)") if several else ("ops added", "ops removed")
    for col in ("pass", "nodes", *ops, "dims fixed", "time (s)"):
        table.add_column(col)
    for p in passes:
        moved = p.moved_to_parts()
        table.add_row(
            p.name,
            p.nodes_text(),
            ops_text(p.ops_added, "+"),
            ops_text(p.ops_removed, "-") if moved is None else f"moved to {moved}: " + ops_text(p.ops_removed, " "),
            str(len(p.dims_fixed)),
            f"{p.wall_time_s:.2f}" + (" (cached)" if p.cache == "hit" else ""),
        )
    return table


def print_first_divergent(out: Console, verify: VerifyReport, *, with_failures: bool = False) -> None:
    """Per mode: its first divergent step (and, with ``with_failures``, its failure lines)."""
    for m in verify.modes.values():
        first = "none" if m.first_divergent_step is None else f"position {m.first_divergent_step}"
        out.print(f"{m.mode}: first divergent step: {first}")
        if with_failures:
            for msg in m.failures:  # each line starts with its mode
                out.print(f"[red]FAILED:[/] {escape(msg)}", soft_wrap=True)


def print_verify(out: Console, result: VerifyReport) -> None:
    """``onnxdeploy verify``'s summary: the modes' table, first divergent steps, failures, the verdict."""
    out.print(verify_table(result))
    if (reference := result.reference.note(None)) is not None:  # a cache_policy's cut past
        out.print(f"[yellow]{escape(reference)}[/]", soft_wrap=True)
    print_first_divergent(out, result, with_failures=True)
    if result.generations is not None:
        from onnxdeploy.text_report import generations_table  # noqa: PLC0415  (report models)

        out.print(generations_table(result.generations, result.reference.label()))
    for msg in result.failures:
        out.print(f"[red]FAILED:[/] {escape(msg)}", soft_wrap=True)
    out.print("[bold green]PASSED[/]" if result.passed else "[bold red]FAILED[/]")


def print_sdk(out: Console, sdk: dict[str, Any]) -> None:
    """The SDK's build outcome, its CPU placements and where it disagrees with the matrix."""
    built = "built" if sdk["built"] else f"[red]did not build[/]: {escape(sdk['error'])}"
    out.print(f"{escape(sdk['sdk'])} ({sdk['target_platform']}): {built} in {sdk['seconds']} s")
    for n in sdk["nodes"]:
        if n["sdk"] in ("cpu", "no_npu_lowering") or n["matrix"] != "supported":
            rule = f" ({n['rule']})" if n["rule"] else ""
            out.print(
                f"    {escape(n['node'])} ({n['op']}): SDK {n['sdk']}{rule}; matrix {n['matrix']}", soft_wrap=True
            )
    if sdk["disagreements"]:
        out.print(f"[yellow]{len(sdk['disagreements'])} node(s) where the SDK and the matrix disagree[/] (--json: sdk)")
