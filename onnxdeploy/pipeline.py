"""The pipeline driver: load → passes → checks → verify → atomic save → run report.

Exit status (README, "Exit codes"): 0 passed; 1 a check found an error or the verification failed
(the model and the report are still written, the report says what failed); 2 bad input or config
(an :class:`~onnxdeploy.errors.OnnxDeployError`: nothing is written but the error).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir
import onnxruntime
import onnxsim

from onnxdeploy import __version__
from onnxdeploy.artifacts import Artifact, ArtifactSet
from onnxdeploy.checks import CheckContext, get_check
from onnxdeploy.checks.target import TARGET_CHECKS
from onnxdeploy.config import PipelineConfig, default_checks
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import (
    EXIT_FAILED,
    EXIT_OK,
    ConfigError,
    ContractError,
    DuplicateTensorError,
    OnnxDeployError,
    OutputError,
)
from onnxdeploy.model_io import (
    LoadedModel,
    StagedArtifacts,
    check_not_an_input,
    input_files,
    load_model,
    read_model_header,
    release_weights,
    sha256_file,
    stage_artifacts,
    stand_in_proto,
)
from onnxdeploy.pass_bisect import first_divergent_node, verify_pass_output
from onnxdeploy.pass_cache import PassCache
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import PassContext, pass_order_problem
from onnxdeploy.render import render_html, render_markdown, yaml_inline
from onnxdeploy.report import (
    AccuracyReport,
    FileRecord,
    Finding,
    GraphReport,
    NodeDivergence,
    PassReport,
    PassVerifyRecord,
    PhaseReport,
    RunReport,
    TensorInfo,
    summarise_verify,
)
from onnxdeploy.resources import peak_rss_bytes, rss_bytes
from onnxdeploy.runner import check_header, verify
from onnxdeploy.runner.accuracy import evaluate_accuracy
from onnxdeploy.runner.runtimes import compare_on_runtime
from onnxdeploy.token_ids import load_token_ids

__all__ = ["RunOutcome", "run_pipeline"]

Progress = Callable[[str], None]
StepProgress = Callable[[str, int, int], None]
"""``step_progress(stage, done, total)``: ``stage`` is ``"passes"`` or ``"checks"``."""

REPORT_FILES = ("report.json", "report.md", "report.html")
"""The run's report files, written beside the graphs."""


@dataclass
class RunOutcome:
    """Result of :func:`run_pipeline`: the report, the exit status and the files written."""

    report: RunReport
    exit_code: int
    model_path: Path
    report_json: Path
    report_md: Path
    report_html: Path


def _versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "onnx": onnx.__version__,
        "onnx_ir": onnx_ir.__version__,
        "onnxsim": getattr(onnxsim, "__version__", "unknown"),
        "onnxruntime": onnxruntime.__version__,
    }


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
    outputs = (
        (config.output_name, "output model"),
        (f"{config.output_name}.data", "output weights"),
        *((name, "report") for name in REPORT_FILES),
    )
    for name, what in outputs:
        check_not_an_input(out_dir / name, inputs, what)
    for parent in (out_dir, *out_dir.parents):
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"output_dir {out_dir}: {parent} exists and is not a folder")
            if not os.access(parent, os.W_OK):
                raise OutputError(f"output_dir {out_dir}: {parent} is not writable")
            break


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends (they are delivered then, not lost)."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _PhaseClock:
    """Records wall time and memory at each phase boundary of a run (``report.json`` → ``phases``)."""

    def __init__(self) -> None:
        self.phases: list[PhaseReport] = []
        self._start = time.perf_counter()

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


