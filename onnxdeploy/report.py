"""Report models: per pass, per check finding, per file and phase, and the run report.

The verification's models (per step, per mode, per runtime, accuracy) live in :mod:`onnxdeploy.report_verify` and
are re-exported here, so ``from onnxdeploy.report import VerifyReport`` keeps working.

The run report JSON (``report.json``) is the CI interface; its fields are listed in the README
("Report fields"). ``schema_version`` changes when a field
changes meaning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from onnxdeploy.report_verify import (
    AccuracyFigures,
    AccuracyReport,
    CallTiming,
    GenerationsReport,
    GenerationText,
    LatencySummary,
    ModeResult,
    NumericsReport,
    PrefillSummary,
    RuntimeComparison,
    SessionSettings,
    StepBlock,
    StepRecord,
    VerifyReference,
    VerifyReport,
    spike_threshold_ms,
    summarise_steps,
    summarise_verify,
)

__all__ = [
    "SCHEMA_VERSION",
    "Level",
    "Finding",
    "CHECK_REPORT_SCHEMA_VERSION",
    "CheckReport",
    "RuntimeComparison",
    "PassReport",
    "StepRecord",
    "GenerationText",
    "GenerationsReport",
    "LatencySummary",
    "CallTiming",
    "PrefillSummary",
    "GraphReport",
    "ModeResult",
    "NumericsReport",
    "SessionSettings",
    "VerifyReference",
    "VerifyReport",
    "PassVerifyRecord",
    "NodeDivergence",
    "PhaseReport",
    "AccuracyFigures",
    "AccuracyReport",
    "RunReport",
    "TensorInfo",
    "FileRecord",
    "StepBlock",
    "spike_threshold_ms",
    "summarise_steps",
    "summarise_verify",
]

SCHEMA_VERSION = 3
"""3: ``steps`` of a mode lists every position only up to ``report.max_rows``; beyond it a selection, the positions
left out summarised in ``steps_omitted``; ``files`` lists every input and output file with its sha256.
2: step latencies are per single-token call (prompt positions computed by a multi-token call have none; the
prefill is reported apart), positions a ``prefill_logits: last`` graph does not compute are not compared."""

Level = Literal["error", "warning", "info"]


class Finding(BaseModel):
    """One check result: a stable ``code`` (e.g. ``OD101``), a level, what and where, and how to fix it."""

    model_config = ConfigDict(extra="forbid")

    code: str
    level: Level
    check: str = Field(description="Registry name of the check that produced it.")
    message: str
    nodes: list[str] = Field(default_factory=list, description="Node or tensor names concerned.")
    hint: str = Field("", description="How to fix it, naming the pass that does where one does.")
    rule: str = Field("", description="The rule broken, e.g. 'ai.onnx opset within 12..19' (target checks).")
    source: str = Field("", description="Where the rule comes from: document, section, version, address, date read.")


CHECK_REPORT_SCHEMA_VERSION = 1
"""Version of the ``onnxdeploy check --json`` output (:class:`CheckReport`); changes when a field changes meaning."""


class CheckReport(BaseModel):
    """What ``onnxdeploy check MODEL [--target T] --json`` prints: the checks run on one model and their findings.

    Schema (``schema_version``: :data:`CHECK_REPORT_SCHEMA_VERSION`): ``status`` is ``failed`` when any
    finding has level ``error`` (exit 1), else ``passed``; ``summary`` counts findings per level; each
    finding has ``code``, ``level``, ``check``, ``message``, ``nodes``, ``hint``, ``rule`` and ``source``
    (see :class:`Finding`; codes in :mod:`onnxdeploy.checks`); ``sdk`` holds the device SDK's own verdict
    when ``--sdk`` was asked.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: int = CHECK_REPORT_SCHEMA_VERSION
    status: Literal["passed", "failed"]
    model: str
    target: str | None = None
    target_version: str | None = Field(None, description="The matrix's product_version for the target.")
    checks_run: list[str] = Field(default_factory=list)
    summary: dict[str, int] = Field(default_factory=dict, description="Findings per level: error, warning, info.")
    findings: list[Finding] = Field(default_factory=list)
    sdk: dict[str, Any] | None = Field(None, description="The device SDK's own verdict (check --sdk), else null.")


