"""Teacher-forced accuracy of a candidate (e.g. a quantized model) against the original on held-out tokens.

Both models are fed the same tokens, one model at a time (the original's logits are kept: ``4 * V`` bytes
per position). At every position ``t`` but the last, the next-token distributions are compared:
``KL(p_original || p_candidate)`` in nats, top-1 agreement, and each model's negative log-likelihood of the
token actually at ``t + 1``, which gives both perplexities (``exp`` of the mean NLL) and their ratio.

**Feeding** (:func:`teacher_forced_logits`): the fewest calls that give logits at every position. The original
(exporter convention) takes every token in **one call** with an empty past (its logits are ``(B, S, V)``)
unless its ``input_ids`` has a static sequence dim of 1, which is fed token by token; a contract graph goes
``step_len`` at a time; a graph set through its prefill buckets when every graph returns every position
(``prefill_logits: all``), else one token per call through its step-1 graphs.

**Sessions** (:mod:`onnxdeploy.runner.session`, README "Sessions"): every session's prepacking follows its
graph (on for quantized MatMul weights, so ``MatMulNBits`` runs MLAS's packed kernels instead of dequantizing
every call). The candidate is measured at two ``accuracy_level`` settings, each figure carrying the session
it was taken in (:attr:`onnxdeploy.report.AccuracyFigures.session`):

- ``weight_only``: every quantized MatMul at accuracy_level 0, i.e. fp32 activations and accumulation
  (:data:`WEIGHT_ONLY_ENTRIES`; the runner applies ``session.qdq_matmulnbits_accuracy_level`` to the graph's own
  ``MatMulNBits`` nodes too): the error the weights alone cause. Thresholds apply to it.
- ``default_optimized``: ORT's defaults (:data:`DEFAULT_ENTRIES`): the ``MatMulNBits`` ORT fuses from
  ``DequantizeLinear`` + ``MatMul`` at accuracy_level 4 (int8 activations where MLAS has the kernel: about
  6e-3 relative error of its own), the graph's own nodes at their attribute.

When both settings give the same session (float weights, or ``MatMulNBits`` already at level 0 and nothing
fused), the candidate runs once and both figures are the same measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from onnxdeploy.errors import ConfigError
from onnxdeploy.report import AccuracyFigures, AccuracyReport, SessionSettings
from onnxdeploy.runner.decoder import Decoder, make_decoder
from onnxdeploy.runner.exporter_decoder import ExporterDecoder
from onnxdeploy.runner.graph_set import GraphSetDecoder
from onnxdeploy.runner.session import (
    ACCURACY_LEVEL_KEY,
    DEFAULT_PROVIDERS,
    graph_weights,
    open_session,
    read_header,
    session_settings,
)

__all__ = [
    "DEFAULT_ENTRIES",
    "WEIGHT_ONLY_ENTRIES",
    "accuracy_figures",
    "evaluate_accuracy",
    "teacher_forced",
    "teacher_forced_logits",
]

WEIGHT_ONLY_ENTRIES = {ACCURACY_LEVEL_KEY: "0"}
"""Session config entries under which every quantized MatMul computes in fp32 (weight-only error)."""
DEFAULT_ENTRIES: dict[str, str] = {}
"""ORT as shipped: no accuracy_level override (fused DequantizeLinear + MatMul at ORT's default 4, the graph's own
MatMulNBits at their attribute); prepacking follows the graph as in every runner session."""


def _feed_every_position(decoder: Decoder, tokens: list[int]) -> list[tuple[np.ndarray | None, float]]:
    """Feed ``tokens`` from position 0 in the fewest calls that return logits at every position (module docstring)."""
    if isinstance(decoder, GraphSetDecoder) and not decoder.every_position_logits:
        return [output for token in tokens for output in decoder.feed([token])]
    if isinstance(decoder, ExporterDecoder) and _static_sequence(decoder) == 1:
        return [output for token in tokens for output in decoder.feed([token])]
    return decoder.feed(tokens)


def _static_sequence(decoder: ExporterDecoder) -> int | None:
    """``input_ids``' sequence dim when static (an export made for one token per call), else None."""
    shape, _ = decoder.model_session.input_types()["input_ids"]
    return shape[1] if len(shape) > 1 and isinstance(shape[1], int) else None


def teacher_forced(
    path: str | Path,
    tokens: Sequence[int],
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    config_entries: dict[str, str] | None = None,
) -> tuple[np.ndarray, SessionSettings | None]:
    """Feed ``tokens`` to a model (its contract or the exporter convention) and return the logits at each.

    Every position needs its own logits (each one's next-token distribution is compared): see the module
    docstring for the calls made. A graph set whose prefill buckets return only the last position's is fed one
    token per call through its step-1 graphs (or a bucket padded after its one real token, in a set without
    them), moving to a larger cache length as the text grows; chunking and keeping each chunk's last logits
    would need one call per position as well, with more padding computed.

    Args:
        path: the ``.onnx`` file.
        tokens: token ids (the count must fit a contract's largest ``max_cache_len``).
        providers: ORT execution providers in priority order.
        config_entries: further ORT session config entries, for every graph of a set.

    Returns:
        ``(logits, settings)``: float32 ``(len(tokens), V)``, row ``t`` batch row 0's logits after token ``t``;
        the (primary) session's prepacking and accuracy_level.

    Raises:
        ModelLoadError, ContractError, CacheOverflowError, DecodeRunError: as the runner's decode loops.
    """
    model_session = open_session(path, providers=providers, config_entries=config_entries)
    settings = model_session.settings
    with make_decoder(model_session) as decoder:
        outputs = _feed_every_position(decoder, [int(t) for t in tokens])
    return np.stack([logits for logits, _ in outputs]).astype(np.float32), settings


