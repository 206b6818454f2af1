"""Report models of the verification: per position, per mode, per runtime, accuracy; and long step lists summarised.

They are the ``verify`` section of ``report.json`` (and the output of ``onnxdeploy verify --json``), the
``runtimes`` and the ``accuracy`` sections; :mod:`onnxdeploy.report` re-exports them beside the run report.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "RuntimeComparison",
    "StepRecord",
    "LatencySummary",
    "CallTiming",
    "PrefillSummary",
    "StepBlock",
    "ModeResult",
    "NumericsReport",
    "SessionSettings",
    "GenerationText",
    "GenerationsReport",
    "VerifyReference",
    "VerifyReport",
    "AccuracyFigures",
    "AccuracyReport",
    "PolicyQualityFigures",
    "BatchRequestReport",
    "BatchingReport",
    "spike_threshold_ms",
    "summarise_steps",
    "summarise_verify",
]


class RuntimeComparison(BaseModel):
    """The candidate on one runtime against the original on ONNX Runtime (``verify.runtimes``).

    The candidate is fed the original's greedy tokens (teacher-forced); errors are per position over the
    vocabulary, top-1 agreement over all positions.
    """

    model_config = ConfigDict(extra="forbid")

    runtime: str
    device: str = Field(description="'CPU' for OpenVINO; the active ORT providers for onnxruntime.")
    precision: str = Field("", description="OpenVINO's INFERENCE_PRECISION_HINT as compiled ('f32').")
    passed: bool
    positions: int = 0
    top1_agreement: float = 0.0
    max_abs_logit_diff: float | None = None
    max_abs_logit_diff_allowed: float | None = Field(
        None, description="The tolerance this runtime was held to (its verify.runtimes entry's, else verify's)."
    )
    first_divergent_step: int | None = None
    refused: str | None = Field(None, description="Why the runtime could not run the candidate (names the op).")
    max_rel_logit_diff: float | None = Field(
        None, description="Largest per-position max|diff| / max|reference logit| (runner/thresholds.py)."
    )
    mean_cosine_similarity: float | None = Field(None, description="Mean cosine similarity of the logit rows.")
    thresholds: dict[str, Any] | None = Field(
        None, description="The bounds this runtime was held to and their basis (fp32 / fp16 / int8 defaults)."
    )
    graphs: list[str] = Field(default_factory=list, description="The candidate's graph files opened on the runtime.")
    graphs_driven: dict[str, int] = Field(
        default_factory=dict, description="Compared calls per graph file on this runtime (0: not driven)."
    )
    graphs_driven_apart: list[str] = Field(default_factory=list, description="Graphs driven apart from the decode.")
    by_graph: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="The figures of the positions each graph of a set computed."
    )
    accuracy: dict[str, Any] | None = Field(
        None, description="Held-out teacher-forced figures on this runtime (int8 builds are judged by them)."
    )
    failures: list[str] = Field(default_factory=list, description="Each bound broken, overall or per graph.")


class StepRecord(BaseModel):
    """Comparison at one decode position (prompt positions included).

    Logit errors are over the vocabulary of batch row 0 at that position. Latencies (ms) are the wall time
    of the ``session.run`` that fed this one position alone; a position fed by a multi-token call (a prefill,
    a bucket) has none: that call is in :class:`PrefillSummary`.
    """

    model_config = ConfigDict(extra="forbid")

    position: int
    phase: Literal["prompt", "generate"]
    token_in: int = Field(description="Token id fed to the candidate at this position.")
    top1_reference: int
    top1_candidate: int
    top1_match: bool
    topk_overlap: float = Field(description="|top-k(ref) ∩ top-k(cand)| / k, k=5.")
    max_abs_logit_diff: float
    max_rel_logit_diff: float
    cosine_similarity: float
    within_tolerance: bool
    latency_ms_reference: float | None = None
    latency_ms_candidate: float | None = None
    graph: str | None = Field(None, description="File name of the candidate graph that computed this position.")


class LatencySummary(BaseModel):
    """Latency percentiles of per-call ``session.run`` wall time, in ms (single-token decode steps)."""

    model_config = ConfigDict(extra="forbid")

    calls: int = Field(0, description="Calls summarized; with fewer than 100, p99 is close to the max.")
    p50: float
    p99: float
    max: float
    mean: float
    min: float = 0.0
    std: float = Field(0.0, description="Standard deviation (ms).")
    iqr: float = Field(0.0, description="Interquartile range p75 - p25 (ms): the spread around the median.")
    spikes: int = Field(0, description="Calls slower than 3x the median.")


class CallTiming(BaseModel):
    """One multi-token call (a prefill or a bucket): which graph, how many real and padded tokens, how long."""

    model_config = ConfigDict(extra="forbid")

    graph: str
    start: int = Field(description="Position of its first token.")
    tokens: int = Field(description="Real tokens fed.")
    step_len: int = Field(description="Positions computed (tokens + padding).")
    ms: float


class PrefillSummary(BaseModel):
    """The calls that fed the prompt, reported apart from the per-step latency."""

    model_config = ConfigDict(extra="forbid")

    calls: int
    tokens: int
    total_ms: float
    ms_per_token: float
    tokens_per_s: float
    per_call: list[CallTiming] = Field(default_factory=list)


class StepBlock(BaseModel):
    """Consecutive positions whose :class:`StepRecord` rows were left out of a mode's ``steps`` (``report.max_rows``).

    Figures are over the block's positions; latencies (ms) over those that have a single-token call.
    """

    model_config = ConfigDict(extra="forbid")

    first_position: int
    last_position: int
    positions: int
    top1_agreement: float
    max_abs_logit_diff: float
    min_cosine_similarity: float
    latency_ms_candidate_p50: float | None = None
    latency_ms_candidate_max: float | None = None
    graphs: list[str] = Field(default_factory=list, description="Candidate graph files that computed these positions.")


class ModeResult(BaseModel):
    """Summary and per-step records of one decode mode (``teacher_forced`` or ``free_running``)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["teacher_forced", "free_running"]
    passed: bool
    positions: int
    top1_agreement: float = Field(description="Fraction of positions whose top-1 token agrees.")
    max_abs_logit_diff: float
    mean_cosine_similarity: float
    first_divergent_step: int | None = Field(
        description="First position whose top-1 differs or whose max abs diff breaks the tolerance."
    )
    latency_ms: LatencySummary = Field(description="Candidate per-step latency: single-token calls after the prompt.")
    reference_latency_ms: LatencySummary = Field(description="Original per-step latency, measured the same way.")
    prefill: PrefillSummary | None = Field(None, description="The candidate's prompt calls.")
    reference_prefill: PrefillSummary | None = Field(None, description="The original's prompt call(s).")
    positions_by_graph: dict[str, int] = Field(
        default_factory=dict, description="Compared positions per candidate graph file (a graph set lists each)."
    )
    failures: list[str] = Field(default_factory=list)
    steps: list[StepRecord] = Field(
        default_factory=list,
        description="Per-position records: all of them up to report.max_rows, else a selection (summarise_steps).",
    )
    steps_omitted: list[StepBlock] = Field(
        default_factory=list, description="Runs of consecutive positions left out of steps, summarised; [] if none."
    )


