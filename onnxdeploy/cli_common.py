"""What every ``onnxdeploy`` command shares: consoles, shared options, errors printed once, progress bars.

A command parses its options, calls the library and prints; a domain error (:class:`OnnxDeployError`) is caught
at the command boundary, printed once by :func:`fail` and turned into ``typer.Exit(code)``.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from onnxdeploy.errors import OnnxDeployError

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = [
    "EXIT_INTERRUPTED",
    "NON_TERMINAL_WIDTH",
    "STATE",
    "JsonOpt",
    "QuietOpt",
    "console",
    "consoles",
    "fail",
    "interrupt_on_termination",
    "interrupted",
    "progress",
    "progress_callback",
]


@dataclass
class CliState:
    """Process-wide CLI state: set by the root options and read where an error is printed."""

    debug: bool = False
    """Set by ``--debug`` (root option): errors also print their traceback."""
    json_error_written: bool = False
    """Set once a JSON error object went to stdout, so ``main`` does not write a second one."""


STATE = CliState()
"""The one :class:`CliState` of this process."""

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress and no summary: only errors and failure reasons (stderr).")
]

NON_TERMINAL_WIDTH = 160
"""Columns for tables when output is not a terminal (CI logs, pipes); lines there are never wrapped."""


def console(*, stderr: bool) -> Console:
    """A console for stdout or stderr; off a terminal it never wraps a line (paths stay whole for CI logs)."""
    console = Console(stderr=stderr, highlight=False)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=max(console.width, NON_TERMINAL_WIDTH))


def consoles(as_json: bool) -> tuple[Console, Console]:
    """(out, err): with --json, human output goes to stderr so stdout stays pure JSON."""
    err = console(stderr=True)
    out = err if as_json else console(stderr=False)
    return out, err


def fail(err: Console, exc: OnnxDeployError, *, as_json: bool = False) -> typer.Exit:
    """Print a domain error once (and, with --json, a JSON error object on stdout); return the Exit.

    With ``--debug`` the traceback of ``exc`` (and its causes) is printed first.
    """
    if STATE.debug:
        err.print("".join(traceback.format_exception(exc)), markup=False, highlight=False, soft_wrap=True)
    err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    if as_json:
        payload = {"status": "error", "exit_code": exc.exit_code, "error": str(exc), "type": type(exc).__name__}
        sys.stdout.write(json.dumps(payload) + "\n")
        STATE.json_error_written = True
    return typer.Exit(exc.exit_code)


EXIT_INTERRUPTED = 130
"""Exit status after SIGINT (128 + 2, the shell convention)."""


def interrupted(err: Console, *, as_json: bool) -> typer.Exit:
    """Say that the run was interrupted and that nothing was left behind; return the Exit (status 130)."""
    message = "interrupted: the run stopped and its temporary files were removed; no output was written"
    err.print(f"[bold yellow]{message}[/]")
    if as_json:
        sys.stdout.write(json.dumps({"status": "interrupted", "exit_code": EXIT_INTERRUPTED, "error": message}) + "\n")
        STATE.json_error_written = True
    return typer.Exit(EXIT_INTERRUPTED)


def interrupt_on_termination() -> None:
    """Make SIGTERM and SIGHUP (CI cancel, ``timeout``, a closed terminal) interrupt like Ctrl-C.

    The run then removes its temporary files and exits 130 instead of dying with them on disk.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.default_int_handler)


def progress(console: Console, *, quiet: bool = False) -> Progress:
    """Progress bars on ``console`` (stderr), removed when done; none with ``--quiet`` or off a terminal.

    Off a terminal rich draws a bar only once, when it stops, and a transient one leaves an empty line there (before
    an ``error:`` line, or the summary); the ``•`` stage lines already tell a CI log where the run is.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )


_STAGES = {"passes": "passes", "checks": "checks", "reference": "decode original"}
"""Bar labels of the pipeline's stages and the runner's reference decode; other names are verify modes."""


def progress_callback(bar: Progress) -> Callable[[str, int, int], None]:
    """Return a ``(stage, done, total)`` callback that keeps one bar per stage (passes, checks, each decode mode)."""
    tasks: dict[str, Any] = {}

    def on_step(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(_STAGES.get(stage, f"verify {stage}"), total=total)
        bar.update(tasks[stage], completed=done, total=total)

    return on_step
