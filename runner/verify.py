"""Greedy decode and step-by-step verification of a candidate model against the original (DESIGN.md, "Runner").

Positions evaluated are ``len(prompt) + steps``: the prompt, then every generated token is fed, so
there are logits at every fed position. Two modes:

- ``teacher_forced``: the original decodes greedily; the candidate is fed that same sequence and its
  logits are compared at every position.
- ``free_running``: each model is fed its own argmax choices (same prompt). The original's free run
  is the greedy decode already made, so it is run once and reused.

Never both models resident: the original is opened, warmed up, decoded once (only its tokens, logits
and latencies are kept) and closed before the candidate is opened. What can be refused from the file
headers (contract, vocabulary, cache capacity, ``step_len``) is refused for both before either decodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxdeploy.contract import read_contract
from onnxdeploy.errors import CacheOverflowError, ConfigError
from onnxdeploy.report import ModeResult, StepRecord, VerifyReport
from onnxdeploy.resources import rss_bytes
from onnxdeploy.runner.compare import step_record, summarize_mode
from onnxdeploy.runner.decoder import Decoder, open_decoder
from onnxdeploy.runner.exporter_decoder import exporter_logits_output
from onnxdeploy.runner.session import DEFAULT_PROVIDERS, read_header

__all__ = ["MODES", "ProgressCallback", "check_header", "greedy_decode", "verify"]

MODES = ("teacher_forced", "free_running")
"""The decode modes :func:`verify` knows."""

ProgressCallback = Callable[[str, int, int], None]
"""``progress(mode, done, total)``: ``mode`` is ``"reference"`` (the original's greedy decode) or a
decode mode; ``done`` of ``total`` positions have been fed."""


@dataclass
class _DecodeRun:
    """One decode pass: what was fed at each position, the logits and latencies there."""

    tokens_in: list[int]
    logits: np.ndarray  # float32 (positions, V)
    latencies_ms: list[float]  # per position: the latency of the call that computed it
    call_latencies_ms: list[float]


def _decode(
    decoder: Decoder,
    prompt: Sequence[int],
    steps: int,
    *,
    forced: Sequence[int] | None = None,
    report: Callable[[int], None] = lambda done: None,
) -> _DecodeRun:
    """Feed the prompt, then ``steps`` tokens: ``forced`` ones, or else the argmax of the previous position."""
    decoder.reset()
    outputs = decoder.feed(list(prompt))
    report(decoder.position)
    tokens_in = list(prompt)
    for step in range(steps):
        token = forced[step] if forced is not None else int(np.argmax(outputs[-1][0]))
        outputs += decoder.feed([token])
        tokens_in.append(token)
        report(decoder.position)
    return _DecodeRun(
        tokens_in=tokens_in,
        logits=np.stack([logits for logits, _ in outputs]),
        latencies_ms=[latency for _, latency in outputs],
        call_latencies_ms=decoder.call_latencies_ms,
    )


def _warm_up(decoder: Decoder, prompt: Sequence[int], steps: int) -> None:
    """Run the prompt and one generated token once so allocations do not land in the timed calls."""
    _decode(decoder, prompt, min(steps, 1))
    decoder.reset()


def check_header(path: str | Path, prompt: list[int], positions: int, *, verifying: bool) -> None:
    """Read a model's header (no weights, no session) and refuse what needs no decoding to refuse.

    The pipeline calls it on the original before the first pass, so a prompt the model cannot take fails
    before any work.

    Args:
        path: the ``.onnx`` file.
        prompt: the prompt token ids.
        positions: ``len(prompt) + steps``, the positions to decode.
        verifying: the model is a verification candidate (contract ``step_len`` must be 1).

    Raises:
        ModelLoadError: the file or its external data is refused (:func:`read_header`).
        ContractError: a contract that does not validate; without one, no KV cache or no single logits output.
        ConfigError: a prompt id outside the vocabulary (the logits' last dim, when static); with
            ``verifying``, a contract ``step_len`` above 1.
        CacheOverflowError: a contract with fewer than ``positions`` cache slots.
    """
    source = str(path)
    header = read_header(path)
    contract = read_contract(header, source=source)
    logits = contract.logits if contract is not None else exporter_logits_output(header)
    declared = next((o for o in header.graph.output if o.name == logits), None)
    dims = declared.type.tensor_type.shape.dim if declared is not None else []
    vocab = dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
    del header
    if vocab is not None and max(prompt) >= vocab:
        raise ConfigError(
            f"verify: prompt token id {max(prompt)} is outside the vocabulary of {source} "
            f"(logits have {vocab} entries: ids 0..{vocab - 1})"
        )
    if contract is not None:
        if verifying and contract.step_len > 1:
            raise ConfigError(
                f"verify: {source} is a step_len {contract.step_len} graph (a prefill bucket); the runner decodes "
                "one token per call, so it can verify step_len 1 graphs only"
            )
        if positions > contract.max_cache_len:
            raise CacheOverflowError(contract.max_cache_len, contract.max_cache_len)


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
    check_header(model_path, prompt, len(prompt) + steps, verifying=False)
    with open_decoder(model_path, providers=providers) as decoder:
        run = _decode(decoder, prompt, steps)
    return np.asarray(run.tokens_in[len(prompt) :], dtype=np.int64), run.logits


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
    return [
        step_record(
            position=position,
            phase="prompt" if position < prompt_len else "generate",
            token_in=candidate.tokens_in[position],
            reference=reference.logits[position],
            candidate=candidate.logits[position],
            latency_ms_reference=reference.latencies_ms[position],
            latency_ms_candidate=candidate.latencies_ms[position],
            max_abs_logit_diff=max_abs_logit_diff,
        )
        for position in range(len(candidate.tokens_in))
    ]


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
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Decode the original and the candidate greedily and compare them position by position.

    The models are never resident together: the original is opened, warmed up, decoded greedily and
    closed (its logits, tokens and latencies are kept: ``4 * V`` bytes per position), then the candidate
    is opened, warmed up and run in each mode, then closed. Both headers are checked first (contract,
    vocabulary, capacity, ``step_len``), so a bad candidate fails before the original decodes. Each model
    is warmed up once (prompt plus one token) before its timed runs. Latency summaries are per
    ``session.run`` call (the original's prefill is one call). ``rss_growth_bytes`` is the change in
    resident memory while each model decodes after its warm-up, summed over the two (a leak indicator,
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
        progress: optional ``progress(mode, done, total)`` callback; ``mode`` is ``"reference"`` while
            the original decodes, then each mode; ``done`` of ``total`` positions fed.

    Returns:
        The report; ``passed`` is true when every mode passed. EP fallbacks of either session are
        listed in ``provider_fallbacks``.

    Raises:
        ConfigError: no or an unknown mode, an empty prompt, a negative ``steps``, a prompt id that is
            negative or outside either model's vocabulary, a threshold out of range, or a contract model
            with ``step_len`` above 1.
        DecodeRunError: ONNX Runtime failed inside ``session.run``.
        ModelLoadError: a model cannot be loaded (names the path).
        ContractError: a model follows neither a contract nor the exporter convention.
        CacheOverflowError: a contract model has fewer than ``len(prompt) + steps`` cache slots
            (checked before any decoding).
        OnnxDeployError: the two models' vocabulary sizes differ.
    """
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise ConfigError(f"verify: modes must be one or more of {list(MODES)}, got {list(modes)}")
    prompt = _check_request(prompt, steps)
    if not max_abs_logit_diff >= 0:
        raise ConfigError(f"verify: max_abs_logit_diff must be >= 0, got {max_abs_logit_diff}")
    if not 0 <= min_top1_agreement <= 1:
        raise ConfigError(f"verify: min_top1_agreement must be within 0..1, got {min_top1_agreement}")
    total = len(prompt) + steps

    def reporter(mode: str) -> Callable[[int], None]:
        return (lambda done: progress(mode, done, total)) if progress is not None else (lambda done: None)

    for path in (original_path, candidate_path):
        check_header(path, prompt, total, verifying=True)

    with open_decoder(original_path, providers=providers) as original:
        _warm_up(original, prompt, steps)
        rss_before = rss_bytes()
        reference = _decode(original, prompt, steps, report=reporter("reference"))
        rss_growth = rss_bytes() - rss_before
        original_fallbacks = list(original.model_session.fallbacks)
    generated = reference.tokens_in[len(prompt) :]
    results: dict[str, ModeResult] = {}
    with open_decoder(candidate_path, providers=providers) as candidate:
        _warm_up(candidate, prompt, steps)
        rss_before = rss_bytes()
        for mode in modes:
            run = _decode(
                candidate,
                prompt,
                steps,
                forced=generated if mode == "teacher_forced" else None,
                report=reporter(mode),
            )
            results[mode] = summarize_mode(
                mode,  # type: ignore[arg-type]
                _records(reference, run, len(prompt), max_abs_logit_diff),
                candidate_latencies_ms=run.call_latencies_ms,
                reference_latencies_ms=reference.call_latencies_ms,
                max_abs_logit_diff=max_abs_logit_diff,
                min_top1_agreement=min_top1_agreement,
            )
        rss_growth += rss_bytes() - rss_before
        candidate_session = candidate.model_session

    return VerifyReport(
        passed=all(result.passed for result in results.values()),
        original=str(original_path),
        candidate=str(candidate_path),
        providers=list(providers),
        providers_active=list(candidate_session.providers_active),
        provider_fallbacks=[*original_fallbacks, *candidate_session.fallbacks],
        prompt=list(prompt),
        steps=steps,
        max_abs_logit_diff_threshold=max_abs_logit_diff,
        min_top1_agreement_threshold=min_top1_agreement,
        rss_growth_bytes=rss_growth,
        modes=results,
    )
