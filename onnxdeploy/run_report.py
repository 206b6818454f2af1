"""The report stage of a pipeline run: ``RunReport`` assembled from the stages' results, staged as three files.

``report.json`` (per-position rows summarised beyond ``report.max_rows``), ``report.md`` and ``report.html``
(every position plotted) are staged beside the graphs and renamed into place with them by the commit. Paths in
the report are the final ones in the output folder; files are hashed where they are staged.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Protocol

import onnx
import onnx_ir
import onnxruntime
import onnxsim

from onnxdeploy import __version__
from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.config import PipelineConfig
from onnxdeploy.contract import read_contract
from onnxdeploy.html_report import render_html
from onnxdeploy.model_io import StagedArtifacts, input_files, sha256_file
from onnxdeploy.render import render_markdown
from onnxdeploy.report import FileRecord, GraphReport, PhaseReport, RunReport, summarise_verify
from onnxdeploy.run_stages import Checked, GraphIO, Loaded, Passed, StageResult, Verified, Written, graph_io
from onnxdeploy.sdk_stage import SdkBuilt

__all__ = ["REPORT_FILES", "report_stage"]

REPORT_FILES = ("report.json", "report.md", "report.html")
"""The run's report files, written beside the graphs."""


def report_stage(
    config: PipelineConfig,
    load: Loaded,
    passes: Passed | None,
    written: Written,
    checks: Checked,
    verified: Verified | None,
    *,
    clock: PhaseClock,
    start: float,
    sdk: SdkBuilt | None = None,
) -> RunReport:
    """Assemble the run's report and stage its three files.

    Args:
        config: the pipeline.
        load: the load stage's result (the input's inputs and outputs, or why it could not be loaded).
        passes: the passes stage's; None when the input could not be loaded (a checks-only run on a graph that
            defines a tensor twice: the report is all the run writes).
        written: the write stage's (the staging folder the reports join).
        checks: the checks stage's.
        verified: the verify stage's; None when the input could not be loaded.
        clock: the run's phase clock; the ``report`` phase (rendering report.html) closes before report.json is
            written, so the phases account for the rendering too.
        start: ``time.perf_counter()``'s reading at the process's start.
        sdk: the SDK build stage's result (``report.json`` → ``sdk``; its failures join the run's), if it ran.

    Returns:
        The report as written to report.json (status ``failed`` when any stage has a failure).
    """
    stages: list[StageResult | SdkBuilt | None] = [load, passes, written, checks, sdk, verified]
    failures = [line for stage in stages if stage is not None for line in stage.failures]
    common = {
        "status": "failed" if failures else "passed",
        "pipeline": str(config.source.resolve()) if config.source else None,
        "input_model": str(config.model),
        "output_files": [str(config.output_dir / n) for n in (*written.staged.files, *REPORT_FILES)],
        "removed_files": [str(config.output_dir / n) for n in written.removes],
        "target": config.target,
        "checks_run": checks.names,
        "failures": failures,
        "phases": clock.phases,
        "onnxdeploy_version": __version__,
        "versions": _versions(),
        "sdk": sdk.report if sdk is not None else None,
    }
    if passes is None or verified is None:
        report = RunReport(
            **common,
            output_model=None,
            notes=[f"{load.unloadable}; the model was checked as it is and not written"],
            findings=checks.findings,
            wall_time_s=round(time.perf_counter() - start, 3),
        )
    else:
        report = _written_report(config, common, load, passes, written, checks, verified, start)
    return _stage_reports(written.staged, report, config, clock, start)


def _written_report(
    config: PipelineConfig,
    common: dict,
    load: Loaded,
    passes: Passed,
    written: Written,
    checks: Checked,
    verified: Verified,
    start: float,
) -> RunReport:
    """The report of a run that wrote its graphs: files, graphs, contract, passes, findings, verification."""
    primary = passes.artifacts.artifacts[0]
    final_model = config.output_dir / primary.name
    contract = read_contract(primary.model, source=str(final_model))
    each_pass = passes.each_pass
    return RunReport(
        **common,
        output_model=str(final_model),
        files=_file_records(config, written.staged, passes.artifacts, load.input_io),
        notes=passes.artifacts.notes,
        contract=contract.model_dump() if contract else None,
        graphs=_graph_reports(passes.artifacts, written.staged),
        passes=passes.reports,
        findings=[*passes.findings, *checks.findings],
        verify=verified.verify,
        accuracy=verified.accuracy,
        runtimes=verified.runtimes,
        pass_verification=each_pass.records,
        first_divergent_pass=each_pass.first_pass,
        first_divergent_node=each_pass.node,
        wall_time_s=round(time.perf_counter() - start, 3),
    )


