"""GPTQ for ``quantize_weights``: round-to-nearest with error feedback over the calibration Hessian.

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
2023, Algorithm 1 with lazy batch updates) quantizes columns in order and spreads each column's error over
the columns not yet quantized, weighted by the inverse Hessian ``H = X^T X`` of the calibration activations
``X`` ``(T, K)``; group scales are taken when a group's first column is reached (static groups in the order
processed). With act-order the columns are processed by decreasing ``diag(H)``, and the caller physically
permutes ``K`` in the graph, so the groups are contiguous in the stored weight and no ``g_idx`` is needed.

The representation and the scale rules are :mod:`._weight_quant`'s (:class:`QuantizedWeight`, the MLAS rule or
the clipping search of :mod:`._quant_search`).
"""

from __future__ import annotations

import numpy as np

from onnxdeploy.passes._weight_quant import QuantizedWeight, block_scales, round_to_grid

__all__ = ["gptq", "inverse_hessian_factor"]


def inverse_hessian_factor(hessian: np.ndarray, damp: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """The upper Cholesky factor of ``(H + damp·mean(diag H)·I)^-1`` GPTQ works with, and the dead channels.

    Args:
        hessian: ``X^T X`` float ``(K, K)``.
        damp: dampening, a fraction of ``mean(diag(H))`` added to the diagonal (the paper's 1%).

    Returns:
        ``(U, dead)``: U float64 ``(K, K)`` upper triangular; dead bool ``(K,)``, channels never active (their
        diagonal is set to 1 before inverting; their weights are zeroed).
    """
    h = np.array(hessian, dtype=np.float64)
    k = h.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    return np.linalg.cholesky(np.linalg.inv(h)).T, dead


def gptq(
    wt: np.ndarray,
    hessian: np.ndarray | None,
    *,
    bits: int,
    block_size: int,
    symmetric: bool,
    damp: float = 0.01,
    lazy_block: int = 128,
    factor: tuple[np.ndarray, np.ndarray] | None = None,
    search_weights: np.ndarray | None = None,
    search: bool = False,
) -> QuantizedWeight:
    """GPTQ quantization of ``wt`` ``(N, K)`` in its column order, given ``hessian`` ``(K, K)`` in that order.

    Args:
        wt: the weight, output-channel-major, columns already in processing order.
        hessian: ``X^T X`` float64 ``(K, K)`` of the calibration activations, same column order.
        bits: 4 or 8.
        block_size: input channels per group (groups are contiguous in this column order).
        symmetric: signed values without zero point, else unsigned with one.
        damp: ``damp * mean(diag(H))`` is added to the diagonal before inverting (the paper's 1%).
        lazy_block: columns per lazy batch update.
        factor: :func:`inverse_hessian_factor` of ``hessian`` if already computed (weights reading one
            activation share it); ``hessian`` may then be None.
        search: choose each group's scale, when its first column is reached, by the clipping search
            (:mod:`._quant_search`) on the error-updated weights, weighted by ``search_weights``.
        search_weights: ``diag(H)`` float ``(K,)`` in this column order (None: plain squared error).

    Returns:
        The quantized weight (same layout and group scheme as :func:`quantize_rtn`).
    """
    w = np.array(wt, dtype=np.float32)  # float32 updates (as the paper's implementation): half the traffic of float64
    n, k = w.shape
    # Upper Cholesky factor of H^-1: row i holds the update weights for the columns after i.
    hinv, dead = factor if factor is not None else inverse_hessian_factor(hessian, damp)
    hinv = hinv.astype(np.float32)
    w[:, dead] = 0.0
    n_blocks = -(-k // block_size)
    scales = np.empty((n, n_blocks), dtype=np.float32)
    zeros = None if symmetric else np.empty((n, n_blocks), dtype=np.int16)
    q = np.empty((n, k), dtype=np.int16)
    scale = zero = None
    for i1 in range(0, k, lazy_block):
        i2 = min(i1 + lazy_block, k)
        w1 = w[:, i1:i2].copy()
        err1 = np.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = i1 + j
            if col % block_size == 0:
                g = col // block_size
                end = min(col + block_size, k)
                group = np.concatenate([w1[:, j:], w[:, i2:end]], axis=1)[:, : end - col]
                gw = None if search_weights is None else search_weights[col:end][None, :].astype(np.float32)
                scale, zero = block_scales(group, bits, symmetric, search, gw)
                scales[:, g] = scale
                if zeros is not None:
                    zeros[:, g] = zero
            qcol = round_to_grid(w1[:, j], scale, zero, bits, symmetric)
            q[:, col] = qcol
            deq = (qcol - (zero if zero is not None else 0)) * scale
            err = (w1[:, j] - deq) / hinv1[j, j]
            w1[:, j:] -= np.outer(err, hinv1[j, j:])
            err1[:, j] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return QuantizedWeight(q, scales, zeros, bits, block_size)