class _EachPass:
    """``verify_each_pass`` / ``bisect``: a short decode after each pass, the first diverging pass and node."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.records: list[PassVerifyRecord] = []
        self.first_pass: str | None = None
        self.node: NodeDivergence | None = None
        self.note: str | None = None

    def wants_input(self) -> bool:
        """Whether the next pass's input must be kept (bisect, nothing diverged yet)."""
        return self.config.bisect and self.first_pass is None

    def after(self, name: str, before: onnx_ir.Model | None, after: onnx_ir.Model, say: Progress) -> None:
        """Decode the pass's output; on the first divergence (with bisect) compare it node by node with its input."""
        v = self.config.verify
        if not self.config.verify_each_pass or v is None:
            return
        say(f"verify after pass {name}")
        record = verify_pass_output(
            self.config.model,
            after,
            name,
            prompt=list(v.prompt),
            steps=min(v.steps, EACH_PASS_STEPS),
            max_abs_logit_diff=v.max_abs_logit_diff,
            min_top1_agreement=v.min_top1_agreement,
        )
        self.records.append(record)
        if not record.diverged or self.first_pass is not None:
            return
        self.first_pass = name
        if self.config.bisect and before is not None:
            if _io_names(before) != _io_names(after):
                self.note = f"bisect: pass {name} changes the graph's inputs/outputs; its nodes were not compared"
                return
            say(f"bisect: comparing the input and output of pass {name} node by node")
            found = first_divergent_node(before, after, list(v.prompt))
            self.node = found.model_copy(update={"pass_name": name}) if found is not None else None

    def failures(self) -> list[str]:
        """Lines for ``report.failures``."""
        if self.first_pass is None:
            return []
        line = f"verify_each_pass: pass {self.first_pass} is the first whose output diverges from the original"
        if self.node is not None:
            line += f"; first diverging node: {self.node.op_type} '{self.node.node}' (output {self.node.output})"
        elif self.note:
            line += f"; {self.note}"
        return [line]


EACH_PASS_STEPS = 4
"""Generated positions decoded after each pass by ``verify_each_pass`` (after the verify prompt)."""


def _io_names(model: onnx_ir.Model) -> tuple[list[str], list[str]]:
    return [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]


def _check_before_passes(config: PipelineConfig, artifacts: ArtifactSet) -> None:
    """Everything the config and the model's graph decide, checked before the first pass (no weight read).

    Raises:
        ConfigError: the passes' order keeps one from running (``pass_order_problem`` with the input graph), a
            pass's ``check_model`` hook refuses (prefixed with the pipeline key), or a prompt id is outside the
            vocabulary of the model's logits output.
    """
    where = str(config.source) if config.source else str(config.model)
    problem = pass_order_problem([spec.build() for spec in config.passes], artifacts.primary)
    if problem is not None:  # with the graph: its opset, and what a pass's minimum opset depends on
        i, reason = problem
        raise ConfigError(f"{where}: key 'passes[{i}].{config.passes[i].name}': {reason}")
    settings = config.settings()
    for i, spec in enumerate(config.passes):
        try:
            spec.build().check_model(artifacts.primary, settings)
        except ConfigError as exc:
            raise ConfigError(f"{where}: key 'passes[{i}].{spec.name}': {exc}") from None
    if config.verify is not None:
        _check_prompt_vocab(config, where)


def _check_prompt_vocab(config: PipelineConfig, where: str) -> None:
    """Refuse a prompt the original cannot take (ids outside its vocabulary, no logits output) before any pass."""
    v = config.verify
    assert v is not None
    try:
        check_header(config.model, list(v.prompt), len(v.prompt) + v.steps)
    except ConfigError as exc:
        raise ConfigError(f"{where}: key 'verify.prompt': {exc}") from None
    except ContractError as exc:
        raise ConfigError(f"{where}: key 'verify': the original cannot be decoded for verification: {exc}") from None


def _checked(
    config: PipelineConfig, staged: StagedArtifacts, artifacts: ArtifactSet, say: Progress, step: StepProgress
) -> list[Finding]:
    """Run the pipeline's checks on every staged graph as written (its header; weights are not read)."""
    checks = _check_names(config, artifacts)
    findings: list[Finding] = []
    several = len(artifacts.artifacts) > 1
    total = len(checks) * len(artifacts.artifacts)
    step("checks", 0, total)
    for i, artifact in enumerate(artifacts.artifacts):
        path = staged.path(artifact.name)
        header = onnx.load(str(path), format="protobuf", load_external_data=False)
        ctx = CheckContext(model_path=path, target=config.target)
        say(f"checks {', '.join(checks)}" + (f" on {artifact.name}" if several else ""))
        for name in checks:
            for f in get_check(name)().run(header, ctx):
                message = f"{artifact.name}: {f.message}" if several else f.message
                message = message.replace(str(staged.staging), str(config.output_dir))
                findings.append(f.model_copy(update={"message": message}))
        step("checks", (i + 1) * len(checks), total)
    return findings


