"""The stages of a pipeline run, in order: load, passes, write, checks, verify, then report and commit.

Each stage is one function; its result carries ``failures``, the lines it adds to ``report.failures`` (the run
fails when any stage has one; the run's failures are the stages' in stage order). A stage that finds bad input
or config raises :class:`~onnxdeploy.errors.OnnxDeployError` instead (exit 2, nothing written).
:func:`onnxdeploy.pipeline.run_pipeline` runs them inside the locked output folder and owns the staging folder,
the pass cache entry and the scratch folder they hold; the report stage is :mod:`onnxdeploy.run_report`.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir

from onnxdeploy.artifacts import Artifact, ArtifactSet, EarlierOutputs
from onnxdeploy.batching_stage import batching_report, check_batching
from onnxdeploy.checks import CheckContext, get_check
from onnxdeploy.checks.target import TARGET_CHECKS
from onnxdeploy.config import PipelineConfig, default_checks
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError, ContractError, DuplicateTensorError
from onnxdeploy.model_io import (
    LoadedModel,
    StagedArtifacts,
    check_not_an_input,
    input_files,
    load_model,
    read_model_header,
    release_weights,
    stage_artifacts,
    stand_in_proto,
)
from onnxdeploy.pass_bisect import EachPassVerifier
from onnxdeploy.pass_cache import PassCache
from onnxdeploy.passes import PassContext, pass_order_problem
from onnxdeploy.render import yaml_inline
from onnxdeploy.report import (
    AccuracyReport,
    Finding,
    PassReport,
    RuntimeComparison,
    TensorInfo,
    VerifyReport,
)
from onnxdeploy.runner import check_header, logits_vocab, verify
from onnxdeploy.runner.accuracy import evaluate_accuracy
from onnxdeploy.runner.cache_policy import evaluate_policy_accuracy
from onnxdeploy.runner.thresholds import LogitThresholds
from onnxdeploy.sdk_stage import other_runtimes
from onnxdeploy.text import generations_with

__all__ = [
    "Checked",
    "Loaded",
    "Passed",
    "StageResult",
    "Verified",
    "Written",
    "check_input_stage",
    "checks_stage",
    "commit_stage",
    "graph_io",
    "load_stage",
    "open_pass_cache",
    "passes_stage",
    "verify_stage",
    "write_nothing",
    "write_stage",
]

Say = Callable[[str], None]
StepProgress = Callable[[str, int, int], None]
"""``step_progress(stage, done, total)``: ``stage`` is ``"passes"`` or ``"checks"``."""

GraphIO = tuple[list[TensorInfo], list[TensorInfo]]


@dataclass(kw_only=True)
class StageResult:
    """What every stage hands on.

    Attributes:
        failures: lines for ``report.failures``; the run fails when any stage has one.
    """

    failures: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Loaded(StageResult):
    """The input, loaded and checked against the config before any pass.

    Attributes:
        loaded: the loaded input, or None when onnx_ir cannot hold its graph (``unloadable``).
        artifacts: the set the passes start from (the input as the primary), or None likewise.
        input_io: the input graph's inputs and outputs, taken before the passes edit it.
        unloadable: why the graph cannot be loaded (a tensor defined twice; only a checks-only run gets here).
    """

    loaded: LoadedModel | None = None
    artifacts: ArtifactSet | None = None
    input_io: GraphIO = field(default_factory=lambda: ([], []))
    unloadable: DuplicateTensorError | None = None


@dataclass(kw_only=True)
class Passed(StageResult):
    """The artifact set after the passes, their reports, the findings found on the way, per-pass verification."""

    artifacts: ArtifactSet
    reports: list[PassReport]
    findings: list[Finding]
    each_pass: EachPassVerifier


@dataclass(kw_only=True)
class Written(StageResult):
    """The outputs staged in a temporary folder inside the output folder (renamed into place by the commit).

    ``removes``: file names in the output folder an earlier run wrote that this run's output does not replace
    (:func:`stale_outputs`); the commit removes them, the report lists them.
    """

    staged: StagedArtifacts
    removes: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Checked(StageResult):
    """The checks that ran and their findings; every error finding is a failure."""

    names: list[str]
    findings: list[Finding]


@dataclass(kw_only=True)
class Verified(StageResult):
    """The verification on ONNX Runtime, on the other runtimes, and the held-out accuracy (None: not configured)."""

    verify: VerifyReport | None = None
    accuracy: AccuracyReport | None = None
    runtimes: list[RuntimeComparison] = field(default_factory=list)


def _where(config: PipelineConfig) -> str:
    return str(config.source) if config.source else str(config.model)


# ------------------------------------------------------------------------------------------------------ load


def load_stage(config: PipelineConfig, say: Say) -> Loaded:
    """Load the input (weights memory-mapped) and check what the config and its graph decide before any pass.

    Raises:
        OnnxDeployError: the input cannot be loaded (a tensor defined twice only when passes or verify need
            the graph: a checks-only run checks such a graph as it is), or the config does not fit it
            (:func:`_check_before_passes`).
    """
    say(f"loading {config.model}")
    try:
        loaded = load_model(config.model)
    except DuplicateTensorError as exc:
        if config.passes or config.verify is not None:
            raise  # a pass or the verification cannot proceed on a graph onnx_ir and ORT cannot hold
        return Loaded(unloadable=exc)
    artifacts = ArtifactSet(
        [Artifact(config.output_name, loaded.model)],
        input_was_external=bool(loaded.external_files),
        notes=[loaded.sorted_at_load] if loaded.sorted_at_load else [],
    )
    for note in artifacts.notes:
        say(note)
    _check_before_passes(config, artifacts)
    return Loaded(loaded=loaded, artifacts=artifacts, input_io=graph_io(loaded.model))


def _check_before_passes(config: PipelineConfig, artifacts: ArtifactSet) -> None:
    """Everything the config and the model's graph decide, checked before the first pass (no weight read).

    Raises:
        ConfigError: the passes' order keeps one from running (``pass_order_problem`` with the input graph), a
            pass's ``check_model`` hook refuses (prefixed with the pipeline key), a prompt id is outside the
            vocabulary of the model's logits output, or ``verify.batching`` cannot be served
            (:func:`~onnxdeploy.batching_stage.check_batching`).
    """
    where = _where(config)
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
        check_batching(config, logits_vocab(config.model))


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


def graph_io(model: onnx_ir.Model) -> GraphIO:
    """A graph's inputs and outputs: name, element type, dims (int, symbolic name or '?')."""

    def info(value: onnx_ir.Value) -> TensorInfo:
        shape = None
        if value.shape is not None:
            shape = [d if isinstance(d, int) else (d.value or "?") for d in value.shape]
        return TensorInfo(name=value.name or "", dtype=value.dtype.name if value.dtype else "?", shape=shape)

    return [info(v) for v in model.graph.inputs], [info(v) for v in model.graph.outputs]


