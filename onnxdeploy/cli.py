"""The ``onnxdeploy`` command line: a thin typer layer over the library.

Exit status: 0 success, 1 a check or the verification failed, 2 bad input or configuration.
Domain errors are caught here, printed once, and turned into ``typer.Exit(code)``.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from onnxdeploy import __version__
from onnxdeploy.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ConfigError, OnnxDeployError, OutputError

if TYPE_CHECKING:  # the commands import the library lazily: `onnxdeploy --help` stays fast
    from rich.progress import Progress

    from onnxdeploy.config import PipelineConfig

__all__ = ["app", "main"]

app = typer.Typer(
    name="onnxdeploy",
    help="Make an ONNX LLM decoder with a KV cache static for edge NPUs, check it, and prove it decodes the same.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: flags show no '<bool>' value, nothing is boxed or wrapped mid-path
)

_json_error_written = False
"""Set once a JSON error object went to stdout, so :func:`main` does not write a second one."""

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress and no summary: only errors and failure reasons (stderr).")
]

NON_TERMINAL_WIDTH = 160
"""Columns for tables when output is not a terminal (CI logs, pipes); lines there are never wrapped."""


def _console(*, stderr: bool) -> Console:
    """A console for stdout or stderr; off a terminal it never wraps a line (paths stay whole for CI logs)."""
    console = Console(stderr=stderr, highlight=False)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=max(console.width, NON_TERMINAL_WIDTH))


def _consoles(as_json: bool) -> tuple[Console, Console]:
    """(out, err): with --json, human output goes to stderr so stdout stays pure JSON."""
    err = _console(stderr=True)
    out = err if as_json else _console(stderr=False)
    return out, err


_debug = False
"""Set by ``--debug`` (root option): errors also print their traceback."""


def _fail(err: Console, exc: OnnxDeployError, *, as_json: bool = False) -> typer.Exit:
    """Print a domain error once (and, with --json, a JSON error object on stdout); return the Exit.

    With ``--debug`` the traceback of ``exc`` (and its causes) is printed first.
    """
    if _debug:
        err.print("".join(traceback.format_exception(exc)), markup=False, highlight=False, soft_wrap=True)
    err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    if as_json:
        global _json_error_written
        payload = {"status": "error", "exit_code": exc.exit_code, "error": str(exc), "type": type(exc).__name__}
        sys.stdout.write(json.dumps(payload) + "\n")
        _json_error_written = True
    return typer.Exit(exc.exit_code)


EXIT_INTERRUPTED = 130
"""Exit status after SIGINT (128 + 2, the shell convention)."""


def _interrupted(err: Console, *, as_json: bool) -> typer.Exit:
    """Say that the run was interrupted and that nothing was left behind; return the Exit (status 130)."""
    message = "interrupted: the run stopped and its temporary files were removed; no output was written"
    err.print(f"[bold yellow]{message}[/]")
    if as_json:
        global _json_error_written
        sys.stdout.write(json.dumps({"status": "interrupted", "exit_code": EXIT_INTERRUPTED, "error": message}) + "\n")
        _json_error_written = True
    return typer.Exit(EXIT_INTERRUPTED)


def _interrupt_on_termination() -> None:
    """Make SIGTERM and SIGHUP (CI cancel, ``timeout``, a closed terminal) interrupt like Ctrl-C.

    The run then removes its temporary files and exits 130 instead of dying with them on disk.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.default_int_handler)


