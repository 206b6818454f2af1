"""Error-minimising block scales for ``quantize_weights``: a search over clipping ratios of each block's range.

Round-to-nearest with the range's extremes as the scale (ONNX Runtime's MLAS rule, :mod:`._weight_quant`) wastes
levels on outliers: most of a block's values sit far from its largest one. Shrinking the range by a ratio
``alpha`` clips the outliers and rounds the rest more finely. For each block this module tries the ratios of
:data:`CLIP_GRID` and keeps the one whose dequantized block has the least squared error, weighted per input
channel by ``diag(X^T X)`` of the calibration activations when they are known (the output error a channel's
weight error causes; activation-aware in the sense of AWQ's clipping search, Lin et al., "AWQ:
Activation-aware Weight Quantization for LLM Compression and Acceleration", 2024, section 3.3), plain squared
error when not (MSE-optimal clipping, as in llama.cpp's ``make_qx_quants`` and ORT's GPTQ ``mse=True``).

The result uses the same representation as the MLAS rule (scale float32, integer zero point in the level
range, ``(q - zero_point) * scale``), so the packing, the ONNX ``DequantizeLinear`` and ``MatMulNBits``
semantics, and the bits per weight are unchanged: only the values of scale and zero point differ.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CLIP_GRID", "searched_params"]

CLIP_GRID = tuple(float(a) for a in np.linspace(1.0, 0.55, 19))
"""Clipping ratios tried, largest first (1.0 is the MLAS rule's range: the search never does worse than it)."""


def _params(lo: np.ndarray, hi: np.ndarray, extreme: np.ndarray, bits: int, symmetric: bool, alpha: float):
    """Scale and zero point for the range scaled by ``alpha`` (the MLAS formulas of :mod:`._weight_quant`)."""
    if symmetric:
        scale = extreme * alpha / -float(1 << (bits - 1))
        return np.where(scale == 0, 1.0, scale).astype(np.float32), None
    qmax = (1 << bits) - 1
    scale = (hi - lo) * alpha / qmax
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    return scale, np.clip(np.rint(-lo * alpha / scale), 0, qmax).astype(np.float32)


def searched_params(
    w: np.ndarray, bits: int, symmetric: bool, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-block scale (and zero point) minimising the (weighted) squared error of the dequantized block.

    Args:
        w: float32 blocks along axis 1: ``(M, b)`` (rows are blocks) or ``(A, b, C)`` (``A × C`` blocks).
        bits: 4 or 8.
        symmetric: signed values without zero point (``scale = alpha · v / -2^(b-1)``, ``v`` the value of
            largest magnitude), else unsigned with one over ``alpha · [min(w, 0), max(w, 0)]``.
        weights: non-negative per-element error weights broadcastable to ``w`` (``diag(X^T X)`` of each input
            channel; zeros for padding), or None for plain squared error.

    Returns:
        ``(scale, zero_point)``: float32 of ``w``'s shape without axis 1; zero point float32 integers in
        ``[0, 2^bits - 1]``, or None when symmetric. Ties keep the larger ratio.
    """
    w = np.asarray(w, dtype=np.float32)
    lo = np.minimum(w.min(axis=1), 0.0)
    hi = np.maximum(w.max(axis=1), 0.0)
    extreme = np.where(np.abs(lo) > np.abs(hi), lo, hi)
    qmin, qmax = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1)
    best_err = best_scale = best_zero = None
    grid = np.empty_like(w)
    for alpha in CLIP_GRID:
        scale, zero = _params(lo, hi, extreme, bits, symmetric, alpha)
        s = np.expand_dims(scale, 1)
        np.divide(w, s, out=grid)
        np.rint(grid, out=grid)
        if zero is not None:
            z = np.expand_dims(zero, 1)
            grid += z
            np.clip(grid, qmin, qmax, out=grid)
            grid -= z
        else:
            np.clip(grid, qmin, qmax, out=grid)
        grid *= s
        grid -= w
        np.square(grid, out=grid)
        if weights is not None:
            grid *= weights
        err = grid.sum(axis=1)
        if best_err is None:
            best_err, best_scale, best_zero = err, scale, zero
            continue
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
        if zero is not None:
            best_zero = np.where(better, zero, best_zero)
    assert best_scale is not None
    return best_scale.astype(np.float32), best_zero