# ---------------------------------------------------------------------------------------------------- passes


def open_pass_cache(
    config: PipelineConfig, loaded: LoadedModel, calibration: list[list[int]], context: PassContext
) -> PassCache | None:
    """The run's pass cache, or None when the pipeline has no passes or ``cache: null`` (``--no-cache``).

    ``verify_each_pass`` and ``bisect`` decode every pass's output, so they run every pass: no cache then (a
    pass served from the cache would not be verified, and a later pass would be blamed). The key includes what
    the context supplies (:meth:`~onnxdeploy.passes.PassContext.provenance`) and ``output_name``: the graphs' file
    names (``<stem>.s1.c16.onnx``, ``<stem>.part1.onnx``) and the contracts that list them derive from it, and an entry
    is served with the names it was stored under, so a run with another ``output_name`` must miss (a hit had written
    the other run's ``model.onnx`` into this run's folder, over an input of that name).
    """
    if config.cache is None or not config.passes or config.verify_each_pass or config.bisect:
        return None
    return PassCache.for_run(
        config.cache,
        loaded,
        [(spec.name, spec.config.model_dump(mode="json")) for spec in config.passes],
        supplied={**context.provenance(), "output_name": config.output_name},
        calibration=calibration,
    )


def passes_stage(
    config: PipelineConfig,
    artifacts: ArtifactSet,
    context: PassContext,
    cache: PassCache | None,
    say: Say,
    step: StepProgress,
) -> Passed:
    """Run the passes not served from ``cache``, each output verified when ``verify_each_pass`` asks.

    Every pass's output is stored in ``cache`` (when there is one); ``check_after_each_pass`` runs the ONNX
    checker on every graph after every pass (its findings name the pass). After each pass the memory-mapped
    weights of its input are unmapped (:func:`~onnxdeploy.model_io.release_weights`; they map again if read):
    a weight a pass replaced (``fuse_matmuls``' q/k/v, ``quantize_weights``' float MatMul weights) is then no
    longer resident through verify (measured: 0.73x a 1 GB model's bytes held into verify on the fast chain).

    Returns:
        The result; its failures are the error findings found after the passes and the first diverging pass.

    Raises:
        OnnxDeployError: a pass refuses the graph (its message names the pass and the reason).
    """
    each_pass = EachPassVerifier(config.model, config.verify, enabled=config.verify_each_pass, bisect=config.bisect)
    reports: list[PassReport] = []
    findings: list[Finding] = []
    first = 0
    if cache is not None:
        cache.say = say  # misses, stores, evictions on the console; problems also in the report's notes
        hit = cache.lookup()
        if hit is not None:
            artifacts, first = hit.artifacts, hit.passes
            reports = [r.model_copy(update={"cache": "hit"}) for r in hit.reports]
            findings += hit.findings
            context.passes_run.extend(r.name for r in hit.reports)
            served = cache.folder / cache.keys[first - 1]
            say(f"pass cache: passes {', '.join(context.passes_run)} from the cache {served}")
    step("passes", first, len(config.passes))
    for i, spec in enumerate(config.passes[first:], start=first):
        say(f"pass {spec.name} {yaml_inline(spec.config.model_dump(mode='json', exclude_defaults=True))}")
        before = artifacts.primary.clone() if each_pass.wants_input() else None
        result = spec.build()(artifacts, context)
        for model in artifacts.models():  # the pass's input: pages it read (fused, quantized) leave memory
            release_weights(model)
        artifacts = result.artifacts
        reports.append(result.report)
        each_pass.after(spec.name, before, artifacts, say)
        step("passes", i + 1, len(config.passes))
        if config.check_after_each_pass:
            findings += _checker_findings(config, artifacts, spec.name)
        if cache is not None:
            result.report.cache = cache.store(i + 1, artifacts, reports, findings)
    if cache is not None:
        artifacts.notes.extend(cache.notes)
    failures = [*_error_lines(findings), *each_pass.failures()]
    return Passed(artifacts=artifacts, reports=reports, findings=findings, each_pass=each_pass, failures=failures)