def run_pipeline(
    config: PipelineConfig,
    *,
    progress: Progress | None = None,
    verify_progress: Callable[[str, int, int], None] | None = None,
    step_progress: StepProgress | None = None,
) -> RunOutcome:
    """Run a validated pipeline; write ``<output_dir>/{model.onnx[, model.onnx.data], report.json|md|html}``.

    Memory stays near the model's size whatever it is: the input's weights are memory-mapped, passes edit
    the graph only, checks read the written graph without its weights, and verification opens one ONNX
    Runtime session at a time by path (DESIGN.md, "Models of any size").

    Args:
        config: from :func:`onnxdeploy.config.load_pipeline`.
        progress: called with a one-line message at each stage (the CLI prints it).
        verify_progress: forwarded to the runner (mode, positions done, positions total).
        step_progress: called with ``("passes" | "checks", done, total)`` as passes and checks complete.

    Returns:
        The outcome; ``exit_code`` is 0 (passed) or 1 (a check or the verification failed).

    Raises:
        OnnxDeployError: bad input or config (exit 2), found before the first pass wherever the config and
            the model's graph decide it. Nothing is written then: outputs are staged in a temporary folder
            that is removed, and the output folder is removed again if this run made it (also on SIGINT).
        OutputError: the outputs cannot be written (names the path), or they would overwrite the input.
    """
    say = progress or (lambda _msg: None)
    step = step_progress or (lambda _stage, _done, _total: None)
    start = time.perf_counter()
    model_in = config.model
    _check_output_location(config)
    # Token files are inputs too: a bad one is refused before the output folder exists, so nothing is written.
    calibration = _token_ids(config, "calibration")
    held_out = (_token_ids(config, "verify.accuracy") or [None])[0]
    out_dir = config.output_dir
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
    staged: StagedArtifacts | None = None
    cache: PassCache | None = None
    context = make_pass_context(model_path=model_in, target=config.target, calibration=calibration)
    clock = _PhaseClock()
    try:
        say(f"loading {model_in}")
        try:
            loaded = load_model(model_in)
        except DuplicateTensorError as exc:
            if config.passes or config.verify is not None:
                raise  # a pass or the verification cannot proceed on a graph onnx_ir and ORT cannot hold
            staged = stage_artifacts([], out_dir, external=False, data_name=f"{config.output_name}.data")
            report = _unloadable_report(config, staged, exc, say, start)
            with _signals_held():
                staged.commit()
            return RunOutcome(
                report=report,
                exit_code=EXIT_FAILED,
                model_path=model_in,
                report_json=out_dir / "report.json",
                report_md=out_dir / "report.md",
                report_html=out_dir / "report.html",
            )
        artifacts = ArtifactSet(
            [Artifact(config.output_name, loaded.model)],
            input_was_external=bool(loaded.external_files),
            notes=[loaded.sorted_at_load] if loaded.sorted_at_load else [],
        )
        for note in artifacts.notes:
            say(note)
        _check_before_passes(config, artifacts)
        input_io = _graph_io(loaded.model)  # before the passes edit it
        clock.done("load")

        pass_reports: list[PassReport] = []
        findings: list[Finding] = []
        cache = _pass_cache(config, loaded, calibration, context)
        first = 0
        if cache is not None:
            cache.say = say  # misses, stores, evictions on the console; problems also in the report's notes
            hit = cache.lookup()
            if hit is not None:
                artifacts, first = hit.artifacts, hit.passes
                pass_reports = [r.model_copy(update={"cache": "hit"}) for r in hit.reports]
                findings += hit.findings
                context.passes_run.extend(r.name for r in hit.reports)
                served = cache.folder / cache.keys[first - 1]
                say(f"pass cache: passes {', '.join(context.passes_run)} from the cache {served}")
        each_pass = _EachPass(config)
        step("passes", first, len(config.passes))
        for i, spec in enumerate(config.passes[first:], start=first):
            say(f"pass {spec.name} {yaml_inline(spec.config.model_dump(mode='json', exclude_defaults=True))}")
            before = artifacts.primary.clone() if each_pass.wants_input() else None
            result = spec.build()(artifacts, context)
            artifacts = result.artifacts
            pass_reports.append(result.report)
            each_pass.after(spec.name, before, artifacts.primary, say)
            step("passes", i + 1, len(config.passes))
            if config.check_after_each_pass:
                for artifact in artifacts.artifacts:
                    header = stand_in_proto(artifact.model, as_inputs=True)
                    findings += [
                        f.model_copy(update={"message": f"after pass {spec.name}: {f.message}"})
                        for f in get_check("checker")().run(header, CheckContext(target=config.target))
                    ]
            if cache is not None:
                result.report.cache = cache.store(i + 1, artifacts, pass_reports, findings)
        if cache is not None:
            artifacts.notes.extend(cache.notes)

        clock.done("passes")
        inputs = input_files(config.model)
        for artifact in artifacts.artifacts[1:]:  # the primary's name was checked before any work
            check_not_an_input(out_dir / artifact.name, inputs, "output model")
        external = artifacts.external()
        say(f"writing {len(artifacts.artifacts)} graph(s)" + (" and one external data file" if external else ""))
        staged = stage_artifacts(
            [(a.name, a.model) for a in artifacts.artifacts],
            out_dir,
            external=external,
            data_name=f"{config.output_name}.data",
            size_threshold_bytes=artifacts.weights.size_threshold_bytes,
        )
        for model in artifacts.models():
            release_weights(model)  # the input's pages leave memory before ONNX Runtime maps the outputs
        clock.done("write")
        findings += _checked(config, staged, artifacts, say, step)
        clock.done("checks")
        primary = artifacts.artifacts[0]
        final_model = out_dir / primary.name
        tmp_model = staged.path(primary.name)

        verify_report = None
        accuracy_report = None
        runtime_reports = []
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
                strict_providers=v.strict_providers,
                remainder=v.remainder,
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

            for spec in v.runtime_specs():
                if spec.name != "onnxruntime":
                    say(f"verify on {spec.name}: the candidate against the original on ONNX Runtime")
                    runtime_reports.append(
                        compare_on_runtime(
                            str(model_in),
                            str(tmp_model),
                            spec.name,
                            prompt=list(v.prompt),
                            steps=v.steps,
                            max_abs_logit_diff=spec.max_abs_logit_diff,
                        )
                    )
            accuracy_report = _accuracy(config, held_out, model_in, tmp_model, final_model, say)
            clock.done("verify")

        failures = [f"{f.code} {f.message}" for f in findings if f.level == "error"]
        failures += each_pass.failures()
        if accuracy_report is not None:
            failures += accuracy_report.failures
        if verify_report is not None and not verify_report.passed:
            failures += [f"verify: {msg}" for msg in verify_report.failures]
            for mode in verify_report.modes.values():
                failures += [f"verify {msg}" for msg in mode.failures]  # each line starts with its mode
        for r in runtime_reports:
            if not r.passed:
                failures.append(
                    f"verify on {r.runtime}: "
                    + (
                        r.refused
                        or f"max |diff| {r.max_abs_logit_diff:.3g} (allowed {r.max_abs_logit_diff_allowed:.3g}), "
                        f"top-1 {r.top1_agreement:.3f}"
                    )
                )
        contract = read_contract(primary.model, source=str(final_model))
        report = RunReport(
            status="failed" if failures else "passed",
            pipeline=str(config.source.resolve()) if config.source else None,
            input_model=str(model_in),
            output_model=str(final_model),
            output_files=[str(out_dir / name) for name in (*staged.files, *REPORT_FILES)],
            files=_file_records(config, staged, artifacts, input_io),
            notes=artifacts.notes,
            target=config.target,
            contract=contract.model_dump() if contract else None,
            graphs=_graph_reports(artifacts),
            passes=pass_reports,
            checks_run=_check_names(config, artifacts),
            findings=findings,
            verify=verify_report,
            accuracy=accuracy_report,
            runtimes=runtime_reports,
            failures=failures,
            pass_verification=each_pass.records,
            first_divergent_pass=each_pass.first_pass,
            first_divergent_node=each_pass.node,
            wall_time_s=round(time.perf_counter() - start, 3),
            phases=clock.phases,
            onnxdeploy_version=__version__,
            versions=_versions(),
        )
        report = _stage_reports(staged, report, config)
        # Everything is on disk under the staging folder: only renames remain, done with signals held.
        with _signals_held():
            staged.commit()
        stale = out_dir / f"{config.output_name}.data"
        if staged.data_file is None and stale.is_file():
            stale.unlink()  # an earlier run's weights: the new graph is self-contained and never reads them
    except BaseException as exc:
        with _signals_held():  # a second Ctrl-C (or SIGTERM) must not cut the cleanup short
            if staged is not None:
                staged.discard()
            _remove_if_made(out_dir, made_dir)
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write the outputs to {out_dir}: {exc.strerror or exc}") from exc
        if isinstance(exc, OnnxDeployError) and staged is not None and exc.args:
            # name the output folder, not the staging folder that no longer exists
            exc.args = (str(exc.args[0]).replace(str(staged.staging), str(out_dir)), *exc.args[1:])
        raise
    finally:
        os.close(lock)  # releases the flock
        if cache is not None:
            cache.close()  # other runs may evict the entry this run was served from
        if context.scratch_dir is not None:
            shutil.rmtree(context.scratch_dir, ignore_errors=True)
    say(f"wrote {', '.join(str(out_dir / n) for n in staged.files)}")
    return RunOutcome(
        report=report,
        exit_code=EXIT_FAILED if failures else EXIT_OK,
        model_path=final_model,
        report_json=out_dir / "report.json",
        report_md=out_dir / "report.md",
        report_html=out_dir / "report.html",
    )