class PassReport(BaseModel):
    """What one pass did: sizes before/after, op histogram diff, dims fixed, changes, wall time (s).

    Node counts are summed over the graphs of the set; the op histograms and their diff are the primary graph's.
    """

    def nodes_text(self) -> str:
        """``before → after`` nodes, saying when they are summed over a graph set (``626 → 938 (Σ 4 graphs)``)."""
        graphs = max(self.graphs_before, self.graphs_after)
        text = f"{self.nodes_before} → {self.nodes_after}"
        if graphs > 1:
            sizes = (
                str(self.graphs_after)
                if self.graphs_before == self.graphs_after
                else f"{self.graphs_before} → {self.graphs_after}"
            )
            text += f" (Σ {sizes} graphs)"
        return text

    def moved_to_parts(self) -> str | None:
        """``parts 1..2`` for ``split``, whose decode graph's "removed" ops moved to the other parts; else None.

        From ``details.parts`` (one row per part, ``passes/split.py``): part 0 keeps the graph's name, so the
        primary's op histogram diff is what parts 1..K-1 took, not ops the pass deleted.
        """
        parts = self.details.get("parts") if self.name == "split" else None
        if not isinstance(parts, list) or len(parts) < 2:
            return None
        return "part 1" if len(parts) == 2 else f"parts 1..{len(parts) - 1}"

    model_config = ConfigDict(extra="forbid")

    name: str
    config: dict[str, Any] = Field(default_factory=dict)
    modified: bool = False
    wall_time_s: float = 0.0
    nodes_before: int = Field(0, description="Nodes of every graph of the set the pass was given, summed.")
    nodes_after: int = Field(0, description="Nodes of every graph of the set the pass returned, summed.")
    graphs_before: int = Field(1, description="Graphs in the set the pass was given.")
    graphs_after: int = Field(1, description="Graphs in the set the pass returned (nodes are summed over them).")
    initializers_before: int = 0
    initializers_after: int = 0
    initializer_bytes_before: int = 0
    initializer_bytes_after: int = 0
    op_histogram_before: dict[str, int] = Field(default_factory=dict)
    op_histogram_after: dict[str, int] = Field(default_factory=dict)
    ops_added: dict[str, int] = Field(
        default_factory=dict, description="Op type -> count increase, in the primary (decode) graph."
    )
    ops_removed: dict[str, int] = Field(
        default_factory=dict, description="Op type -> count decrease, in the primary (decode) graph."
    )
    dims_fixed: list[str] = Field(default_factory=list, description="'tensor[axis]: old -> new' entries.")
    changes: list[str] = Field(default_factory=list, description="Human-readable changes.")
    warnings: list[str] = Field(default_factory=list)
    details: dict[str, Any] = Field(
        default_factory=dict, description="Pass-specific figures, e.g. quantize_weights' per-layer weight error."
    )
    cache: Literal["hit", "stored", "not_stored", "off"] = Field(
        "off",
        description="Pass cache: hit (served from the cache, figures from the run that stored it), stored (ran and "
        "stored), not_stored (ran; why in the run's notes), off (no cache).",
    )


class PassVerifyRecord(BaseModel):
    """``verify_each_pass``: a short teacher-forced decode of one pass's output against the original."""

    name: str = Field(description="The pass (registry name).")
    positions: int = Field(description="Positions decoded (prompt + steps).")
    max_abs_logit_diff: float
    top1_agreement: float
    first_divergent_step: int | None = None
    diverged: bool = Field(description="A verify threshold is broken after this pass.")


class NodeDivergence(BaseModel):
    """``bisect``: the first node of the diverging pass's input graph that its output graph does not reproduce."""

    pass_name: str | None = Field(None, description="The pass whose input and output were compared.")
    node: str = Field(description="Node name in the pass's input graph.")
    op_type: str
    output: str = Field(description="The node output that differs.")
    mapped_by: Literal["name", "value", "none"] = Field(
        description="How the output was found in the pass's output graph: same name, same numbers (data flow), "
        "or not at all (the pass changed what it computes)."
    )
    counterpart_node: str | None = Field(None, description="The node producing the same-named value after the pass.")
    max_abs_diff: float | None = Field(None, description="Largest |difference| where a counterpart was mapped.")
    call: int = Field(0, description="Session run (0 = the first call of the decode) where it first differs.")
    nodes_in_output_reading_same_inputs: list[str] = Field(
        default_factory=list, description="Nodes of the pass's output graph that read the node's mapped inputs."
    )


class GraphReport(BaseModel):
    """One graph file a run wrote (``report.json`` → ``graphs``): a decode graph or a prefill bucket, or one part.

    From the graph's contract (``part``, ``logits``) and the writer (the data file it put the weights in). A split
    model's parts 0..K-2 output the hidden state ``hidden_states.<k>`` float ``(B, step_len, hidden)``, not logits;
    the last part outputs the logits ``(B, S, V)`` (``prefill_logits: last``: ``(B, 1, V)``).
    """

    model_config = ConfigDict(extra="forbid")

    file: str
    step_len: int
    max_cache_len: int
    prefill_logits: Literal["all", "last"]
    role: Literal["decode", "prefill"]
    part: int | None = Field(None, description="0-based part index of a split model (split); null: not split.")
    output: Literal["logits", "hidden_state"] = Field(
        "logits", description="logits, or (a split model's parts but the last) the hidden state for the next part."
    )
    output_name: str | None = Field(None, description="The graph output: the logits or hidden_states.<k> name.")
    weights_file: str | None = Field(
        None, description="The data file this graph's external weights were written to; null: all inline."
    )

    def output_text(self) -> str:
        """``logits (all)``, ``logits (last)`` or ``hidden state hidden_states.2``, for the reports' tables."""
        if self.output == "hidden_state":
            return f"hidden state {self.output_name}"
        return f"logits ({self.prefill_logits})"


