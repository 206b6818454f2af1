"""Greedy decode and step-by-step verification of a candidate against the original (docs/ARCHITECTURE.md, "Runner").

Positions evaluated are ``len(prompt) + steps``: the prompt, then every generated token is fed, so
there are logits at every fed position. Two modes:

- ``teacher_forced``: the original decodes greedily; the candidate is fed that same sequence and its
  logits are compared at every position.
- ``free_running``: each model is fed its own argmax choices (same prompt). The original's free run
  is the greedy decode already made, so it is run once and reused.

Never both models resident: the original is opened, warmed up, decoded once (only its tokens, logits
and latencies are kept) and closed before the candidate is opened. What can be refused from the file
headers (contract, vocabulary, cache capacity) is refused for both before either decodes.

A candidate whose contract lists a graph set is driven as a set (:mod:`onnxdeploy.runner.graph_set`):
prompt through the buckets, decode through the step-1 graphs, moving to a larger cache length when the
context outgrows one. Positions a ``prefill_logits: last`` bucket does not compute are not compared; every
other position is, and its record names the graph that computed it. The graphs the modes did not use are then
driven apart (:mod:`onnxdeploy.runner.coverage`): the report states the calls per graph (``graphs_driven``) and
fails naming a graph that could not be driven.

Sessions follow their graph (:mod:`onnxdeploy.runner.session`): a quantized candidate's weights are prepacked,
and the report names each model's prepacking and ``accuracy_level`` beside its latencies (``original_session``,
``candidate_session``).

Latency (README, "Latency"): each model is warmed up first (the prompt and up to three steps, and every
graph of a set once). The per-step summary covers the single-token calls after the prompt, for the original
as for the candidate; the prompt's calls (one prefill call for the original, buckets for a set) are reported
apart (``prefill``), never spread over the prompt positions.
"""

from __future__ import annotations

import gc
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from onnxdeploy.contract import CachePolicy, DecodeContract, read_contract
from onnxdeploy.errors import CacheOverflowError, ConfigError
from onnxdeploy.report import (
    CallTiming,
    ModeResult,
    NumericsReport,
    PrefillSummary,
    StepRecord,
    VerifyReference,
    VerifyReport,
)
from onnxdeploy.resources import release_free_heap, rss_bytes
from onnxdeploy.runner.cache_policy import CutPastReference, PolicyDecoder
from onnxdeploy.runner.compare import step_record, summarize_mode
from onnxdeploy.runner.coverage import GraphCoverage, drive_every_graph
from onnxdeploy.runner.decode_state import CallRecord
from onnxdeploy.runner.decoder import Decoder, open_decoder
from onnxdeploy.runner.exporter_decoder import exporter_logits_output
from onnxdeploy.runner.graph_set import GraphSetDecoder, Remainder
from onnxdeploy.runner.numerics import compute_dtype, float32_shadow, numerics_report
from onnxdeploy.runner.session import ACCURACY_LEVEL_KEY, DEFAULT_PROVIDERS, graph_weights, open_session, read_header
from onnxdeploy.runner.thresholds import LogitThresholds, mode_bounds_failures

__all__ = ["MODES", "ProgressCallback", "check_header", "greedy_decode", "logits_vocab", "verify"]

MODES = ("teacher_forced", "free_running")
"""The decode modes :func:`verify` knows."""

ProgressCallback = Callable[[str, int, int], None]
"""``progress(mode, done, total)``: ``mode`` is ``"reference"`` (the original's greedy decode) or a
decode mode; ``done`` of ``total`` positions have been fed."""


WARM_UP_STEPS = 3
"""Generated tokens fed after the prompt in the untimed warm-up decode."""