def _checker_findings(config: PipelineConfig, artifacts: ArtifactSet, pass_name: str) -> list[Finding]:
    """``check_after_each_pass``: the ONNX checker on every graph's header, each finding naming the pass."""
    findings = []
    for artifact in artifacts.artifacts:
        header = stand_in_proto(artifact.model, as_inputs=True)
        findings += [
            f.model_copy(update={"message": f"after pass {pass_name}: {f.message}"})
            for f in get_check("checker")().run(header, CheckContext(target=config.target))
        ]
    return findings


def _error_lines(findings: list[Finding]) -> list[str]:
    return [f"{f.code} {f.message}" for f in findings if f.level == "error"]


# ----------------------------------------------------------------------------------------------------- write


def write_stage(config: PipelineConfig, artifacts: ArtifactSet, say: Say) -> Written:
    """Stage every graph (and the shared external data file) inside the output folder; the input leaves memory.

    Raises:
        OutputError: a graph would overwrite an input file, is over the protobuf limit inline, or the folder
            cannot be written.
    """
    out_dir = config.output_dir
    inputs = input_files(config.model)
    for artifact in artifacts.artifacts:  # the primary's config name was checked before any work; its graph's too
        check_not_an_input(out_dir / artifact.name, inputs, "output model")
    external = artifacts.external()
    data_names = part_data_files(artifacts)
    files = len(set(data_names.values())) + (len(data_names) < len(artifacts.artifacts))  # split per_part: K
    data = "one external data file" if files == 1 else f"{files} external data files"
    say(f"writing {len(artifacts.artifacts)} graph(s)" + (f" and {data}" if external else ""))
    staged = stage_artifacts(
        [(a.name, a.model) for a in artifacts.artifacts],
        out_dir,
        external=external,
        data_name=f"{config.output_name}.data",
        size_threshold_bytes=artifacts.weights.size_threshold_bytes,
        data_names=data_names,
    )
    for model in artifacts.models():
        release_weights(model)  # the input's pages leave memory before ONNX Runtime maps the outputs
    return Written(staged=staged, removes=stale_outputs(config, staged))


def part_data_files(artifacts: ArtifactSet) -> dict[str, str]:
    """Graph file → data file of the parts whose contract names one (``split {weights: per_part}``)."""
    found = {}
    for artifact in artifacts.artifacts:
        contract = read_contract(artifact.model, source=artifact.name)
        if contract is not None and contract.part is not None and contract.part.weights_file:
            found[artifact.name] = contract.part.weights_file
    return found


