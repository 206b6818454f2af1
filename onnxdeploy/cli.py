"""The ``onnxdeploy`` command line: a thin typer layer over the library.

Exit status: 0 success, 1 a check or the verification failed, 2 bad input or configuration.
Domain errors are caught at each command, printed once, and turned into ``typer.Exit(code)``.

Here: the app, ``run`` and ``passes``, the root options and :func:`main`. The other commands live beside it,
one module per concept: ``cli_model`` (``inspect``, ``check``, ``sdk``), ``cli_verify`` (``verify``),
``cli_matrix`` (``matrix``), ``plan_cli`` (``plan``); ``cli_common`` holds what they share (consoles, options,
errors, progress).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from onnxdeploy import IMPORTED_AT
from onnxdeploy.cli_common import (
    STATE,
    JsonOpt,
    QuietOpt,
    consoles,
    fail,
    interrupt_on_termination,
    interrupted,
    progress,
    progress_callback,
)
from onnxdeploy.cli_matrix import matrix_app
from onnxdeploy.cli_model import check_cmd, inspect, sdk_app
from onnxdeploy.cli_verify import verify_cmd
from onnxdeploy.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError, OnnxDeployError
from onnxdeploy.plan_cli import plan_cmd
from onnxdeploy.resources import exec_with_system_allocator, fixed_mmap_threshold, run_clock_start

if TYPE_CHECKING:  # the commands import the library lazily: `onnxdeploy --help` stays fast
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
    out, err = consoles(as_json)
    if output_dir is not None and not str(output_dir).strip():
        raise fail(err, ConfigError("--output-dir is empty"), as_json=as_json)
    interrupt_on_termination()
    try:
        config = _run_config(pipeline, output_dir, cache_dir=cache_dir, no_cache=no_cache, bisect=bisect)
        from onnxdeploy.pipeline import run_pipeline  # noqa: PLC0415  (onnx, ORT: only once the config is valid)

        with progress(err, quiet=quiet) as bar:
            on_step = progress_callback(bar)
            outcome = run_pipeline(
                config,
                progress=None if quiet else lambda msg: err.print(f"[dim]•[/] {escape(msg)}", highlight=False),
                verify_progress=on_step,
                step_progress=on_step,
                started=run_clock_start(IMPORTED_AT),
            )
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=as_json) from None
    except OSError as exc:  # e.g. the pipeline file is unreadable
        error = OnnxDeployError(f"{exc.filename or pipeline}: {exc.strerror or exc}")
        raise fail(err, error, as_json=as_json) from None
    except KeyboardInterrupt:
        raise interrupted(err, as_json=as_json) from None
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


app.command()(inspect)


@app.command("passes")
def list_passes(*, as_json: JsonOpt = False) -> None:
    """List every pass with its config keys (nested ones as budget.max_mean_kl), types, defaults and descriptions."""
    from onnxdeploy.pass_listing import config_rows
    from onnxdeploy.passes import CATALOG  # the catalogue: no pass module (onnx) is imported
    from onnxdeploy.render import yaml_inline

    rows = [
        {"name": name, "summary": info.summary, "config": config_rows(info.config_model)}
        for name, info in sorted(CATALOG.items())
    ]
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2, default=str) + "\n")
        raise typer.Exit(EXIT_OK)
    out, _ = consoles(False)
    for row in rows:
        table = Table(title=f"{row['name']} — {row['summary']}", title_justify="left")
        for col in ("field", "type", "default", "description"):
            table.add_column(col, overflow="fold")
        for f in row["config"]:
            default = "(required)" if f["required"] else yaml_inline(json.loads(json.dumps(f["default"], default=str)))
            table.add_row(f["name"], f["type"], escape(default), f["description"])
        out.print(table)
    raise typer.Exit(EXIT_OK)


app.command("verify")(verify_cmd)
app.command("check")(check_cmd)
app.add_typer(matrix_app, name="matrix")
app.add_typer(sdk_app, name="sdk")
app.command("plan")(plan_cmd)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Print the traceback of an error (e.g. `onnxdeploy --debug run p.yaml`).")
    ] = False,
) -> None:
    STATE.debug = debug
    if version:
        from onnxdeploy import __version__  # noqa: PLC0415  (importlib.metadata: ~25 ms, only for --version)

        typer.echo(f"onnxdeploy {__version__}")
        raise typer.Exit(EXIT_OK)


def main() -> None:
    """Console-script entry point (``onnxdeploy``).

    Usage errors (bad options, missing arguments) exit 2 with typer's message on stderr; with ``--json``
    a JSON error object is also written to stdout, so CI parsers always get JSON.
    """
    exec_with_system_allocator(sys.argv[1] if len(sys.argv) > 1 else None)  # run / verify: resources.py says why
    fixed_mmap_threshold()  # freed large blocks go back to the kernel (resources.fixed_mmap_threshold)
    try:
        app()
    except SystemExit as exc:
        if exc.code == EXIT_BAD_INPUT and "--json" in sys.argv[1:] and not STATE.json_error_written:
            payload = {"status": "error", "exit_code": EXIT_BAD_INPUT, "error": "usage error (see stderr)"}
            sys.stdout.write(json.dumps(payload) + "\n")
        raise