def _unloadable_report(
    config: PipelineConfig, staged: StagedArtifacts, exc: DuplicateTensorError, say: Progress, start: float
) -> RunReport:
    """A checks-only run on a graph that defines a tensor twice: its checks' findings on the input, no model written.

    The graph cannot be loaded into onnx_ir (nor run by ONNX Runtime), so the checks read the input's header as
    it is and the report (status ``failed``) is all the run writes.
    """
    header = read_model_header(config.model)
    names = list(config.checks) if config.checks is not None else default_checks(False)
    if config.target:
        names += [n for n in TARGET_CHECKS if n not in names]
    context = CheckContext(model_path=config.model, target=config.target)
    findings: list[Finding] = []
    for name in names:
        say(f"check {name}")
        findings += get_check(name)().run(header, context)
    failures = [f"{f.code} {f.message}" for f in findings if f.level == "error"] or [str(exc)]
    report = RunReport(
        status="failed",
        pipeline=str(config.source.resolve()) if config.source else None,
        input_model=str(config.model),
        output_model=None,
        output_files=[str(config.output_dir / n) for n in REPORT_FILES],
        notes=[f"{exc}; the model was checked as it is and not written"],
        target=config.target,
        checks_run=names,
        findings=findings,
        failures=failures,
        wall_time_s=round(time.perf_counter() - start, 3),
        onnxdeploy_version=__version__,
        versions=_versions(),
    )
    return _stage_reports(staged, report, config)