def _versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "onnx": onnx.__version__,
        "onnx_ir": onnx_ir.__version__,
        "onnxsim": getattr(onnxsim, "__version__", "unknown"),
        "onnxruntime": onnxruntime.__version__,
    }


class PhaseClock(Protocol):
    """Closes a run's phases (``report.json`` → ``phases``): the pipeline's clock."""

    phases: list[PhaseReport]

    def done(self, name: str) -> None:
        """Close the phase ``name``."""


def _stage_reports(
    staged: StagedArtifacts, report: RunReport, config: PipelineConfig, clock: PhaseClock, start: float
) -> RunReport:
    """Stage report.html (plots of every position) and report.json/report.md (rows up to ``report.max_rows``).

    The ``report`` phase (the HTML and its plots) is closed and ``wall_time_s`` read just before report.json is
    written: only report.md's rendering and the final renames are outside them.

    Returns:
        The report as written to report.json (per-position rows summarised beyond ``report.max_rows``).
    """
    max_rows = config.report.max_rows
    staged.add_text("report.html", render_html(report, max_rows=max_rows))
    clock.done("report")
    report = report.model_copy(
        update={"phases": list(clock.phases), "wall_time_s": round(time.perf_counter() - start, 3)}
    )
    if report.verify is not None:
        report = report.model_copy(update={"verify": summarise_verify(report.verify, max_rows)})
    staged.add_text("report.json", report.model_dump_json(indent=2))
    staged.add_text("report.md", render_markdown(report))
    return report


def _file_records(
    config: PipelineConfig, staged: StagedArtifacts, artifacts: ArtifactSet, input_io: GraphIO
) -> list[FileRecord]:
    """Every input file (model, its data, pipeline, token files) and staged output, with size and sha256.

    Hashing reads each file once, in chunks (memory stays flat); the outputs are hashed in the staging folder
    and listed under their final paths.
    """
    model = Path(config.model)
    extra = [config.source] + [
        s.token_ids_file for s in (config.calibration, config.verify and config.verify.accuracy) if s
    ]
    if config.verify is not None:  # text inputs (text.py): the held-out text and the tokenizer that encoded it
        acc = config.verify.accuracy
        extra += [acc.text_file if acc else None, config.verify.tokenizer]
    inputs = [model, *sorted(p for p in input_files(model) if p != model.resolve()), *(Path(p) for p in extra if p)]
    records = []
    for path in dict.fromkeys(inputs):  # the model, then the rest, each once
        io = input_io if path == model else ([], [])
        records.append(_file_record(path, str(path.resolve()), "input", io))  # absolute, as the outputs are
    graphs = {a.name: a.model for a in artifacts.artifacts}
    for name in staged.files:
        io = graph_io(graphs[name]) if name in graphs else ([], [])
        records.append(_file_record(staged.path(name), str((config.output_dir / name).resolve()), "output", io))
    return records


def _file_record(path: Path, listed_as: str, role: str, io: GraphIO) -> FileRecord:
    return FileRecord(
        path=listed_as, role=role, bytes=path.stat().st_size, sha256=sha256_file(path), inputs=io[0], outputs=io[1]
    )


def _graph_reports(artifacts: ArtifactSet, staged: StagedArtifacts) -> list[GraphReport]:
    """``report.json`` → ``graphs``: every graph written that carries a contract, primary first.

    Each with its part index and output (logits, or a split part's hidden state) from its contract, and the data
    file the writer put its weights in (``staged.weights_files``).
    """
    graphs = []
    for artifact in artifacts.artifacts:
        c = read_contract(artifact.model, source=artifact.name)
        if c is not None:
            hidden = c.part.hidden_out if c.part is not None else None
            graphs.append(
                GraphReport(
                    file=artifact.name,
                    step_len=c.step_len,
                    max_cache_len=c.max_cache_len,
                    prefill_logits=c.prefill_logits,
                    role="decode" if c.step_len == 1 else "prefill",
                    part=c.part.index if c.part is not None else None,
                    output="hidden_state" if hidden else "logits",
                    output_name=hidden or c.logits,
                    weights_file=staged.weights_files.get(artifact.name),
                )
            )
    return graphs
