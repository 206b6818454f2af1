"""Calibration statistics of activations: ``X^T X`` (GPTQ) or its diagonal (act-order) over the calibration tokens.

The model runs through the context's decode loop (:func:`onnxdeploy.passes._probe.calibration_decoder`: its
contract, or the exporter convention) on a probe copy whose graph outputs include the activations; every
position fed contributes its row ``x`` ``(K,)`` of batch row 0.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from threadpoolctl import threadpool_limits

from onnxdeploy.contract import read_contract
from onnxdeploy.model_io import release_weights, stand_in_proto
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._probe import calibration_decoder, open_probe, pruned_copy
from onnxdeploy.report import PassReport

__all__ = ["CALIBRATION_CHUNK", "collect_statistics"]

CALIBRATION_CHUNK = 256
"""Tokens per calibration call for exporter-convention models (a contract model takes max_cache_len)."""


def _accumulate(stats: dict[str, np.ndarray], results: dict, names: list[str], full: bool) -> None:
    """Add one decode call's activations to ``stats``: ``x^T x`` (``full``) or ``sum(x * x)`` per channel.

    One BLAS thread (``threadpoolctl``), as in :mod:`._quant_tensors`: these ``(T, K)`` products are small.
    """
    with threadpool_limits(limits=1, user_api="blas"):
        _accumulate_all(stats, results, names, full)


def _accumulate_all(stats: dict[str, np.ndarray], results: dict, names: list[str], full: bool) -> None:
    for name in names:
        x = np.asarray(results[name], dtype=np.float64)
        # (B, S, K): batch row 0 (rows are fed the same tokens); (B·S, K) as a Gemm reads it: all.
        x = (x[0] if x.ndim >= 3 else x).reshape(-1, x.shape[-1])
        part = x.T @ x if full else np.einsum("tk,tk->k", x, x)
        stats[name] = stats[name] + part if name in stats else part


def collect_statistics(
    model: ir.Model, activations: list[ir.Value], full: bool, context: PassContext, report: PassReport
) -> dict[str, np.ndarray]:
    """``X^T X`` (``full``) or ``diag(X^T X)`` float64 per activation, over the calibration tokens.

    The model is run through the context's decode loop (its contract, or the exporter convention) with the
    activations added as graph outputs; batch row 0 of every position fed is used. A contract model is fed
    ``max_cache_len`` tokens a call (whole steps of ``step_len``), others :data:`CALIBRATION_CHUNK`.

    Args:
        model: the graph (not edited: a structural copy gets the extra outputs).
        activations: the values whose statistics are wanted (named).
        full: the whole ``X^T X`` (GPTQ) rather than its diagonal (act-order).
        context: calibration token ids, scratch folder and session factory.
        report: receives a line on the tokens used.

    Returns:
        Activation name -> float64 ``(K, K)`` or ``(K,)``.
    """
    names = [str(v.name) for v in activations]
    probe = pruned_copy(model, names, keep_outputs=True, shadow=False)
    header = stand_in_proto(model)
    contract = read_contract(model)
    stats: dict[str, np.ndarray] = {}
    count = 0
    with open_probe(probe, context, who="quantize_weights", what="the calibration model") as model_session:
        model_session.model = header  # the decode loop reads the graph's own outputs, not the probes
        # This graph alone (a graph set's siblings are not written here): its contract, or the exporter convention.
        decoder = calibration_decoder(context, model_session, contract, who="quantize_weights")
        decoder.extra_outputs = names
        chunk = contract.max_cache_len if contract is not None else CALIBRATION_CHUNK
        step = contract.step_len if contract is not None else 1
        chunk -= chunk % step
        for sequence in context.calibration:
            for start in range(0, len(sequence) - step + 1, chunk):
                piece = list(sequence[start : start + chunk])
                piece = piece[: len(piece) - len(piece) % step]
                decoder.reset()
                decoder.extra_results = []
                decoder.feed(piece)
                count += len(piece)
                for results in decoder.extra_results:
                    _accumulate(stats, results, names, full)
    release_weights(probe)
    report.changes.append(f"calibration: {count} tokens through {len(names)} activation(s)")
    return stats