def _stage_reports(staged: StagedArtifacts, report: RunReport, config: PipelineConfig) -> RunReport:
    """Stage report.html (plots of every position) and report.json/report.md (rows up to ``report.max_rows``).

    Returns:
        The report as written to report.json (per-position rows summarised beyond ``report.max_rows``).
    """
    max_rows = config.report.max_rows
    staged.add_text("report.html", render_html(report, max_rows=max_rows))
    if report.verify is not None:
        report = report.model_copy(update={"verify": summarise_verify(report.verify, max_rows)})
    staged.add_text("report.json", report.model_dump_json(indent=2))
    staged.add_text("report.md", render_markdown(report))
    return report


def _graph_io(model: onnx_ir.Model) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """A graph's inputs and outputs: name, element type, dims (int, symbolic name or '?')."""

    def info(value: onnx_ir.Value) -> TensorInfo:
        shape = None
        if value.shape is not None:
            shape = [d if isinstance(d, int) else (d.value or "?") for d in value.shape]
        return TensorInfo(name=value.name or "", dtype=value.dtype.name if value.dtype else "?", shape=shape)

    return [info(v) for v in model.graph.inputs], [info(v) for v in model.graph.outputs]


def _file_records(
    config: PipelineConfig,
    staged: StagedArtifacts,
    artifacts: ArtifactSet,
    input_io: tuple[list[TensorInfo], list[TensorInfo]],
) -> list[FileRecord]:
    """Every input file (model, its data, pipeline, token files) and staged output, with size and sha256.

    Hashing reads each file once, in chunks (memory stays flat); the outputs are hashed in the staging folder
    and listed under their final paths.
    """
    model = Path(config.model)
    extra = [config.source] + [
        s.token_ids_file for s in (config.calibration, config.verify and config.verify.accuracy) if s
    ]
    inputs = [model, *sorted(p for p in input_files(model) if p != model.resolve()), *(Path(p) for p in extra if p)]
    records = []
    for path in dict.fromkeys(inputs):  # the model, then the rest, each once
        io = input_io if path == model else ([], [])
        records.append(
            FileRecord(
                path=str(path),
                role="input",
                bytes=path.stat().st_size,
                sha256=sha256_file(path),
                inputs=io[0],
                outputs=io[1],
            )
        )
    graphs = {a.name: a.model for a in artifacts.artifacts}
    for name in staged.files:
        io = _graph_io(graphs[name]) if name in graphs else ([], [])
        path = staged.path(name)
        records.append(
            FileRecord(
                path=str(config.output_dir / name),
                role="output",
                bytes=path.stat().st_size,
                sha256=sha256_file(path),
                inputs=io[0],
                outputs=io[1],
            )
        )
    return records