class NumericsReport(BaseModel):
    """How the candidate's floating point ran on the provider that computed it (native or emulated)."""

    model_config = ConfigDict(extra="forbid")

    compute_dtype: Literal["float32", "float16", "bfloat16", "float64"] = Field(
        description="The float type holding most of the candidate's weight elements (its compute dtype)."
    )
    provider: str = Field(description="The execution provider that ran the candidate (first active).")
    execution: Literal["native", "emulated"] = Field(
        description="native: the provider computes in compute_dtype; emulated: it does not (ORT's CPU EP runs "
        "float16 MatMul/Add/Softmax through float32 Casts and has no bfloat16 kernels): the figures say the graph "
        "is right, not how a float16/bfloat16 device rounds."
    )
    detail: str = Field(description="What ran in place of compute_dtype, in words.")


class SessionSettings(BaseModel):
    """How the runner opened a model's ONNX Runtime session(s), decided from the graph (runner/session.py).

    ``prepacking``: ORT's weight prepacking (``session.disable_prepacking`` "0"), on for graphs with quantized
    weights (``MatMulNBits`` or integer weights behind a ``DequantizeLinear``: without it ORT dequantizes them on
    every call), off for float weights (they stay mapped from the file instead of a private packed copy).
    ``accuracy_level``: the ``MatMulNBits`` accuracy levels the session computes at (the nodes' attribute, or for
    ``DequantizeLinear`` + ``MatMul`` that ORT fuses, ``session.qdq_matmulnbits_accuracy_level``, default 4); empty
    for float weights.
    On fp32 activations ORT's CPU EP computes level 4 with int8 activations where MLAS has the kernel and every
    other level in fp32 (onnxruntime 1.32, ``contrib_ops/cpu/quantization/matmul_nbits.cc``, GetComputeType).
    """

    model_config = ConfigDict(extra="forbid")

    weights: Literal["float", "quantized"] = Field(description="What the graph's MatMul weights are.")
    prepacking: bool = Field(description="ORT weight prepacking on (session.disable_prepacking=0).")
    accuracy_level: list[int] = Field(
        default_factory=list, description="MatMulNBits accuracy_level(s) computed at (0/1 fp32 ... 4 int8); [] float."
    )
    reason: str = Field("", description="Why, in one line (which nodes decided, or an explicit config entry).")

    def text(self) -> str:
        """One line: ``quantized weights, prepacking on, accuracy_level 4``."""
        levels = "/".join(str(level) for level in self.accuracy_level)
        return f"{self.weights} weights, prepacking {'on' if self.prepacking else 'off'}" + (
            f", accuracy_level {levels}" if levels else ""
        )


