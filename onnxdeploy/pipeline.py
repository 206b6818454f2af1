"""The pipeline driver: load → passes → write → checks → verify → report → commit, in the locked output folder.

The stages are :mod:`onnxdeploy.run_stages` (and :mod:`onnxdeploy.run_report`); this module runs them in
order, times them (``report.json`` → ``phases``), and owns what a run holds while they run: the output
folder's lock, the staging folder, the pass cache entry and the scratch folder, released and cleaned up
whatever happens (also on SIGINT).

Exit status (README, "Exit codes"): 0 passed; 1 a check found an error or the verification failed
(the model and the report are still written, the report says what failed); 2 bad input or config
(an :class:`~onnxdeploy.errors.OnnxDeployError`: nothing is written but the error).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from onnxdeploy.artifacts import EarlierOutputs, header_only
from onnxdeploy.config import PipelineConfig, check_pass_settings
from onnxdeploy.errors import (
    EXIT_FAILED,
    EXIT_OK,
    ConfigError,
    ContractError,
    ModelLoadError,
    OnnxDeployError,
    OutputError,
)
from onnxdeploy.model_io import StagedArtifacts, check_not_an_input, input_files
from onnxdeploy.pass_cache import PassCache
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import PassContext
from onnxdeploy.report import PhaseReport, RunReport
from onnxdeploy.resources import peak_rss_bytes, rss_bytes
from onnxdeploy.run_report import REPORT_FILES, report_stage
from onnxdeploy.run_scratch import STAGING_PREFIX, remove_own, remove_stale, run_temp_root
from onnxdeploy.run_stages import (
    Loaded,
    Passed,
    Say,
    StepProgress,
    check_input_stage,
    checks_stage,
    commit_stage,
    load_stage,
    open_pass_cache,
    passes_stage,
    signals_held,
    verify_stage,
    write_nothing,
    write_stage,
)
from onnxdeploy.runner.verify import logits_vocab
from onnxdeploy.sdk_stage import sdk_stage
from onnxdeploy.text import load_codec, text_token_ids
from onnxdeploy.token_ids import load_token_ids

__all__ = ["RunOutcome", "run_pipeline"]


@dataclass
class RunOutcome:
    """Result of :func:`run_pipeline`: the report, the exit status and the files written."""

    report: RunReport
    exit_code: int
    model_path: Path
    report_json: Path
    report_md: Path
    report_html: Path


@dataclass
class _RunInputs:
    """What a run reads besides the model and the config: token files, read before anything is written."""

    calibration: list[list[int]]
    held_out: list[int] | None


@dataclass
class _Progress:
    say: Say
    step: StepProgress
    verify: StepProgress | None


def run_pipeline(
    config: PipelineConfig,
    *,
    progress: Say | None = None,
    verify_progress: Callable[[str, int, int], None] | None = None,
    step_progress: StepProgress | None = None,
    started: float | None = None,
) -> RunOutcome:
    """Run a validated pipeline; write ``<output_dir>/{model.onnx[, model.onnx.data], report.json|md|html}``.

    Memory stays near the model's size whatever it is: the input's weights are memory-mapped, passes edit
    the graph only, checks read the written graph without its weights, and verification opens one ONNX
    Runtime session at a time by path (docs/ARCHITECTURE.md, "Models of any size").

    Args:
        config: from :func:`onnxdeploy.config.load_pipeline`.
        progress: called with a one-line message at each stage (the CLI prints it).
        verify_progress: forwarded to the runner (mode, positions done, positions total).
        step_progress: called with ``("passes" | "checks", done, total)`` as passes and checks complete.
        started: the ``time.perf_counter()`` value ``wall_time_s`` and the "startup" phase count from (the CLI
            gives the process's start); None: this call.

    Returns:
        The outcome; ``exit_code`` is 0 (passed) or 1 (a check or the verification failed).

    Raises:
        OnnxDeployError: bad input or config (exit 2), found before the first pass wherever the config and
            the model's graph decide it. Nothing is written then: outputs are staged in a temporary folder
            that is removed, and the output folder is removed again if this run made it (also on SIGINT).
        OutputError: the outputs cannot be written (names the path), or they would overwrite the input.
    """
    told = _Progress(
        say=progress or (lambda _msg: None),
        step=step_progress or (lambda _stage, _done, _total: None),
        verify=verify_progress,
    )
    # the CLI's clock starts with the process (interpreter start, imports and config load are in wall_time_s
    # too: resources.run_clock_start); a call from Python (a notebook) counts from the call
    start = time.perf_counter() if started is None else started
    _check_output_location(config)
    # Token files are inputs too: a bad one is refused before the output folder exists, so nothing is written.
    vocab = _vocab(config)
    _check_prompt_ids(config, vocab)
    inputs = _RunInputs(
        calibration=_token_ids(config, "calibration", vocab),
        held_out=(_token_ids(config, "verify.accuracy", vocab) or [None])[0],
    )
    if inputs.held_out is not None:  # the passes may refuse a held-out sequence longer than their caches
        check_pass_settings(config, _source(config), config.settings(accuracy_tokens=len(inputs.held_out)))
    with run_temp_root(), _claimed(config.output_dir) as run:
        _remove_stale_staging(config, told.say)
        run.context = make_pass_context(model_path=config.model, target=config.target, calibration=inputs.calibration)
        report = _run_stages(config, run, inputs, told, start)
    out_dir = config.output_dir
    return RunOutcome(
        report=report,
        exit_code=EXIT_FAILED if report.failures else EXIT_OK,
        model_path=Path(report.output_model) if report.output_model else config.model,
        report_json=out_dir / "report.json",
        report_md=out_dir / "report.md",
        report_html=out_dir / "report.html",
    )


def _remove_stale_staging(config: PipelineConfig, say: Say) -> None:
    """Remove the staging folders runs killed by SIGKILL left in ``output_dir`` and the pass cache (run_scratch.py).

    Called with the output folder locked; the system temp folder's stale run roots go in :func:`run_temp_root`.
    """
    folders = [config.output_dir] + ([config.cache.folder()] if config.cache is not None else [])
    removed = [path for folder in folders for path in remove_stale(Path(folder), STAGING_PREFIX)]
    if removed:
        say(f"removed {len(removed)} staging folder(s) of killed runs: {', '.join(str(p) for p in removed)}")


def _run_stages(config: PipelineConfig, run: _Held, inputs: _RunInputs, told: _Progress, start: float) -> RunReport:
    """The stages in order, each phase timed; the staging folder and pass cache are registered on ``run``.

    An input onnx_ir cannot hold (a checks-only run only: :func:`~onnxdeploy.run_stages.load_stage`) skips
    to checks on the input as it is; the reports are then all the run writes.
    """
    clock = _PhaseClock(start)
    clock.done("startup")  # interpreter, imports, config, token files, the output folder's lock
    load = load_stage(config, told.say)
    clock.done("load")
    if load.artifacts is None or load.loaded is None:
        assert load.unloadable is not None
        written = write_nothing(config)
        run.staged = written.staged
        checks = check_input_stage(config, load.unloadable, told.say)
        report = report_stage(config, load, None, written, checks, None, clock=clock, start=start)
        commit_stage(config, written, wrote_model=False, say=told.say)
        return report
    assert run.context is not None
    run.cache = open_pass_cache(config, load.loaded, inputs.calibration, run.context)
    passes = passes_stage(config, load.artifacts, run.context, run.cache, told.say, told.step)
    clock.done("passes")
    written = write_stage(config, passes.artifacts, told.say)
    run.staged = written.staged
    clock.done("write")
    checks = checks_stage(config, written.staged, passes.artifacts, told.say, told.step)
    clock.done("checks")
    built = sdk_stage(config, written.staged, passes.artifacts, checks.findings, inputs.calibration, told.say)
    if built.report is not None and built.report.get("ran"):
        clock.done("sdk")
    _drop_graphs(load, passes)
    verified = verify_stage(
        config, written.staged, passes.artifacts, inputs.held_out, told.say, told.verify, inputs.calibration
    )
    if config.verify is not None:
        clock.done("verify")
    report = report_stage(config, load, passes, written, checks, verified, clock=clock, start=start, sdk=built)
    commit_stage(config, written, wrote_model=True, say=told.say)
    return report


def _drop_graphs(load: Loaded, passes: Passed) -> None:
    """Replace the input's and every written graph's model by its header (``artifacts.header_only``), then collect.

    Verification opens the written files in ONNX Runtime and the report reads only contracts and I/O, so the
    graphs' Python objects (and the heap they fragment) are not held across the sessions' peak.
    """
    for artifact_set in (load.artifacts, passes.artifacts):
        for artifact in artifact_set.artifacts if artifact_set is not None else []:
            artifact.model = header_only(artifact.model)
    if load.loaded is not None:
        load.loaded.model = header_only(load.loaded.model)
    gc.collect()


class _PhaseClock:
    """Records wall time and memory at each phase boundary of a run (``report.json`` → ``phases``)."""

    def __init__(self, start: float) -> None:
        self.phases: list[PhaseReport] = []
        self._start = start

    def done(self, name: str) -> None:
        """Close the phase ``name``, started where the previous one ended."""
        now = time.perf_counter()
        self.phases.append(
            PhaseReport(
                name=name,
                wall_time_s=round(now - self._start, 4),
                peak_rss_bytes=peak_rss_bytes(),
                rss_bytes=rss_bytes(),
            )
        )
        self._start = now


@dataclass
class _Held:
    """What a run holds until it ends; :func:`_claimed` releases it whatever happens.

    Attributes:
        out_dir: the locked output folder.
        context: the passes' context (its scratch folder is removed at the end).
        staged: the staging folder, once the write stage made it (discarded when the run fails).
        cache: the pass cache, which holds the entry the run is served from until the end.
    """

    out_dir: Path
    context: PassContext | None = None
    staged: StagedArtifacts | None = None
    cache: PassCache | None = None

    def release(self) -> None:
        """Let other runs evict the cache entry this run was served from; remove the passes' scratch folder."""
        if self.cache is not None:
            self.cache.close()
        if self.context is not None and self.context.scratch_dir is not None:
            shutil.rmtree(self.context.scratch_dir, ignore_errors=True)


@contextlib.contextmanager
def _claimed(out_dir: Path) -> Iterator[_Held]:
    """Make (if needed) and lock ``out_dir`` for one run; on any failure leave it as it was.

    On an exception (also KeyboardInterrupt) the staging folder is discarded and ``out_dir`` removed again if
    this run made it, with signals held; an OSError becomes an OutputError naming ``out_dir``, and a domain
    error's message names ``out_dir`` instead of the staging folder that no longer exists.

    Raises:
        OutputError: ``out_dir`` cannot be made or locked (another run writes to it).
    """
    made_dir = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock_folder(out_dir)
    except OSError as exc:
        raise OutputError(
            f"cannot write to output_dir {out_dir}: {exc.strerror or exc}; choose a writable output_dir (--output-dir)"
        ) from exc
    except BaseException:
        _remove_if_made(out_dir, made_dir)
        raise
    run = _Held(out_dir)
    try:
        yield run
    except BaseException as exc:
        with signals_held():  # a second Ctrl-C (or SIGTERM) must not cut the cleanup short
            if run.staged is not None:
                run.staged.discard()
            remove_own(out_dir, STAGING_PREFIX)  # one made just before the signal, not yet in run.staged
            _remove_if_made(out_dir, made_dir)
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write the outputs to {out_dir}: {exc.strerror or exc}") from exc
        if isinstance(exc, OnnxDeployError) and run.staged is not None and exc.args:
            exc.args = (str(exc.args[0]).replace(str(run.staged.staging), str(out_dir)), *exc.args[1:])
        raise
    finally:
        os.close(lock)  # releases the flock
        run.release()


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
    """Refuse outputs that would overwrite the input or sit where a folder cannot be made, and changed earlier ones.

    An earlier run's outputs (its ``report.json``) changed since it wrote them: ``EarlierOutputs.refuse_changed``.
    """
    out_dir = config.output_dir
    inputs = input_files(config.model)
    if config.source is not None:
        inputs.add(Path(config.source).resolve())
    outputs = (
        (config.output_name, "output model"),
        (f"{config.output_name}.data", "output weights"),
        *((name, "report") for name in REPORT_FILES),
    )
    where = f"{config.source}: key 'output_dir'" if config.source is not None else "output_dir"
    for name, what in outputs:
        check_not_an_input(out_dir / name, inputs, f"{where}: {what}")
    earlier = EarlierOutputs.read(out_dir) if out_dir.is_dir() else None
    if earlier is not None:  # before any pass: what an earlier run left must still be what it wrote
        earlier.refuse_changed(out_dir, keep={config.output_name, f"{config.output_name}.data"})
    for parent in (out_dir, *out_dir.parents):
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"output_dir {out_dir}: {parent} exists and is not a folder")
            if not os.access(parent, os.W_OK):
                raise OutputError(f"output_dir {out_dir}: {parent} is not writable")
            break


