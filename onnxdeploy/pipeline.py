"""The pipeline driver: load → passes → checks → verify → atomic save → run report.

Exit status (README, "Exit codes"): 0 passed; 1 a check found an error or the verification failed
(the model and the report are still written, the report says what failed); 2 bad input or config
(an :class:`~onnxdeploy.errors.OnnxDeployError`: nothing is written but the error).
"""

from __future__ import annotations

import fcntl
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime

from onnxdeploy import __version__
from onnxdeploy.checks import CheckContext, get_check
from onnxdeploy.config import PipelineConfig
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import EXIT_FAILED, EXIT_OK, OnnxDeployError, OutputError
from onnxdeploy.graph import (
    PROTOBUF_LIMIT_BYTES,
    check_not_an_input,
    default_file_mode,
    initializer_bytes,
    input_files,
    load_model,
    save_model_atomic,
)
from onnxdeploy.render import render_markdown
from onnxdeploy.report import Finding, PassReport, RunReport
from onnxdeploy.runner import verify

__all__ = ["RunOutcome", "run_pipeline", "write_text_atomic"]

Progress = Callable[[str], None]


@dataclass
class RunOutcome:
    """Result of :func:`run_pipeline`: the report, the exit status and the files written."""

    report: RunReport
    exit_code: int
    model_path: Path
    report_json: Path
    report_md: Path


def _write_temp(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to a new temporary file beside ``path`` and return the temporary path."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, default_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename.

    Raises:
        OutputError: ``path`` is a folder, or its folder cannot be written (the temporary file is removed).
    """
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a folder")
    try:
        tmp = _write_temp(path, text)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _versions() -> dict[str, str]:
    return {"python": platform.python_version(), "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def _lock_folder(folder: Path) -> int:
    """Take an exclusive, non-blocking ``flock`` on ``folder`` itself (no lock file is left behind).

    Returns:
        The open folder descriptor; closing it releases the lock.

    Raises:
        OutputError: another run holds the lock (two runs would mix their model and reports).
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputError(f"another onnxdeploy run is writing to {folder}; use another output_dir") from None
    return fd


def _check_output_location(config: PipelineConfig) -> None:
    """Refuse outputs that would overwrite the input model or sit where a folder cannot be made."""
    out_dir = config.output_dir
    inputs = input_files(config.model)
    if config.source is not None:
        inputs.add(Path(config.source).resolve())
    for name, what in ((config.output_name, "output model"), ("report.json", "report"), ("report.md", "report")):
        check_not_an_input(out_dir / name, inputs, what)
    for parent in (out_dir, *out_dir.parents):
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"output_dir {out_dir}: {parent} exists and is not a folder")
            if not os.access(parent, os.W_OK):
                raise OutputError(f"output_dir {out_dir}: {parent} is not writable")
            break