def write_nothing(config: PipelineConfig) -> Written:
    """An empty staging folder, for a run that writes its reports only (an input that cannot be loaded)."""
    staged = stage_artifacts([], config.output_dir, external=False, data_name=f"{config.output_name}.data")
    return Written(staged=staged, removes=stale_outputs(config, staged))


def stale_outputs(config: PipelineConfig, staged: StagedArtifacts) -> list[str]:
    """What of an earlier run's output in ``output_dir`` this run leaves behind, to be removed at its commit.

    The graphs and data files the earlier run's ``report.json`` lists (:class:`~onnxdeploy.artifacts.EarlierOutputs`)
    that this run does not write (a graph-set run's ``model.s1.c16.onnx`` after a single-graph run, a data file
    after a self-contained one), and the old ``<output_name>.data`` when this run's graphs are self-contained
    (they never read it) — only where an earlier run's ``report.json`` shows the folder is a run's: without one,
    a ``model.onnx.data`` there may be the user's own and is left alone. A user's other files are never listed.
    """
    out_dir = config.output_dir
    earlier = EarlierOutputs.read(out_dir)
    if not earlier:
        return []
    removes = earlier.stale(out_dir, staged.files)
    data = f"{config.output_name}.data"
    if staged.files and staged.data_file is None and data not in removes and (out_dir / data).is_file():
        removes.append(data)
    return removes


# ---------------------------------------------------------------------------------------------------- checks


def checks_stage(
    config: PipelineConfig, staged: StagedArtifacts, artifacts: ArtifactSet, say: Say, step: StepProgress
) -> Checked:
    """Run the pipeline's checks on every staged graph as written (its header; weights are not read).

    Messages name the output folder, not the staging folder; on a set each is prefixed with its graph's name.
    """
    checks = check_names(config, artifacts)
    findings: list[Finding] = []
    several = len(artifacts.artifacts) > 1
    total = len(checks) * len(artifacts.artifacts)
    step("checks", 0, total)
    for i, artifact in enumerate(artifacts.artifacts):
        path = staged.path(artifact.name)
        header = read_model_header(path)  # inline weights as references to the file: not read, not copied
        ctx = CheckContext(model_path=path, target=config.target)
        say(f"checks {', '.join(checks)}" + (f" on {artifact.name}" if several else ""))
        for name in checks:
            for f in get_check(name)().run(header, ctx):
                message = f"{artifact.name}: {f.message}" if several else f.message
                message = message.replace(str(staged.staging), str(config.output_dir))
                findings.append(f.model_copy(update={"message": message}))
        step("checks", (i + 1) * len(checks), total)
    return Checked(names=checks, findings=findings, failures=_error_lines(findings))


def check_input_stage(config: PipelineConfig, unloadable: DuplicateTensorError, say: Say) -> Checked:
    """A checks-only run on a graph that defines a tensor twice: the checks read the input's header as it is.

    The graph cannot be loaded into onnx_ir (nor run by ONNX Runtime), so nothing else can look at it.

    Returns:
        The checks' findings; the failures are their errors, else why the input could not be loaded.
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
    return Checked(names=names, findings=findings, failures=_error_lines(findings) or [str(unloadable)])


def check_names(config: PipelineConfig, artifacts: ArtifactSet) -> list[str]:
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


# ---------------------------------------------------------------------------------------------------- verify


def verify_stage(
    config: PipelineConfig,
    staged: StagedArtifacts,
    artifacts: ArtifactSet,
    held_out: list[int] | None,
    say: Say,
    verify_progress: StepProgress | None,
    calibration: list[list[int]] | None = None,
) -> Verified:
    """Decode the staged candidate against the original: on ONNX Runtime, on the other runtimes, held-out tokens.

    The reports name the candidate by its final path in the output folder, not the staging folder.

    Returns:
        The result (empty without a ``verify`` section); failures in the order accuracy, ONNX Runtime (the
        run's, then each mode's), other runtimes.

    Raises:
        DecodeRunError / ContractError: a model cannot be decoded (as :func:`onnxdeploy.runner.verify`).
    """
    v = config.verify
    if v is None:
        return Verified()
    name = artifacts.artifacts[0].name
    candidate, final = staged.path(name), config.output_dir / name
    say(f"verify: {len(v.prompt)} prompt tokens + {v.steps} steps, modes {', '.join(v.modes)}")
    report = verify(
        str(config.model),
        str(candidate),
        prompt=list(v.prompt),
        steps=v.steps,
        modes=tuple(v.modes),
        max_abs_logit_diff=v.max_abs_logit_diff,
        min_top1_agreement=v.min_top1_agreement,
        providers=tuple(v.providers),
        strict_providers=v.strict_providers,
        remainder=v.remainder,
        progress=verify_progress,
        bounds=LogitThresholds(max_rel_logit_diff=v.max_rel_logit_diff, min_cosine_similarity=v.min_cosine_similarity),
    )
    fallbacks = [line.replace(str(candidate), str(final)) for line in report.provider_fallbacks]
    report = report.model_copy(update={"candidate": str(final), "provider_fallbacks": fallbacks})
    report = generations_with(report, v.tokenizer, prompt_text=v.prompt_text, chat=v.chat_template)
    batching = None
    if v.batching is not None:  # the trace served by continuous batching, each request against its batch-1 decode
        say(f"verify: batching ({v.batching.policy}), each request against its batch-1 decode of the original")
        batching = batching_report(config, candidate, logits_vocab(config.model))
        report = report.model_copy(update={"batching": batching})
    runtimes = other_runtimes(config, candidate, held_out, calibration or [], say)
    accuracy = _accuracy(config, held_out, candidate, final, say)
    failures = [*(accuracy.failures if accuracy is not None else []), *_verify_failures(report)]
    failures += [_runtime_failure(r) for r in runtimes if not r.passed]
    failures += batching.failures() if batching is not None else []
    return Verified(verify=report, accuracy=accuracy, runtimes=runtimes, failures=failures)


def _verify_failures(report: VerifyReport) -> list[str]:
    """The verification's failure lines: the run's, then each mode's (each line starts with its mode)."""
    if report.passed:
        return []
    lines = [f"verify: {msg}" for msg in report.failures]
    for mode in report.modes.values():
        lines += [f"verify {msg}" for msg in mode.failures]
    return lines