class GenerationText(BaseModel):
    """One model's free-running generation after the prompt, decoded (``onnxdeploy/text.py``)."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int] = Field(description="Generated token ids, up to and including the first stop token.")
    text: str = Field(description="The tokens decoded, special tokens and the stop token left out.")
    stopped: bool = Field(False, description="The generation ended at a stop token the tokenizer folder declares.")
    mark_start: int | None = Field(None, description="Character offset in text of the first differing token.")
    mark_end: int | None = Field(None, description="Character offset in text just after the first differing token.")


class GenerationsReport(BaseModel):
    """The original's and the candidate's free-running generations as text, with the first differing token."""

    model_config = ConfigDict(extra="forbid")

    tokenizer: str = Field(description="The tokenizer.json that decoded them.")
    prompt_text: str = Field(description="The prompt as text (as given, or its ids decoded).")
    chat_template: bool = Field(False, description="The prompt went through the folder's chat template.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Ids that end a generation (the folder's).")
    original: GenerationText
    candidate: GenerationText | None = Field(None, description="null without the free_running mode.")
    first_differing_token: int | None = Field(
        None, description="Index among the generated tokens of the first one that differs; null if none does."
    )


class BatchRequestReport(BaseModel):
    """One request of ``verify.batching``'s trace served on the candidate, against its batch-1 decode of the original.

    Logit figures are over the float32 logits each generated token was chosen from (the prefill's last position,
    then every decode step), the original decoding the request alone and greedily (runner/batching_verify.py).
    """

    model_config = ConfigDict(extra="forbid")

    id: int = Field(description="The request's index in the trace.")
    prompt_len: int
    new_tokens: int = Field(description="Tokens the host generated (max_new_tokens, or fewer at a stop token).")
    equal_tokens: int = Field(description="Of those, how many from the first equal the original's greedy tokens.")
    max_abs_logit_diff: float
    top1_agreement: float
    row: int = Field(description="The decode row it ran in.")
    arrival: int | None = Field(None, description="The decode step at which it entered the queue (the trace's).")
    admitted: int = Field(description="The host's decode step at which it was prefilled.")
    finished: int = Field(description="The decode step after which its row was free.")
    passed: bool


class BatchingReport(BaseModel):
    """``verify.batching``: a trace served by the continuous-batching host on the candidate, request by request."""

    model_config = ConfigDict(extra="forbid")

    passed: bool
    policy: str = Field(description="continuous or static.")
    trace: str = Field(description="The trace file, or 'inline' (verify.batching's own requests / poisson).")
    batch: int = Field(description="Rows of the candidate's decode graph.")
    prefill: str | None = Field(
        None, description="graphs (batch-1 prefill graphs) or rows (prompts through the decode graph's rows)."
    )
    decode_steps: int = Field(description="Decode calls the host made over the trace.")
    max_abs_logit_diff_threshold: float
    requests: list[BatchRequestReport]

    def summary(self) -> str:
        """One line of the figures: requests equal, tokens, max |Δ|, lowest top-1, decode calls."""
        ok = sum(r.passed for r in self.requests)
        tokens = sum(r.new_tokens for r in self.requests)
        worst = max((r.max_abs_logit_diff for r in self.requests), default=0.0)
        top1 = min((r.top1_agreement for r in self.requests), default=1.0)
        return (
            f"batching ({self.policy}, B={self.batch}, trace {self.trace}): {ok}/{len(self.requests)} requests equal "
            f"to their batch-1 decode, {tokens} tokens in {self.decode_steps} decode calls, max |Δ| {worst:.2g} "
            f"(allowed {self.max_abs_logit_diff_threshold:.2g}), top-1 {top1:.3f}"
        )

    def failures(self) -> list[str]:
        """One line per request that failed: tokens equal, max |Δ| against the tolerance, top-1."""
        return [
            f"verify batching: request {r.id} ({r.prompt_len} prompt, admitted at step {r.admitted}, row {r.row}): "
            f"{r.equal_tokens}/{r.new_tokens} tokens equal, max |Δ| {r.max_abs_logit_diff:.3g} (allowed "
            f"{self.max_abs_logit_diff_threshold:.3g}), top-1 {r.top1_agreement:.3f}"
            for r in self.requests
            if not r.passed
        ]


class VerifyReference(BaseModel):
    """What the candidate's logits were compared with: the original on its whole past, or on a ``cache_policy``'s cut.

    Past ``max_cache_len`` a ``cache_policy`` candidate is judged against the original fed the same kept past (sinks
    + recent, ``runner.cache_policy.CutPastReference``; README, "Past max_cache_len"): the figures then say the graph
    does what the policy says, not what the policy costs against the full context (``accuracy.policy_quality``).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["full_context", "cut_past"] = Field(
        "full_context",
        description="full_context: the original fed every earlier position. cut_past: the original fed only the "
        "positions the cache_policy keeps (sinks + recent) before every call, at their true position ids.",
    )
    sinks: int | None = Field(None, description="cut_past: the contract's cache_policy.sinks.")
    recent: int | None = Field(None, description="cut_past: the contract's cache_policy.recent.")
    max_cache_len: int | None = Field(None, description="cut_past: the cache length the policy acts past.")
    #: a quantized original (MatMulNBits, or DQ -> MatMul fused into one): both sides ran at accuracy_level 0 (int8
    #: activations turn float noise into logit jumps) and its prompt went a token per call (rows depend on the call)
    prompt_per_token: bool = False

    def label(self) -> str:
        """The reference's name in tables: ``original``, or ``original (cut past: sinks 4 + recent 12)``."""
        return (
            "original"
            if self.kind == "full_context"
            else f"original (cut past: sinks {self.sinks} + recent {self.recent})"
        )

    def note(self, accuracy: AccuracyReport | None) -> str | None:
        """One line saying the reference is not the full context (None when it is), and where the policy's cost is."""
        if self.kind == "full_context":
            quantized = "reference: a quantized original, its prompt a token per call, both at accuracy_level 0"
            return quantized if self.prompt_per_token else None
        quality = None if accuracy is None else accuracy.policy_quality
        cost = (
            "see accuracy.policy_quality"
            if quality is not None and quality.mean_kl is not None
            else "not measured (verify.accuracy with held-out text longer than max_cache_len measures it)"
        )
        return (
            f"reference: the original fed the same kept past (sinks {self.sinks} + recent {self.recent} past "
            f"max_cache_len {self.max_cache_len}), not the full context, so these figures leave out what the "
            f"policy costs; its cost against the full context: {cost}"
        )