def run_pipeline(
    config: PipelineConfig,
    *,
    progress: Progress | None = None,
    verify_progress: Callable[[str, int, int], None] | None = None,
) -> RunOutcome:
    """Run a validated pipeline and write ``<output_dir>/{model.onnx, report.json, report.md}``.

    Args:
        config: from :func:`onnxdeploy.config.load_pipeline`.
        progress: called with a one-line message at each stage (the CLI prints it).
        verify_progress: forwarded to the runner (mode, positions done, positions total).

    Returns:
        The outcome; ``exit_code`` is 0 (passed) or 1 (a check or the verification failed).

    Raises:
        OnnxDeployError: bad input or config (exit 2). Nothing is written then: the model goes to a
            temporary file that is removed, and the output folder is removed again if this run made it.
        OutputError: the outputs cannot be written (names the path), or they would overwrite the input.
    """
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    model_in = config.model
    _check_output_location(config)
    say(f"loading {model_in}")
    model = load_model(model_in)
    weights = initializer_bytes(model)
    if weights > PROTOBUF_LIMIT_BYTES:
        raise OnnxDeployError(
            f"{model_in}: {weights / 2**30:.2f} GiB of weights is over the 2 GiB protobuf limit; models kept in "
            "external data above that size are not supported yet (the passes copy and fold the whole ModelProto)"
        )
    pass_reports: list[PassReport] = []
    findings: list[Finding] = []
    for spec in config.passes:
        say(f"pass {spec.name}")
        result = spec.build()(model)
        model = result.model
        pass_reports.append(result.report)
        if config.check_after_each_pass:
            findings += [
                f.model_copy(update={"message": f"after pass {spec.name}: {f.message}"})
                for f in get_check("checker")().run(model, CheckContext(model_path=model_in, target=config.target))
            ]

    out_dir = config.output_dir
    made_dir = not out_dir.exists()
    final_model = out_dir / config.output_name
    lock = None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock_folder(out_dir)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{config.output_name}.", suffix=".tmp", dir=out_dir)
        os.close(fd)
    except OSError as exc:
        if lock is not None:
            os.close(lock)
        raise OutputError(f"cannot write to output_dir {out_dir}: {exc.strerror or exc}") from exc
    tmp_model = Path(tmp_name)
    temps: list[Path] = []
    try:
        save_model_atomic(model, tmp_model)
        ctx = CheckContext(model_path=tmp_model, target=config.target)
        checks = list(config.checks)
        if config.target and "target_opset" not in checks:
            checks.append("target_opset")  # a target always gets its opset/IR range checked
        for name in checks:
            say(f"check {name}")
            findings += get_check(name)().run(model, ctx)

        verify_report = None
        if config.verify is not None:
            v = config.verify
            say(f"verify: {len(v.prompt)} prompt tokens + {v.steps} steps, modes {', '.join(v.modes)}")
            verify_report = verify(
                str(model_in),
                str(tmp_model),
                prompt=list(v.prompt),
                steps=v.steps,
                modes=tuple(v.modes),
                max_abs_logit_diff=v.max_abs_logit_diff,
                min_top1_agreement=v.min_top1_agreement,
                providers=tuple(v.providers),
                progress=verify_progress,
            )
            verify_report = verify_report.model_copy(
                update={
                    "candidate": str(final_model),
                    "provider_fallbacks": [
                        line.replace(str(tmp_model), str(final_model)) for line in verify_report.provider_fallbacks
                    ],
                }
            )

        failures = [f"{f.code} {f.message}" for f in findings if f.level == "error"]
        if verify_report is not None and not verify_report.passed:
            for mode in verify_report.modes.values():
                failures += [f"verify {mode.mode}: {msg}" for msg in mode.failures]
        contract = read_contract(model, source=str(final_model))
        report = RunReport(
            status="failed" if failures else "passed",
            pipeline=str(config.source.resolve()) if config.source else None,
            input_model=str(model_in),
            output_model=str(final_model),
            target=config.target,
            contract=contract.model_dump() if contract else None,
            passes=pass_reports,
            checks_run=checks,
            findings=findings,
            verify=verify_report,
            failures=failures,
            wall_time_s=round(time.perf_counter() - start, 3),
            onnxdeploy_version=__version__,
            versions=_versions(),
        )
        report_json = out_dir / "report.json"
        report_md = out_dir / "report.md"
        json_text = report.model_dump_json(indent=2)
        md_text = render_markdown(report)
        for path, text in ((report_json, json_text), (report_md, md_text)):
            temps.append(_write_temp(path, text))
        # Everything is on disk under temporary names: only renames remain.
        os.replace(tmp_model, final_model)
        for tmp, path in zip(temps, (report_json, report_md), strict=True):
            os.replace(tmp, path)
    except BaseException as exc:
        tmp_model.unlink(missing_ok=True)
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        if made_dir and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write the outputs to {out_dir}: {exc.strerror or exc}") from exc
        raise
    finally:
        os.close(lock)  # releases the flock
    say(f"wrote {final_model}, {report_json}, {report_md}")
    return RunOutcome(
        report=report,
        exit_code=EXIT_FAILED if failures else EXIT_OK,
        model_path=final_model,
        report_json=report_json,
        report_md=report_md,
    )