@dataclass
class _DecodeRun:
    """One decode pass: what was fed at each position, the logits there and every call made."""

    tokens_in: list[int]
    logits: list[np.ndarray | None]  # float32 (V,) per position; None where the graph computes none
    calls: list[CallRecord]
    prompt_len: int

    def call_at(self) -> list[CallRecord]:
        """The call that fed each position."""
        by_position: list[CallRecord] = []
        for call in self.calls:
            by_position += [call] * call.tokens
        return by_position

    def step_latencies_ms(self) -> list[float]:
        """Wall time of each single-token call after the prompt (ms): the per-step latency."""
        return [c.ms for c in self.calls if c.start >= self.prompt_len]

    def prefill(self) -> PrefillSummary | None:
        """The calls that fed the prompt, or None when nothing was fed."""
        calls = [c for c in self.calls if c.start < self.prompt_len]
        if not calls:
            return None
        tokens = sum(c.tokens for c in calls)
        total = sum(c.ms for c in calls)
        return PrefillSummary(
            calls=len(calls),
            tokens=tokens,
            total_ms=total,
            ms_per_token=total / tokens,
            tokens_per_s=tokens / (total / 1e3) if total > 0 else 0.0,
            per_call=[
                CallTiming(graph=c.graph, start=c.start, tokens=c.tokens, step_len=c.step_len, ms=c.ms) for c in calls
            ],
        )


def _decode(
    decoder: Decoder,
    prompt: Sequence[int],
    steps: int,
    *,
    forced: Sequence[int] | None = None,
    report: Callable[[int], None] = lambda done: None,
    per_token: bool = False,
) -> _DecodeRun:
    """Feed the prompt (one call; ``per_token``: a call per token), then ``steps`` tokens: ``forced`` or argmax."""
    decoder.reset()
    outputs = [o for token in prompt for o in decoder.feed([token])] if per_token else decoder.feed(list(prompt))
    report(decoder.position)
    tokens_in = list(prompt)
    for step in range(steps):
        last = outputs[-1][0]
        assert last is not None  # the last real token of every call has logits
        token = forced[step] if forced is not None else int(np.argmax(last))
        outputs += decoder.feed([token])
        tokens_in.append(token)
        report(decoder.position)
    return _DecodeRun(
        tokens_in=tokens_in,
        logits=[logits for logits, _ in outputs],
        calls=decoder.call_records,
        prompt_len=len(prompt),
    )


def _warm_up(decoder: Decoder, prompt: Sequence[int], steps: int) -> None:
    """Untimed: every graph of a set once, then the prompt and up to :data:`WARM_UP_STEPS` generated tokens."""
    if isinstance(decoder, GraphSetDecoder):
        decoder.warm_up()
    _decode(decoder, prompt, min(steps, WARM_UP_STEPS))
    decoder.reset()


def _vocab(header: onnx.ModelProto, contract: DecodeContract | None) -> int | None:
    """The logits output's last dim when static (the vocabulary size), else None."""
    logits = contract.logits if contract is not None else exporter_logits_output(header)
    declared = next((o for o in header.graph.output if o.name == logits), None)
    dims = declared.type.tensor_type.shape.dim if declared is not None else []
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None


def logits_vocab(path: str | Path) -> int | None:
    """The vocabulary size of a model file: its logits output's last dim when static, else None (no weights read).

    Raises:
        ModelLoadError: the file or its external data is refused (:func:`read_header`).
        ContractError: a contract that does not validate; without one, no single logits output.
    """
    header = read_header(path)
    return _vocab(header, read_contract(header, source=str(path)))


def check_header(path: str | Path, prompt: list[int], positions: int) -> None:
    """Read a model's header (no weights, no session) and refuse what needs no decoding to refuse.

    The pipeline calls it on the original before the first pass, so a prompt the model cannot take fails
    before any work.

    Args:
        path: the ``.onnx`` file.
        prompt: the prompt token ids.
        positions: ``len(prompt) + steps``, the positions to decode.

    Raises:
        ModelLoadError: the file or its external data is refused (:func:`read_header`).
        ContractError: a contract that does not validate; without one, no KV cache or no single logits output.
        ConfigError: a prompt id outside the vocabulary (the logits' last dim, when static), or a step_len > 1
            graph that can take neither one token nor padding (a contract from an older version).
        CacheOverflowError: a contract (its graph set's largest cache) with fewer than ``positions`` slots.
    """
    source = str(path)
    header = read_header(path)
    contract = read_contract(header, source=source)
    vocab = _vocab(header, contract)
    del header
    if vocab is not None and max(prompt) >= vocab:
        raise ConfigError(
            f"verify: prompt token id {max(prompt)} is outside the vocabulary of {source} "
            f"(logits have {vocab} entries: ids 0..{vocab - 1})"
        )
    if contract is not None:
        if contract.step_len > 1 and contract.padding is None and not any(e.step_len == 1 for e in contract.graph_set):
            raise ConfigError(
                f"verify: {source} is a step_len {contract.step_len} graph whose contract declares no padding and no "
                "step_len 1 graph beside it, so generated tokens cannot be fed one at a time; re-run static_kv"
            )
        largest = max([contract.max_cache_len, *(e.max_cache_len for e in contract.graph_set)])
        if positions > largest and contract.cache_policy is None:  # a policy decodes on past it (cache_policy.py)
            raise CacheOverflowError(largest, largest)