class VerifyReport(BaseModel):
    """Step-by-step verification of a candidate against the original on ONNX Runtime."""

    model_config = ConfigDict(extra="forbid")

    passed: bool
    original: str
    candidate: str
    providers: list[str] = Field(description="Execution providers requested, in priority order.")
    providers_active: list[str] = Field(default_factory=list, description="Providers the candidate session used.")
    provider_fallbacks: list[str] = Field(default_factory=list)
    prompt: list[int]
    steps: int
    max_abs_logit_diff_threshold: float
    min_top1_agreement_threshold: float
    rss_growth_bytes: int = 0
    strict_providers: bool = Field(False, description="A requested provider that fell back to CPU fails the run.")
    graphs: list[str] = Field(default_factory=list, description="Candidate graph files driven (a graph set: all).")
    graphs_driven: dict[str, int] = Field(
        default_factory=dict,
        description="Compared calls per candidate graph file, over the modes and the calls driven apart; every graph "
        "of a set is listed, 0 for one that could not be driven (a failure names it).",
    )
    graphs_driven_apart: list[str] = Field(
        default_factory=list,
        description="Graphs of a set the modes' decode did not use, each driven apart in one call teacher-forced on "
        "the original's tokens and compared with it (runner/coverage.py).",
    )
    failures: list[str] = Field(
        default_factory=list,
        description="Failures outside the modes (provider fallbacks, a graph of a set not driven or not matching).",
    )
    modes: dict[str, ModeResult]
    numerics: NumericsReport | None = Field(
        None, description="Compute dtype of the candidate and whether the provider ran it natively or emulated."
    )
    original_session: SessionSettings | None = Field(
        None, description="The original's session: prepacking and accuracy_level its latencies were measured at."
    )
    candidate_session: SessionSettings | None = Field(
        None, description="The candidate's session (a set: its primary graph's; every graph has the same weights)."
    )
    reference: VerifyReference = Field(
        default_factory=VerifyReference,
        description="What the original was fed: its whole past, or a cache_policy's cut past (kind cut_past).",
    )
    generations: GenerationsReport | None = Field(
        None, description="Both models' free-running generations as text, when a tokenizer is known (text.py)."
    )
    batching: BatchingReport | None = Field(
        None, description="verify.batching: the trace served by continuous batching, per request (null: not set)."
    )

    def graphs_driven_text(self) -> str | None:
        """One line naming the calls per graph of a set (and those driven outside the modes), else None."""
        if len(self.graphs_driven) < 2:
            return None
        calls = ", ".join(f"{name} {n} call(s)" for name, n in self.graphs_driven.items())
        apart = (
            f"; driven apart from the modes: {', '.join(self.graphs_driven_apart)}" if self.graphs_driven_apart else ""
        )
        return f"graphs driven: {calls}{apart}"