def _source(config: PipelineConfig) -> str:
    return str(config.source) if config.source else str(config.model)


def _vocab(config: PipelineConfig) -> int | None:
    """The input model's vocabulary size (its logits' last dim, when static) if token ids are to be checked."""
    if config.calibration is None and config.verify is None:
        return None
    try:
        return logits_vocab(config.model)
    except ContractError:
        return None  # no logits output found: the load stage refuses the model with its own message
    except ModelLoadError:
        if config.calibration is None and config.verify is not None and config.verify.accuracy is None:
            return None  # only the prompt to check: the load stage refuses the file (or a checks-only run reports it)
        raise


def _check_prompt_ids(config: PipelineConfig, vocab: int | None) -> None:
    """Refuse a verify prompt with an id outside the model's vocabulary, naming its key (and tokenizer).

    A ``verify.prompt_text`` encoded to such an id means the tokenizer is not the model's: the message names the
    tokenizer file and both vocabulary sizes.

    Raises:
        ConfigError: ``max(prompt) >= vocab``, or the tokenizer (when text is encoded) has fewer than half as many
            tokens as the model has logits.
    """
    v = config.verify
    if v is not None and vocab is not None and v.tokenizer is not None and (v.prompt_text is not None or v.accuracy):
        size = load_codec(v.tokenizer, key=f"{_source(config)}: key 'verify.tokenizer'").vocab_size()
        if size * 2 < vocab:  # exporters pad the logits to a multiple of 64..256 ids, never to twice the tokenizer's
            raise ConfigError(
                f"{_source(config)}: key 'verify.tokenizer': the tokenizer {v.tokenizer} has {size} tokens, the "
                f"model {config.model} {vocab} logits: the tokenizer is not this model's; set verify.tokenizer to "
                "the model's tokenizer.json or its folder"
            )
    if v is None or vocab is None or not v.prompt or max(v.prompt) < vocab:
        return
    worst = max(v.prompt)
    model = f"the model {config.model} (its logits have {vocab} entries: ids 0..{vocab - 1})"
    if v.prompt_text is None or v.tokenizer is None:
        where = f"{_source(config)}: key 'verify.prompt'"
        raise ConfigError(f"{where}: token id {worst} is outside the vocabulary of {model}")
    size = load_codec(v.tokenizer, key=f"{_source(config)}: key 'verify.tokenizer'").vocab_size()
    raise ConfigError(
        f"{_source(config)}: key 'verify.prompt_text': the tokenizer {v.tokenizer} ({size} tokens) encodes it to id "
        f"{worst}, outside the vocabulary of {model}: the tokenizer is not this model's; set verify.tokenizer to the "
        "model's tokenizer.json or its folder"
    )