def _runtime_failure(r: RuntimeComparison) -> str:
    """One line: why the candidate failed on another runtime (refused, each bound broken, a graph not driven)."""
    if r.refused:
        return f"verify on {r.runtime}: {r.refused}"
    if r.failures:
        return f"verify on {r.runtime}: {'; '.join(r.failures)}"
    allowed = f"{r.max_abs_logit_diff_allowed:.3g}" if r.max_abs_logit_diff_allowed is not None else "none"
    worst = f"{r.max_abs_logit_diff:.3g}" if r.max_abs_logit_diff is not None else "?"
    return f"verify on {r.runtime}: max |diff| {worst} (allowed {allowed}), top-1 {r.top1_agreement:.3f}"


def _accuracy(
    config: PipelineConfig, tokens: list[int] | None, candidate: Path, final: Path, say: Say
) -> AccuracyReport | None:
    """``verify.accuracy``: teacher-forced KL, top-1 and perplexity of the candidate on ``tokens`` (held out)."""
    assert config.verify is not None
    acc = config.verify.accuracy
    if acc is None or tokens is None:
        return None
    say(f"accuracy: {len(tokens)} held-out tokens, teacher-forced")
    thresholds = {"max_mean_kl": acc.max_mean_kl, "min_top1_agreement": acc.min_top1_agreement}
    thresholds["max_ppl_ratio"] = acc.max_ppl_ratio
    providers = tuple(config.verify.providers)
    # a cache_policy candidate: figures within its cache, and the policy's cost against the full context (issue 18)
    report = evaluate_policy_accuracy(str(config.model), str(candidate), tokens, providers=providers, **thresholds)
    if report is None:
        report = evaluate_accuracy(str(config.model), str(candidate), tokens, providers=providers, **thresholds)
    elif report.policy_quality is not None:
        say(report.policy_quality.text())
    return report.model_copy(update={"candidate": str(final)})


# ---------------------------------------------------------------------------------------------------- commit


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends (they are delivered then, not lost)."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def commit_stage(config: PipelineConfig, written: Written, wrote_model: bool, say: Say) -> None:
    """Rename every staged file into the output folder, then remove an earlier run's files it does not replace.

    Both with signals held (only renames and unlinks remain by now). ``written.removes``
    (:func:`stale_outputs`) are removed and named on the console, as the report lists them.

    Raises:
        OutputError: a rename failed (the files already moved are removed again).
    """
    staged = written.staged
    out_dir = config.output_dir
    with signals_held():
        staged.commit()
        for name in written.removes:
            (out_dir / name).unlink(missing_ok=True)
    if written.removes:
        say(f"removed {', '.join(written.removes)}: an earlier run's output in {out_dir} this run does not replace")
    if wrote_model:
        say(f"wrote {', '.join(str(out_dir / n) for n in staged.files)}")