class AccuracyFigures(BaseModel):
    """Teacher-forced comparison of two models' next-token distributions over the same tokens."""

    model_config = ConfigDict(extra="forbid")

    positions: int = Field(description="Positions compared (tokens fed minus one).")
    mean_kl: float = Field(description="Mean KL(original || candidate) over positions, nats.")
    max_kl: float = Field(description="Largest per-position KL, nats.")
    top1_agreement: float = Field(description="Fraction of positions whose argmax agrees.")
    ppl_original: float = Field(description="Perplexity of the text under the original.")
    ppl_candidate: float = Field(description="Perplexity of the text under the candidate.")
    ppl_ratio: float = Field(description="ppl_candidate / ppl_original.")
    kl_per_position: list[float] = Field(default_factory=list, description="KL at each position, nats.")
    session: SessionSettings | None = Field(
        None, description="The candidate's session these figures were taken in (prepacking, accuracy_level)."
    )


class PolicyQualityFigures(BaseModel):
    """``cache_policy``'s quality cost: its sinks + recent decode against the full-context original (held-out text).

    Measured by :func:`onnxdeploy.runner.cache_policy.evaluate_policy_accuracy` on ``verify.accuracy``'s tokens, over
    the positions at or past ``max_cache_len`` (where the policy evicts; before, both see the whole text).
    """

    model_config = ConfigDict(extra="forbid")

    sinks: int = Field(description="The contract's cache_policy.sinks (slots kept from the start).")
    recent: int = Field(description="The contract's cache_policy.recent (last positions kept).")
    max_cache_len: int = Field(description="The cache length the policy acts past (a set's largest).")
    tokens: int = Field(description="Held-out tokens fed to both, teacher-forced.")
    evicting_positions: int = Field(description="Positions at or past max_cache_len: the ones compared.")
    mean_kl: float | None = Field(None, description="Mean KL(full context || policy) over them, nats; None: none.")
    top1_agreement: float | None = Field(None, description="Argmax agreement over them; None: none compared.")

    def text(self) -> str:
        """One console line: the policy, the figures and over what they were taken."""
        policy = f"cache_policy sinks {self.sinks} + recent {self.recent} past max_cache_len {self.max_cache_len}"
        if self.mean_kl is None or self.top1_agreement is None:
            return f"{policy}: quality not measured: the {self.tokens} held-out tokens never pass max_cache_len"
        return (
            f"{policy}: KL(full context || policy) {self.mean_kl:.3g} nats, top-1 {self.top1_agreement:.3f} over the "
            f"{self.evicting_positions} evicting positions of {self.tokens} held-out tokens"
        )