def _progress(console: Console, *, quiet: bool = False) -> Progress:
    """Progress bars on ``console`` (stderr), removed when done; none with ``--quiet``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet,
    )


_STAGES = {"passes": "passes", "checks": "checks", "reference": "decode original"}
"""Bar labels of the pipeline's stages and the runner's reference decode; other names are verify modes."""


def _progress_callback(bar: Progress) -> Callable[[str, int, int], None]:
    """Return a ``(stage, done, total)`` callback that keeps one bar per stage (passes, checks, each decode mode)."""
    tasks: dict[str, Any] = {}

    def on_step(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(_STAGES.get(stage, f"verify {stage}"), total=total)
        bar.update(tasks[stage], completed=done, total=total)

    return on_step


@app.command()
def run(
    pipeline: Annotated[Path, typer.Argument(help="The pipeline YAML file.")],
    *,
    output_dir: Annotated[
        Path | None, typer.Option("--output-dir", "-o", help="Override the pipeline's output_dir.")
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option("--cache-dir", help="Pass cache folder (overrides the pipeline's cache.dir).")
    ] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Run every pass; neither read nor write the pass cache.")
    ] = False,
    bisect: Annotated[
        bool,
        typer.Option(
            "--bisect",
            help="Decode after every pass (verify_each_pass) and name the first diverging pass and its first "
            "diverging node (pipeline key: bisect).",
        ),
    ] = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run a pipeline: passes, checks, step-by-step verification; write the model, report.json|md|html."""
    out, err = _consoles(as_json)
    if output_dir is not None and not str(output_dir).strip():
        raise _fail(err, ConfigError("--output-dir is empty"), as_json=as_json)
    _interrupt_on_termination()
    try:
        config = _run_config(pipeline, output_dir, cache_dir=cache_dir, no_cache=no_cache, bisect=bisect)
        from onnxdeploy.pipeline import run_pipeline  # noqa: PLC0415  (onnx, ORT: only once the config is valid)

        with _progress(err, quiet=quiet) as bar:
            on_step = _progress_callback(bar)
            outcome = run_pipeline(
                config,
                progress=None if quiet else lambda msg: err.print(f"[dim]•[/] {escape(msg)}", highlight=False),
                verify_progress=on_step,
                step_progress=on_step,
            )
    except OnnxDeployError as exc:
        raise _fail(err, exc, as_json=as_json) from None
    except OSError as exc:  # e.g. the pipeline file is unreadable
        error = OnnxDeployError(f"{exc.filename or pipeline}: {exc.strerror or exc}")
        raise _fail(err, error, as_json=as_json) from None
    except KeyboardInterrupt:
        raise _interrupted(err, as_json=as_json) from None
    report = outcome.report
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    if quiet:
        for reason in report.failures:
            err.print(f"FAILED: {reason}", markup=False)
    elif not as_json:
        from onnxdeploy.console_report import print_run  # noqa: PLC0415  (report models)

        print_run(out, outcome)
    raise typer.Exit(outcome.exit_code)


def _run_config(
    pipeline: Path, output_dir: Path | None, *, cache_dir: Path | None, no_cache: bool, bisect: bool
) -> PipelineConfig:
    """The pipeline file with the command line's overrides (``-o``, ``--bisect``, ``--no-cache``, ``--cache-dir``).

    Raises:
        ConfigError: the pipeline is invalid, or ``--bisect`` without a verify section.
    """
    from onnxdeploy.cache_config import CacheConfig
    from onnxdeploy.config import load_pipeline

    config = load_pipeline(pipeline, output_dir=output_dir)
    if bisect:
        if config.verify is None:
            raise ConfigError(f"{pipeline}: --bisect needs a verify section (its prompt and thresholds)")
        config = config.model_copy(update={"bisect": True, "verify_each_pass": True})
    if no_cache:
        config = config.model_copy(update={"cache": None})
    elif cache_dir is not None:
        section = config.cache or CacheConfig()
        config = config.model_copy(update={"cache": section.model_copy(update={"dir": cache_dir.resolve()})})
    return config


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="An ONNX model file.")],
    *,
    as_json: JsonOpt = False,
) -> None:
    """Show a model's inputs/outputs (symbolic dims), opsets, op histogram, size, external data and contract."""
    from onnxdeploy.inspect import inspect_model

    out, err = _consoles(as_json)
    try:
        info = inspect_model(model)
    except OnnxDeployError as exc:
        raise _fail(err, exc, as_json=as_json) from None
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    out.print(
        f"[bold]{info['path']}[/]  ({info['file_bytes']} bytes, ir_version {info['ir_version']}, "
        f"producer {info['producer']})"
    )
    out.print("opsets: " + ", ".join(f"{d} {v}" for d, v in info["opsets"].items()))
    for kind in ("inputs", "outputs"):
        table = Table(title=kind)
        table.add_column("name")
        table.add_column("dtype")
        table.add_column("shape")
        for t in info[kind]:
            table.add_row(escape(t["name"]), t["dtype"], escape(t["shape_text"]))
        out.print(table)
    symbolic = info["symbolic_dims"]
    out.print("symbolic dims: " + (", ".join(symbolic) if symbolic else "none (all static)"))
    out.print("ops: " + ", ".join(f"{k}×{v}" for k, v in info["op_histogram"].items()))
    out.print(f"nodes: {info['nodes']}, initializers: {info['initializers']} ({info['initializer_bytes']} bytes)")
    ext = info["external_data"]
    out.print(
        "external data: "
        + (
            ", ".join(f"{e['location']} ({e['tensors']} tensors{'' if e['present'] else ', MISSING'})" for e in ext)
            or "none"
        )
    )
    if info["contract"]:
        out.print("contract: " + json.dumps(info["contract"]), soft_wrap=True, highlight=False, markup=False)
    else:
        out.print("contract: none (exporter convention)")
    raise typer.Exit(EXIT_OK)


