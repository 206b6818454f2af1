"""Teacher-forced accuracy of a candidate (e.g. a quantized model) against the original on held-out tokens.

Both models are fed the same tokens, one model at a time (the original's logits are kept: ``4 * V`` bytes
per position). At every position ``t`` but the last, the next-token distributions are compared:
``KL(p_original || p_candidate)`` in nats, top-1 agreement, and each model's negative log-likelihood of the
token actually at ``t + 1``, which gives both perplexities (``exp`` of the mean NLL) and their ratio.

Weight-only error: ONNX Runtime's CPU EP fuses ``DequantizeLinear`` + ``MatMul`` into ``MatMulNBits`` with
int8 activations by default (``session.qdq_matmulnbits_accuracy_level`` 4), which adds its own error (about
6e-3 relative). :func:`evaluate_accuracy` therefore runs the candidate twice: with that fusion computing in
fp32 (``session.qdq_matmulnbits_accuracy_level=0``: the error the weights alone cause) and with ORT's
defaults (prepacking on: what a user gets), and reports both.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from onnxdeploy.errors import ConfigError
from onnxdeploy.report import AccuracyFigures, AccuracyReport
from onnxdeploy.runner.decoder import make_decoder
from onnxdeploy.runner.graph_set import GraphSetDecoder
from onnxdeploy.runner.session import DEFAULT_PROVIDERS, open_session

__all__ = ["DEFAULT_ENTRIES", "WEIGHT_ONLY_ENTRIES", "accuracy_figures", "evaluate_accuracy", "teacher_forced_logits"]

WEIGHT_ONLY_ENTRIES = {"session.qdq_matmulnbits_accuracy_level": "0"}
"""Session config entries under which ORT's DQ+MatMul fusion computes in fp32 (weight-only error)."""
DEFAULT_ENTRIES = {"session.disable_prepacking": "0"}
"""ORT as shipped: prepacking on, so ``MatMulNBits`` (fused or not) takes MLAS's int8-activation path when its
accuracy level asks for it (with prepacking off it dequantizes and computes in fp32)."""


def teacher_forced_logits(
    path: str | Path,
    tokens: Sequence[int],
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    config_entries: dict[str, str] | None = None,
) -> np.ndarray:
    """Feed ``tokens`` to a model (its contract or the exporter convention) and return the logits at each.

    Every position needs its own logits (each one's next-token distribution is compared), so a graph set whose
    prefill buckets return only the last position's (``prefill_logits: last``) is fed one token per call: the
    plan then runs the step-1 graphs (or a bucket padded after its one real token, in a set without them), which
    return the logits of each position from the same weights, moving to a larger cache length as the text grows.
    Chunking and keeping each chunk's last logits would need one call per position as well, with more padding
    computed. A set whose graphs all return every position (``prefill_logits: all``) is fed through its buckets.

    Args:
        path: the ``.onnx`` file.
        tokens: token ids; an exporter-convention model takes them in one call, a contract model
            ``step_len`` at a time, a graph set as above (the count must fit the largest ``max_cache_len``).
        providers: ORT execution providers in priority order.
        config_entries: further ORT session config entries, for every graph of a set.

    Returns:
        float32 ``(len(tokens), V)``: row ``t`` is batch row 0's logits after token ``t``.

    Raises:
        ModelLoadError, ContractError, CacheOverflowError, DecodeRunError: as the runner's decode loops.
    """
    model_session = open_session(path, providers=providers, config_entries=config_entries)
    with make_decoder(model_session) as decoder:
        if isinstance(decoder, GraphSetDecoder) and not decoder.every_position_logits:
            outputs = [output for token in tokens for output in decoder.feed([token])]
        else:
            outputs = decoder.feed(list(tokens))
    return np.stack([logits for logits, _ in outputs]).astype(np.float32)


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
    default-optimised figures are reported beside them.

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
    reference = teacher_forced_logits(original_path, tokens, providers=providers)
    weight_only = accuracy_figures(
        reference,
        teacher_forced_logits(candidate_path, tokens, providers=providers, config_entries=WEIGHT_ONLY_ENTRIES),
        tokens,
    )
    default = accuracy_figures(
        reference,
        teacher_forced_logits(candidate_path, tokens, providers=providers, config_entries=DEFAULT_ENTRIES),
        tokens,
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
        max_mean_kl=max_mean_kl,
        min_top1_agreement=min_top1_agreement,
        max_ppl_ratio=max_ppl_ratio,
        failures=failures,
    )