class AccuracyReport(BaseModel):
    """``verify.accuracy``: the candidate's teacher-forced accuracy on held-out tokens (runner/accuracy.py).

    ``weight_only``: every quantized MatMul at accuracy_level 0 (fp32: ``session.qdq_matmulnbits_accuracy_level=0``,
    applied to MatMulNBits nodes too), the error of the transformation itself; thresholds apply to it.
    ``default_optimized``: ORT's default accuracy levels. Each figure names its session (prepacking, level).
    """

    model_config = ConfigDict(extra="forbid")

    passed: bool
    original: str
    candidate: str
    tokens: int
    weight_only: AccuracyFigures
    default_optimized: AccuracyFigures
    original_session: SessionSettings | None = Field(None, description="The original's session (prepacking).")
    default_is_weight_only: bool = Field(
        False,
        description="Both settings opened the same session (float weights, or MatMulNBits already at level 0): "
        "the candidate ran once and both figures are that measurement.",
    )
    max_mean_kl: float | None = None
    min_top1_agreement: float | None = None
    max_ppl_ratio: float | None = None
    failures: list[str] = Field(default_factory=list)
    policy_quality: PolicyQualityFigures | None = Field(
        None,
        description="A cache_policy candidate: what the policy costs against the full context on all the held-out "
        "tokens (the figures above are then taken on the first max_cache_len of them, where nothing is evicted).",
    )


def spike_threshold_ms(mode: ModeResult) -> float:
    """Latency above which a single-token call is a spike: 3x the mode's candidate median (ms)."""
    return 3.0 * mode.latency_ms.p50


def _block(steps: list[StepRecord]) -> StepBlock:
    latencies = sorted(s.latency_ms_candidate for s in steps if s.latency_ms_candidate is not None)
    return StepBlock(
        first_position=steps[0].position,
        last_position=steps[-1].position,
        positions=len(steps),
        top1_agreement=sum(s.top1_match for s in steps) / len(steps),
        max_abs_logit_diff=max(s.max_abs_logit_diff for s in steps),
        min_cosine_similarity=min(s.cosine_similarity for s in steps),
        latency_ms_candidate_p50=latencies[(len(latencies) - 1) // 2] if latencies else None,
        latency_ms_candidate_max=latencies[-1] if latencies else None,
        graphs=sorted({s.graph for s in steps if s.graph}),
    )


def summarise_steps(mode: ModeResult, max_rows: int) -> ModeResult:
    """Keep at most ``max_rows`` of ``mode.steps``; summarise the positions left out as :class:`StepBlock` runs.

    Kept first: positions that diverge (top-1 differs or beyond tolerance) and latency spikes
    (:func:`spike_threshold_ms`), up to half of ``max_rows``; the rest is filled from the start and the end.

    Args:
        mode: one mode's result with all its per-position records.
        max_rows: rows kept at most (>= 1).

    Returns:
        ``mode`` itself when it has at most ``max_rows`` steps, else a copy with the selection in ``steps`` (in
        position order) and the omitted runs in ``steps_omitted``.
    """
    steps = mode.steps
    n = len(steps)
    if n <= max_rows:
        return mode
    spike = spike_threshold_ms(mode)
    notable = [
        i
        for i, s in enumerate(steps)
        if not (s.top1_match and s.within_tolerance) or (s.latency_ms_candidate or 0.0) > spike
    ]
    keep = set(notable[: max_rows // 2])
    head, tail = 0, n - 1
    while len(keep) < max_rows:  # alternate from both ends, skipping rows already kept
        for side in ("head", "tail"):
            if len(keep) >= max_rows:
                break
            if side == "head":
                while head in keep:
                    head += 1
                keep.add(head)
            else:
                while tail in keep:
                    tail -= 1
                keep.add(tail)
    blocks: list[StepBlock] = []
    run: list[StepRecord] = []
    for i, s in enumerate(steps):
        if i in keep:
            if run:
                blocks.append(_block(run))
                run = []
        else:
            run.append(s)
    if run:
        blocks.append(_block(run))
    return mode.model_copy(update={"steps": [steps[i] for i in sorted(keep)], "steps_omitted": blocks})


def summarise_verify(verify: VerifyReport, max_rows: int) -> VerifyReport:
    """:func:`summarise_steps` applied to every mode of ``verify``."""
    modes = {name: summarise_steps(m, max_rows) for name, m in verify.modes.items()}
    return verify.model_copy(update={"modes": modes})