@app.command("passes")
def list_passes(*, as_json: JsonOpt = False) -> None:
    """List every pass with its config fields, types, defaults (YAML) and descriptions."""
    from onnxdeploy.passes import CATALOG, describe_config  # the catalogue: no pass module (onnx) is imported
    from onnxdeploy.render import yaml_inline

    rows = [
        {"name": name, "summary": info.summary, "config": describe_config(info.config_model)}
        for name, info in sorted(CATALOG.items())
    ]
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2, default=str) + "\n")
        raise typer.Exit(EXIT_OK)
    out, _ = _consoles(False)
    for row in rows:
        table = Table(title=f"{row['name']} — {row['summary']}", title_justify="left")
        for col in ("field", "type", "default", "description"):
            table.add_column(col, overflow="fold")
        for f in row["config"]:
            default = "(required)" if f["required"] else yaml_inline(json.loads(json.dumps(f["default"], default=str)))
            table.add_row(f["name"], f["type"], escape(default), f["description"])
        out.print(table)
    raise typer.Exit(EXIT_OK)


PromptTextOpt = Annotated[
    str | None, typer.Option("--prompt-text", help="The prompt as text, replacing --prompt (the text extra).")
]
TokenizerOpt = Annotated[
    Path | None, typer.Option("--tokenizer", help="tokenizer.json or its folder (default: the original's folder).")
]
ChatTemplateOpt = Annotated[
    bool, typer.Option("--chat-template", help="Render --prompt-text through the folder's chat template.")
]