def _pass_cache(
    config: PipelineConfig, loaded: LoadedModel, calibration: list[list[int]], context: PassContext
) -> PassCache | None:
    """The run's pass cache, or None when the pipeline has no passes or ``cache: null`` (``--no-cache``).

    ``verify_each_pass`` and ``bisect`` decode every pass's output, so they run every pass: no cache then (a
    pass served from the cache would not be verified, and a later pass would be blamed).
    """
    if config.cache is None or not config.passes or config.verify_each_pass or config.bisect:
        return None
    return PassCache.for_run(
        config.cache,
        loaded,
        [(spec.name, spec.config.model_dump(mode="json")) for spec in config.passes],
        supplied=context.provenance(),
        calibration=calibration,
    )


def _token_ids(config: PipelineConfig, key: str) -> list[list[int]]:
    """The token ids of ``calibration`` or ``verify.accuracy`` (``[]`` without that section).

    Raises:
        ConfigError: the section's token_ids_file is unreadable, empty or not token ids (names the pipeline,
            the key and the file).
    """
    section = config.calibration if key == "calibration" else config.verify and config.verify.accuracy
    if section is None:
        return []
    try:
        return load_token_ids(section.token_ids_file, section.max_tokens)
    except ConfigError as exc:
        where = str(config.source) if config.source else str(config.model)
        raise ConfigError(f"{where}: key '{key}.token_ids_file': {exc}") from None


def _accuracy(
    config: PipelineConfig, tokens: list[int] | None, model_in: Path, tmp_model: Path, final_model: Path, say: Progress
) -> AccuracyReport | None:
    """``verify.accuracy``: teacher-forced KL, top-1 and perplexity of the candidate on ``tokens`` (held out)."""
    assert config.verify is not None
    acc = config.verify.accuracy
    if acc is None or tokens is None:
        return None
    say(f"accuracy: {len(tokens)} held-out tokens, teacher-forced")
    report = evaluate_accuracy(
        str(model_in),
        str(tmp_model),
        tokens,
        providers=tuple(config.verify.providers),
        max_mean_kl=acc.max_mean_kl,
        min_top1_agreement=acc.min_top1_agreement,
        max_ppl_ratio=acc.max_ppl_ratio,
    )
    return report.model_copy(update={"candidate": str(final_model)})


def _check_names(config: PipelineConfig, artifacts: ArtifactSet) -> list[str]:
    """The pipeline's checks, plus the target checks whenever a target is set.

    Without a ``checks`` key the defaults depend on whether the output carries a decode contract
    (:func:`onnxdeploy.config.default_checks`): a checks-only pipeline on an export is not held to the
    static-decoder checks.
    """
    if config.checks is not None:
        checks = list(config.checks)
    else:
        has_contract = any(read_contract(a.model, source=a.name) is not None for a in artifacts.artifacts)
        checks = default_checks(has_contract)
    if config.target:
        checks += [name for name in TARGET_CHECKS if name not in checks]
    return checks


def _graph_reports(artifacts: ArtifactSet) -> list[GraphReport]:
    """``report.json`` → ``graphs``: every graph written that carries a contract, primary first."""
    graphs = []
    for artifact in artifacts.artifacts:
        c = read_contract(artifact.model, source=artifact.name)
        if c is not None:
            graphs.append(
                GraphReport(
                    file=artifact.name,
                    step_len=c.step_len,
                    max_cache_len=c.max_cache_len,
                    prefill_logits=c.prefill_logits,
                    role="decode" if c.step_len == 1 else "prefill",
                )
            )
    return graphs


def _remove_if_made(out_dir: Path, made_dir: bool) -> None:
    """Remove ``out_dir`` again when this run made it and left it empty."""
    if made_dir and out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