class TensorInfo(BaseModel):
    """A graph input or output: name, element type and shape (ints, or names of symbolic dims)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    dtype: str = Field(description="ONNX element type name, e.g. 'FLOAT', 'INT64'.")
    shape: list[int | str] | None = Field(description="Dims: an int, a symbolic name, or '?'; null: rank unknown.")


class FileRecord(BaseModel):
    """One file the run read or wrote (``report.json`` → ``files``), with its size and sha256."""

    model_config = ConfigDict(extra="forbid")

    path: str
    role: Literal["input", "output"]
    bytes: int
    sha256: str = Field(description="Hex digest of the file's bytes.")
    inputs: list[TensorInfo] = Field(default_factory=list, description="Graph inputs (ONNX graphs only).")
    outputs: list[TensorInfo] = Field(default_factory=list, description="Graph outputs (ONNX graphs only).")


class PhaseReport(BaseModel):
    """Time and memory of one phase of a run (load, passes, write, checks, verify)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    wall_time_s: float = Field(description="Wall time of the phase, in seconds.")
    peak_rss_bytes: int = Field(description="The process's peak resident set size by the end of the phase, bytes.")
    rss_bytes: int = Field(description="The process's resident set size at the end of the phase, bytes.")


class RunReport(BaseModel):
    """The report of one ``onnxdeploy run``: passes, findings, verification, status."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    status: Literal["passed", "failed"]
    pipeline: str | None = None
    input_model: str
    output_model: str | None
    output_files: list[str] = Field(
        default_factory=list, description="Every file the run wrote: external data, graphs, reports."
    )
    removed_files: list[str] = Field(
        default_factory=list,
        description="Graphs and data files an earlier run wrote into output_dir (listed in its report.json) that this "
        "run's output does not replace: removed when this run's outputs were moved into place.",
    )
    files: list[FileRecord] = Field(
        default_factory=list,
        description="Every input file (model, its data, the pipeline, token files) and every output graph and data "
        "file, with size and sha256 (the reports, which hold this list, are not in it).",
    )
    notes: list[str] = Field(default_factory=list, description="What the loader did (e.g. sorted the graph).")
    target: str | None = None
    contract: dict[str, Any] | None = None
    graphs: list[GraphReport] = Field(
        default_factory=list, description="Every graph written (primary first), from each graph's contract."
    )
    passes: list[PassReport] = Field(default_factory=list)
    checks_run: list[str] = Field(default_factory=list, description="Registry names of the checks that ran.")
    findings: list[Finding] = Field(default_factory=list)
    verify: VerifyReport | None = Field(None, description="null when the pipeline has verify: null.")
    accuracy: AccuracyReport | None = Field(None, description="verify.accuracy figures, when configured.")
    runtimes: list[RuntimeComparison] = Field(
        default_factory=list, description="verify.runtimes other than onnxruntime: each against the original on ORT."
    )
    pass_verification: list[PassVerifyRecord] = Field(
        default_factory=list, description="verify_each_pass: one short decode per pass, in order (empty when off)."
    )
    first_divergent_pass: str | None = Field(None, description="verify_each_pass: the first pass that diverged.")
    first_divergent_node: NodeDivergence | None = Field(
        None, description="bisect: the first node of that pass's input graph its output does not reproduce."
    )
    sdk: dict[str, Any] | None = Field(
        None,
        description="The device SDK build stage (sdk: auto | build | off): mode, build, per graph the verdict, "
        "the .rknn file and per node where the SDK placed it beside the matrix; null for targets without one.",
    )
    failures: list[str] = Field(default_factory=list, description="Why status is 'failed'.")
    wall_time_s: float = 0.0
    phases: list[PhaseReport] = Field(
        default_factory=list, description="Time and memory per phase: load, passes, write, checks, verify."
    )
    onnxdeploy_version: str = ""
    versions: dict[str, str] = Field(default_factory=dict)

    def peak_memory(self) -> tuple[int, str] | None:
        """(the run's peak RSS in bytes, the phase it was reached in), from ``phases``; None without phases.

        ``peak_rss_bytes`` is the process's peak so far at each phase's end, so the largest is the run's and the
        first phase to show it is where it was reached.
        """
        if not self.phases:
            return None
        peak = max(p.peak_rss_bytes for p in self.phases)
        return peak, next(p.name for p in self.phases if p.peak_rss_bytes == peak)