def teacher_forced_logits(
    path: str | Path,
    tokens: Sequence[int],
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    config_entries: dict[str, str] | None = None,
) -> np.ndarray:
    """The logits of :func:`teacher_forced` alone: float32 ``(len(tokens), V)`` (same arguments and errors)."""
    return teacher_forced(path, tokens, providers=providers, config_entries=config_entries)[0]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def accuracy_figures(reference: np.ndarray, candidate: np.ndarray, tokens: Sequence[int]) -> AccuracyFigures:
    """Compare two teacher-forced logit sequences over the same ``tokens``.

    Args:
        reference: float ``(T, V)`` logits of the original after each token.
        candidate: float ``(T, V)`` logits of the candidate.
        tokens: the ``T`` tokens fed.

    Returns:
        Figures over the ``T - 1`` positions that have a next token: per-position KL (nats), its mean and max,
        top-1 agreement, and both perplexities of ``tokens[1:]``.
    """
    lp, lq = _log_softmax(reference[:-1]), _log_softmax(candidate[:-1])
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    nxt = np.asarray(tokens[1:], dtype=np.int64)
    rows = np.arange(len(nxt))
    ppl_ref = float(np.exp(-lp[rows, nxt].mean()))
    ppl_cand = float(np.exp(-lq[rows, nxt].mean()))
    return AccuracyFigures(
        positions=len(nxt),
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        top1_agreement=float((reference[:-1].argmax(-1) == candidate[:-1].argmax(-1)).mean()),
        ppl_original=ppl_ref,
        ppl_candidate=ppl_cand,
        ppl_ratio=ppl_cand / ppl_ref,
        kl_per_position=[float(v) for v in kl],
    )


def evaluate_accuracy(
    original_path: str | Path,
    candidate_path: str | Path,
    tokens: Sequence[int],
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    max_mean_kl: float | None = None,
    min_top1_agreement: float | None = None,
    max_ppl_ratio: float | None = None,
) -> AccuracyReport:
    """Teacher-forced accuracy of the candidate against the original on ``tokens`` (see the module docstring).

    Thresholds apply to the weight-only figures (the error the transformation itself causes); the
    default-optimised figures are reported beside them, each with its session's prepacking and accuracy_level.
    The original runs once; the candidate once per distinct session (once when both settings coincide:
    ``default_is_weight_only``).

    Args:
        original_path: the reference model.
        candidate_path: the model under test.
        tokens: held-out token ids (at least two).
        providers: ORT execution providers in priority order, for both models.
        max_mean_kl: largest allowed mean KL (nats), or None.
        min_top1_agreement: smallest allowed top-1 agreement (0..1), or None.
        max_ppl_ratio: largest allowed perplexity ratio candidate / original, or None.

    Returns:
        The report; ``passed`` is false when a threshold is broken (``failures`` says which).

    Raises:
        ConfigError: fewer than two tokens.
        ModelLoadError, ContractError, CacheOverflowError, DecodeRunError: as the runner's decode loops.
    """
    tokens = [int(t) for t in tokens]
    if len(tokens) < 2:
        raise ConfigError("verify.accuracy: needs at least two tokens (one position with a next token)")
    reference, original_session = teacher_forced(original_path, tokens, providers=providers)
    weight_only = _figures(reference, candidate_path, tokens, providers, WEIGHT_ONLY_ENTRIES)
    weights = graph_weights(read_header(candidate_path))
    same = session_settings(weights, WEIGHT_ONLY_ENTRIES).model_dump(exclude={"reason"}) == session_settings(
        weights, DEFAULT_ENTRIES
    ).model_dump(exclude={"reason"})
    default = (
        weight_only.model_copy() if same else _figures(reference, candidate_path, tokens, providers, DEFAULT_ENTRIES)
    )
    failures = []
    if max_mean_kl is not None and weight_only.mean_kl > max_mean_kl:
        failures.append(f"accuracy: mean KL {weight_only.mean_kl:.4g} exceeds max_mean_kl={max_mean_kl:g}")
    if min_top1_agreement is not None and weight_only.top1_agreement < min_top1_agreement:
        failures.append(
            f"accuracy: top-1 agreement {weight_only.top1_agreement:.4f} is below min_top1_agreement="
            f"{min_top1_agreement:g}"
        )
    if max_ppl_ratio is not None and weight_only.ppl_ratio > max_ppl_ratio:
        failures.append(
            f"accuracy: perplexity ratio {weight_only.ppl_ratio:.4f} exceeds max_ppl_ratio={max_ppl_ratio:g}"
        )
    return AccuracyReport(
        passed=not failures,
        original=str(original_path),
        candidate=str(candidate_path),
        tokens=len(tokens),
        weight_only=weight_only,
        default_optimized=default,
        original_session=original_session,
        default_is_weight_only=same,
        max_mean_kl=max_mean_kl,
        min_top1_agreement=min_top1_agreement,
        max_ppl_ratio=max_ppl_ratio,
        failures=failures,
    )


def _figures(
    reference: np.ndarray, path: str | Path, tokens: list[int], providers: Sequence[str], entries: dict[str, str]
) -> AccuracyFigures:
    """The candidate's figures under ``entries``, with the session they were taken in."""
    logits, settings = teacher_forced(path, tokens, providers=providers, config_entries=entries)
    return accuracy_figures(reference, logits, tokens).model_copy(update={"session": settings})