@app.command("verify")
def verify_cmd(
    original: Annotated[Path, typer.Argument(help="The original model (exporter convention).")],
    candidate: Annotated[Path, typer.Argument(help="The candidate: with a decode contract, or exporter convention.")],
    *,
    steps: Annotated[int, typer.Option("--steps", "-n", min=0, help="Greedy steps after the prompt.")] = 32,
    prompt: Annotated[str, typer.Option("--prompt", help="Comma-separated prompt token ids.")] = "1,17,42,99,7,3",
    prompt_text: PromptTextOpt = None,
    tok: TokenizerOpt = None,
    chat: ChatTemplateOpt = False,
    max_abs_logit_diff: Annotated[float, typer.Option(help="Tolerance on max abs logit diff.")] = 1e-4,
    min_top1_agreement: Annotated[float, typer.Option(help="Minimum top-1 agreement rate.")] = 1.0,
    providers: Annotated[
        str, typer.Option("--providers", help="Comma-separated ONNX Runtime execution providers, in priority order.")
    ] = "CPUExecutionProvider",
    strict_providers: Annotated[
        bool, typer.Option("--strict-providers", help="Exit 1 when a requested provider fell back to another.")
    ] = False,
    remainder: Annotated[
        str, typer.Option("--remainder", help="Graph sets: feed the prompt's remainder 'padded' or through 'buckets'.")
    ] = "padded",
    report: Annotated[
        Path | None, typer.Option("--report", help="Also write the JSON report here (its folder must exist).")
    ] = None,
    max_rows: Annotated[
        int, typer.Option("--max-rows", min=1, help="Per-position rows listed per mode in the JSON at most.")
    ] = 200,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run the step-by-step runner alone: decode both models greedily and compare logits per position.

    A candidate whose contract lists a graph set (prefill buckets, several cache lengths) is driven as a set.
    """
    from onnxdeploy.console_report import print_verify
    from onnxdeploy.report import SCHEMA_VERSION, summarise_verify
    from onnxdeploy.runner import verify
    from onnxdeploy.text import generations_with

    out, err = _consoles(as_json)
    try:
        tokens, requested, tok = _verify_args(prompt, providers, remainder, report, (original, prompt_text, tok, chat))
        with _progress(err, quiet=quiet) as bar:
            on_verify = _progress_callback(bar)
            result = verify(
                str(original),
                str(candidate),
                prompt=tokens,
                steps=steps,
                max_abs_logit_diff=max_abs_logit_diff,
                min_top1_agreement=min_top1_agreement,
                providers=tuple(requested),
                strict_providers=strict_providers,
                remainder=remainder,  # type: ignore[arg-type]
                progress=on_verify,
            )
    except OnnxDeployError as exc:
        raise _fail(err, exc, as_json=as_json) from None
    except KeyboardInterrupt:
        raise _interrupted(err, as_json=as_json) from None
    result = generations_with(result, tok, prompt_text=prompt_text, chat=chat)
    result = summarise_verify(result, max_rows)
    head = {"schema_version": SCHEMA_VERSION, "status": "passed" if result.passed else "failed"}
    payload = json.dumps({**head, **result.model_dump(mode="json")}, indent=2)
    if report is not None:
        try:
            _write_verify_report(report, payload, original, candidate)
        except OnnxDeployError as exc:
            raise _fail(err, exc, as_json=as_json) from None
    if not quiet:
        for line in result.provider_fallbacks:
            err.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)
    if as_json:
        sys.stdout.write(payload + "\n")
    if quiet:
        for msg in [*result.failures, *(line for m in result.modes.values() for line in m.failures)]:
            err.print(f"FAILED: {msg}", markup=False)
    elif not as_json:
        print_verify(out, result)
    raise typer.Exit(EXIT_OK if result.passed else EXIT_FAILED)


def _verify_args(
    prompt: str, providers: str, remainder: str, report: Path | None, text: tuple[Path, str | None, Path | None, bool]
) -> tuple[list[int], list[str], Path | None]:
    """``onnxdeploy verify``'s options checked before any model is read: the prompt ids and the providers.

    ``text`` is ``(original, --prompt-text, --tokenizer, --chat-template)``: the prompt text replaces the ids
    (``onnxdeploy.text.text_prompt``), and the tokenizer found is returned third (None without one).

    Raises:
        ConfigError: the prompt is empty or not comma-separated integers, no provider, an unknown remainder.
        OutputError: ``--report``'s folder does not exist.
    """
    try:
        tokens = [int(t) for t in prompt.split(",")]
    except ValueError:
        raise ConfigError(f"--prompt must be comma-separated integers, got {prompt!r}") from None
    if not tokens:
        raise ConfigError("--prompt is empty")
    requested = [name.strip() for name in providers.split(",") if name.strip()]
    if not requested:
        raise ConfigError("--providers is empty")
    if remainder not in ("padded", "buckets"):
        raise ConfigError(f"--remainder must be 'padded' or 'buckets', got {remainder!r}")
    if report is not None and not report.parent.is_dir():
        raise OutputError(f"--report {report}: folder {report.parent} does not exist; create it or choose another")
    from onnxdeploy.text import text_prompt  # noqa: PLC0415  (tokenizers only when asked for)

    original, prompt_text, tokenizer, chat = text
    tokens, found = text_prompt(original, tokens, prompt_text, tokenizer, chat=chat)
    return tokens, requested, found


def _write_verify_report(report: Path, payload: str, original: Path, candidate: Path) -> None:
    """Write ``--report`` atomically.

    Raises:
        OutputError: it would overwrite one of the models' files, or it cannot be written.
    """
    from onnxdeploy.artifacts import write_text_atomic
    from onnxdeploy.model_io import check_not_an_input, input_files

    try:
        check_not_an_input(report, input_files(original) | input_files(candidate), "--report")
        write_text_atomic(report, payload)
    except OSError as exc:
        raise OutputError(f"cannot write --report {report}: {exc.strerror or exc}") from None


matrix_app = typer.Typer(
    help="Compatibility matrices: list targets, show one, look up an op across targets.", no_args_is_help=True
)
app.add_typer(matrix_app, name="matrix")


@matrix_app.command("list")
def matrix_list(*, as_json: JsonOpt = False) -> None:
    """List every target with its kind, version, ai.onnx opset range, IR range and op count."""
    from onnxdeploy.matrices import get_target, list_targets

    out, err = _consoles(as_json)
    try:
        matrices = [get_target(t) for t in list_targets()]
    except OnnxDeployError as exc:
        raise _fail(err, exc, as_json=as_json) from None
    rows = []
    for m in matrices:
        ai = m.opsets.get("ai.onnx")
        rows.append(
            {
                "target": m.target,
                "name": m.name,
                "kind": m.kind,
                "product_version": m.product_version,
                "ai_onnx_opset": [ai.min, ai.max] if ai else None,
                "ir_version": [m.ir_version.min, m.ir_version.max] if m.ir_version else None,
                "static_shapes": m.static_shapes,
                "ops": len(m.ops),
                "ops_complete": m.ops_complete,
                "gaps": len(m.gaps),
            }
        )
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    table = Table(title="targets (matrices/)")
    for col in ("target", "kind", "version", "ai.onnx", "IR", "static", "ops", "gaps"):
        table.add_column(col, overflow="fold")
    for r in rows:
        opset, ir = r["ai_onnx_opset"], r["ir_version"]
        table.add_row(
            r["target"],
            r["kind"],
            escape(r["product_version"]),
            f"{opset[0]}..{opset[1]}" if opset else "?",
            f"{ir[0]}..{ir[1]}" if ir else "?",
            r["static_shapes"] or "?",
            f"{r['ops']}" + ("" if r["ops_complete"] else " (partial)"),
            str(r["gaps"]),
        )
    out.print(table)
    raise typer.Exit(EXIT_OK)


@matrix_app.command("show")
def matrix_show(
    target: Annotated[str, typer.Argument(help="A target id (see `onnxdeploy matrix list`).")],
    *,
    as_json: JsonOpt = False,
) -> None:
    """Show one target's matrix: ranges, dtypes, limits, sources, gaps; with --json, the whole file."""
    from onnxdeploy.matrices import get_target

    out, err = _consoles(as_json)
    try:
        m = get_target(target)
    except OnnxDeployError as exc:
        raise _fail(err, exc, as_json=as_json) from None
    if as_json:
        sys.stdout.write(m.model_dump_json(indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    out.print(f"[bold]{m.target}[/]: {escape(m.name)} ({m.kind}; {escape(m.product_version)})")
    out.print(escape(m.description), soft_wrap=True)
    ir = f"{m.ir_version.min}..{m.ir_version.max} [{m.ir_version.source}]" if m.ir_version else "unsourced"
    out.print(f"IR version: {ir}; static shapes: {m.static_shapes or 'unsourced'}")
    out.print("opsets: " + ", ".join(f"{d} {r.min}..{r.max} [{r.source}]" for d, r in m.opsets.items()))
    for name, d in m.dtypes.items():
        out.print(f"dtype {name}: {d.supported} [{d.source}] {escape(d.note)}", soft_wrap=True)
    for lim in m.limits:
        out.print(f"limit {lim.name} <= {lim.value} {lim.unit} {escape(lim.applies_to)} [{lim.source}]")
    ops = sorted({f"{e.op}" if e.domain == "ai.onnx" else f"{e.domain}::{e.op}" for e in m.ops})
    out.print(f"ops ({len(ops)}{'' if m.ops_complete else ', partial list'}): " + ", ".join(ops), soft_wrap=True)
    for sid, s in m.sources.items():
        out.print(f"[{sid}] {escape(s.doc)}, {escape(s.section)} ({escape(s.version)}; {s.address}; read {s.read})")
    for gap in m.gaps:
        out.print(f"[yellow]gap:[/] {escape(gap)}", soft_wrap=True)
    raise typer.Exit(EXIT_OK)


@matrix_app.command("lookup")
def matrix_lookup(
    op: Annotated[str, typer.Argument(help="Operator type, e.g. Attention.")],
    *,
    opset: Annotated[int | None, typer.Option("--opset", min=1, help="The model's opset for the op's domain.")] = None,
    target: Annotated[str | None, typer.Option("--target", "-t", help="One target; default: all.")] = None,
    domain: Annotated[str, typer.Option("--domain", help="Operator domain.")] = "ai.onnx",
    as_json: JsonOpt = False,
) -> None:
    """Which targets take OP (at --opset), under which constraints; and each target's highest opset."""
    from onnxdeploy.matrices import get_target, lookup

    out, err = _consoles(as_json)
    try:
        answers = lookup(op, opset=opset, target=target, domain=domain)
    except OnnxDeployError as exc:
        raise _fail(err, exc, as_json=as_json) from None
    rows = []
    for a in answers:
        m = get_target(a.target)
        rows.append(
            {
                "target": a.target,
                "verdict": a.verdict,
                "reason": a.reason,
                "max_opset": a.max_opset,
                "entries": [e.model_dump(exclude_none=True) for e in a.entries],
                "sources": {e.source: m.source_text(e.source) for e in a.entries},
            }
        )
    if as_json:
        sys.stdout.write(json.dumps({"op": op, "domain": domain, "opset": opset, "answers": rows}, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    table = Table(title=f"{domain}::{op}" + (f" at opset {opset}" if opset else ""))
    for col in ("target", "takes it", "why", "constraints", "max opset"):
        table.add_column(col, overflow="fold")
    colours = {"yes": "green", "no": "red", "unknown": "yellow"}
    for r in rows:
        cons = []
        for e in r["entries"]:
            parts = [f"{k}: {'|'.join(v)}" for k, v in (e.get("types") or {}).items()]
            parts += e.get("constraints", [])
            if e.get("placement") == "cpu_fallback":
                parts.append("runs on CPU")
            cons.append(f"v{e['since']}..{e.get('until', '∞')}: " + ("; ".join(parts) or "none stated"))
        table.add_row(
            r["target"],
            f"[{colours[r['verdict']]}]{r['verdict']}[/]",
            escape(r["reason"]),
            escape("\n".join(cons)),
            str(r["max_opset"] or "?"),
        )
    out.print(table)
    for verdict, label in (("yes", "take it"), ("no", "lack it"), ("unknown", "unknown")):
        named = [r["target"] for r in rows if r["verdict"] == verdict]
        if named:
            out.print(f"{label}: {', '.join(named)}", soft_wrap=True)
    raise typer.Exit(EXIT_OK)


sdk_app = typer.Typer(help="Device SDK environments (installed on request, run as subprocesses).", no_args_is_help=True)
app.add_typer(sdk_app, name="sdk")


@sdk_app.command("install")
def sdk_install(
    name: Annotated[str, typer.Argument(help="The SDK: rknn (RKNN-Toolkit2 2.5.0, ~5.6 GB with torch).")],
) -> None:
    """Create the SDK's own virtual environment ($ONNXDEPLOY_SDK_HOME, default ~/.cache/onnxdeploy/sdk)."""
    from onnxdeploy.sdk import install_rknn

    out, err = _consoles(False)
    if name != "rknn":
        raise _fail(err, ConfigError(f"unknown SDK '{name}'; known: rknn"), as_json=False)
    try:
        python = install_rknn(log=lambda line: out.print(escape(line), soft_wrap=True))
    except OnnxDeployError as exc:
        raise _fail(err, exc, as_json=False) from None
    out.print(f"RKNN-Toolkit2 environment ready: {python}")
    raise typer.Exit(EXIT_OK)


@sdk_app.command("status")
def sdk_status() -> None:
    """Say whether each SDK environment is installed (exit 0 either way)."""
    from onnxdeploy.sdk import rknn_env, rknn_python

    out, _ = _consoles(False)
    python = rknn_python()
    out.print(f"rknn: {'installed, ' + str(python) if python else 'not installed (' + str(rknn_env()) + ')'}")
    raise typer.Exit(EXIT_OK)


@app.command("check")
def check_cmd(
    model: Annotated[Path, typer.Argument(help="An ONNX model file.")],
    *,
    target: Annotated[str | None, typer.Option("--target", "-t", help="A target id of matrices/.")] = None,
    checks: Annotated[
        str | None, typer.Option("--checks", help="Comma-separated check names instead of the defaults.")
    ] = None,
    sdk: Annotated[
        bool,
        typer.Option(
            "--sdk",
            help="Also build with the target's SDK (rknn-rk3588) and show its verdict per node beside the matrix's.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run the checks on a model (against --target's matrix): findings with node, rule, source and fixing pass.

    Exit 0 when no finding is an error (and, with --sdk, the SDK builds the model), 1 otherwise, 2 for bad input.
    """
    from onnxdeploy.model_check import check_model_file

    out, err = _consoles(as_json)
    names = [c.strip() for c in checks.split(",") if c.strip()] if checks is not None else None
    try:
        report = check_model_file(model, target=target, checks=names, sdk=sdk)
    except OnnxDeployError as exc:
        raise _fail(err, exc, as_json=as_json) from None
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        out.print(f"checks run: {', '.join(report.checks_run)}" + (f"; target {target}" if target else ""))
        for f in report.findings:
            colour = {"error": "red", "warning": "yellow", "info": "dim"}[f.level]
            out.print(f"[{colour}]{f.code} {f.level}[/] {escape(f.message)}", soft_wrap=True)
            if f.rule:
                out.print(f"    rule: {escape(f.rule)}", soft_wrap=True)
            if f.source:
                out.print(f"    source: {escape(f.source)}", soft_wrap=True)
            if f.hint:
                out.print(f"    fix: {escape(f.hint)}", soft_wrap=True)
        if report.sdk is not None:
            from onnxdeploy.console_report import print_sdk  # noqa: PLC0415  (report models)

            print_sdk(out, report.sdk)
        s = report.summary
        colour = "green" if report.status == "passed" else "red"
        out.print(
            f"[bold {colour}]{report.status.upper()}[/]: {s['error']} error(s), {s['warning']} warning(s), "
            f"{s['info']} info"
        )
    raise typer.Exit(EXIT_OK if report.status == "passed" else EXIT_FAILED)


# `onnxdeploy plan` (issue 17): the command lives in onnxdeploy/plan_cli.py; only registered here.
from onnxdeploy.plan_cli import plan_cmd  # noqa: E402

app.command("plan")(plan_cmd)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Print the traceback of an error (e.g. `onnxdeploy --debug run p.yaml`).")
    ] = False,
) -> None:
    global _debug
    _debug = debug
    if version:
        typer.echo(f"onnxdeploy {__version__}")
        raise typer.Exit(EXIT_OK)


def main() -> None:
    """Console-script entry point (``onnxdeploy``).

    Usage errors (bad options, missing arguments) exit 2 with typer's message on stderr; with ``--json``
    a JSON error object is also written to stdout, so CI parsers always get JSON.
    """
    try:
        app()
    except SystemExit as exc:
        if exc.code == EXIT_BAD_INPUT and "--json" in sys.argv[1:] and not _json_error_written:
            payload = {"status": "error", "exit_code": EXIT_BAD_INPUT, "error": "usage error (see stderr)"}
            sys.stdout.write(json.dumps(payload) + "\n")
        raise