def greedy_decode(
    model_path: str | Path,
    prompt: Sequence[int],
    steps: int,
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode greedily from ``prompt``, feeding every generated token (e.g. to check a ``reference.npz``).

    Args:
        model_path: the model; its decode loop is chosen by :func:`make_decoder`.
        prompt: prompt token ids (at least one).
        steps: number of tokens to generate.
        providers: ORT execution providers in priority order.

    Returns:
        ``(tokens, logits)``: tokens int64 ``(steps,)``, the greedy continuation; logits float32
        ``(len(prompt) + steps, V)``, batch row 0 at every fed position.

    Raises:
        ConfigError: ``prompt`` is empty, ``steps`` is negative, or a prompt id is outside the vocabulary.
        ModelLoadError: the model cannot be loaded.
        ContractError: the model follows neither a contract nor the exporter convention.
        CacheOverflowError: a contract model has fewer than ``len(prompt) + steps`` cache slots.
    """
    prompt = _check_request(prompt, steps)
    check_header(model_path, prompt, len(prompt) + steps)
    with open_decoder(model_path, providers=providers) as decoder:
        run = _decode(decoder, prompt, steps)
    missing = [i for i, row in enumerate(run.logits) if row is None]
    if missing:
        raise ConfigError(
            f"{model_path}: positions {missing[:5]}... have no logits (a prefill_logits: last bucket computed "
            "them); greedy_decode returns logits at every position, so use a set made with prefill_logits: all"
        )
    return np.asarray(run.tokens_in[len(prompt) :], dtype=np.int64), np.stack(run.logits)  # type: ignore[arg-type]


def _check_request(prompt: Sequence[int], steps: int) -> list[int]:
    """Validate the decode request; return the prompt as plain ints (it may come as a numpy array)."""
    if len(prompt) == 0:
        raise ConfigError("verify: prompt must hold at least one token id")
    if steps < 0:
        raise ConfigError(f"verify: steps must be >= 0, got {steps}")
    tokens = [int(token) for token in prompt]
    negative = [t for t in tokens if t < 0]
    if negative:
        raise ConfigError(f"verify: prompt token ids must be >= 0, got {negative}")
    return tokens


def _records(
    reference: _DecodeRun, candidate: _DecodeRun, prompt_len: int, max_abs_logit_diff: float
) -> list[StepRecord]:
    """One record per position both runs computed logits for (a ``last`` bucket computes one per call)."""
    ref_calls, cand_calls = reference.call_at(), candidate.call_at()
    records = []
    for position in range(len(candidate.tokens_in)):
        ref, cand = reference.logits[position], candidate.logits[position]
        if ref is None or cand is None:
            continue
        records.append(
            step_record(
                position=position,
                phase="prompt" if position < prompt_len else "generate",
                token_in=candidate.tokens_in[position],
                reference=ref,
                candidate=cand,
                latency_ms_reference=ref_calls[position].ms if ref_calls[position].tokens == 1 else None,
                latency_ms_candidate=cand_calls[position].ms if cand_calls[position].tokens == 1 else None,
                max_abs_logit_diff=max_abs_logit_diff,
                graph=cand_calls[position].graph,
            )
        )
    return records


def verify(
    original_path: str | Path,
    candidate_path: str | Path,
    *,
    prompt: Sequence[int],
    steps: int,
    modes: Sequence[str] = MODES,
    max_abs_logit_diff: float = 1e-4,
    min_top1_agreement: float = 1.0,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    strict_providers: bool = False,
    remainder: Remainder = "padded",
    progress: ProgressCallback | None = None,
    bounds: LogitThresholds | None = None,
) -> VerifyReport:
    """Decode the original and the candidate greedily and compare them position by position.

    The models are never resident together, and both headers are checked before either decodes (module
    docstring). A graph set is driven as a set, every graph of it (``graphs_driven``). ``rss_growth_bytes`` is the
    change in resident memory while each model decodes after its warm-up, summed over the two (a leak indicator,
    not the models' footprint).

    Args:
        original_path: the reference model (usually exporter convention).
        candidate_path: the model under test (usually carrying a contract).
        prompt: prompt token ids (at least one).
        steps: tokens generated and fed after the prompt; ``len(prompt) + steps`` positions are compared.
        modes: any of ``teacher_forced`` and ``free_running``, run in this order.
        max_abs_logit_diff: the largest max-abs logit difference allowed at any position.
        min_top1_agreement: the smallest fraction of positions whose top-1 token must agree (0..1).
        providers: ORT execution providers in priority order, for both models.
        strict_providers: a requested provider that is not active (ORT fell back) fails the verification.
        remainder: how a graph set feeds the tokens left after its largest bucket (``padded``: one padded
            chunk; ``buckets``: smaller buckets).
        progress: optional ``progress(mode, done, total)`` callback; ``mode`` is ``"reference"`` while
            the original decodes, then each mode; ``done`` of ``total`` positions fed.
        bounds: ``max_rel_logit_diff`` / ``min_cosine_similarity`` per mode and per graph (runner/thresholds.py).

    Returns:
        The report; ``passed`` is true when every mode passed, every graph of a set was driven and matched
        (``graphs_driven``) and, with ``strict_providers``, no requested EP fell back (all in ``provider_fallbacks``).

    Raises:
        ConfigError: no or an unknown mode, an empty prompt, a negative ``steps``, a prompt id that is
            negative or outside either model's vocabulary, or a threshold out of range.
        DecodeRunError: ONNX Runtime failed inside ``session.run``.
        ModelLoadError: a model cannot be loaded (names the path).
        ContractError: a model follows neither a contract nor the exporter convention.
        CacheOverflowError: a contract model has fewer than ``len(prompt) + steps`` cache slots (checked first).
        OnnxDeployError: the two models' vocabulary sizes differ.
    """
    request = _Request(
        prompt=_check_request(prompt, steps),
        steps=steps,
        modes=tuple(modes),
        max_abs_logit_diff=max_abs_logit_diff,
        min_top1_agreement=min_top1_agreement,
        providers=tuple(providers),
        strict_providers=strict_providers,
        remainder=remainder,
        progress=progress,
        bounds=bounds or LogitThresholds(),
    )
    request.check()
    for path in (original_path, candidate_path):
        check_header(path, request.prompt, request.total)
    # ORT's CPU EP has no bfloat16 kernels: such models run as their float32 shadows (labelled emulated)
    shadowed = list(providers) == ["CPUExecutionProvider"] and "bfloat16" in {
        compute_dtype(read_header(path)) for path in (original_path, candidate_path)
    }
    if not shadowed:
        return _verify_paths(original_path, candidate_path, request, candidate_header=None)
    with tempfile.TemporaryDirectory(prefix="onnxdeploy-shadow-") as folder:
        scratch = Path(folder)
        return _verify_paths(
            float32_shadow(original_path, scratch / "original"),
            float32_shadow(candidate_path, scratch / "candidate"),
            request,
            candidate_header=read_header(candidate_path),
        )


@dataclass(frozen=True)
class _Request:
    """What :func:`verify` was asked: the tokens, the modes, the thresholds, the providers, how to drive a set."""

    prompt: list[int]
    steps: int
    modes: tuple[str, ...]
    max_abs_logit_diff: float
    min_top1_agreement: float
    providers: tuple[str, ...]
    strict_providers: bool
    remainder: Remainder
    progress: ProgressCallback | None
    bounds: LogitThresholds = LogitThresholds()

    @property
    def total(self) -> int:
        """Positions decoded: the prompt and the generated tokens."""
        return len(self.prompt) + self.steps

    def check(self) -> None:
        """Refuse an unknown mode or a threshold out of range (ConfigError)."""
        unknown = [mode for mode in self.modes if mode not in MODES]
        if unknown or not self.modes:
            raise ConfigError(f"verify: modes must be one or more of {list(MODES)}, got {list(self.modes)}")
        if not self.max_abs_logit_diff >= 0:
            raise ConfigError(f"verify: max_abs_logit_diff must be >= 0, got {self.max_abs_logit_diff}")
        if not 0 <= self.min_top1_agreement <= 1:
            raise ConfigError(f"verify: min_top1_agreement must be within 0..1, got {self.min_top1_agreement}")

    def reporter(self, mode: str) -> Callable[[int], None]:
        """``done -> None``: the progress callback of one decode, or a no-op."""
        progress, total = self.progress, self.total
        return (lambda done: progress(mode, done, total)) if progress is not None else (lambda done: None)


@dataclass
class _CandidateRuns:
    """What the candidate's decoder gave: one result per mode, the graphs it drove, and what to report about it."""

    modes: dict[str, ModeResult]
    coverage: GraphCoverage
    rss_growth: int
    fallbacks: list[str]
    providers_active: tuple[str, ...]
    graphs: list[str]
    numerics: NumericsReport


def _verify_paths(
    original_path: str | Path,
    candidate_path: str | Path,
    request: _Request,
    *,
    candidate_header: onnx.ModelProto | None,
) -> VerifyReport:
    """:func:`verify` on two model files (maybe float32 shadows: ``candidate_header`` is then the real one)."""
    policy = _past_cache_policy(candidate_header or read_header(candidate_path), request)
    # A quantized original (MatMulNBits, or DequantizeLinear -> MatMul that ORT fuses into one) is compared with
    # fp32 activations (accuracy_level 0 on both sides): at ORT's default level 4 the int8 activations turn a
    # rewrite's 1e-6 float noise into logit jumps (SmolLM2 INT4, static_kv: 0.37-0.5 at level 4, 1.4e-5 at 0). And
    # a row's logits depend on the rows per call (2.4e-3 at level 0): its prompt goes one token per call.
    per_token = policy is None and graph_weights(read_header(original_path)).quantized
    entries = {ACCURACY_LEVEL_KEY: "0"} if per_token else None
    release_free_heap()  # what the caller freed (a pipeline's graphs) leaves memory before the sessions' peak
    opened = (
        CutPastReference(open_session(original_path, providers=request.providers), *policy)
        if policy is not None
        else open_decoder(original_path, providers=request.providers, config_entries=entries)
    )
    with opened as original:
        _warm_up(original, request.prompt, request.steps)
        rss_before = rss_bytes()
        reference = _decode(
            original, request.prompt, request.steps, report=request.reporter("reference"), per_token=per_token
        )
        rss_growth = rss_bytes() - rss_before
        original_fallbacks = _fallbacks(original)
        original_settings = original.model_session.settings
    del opened, original
    gc.collect()  # a cycle may still hold the closed session (its mapped weights); free it before the candidate's
    release_free_heap()  # the original's session, freed, leaves memory before the candidate's sessions open
    candidate_decoder = open_decoder(
        candidate_path, providers=request.providers, remainder=request.remainder, config_entries=entries
    )
    if policy is not None:  # past max_cache_len: the sinks + recent host against the original fed the cut past
        candidate_decoder = PolicyDecoder(candidate_decoder)  # type: ignore[assignment,arg-type]
    with candidate_decoder as candidate:
        runs = _run_candidate(candidate, reference, request, candidate_header)
        candidate_settings = candidate.model_session.settings
    fallbacks = [*original_fallbacks, *runs.fallbacks]
    failures = list(runs.coverage.failures)
    if request.strict_providers and fallbacks:
        failures.append(f"strict_providers: {len(fallbacks)} requested provider(s) fell back: {'; '.join(fallbacks)}")
    return VerifyReport(
        passed=all(result.passed for result in runs.modes.values()) and not failures,
        original=str(original_path),
        candidate=str(candidate_path),
        providers=list(request.providers),
        providers_active=list(runs.providers_active),
        provider_fallbacks=fallbacks,
        prompt=list(request.prompt),
        steps=request.steps,
        max_abs_logit_diff_threshold=request.max_abs_logit_diff,
        min_top1_agreement_threshold=request.min_top1_agreement,
        rss_growth_bytes=rss_growth + runs.rss_growth,
        strict_providers=request.strict_providers,
        graphs=runs.graphs,
        graphs_driven=runs.coverage.calls,
        graphs_driven_apart=runs.coverage.apart,
        failures=failures,
        modes=runs.modes,
        numerics=runs.numerics,
        original_session=original_settings,
        candidate_session=candidate_settings,
        reference=_reference(policy, per_token),
    )


def _reference(policy: tuple[CachePolicy, int] | None, per_token: bool) -> VerifyReference:
    """The original's feed: its whole past, or past the cache the policy's cut past (``CutPastReference``)."""
    if policy is None:
        return VerifyReference(prompt_per_token=per_token)
    return VerifyReference(kind="cut_past", sinks=policy[0].sinks, recent=policy[0].recent, max_cache_len=policy[1])


def _past_cache_policy(header: onnx.ModelProto, request: _Request) -> tuple[CachePolicy, int] | None:
    """The candidate's ``(cache_policy, max_cache_len)`` when the decode passes its cache, else None."""
    contract = read_contract(header)
    if contract is None or contract.cache_policy is None:
        return None
    largest = max([contract.max_cache_len, *(e.max_cache_len for e in contract.graph_set)])
    if len(request.prompt) + request.steps <= largest:
        return None
    return contract.cache_policy, largest


def _run_candidate(
    candidate: Decoder, reference: _DecodeRun, request: _Request, candidate_header: onnx.ModelProto | None
) -> _CandidateRuns:
    """Warm the candidate up, decode it in each mode against ``reference``, then drive the graphs left undriven."""
    _warm_up(candidate, request.prompt, request.steps)
    rss_before = rss_bytes()
    generated = reference.tokens_in[len(request.prompt) :]
    results: dict[str, ModeResult] = {}
    driven: Counter[str] = Counter()
    for mode in request.modes:
        forced = generated if mode == "teacher_forced" else None
        run = _decode(candidate, request.prompt, request.steps, forced=forced, report=request.reporter(mode))
        driven.update(call.graph for call in run.calls)
        results[mode] = summarize_mode(
            mode,  # type: ignore[arg-type]
            _records(reference, run, len(request.prompt), request.max_abs_logit_diff),
            candidate_latencies_ms=run.step_latencies_ms(),
            reference_latencies_ms=reference.step_latencies_ms(),
            max_abs_logit_diff=request.max_abs_logit_diff,
            min_top1_agreement=request.min_top1_agreement,
            prefill=run.prefill(),
            reference_prefill=reference.prefill(),
        )
        extra = mode_bounds_failures(
            mode, reference.logits, run.logits, [c.graph for c in run.call_at()], request.bounds
        )
        if extra:
            results[mode] = results[mode].model_copy(
                update={"passed": False, "failures": results[mode].failures + extra}
            )
    coverage = drive_every_graph(candidate, reference.tokens_in, reference.logits, driven, request.max_abs_logit_diff)
    rss_growth = rss_bytes() - rss_before
    session = candidate.model_session
    numerics = numerics_report(
        candidate_header if candidate_header is not None else session.model,
        (session.providers_active or ("?",))[0],
        shadowed=candidate_header is not None,
    )
    graphs = (
        [name for name, _, _ in candidate.graphs()]
        if isinstance(candidate, GraphSetDecoder)
        else [Path(candidate.source).name]
    )
    return _CandidateRuns(
        results, coverage, rss_growth, _fallbacks(candidate), session.providers_active, graphs, numerics
    )


def _fallbacks(decoder: Decoder) -> list[str]:
    """Requested EPs that are not active, over every session of ``decoder`` (each graph of a set)."""
    if isinstance(decoder, GraphSetDecoder):
        return decoder.fallbacks
    return list(decoder.model_session.fallbacks)
