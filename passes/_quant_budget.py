"""``quantize_weights`` ``budget``: the fewest bytes meeting a KL or perplexity bound on the calibration text.

The candidates form a ladder by bytes (:data:`LADDER`: INT4 in groups of 128, 64, 32, then INT8 per channel; the
pass's ``rules`` still apply on top of each, so a weight a rule pins keeps its setting). Each is quantized with the
pass's method (RTN/GPTQ, act-order, scale search) on a structural copy of the graphs, and both the float graph and
the candidate are teacher-forced over the calibration tokens through the context's decode loop (its contract, or
the exporter convention), as the calibration statistics are collected (:mod:`._calibration_stats`). The first
candidate meeting every bound is kept; every candidate tried is reported with its bits per weight, weight error
and figures. The figures are those of ``runner.accuracy.accuracy_figures`` (mean ``KL(p_float ‖ p_candidate)``
in nats over the positions with a next token, and the perplexity ratio candidate / float); they are computed here
from the logits because a pass does not import the runner (docs/ARCHITECTURE.md, "Layers").
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import read_contract
from onnxdeploy.model_io import stand_in_proto
from onnxdeploy.passes._calibration_stats import CALIBRATION_CHUNK
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._probe import calibration_decoder, open_probe
from onnxdeploy.passes._quant_rules import Budget

__all__ = ["LADDER", "Budget", "calibration_logits", "figures"]

LADDER: tuple[tuple[int, int], ...] = ((4, 128), (4, 64), (4, 32), (8, 0))
"""``(bits, block_size)`` candidates in increasing bytes (``block_size`` 0: INT8 per output channel)."""


def calibration_logits(model: ir.Model, context: PassContext, *, who: str) -> tuple[np.ndarray, list[int]]:
    """Teacher-forced logits of ``model`` over the calibration tokens, in the chunks calibration uses.

    Args:
        model: the graph (written to a scratch probe as is).
        context: calibration tokens, session and decoder factories.
        who: the pass named in errors.

    Returns:
        ``(logits, next_tokens)``: float32 ``(P, V)`` at every position that has a next token within its chunk,
        and those next tokens ``(P,)``.

    Raises:
        PreconditionError: ORT cannot load the graph, or the context has no decode loop.
    """
    contract = read_contract(model)
    chunk = contract.max_cache_len if contract is not None else CALIBRATION_CHUNK
    step = contract.step_len if contract is not None else 1
    chunk -= chunk % step
    rows: list[np.ndarray] = []
    nexts: list[int] = []
    with open_probe(model, context, who=who, what="a budget candidate") as session:
        session.model = stand_in_proto(model)
        decoder = calibration_decoder(context, session, contract, who=who)
        for sequence in context.calibration:
            for start in range(0, len(sequence) - step + 1, chunk):
                piece = [int(t) for t in sequence[start : start + chunk]]
                piece = piece[: len(piece) - len(piece) % step]
                decoder.reset()
                out = decoder.feed(piece)
                rows += [np.asarray(logits, dtype=np.float32) for logits, _ in out[:-1]]
                nexts += piece[1:]
    return np.stack(rows), nexts


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def figures(reference: np.ndarray, candidate: np.ndarray, next_tokens: list[int]) -> tuple[float, float]:
    """``(mean KL(reference ‖ candidate) in nats, perplexity ratio candidate / reference)`` over the positions.

    Args:
        reference: float ``(P, V)`` logits of the float graph.
        candidate: float ``(P, V)`` logits of the candidate at the same positions.
        next_tokens: the token that follows each position ``(P,)``.
    """
    lp, lq = _log_softmax(reference), _log_softmax(candidate)
    kl = float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())
    rows, nxt = np.arange(len(next_tokens)), np.asarray(next_tokens, dtype=np.int64)
    return kl, float(np.exp(lp[rows, nxt].mean() - lq[rows, nxt].mean()))