def _token_ids(config: PipelineConfig, key: str, vocab: int | None) -> list[list[int]]:
    """The token ids of ``calibration`` or ``verify.accuracy`` (``[]`` without that section).

    Args:
        config: the pipeline.
        key: ``calibration`` or ``verify.accuracy``.
        vocab: the input model's vocabulary size; every id must be below it (None: not checked).

    Raises:
        ConfigError: the section's token_ids_file is unreadable, empty, not token ids, or holds an id outside
            the model's vocabulary (names the pipeline, the key and the file).
    """
    section = config.calibration if key == "calibration" else config.verify and config.verify.accuracy
    if section is None:
        return []
    if getattr(section, "text_file", None) is not None:  # verify.accuracy.text_file: text, encoded (text.py)
        assert config.verify is not None and config.verify.tokenizer is not None  # the loader found one
        where = f"{_source(config)}: key '{key}.text_file'"
        codec = load_codec(config.verify.tokenizer, key=where)
        return [text_token_ids(section.text_file, codec, section.max_tokens, key=where, vocab=vocab)]
    try:
        return load_token_ids(section.token_ids_file, section.max_tokens, vocab=vocab)
    except ConfigError as exc:
        raise ConfigError(f"{_source(config)}: key '{key}.token_ids_file': {exc}") from None


def _remove_if_made(out_dir: Path, made_dir: bool) -> None:
    """Remove ``out_dir`` again when this run made it and left it empty."""
    if made_dir and out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
