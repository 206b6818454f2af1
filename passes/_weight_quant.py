"""Weight-only quantization numerics for ``quantize_weights``: round-to-nearest, GPTQ, act-order, packing.

Everything works on one weight in **output-channel-major** layout ``Wt`` float ``(N, K)``: row ``n`` holds the
``K`` input-channel weights of output channel ``n`` (a MatMul weight ``(K, N)`` transposed). Groups (blocks) run
along ``K``: ``n_blocks = ceil(K / block_size)``; per-channel quantization is one block spanning ``K``.

Representation (:class:`QuantizedWeight`): ``q`` int ``(N, K)`` and ``scale`` float32 ``(N, n_blocks)``;
symmetric weights are signed (``q`` in ``[-2^(b-1), 2^(b-1) - 1]``, no zero point), asymmetric ones unsigned
(``q`` in ``[0, 2^b - 1]`` with ``zero_point`` ``(N, n_blocks)`` in the same range). Dequantized:
``(q - zero_point) * scale``.

Scales follow ONNX Runtime's MLAS block quantizer (``MlasQuantizeBlockwise``, used by
``onnxruntime.quantization.matmul_nbits_quantizer``), so round-to-nearest results agree with ORT's:

* symmetric: the value ``v`` of largest magnitude in the block maps to ``-2^(b-1)``: ``scale = v / -2^(b-1)``
  (the full signed range is used, one more level than ``max|w| / (2^(b-1) - 1)``);
* asymmetric: ``[min(w, 0), max(w, 0)]`` maps to ``[0, 2^b - 1]``; ``zero_point = round(-min / scale)``.

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
2023, Algorithm 1 with lazy batch updates) quantizes columns in order and spreads each column's error over
the columns not yet quantized, weighted by the inverse Hessian ``H = X^T X`` of the calibration activations
``X`` ``(T, K)``; group scales are taken when a group's first column is reached (static groups in the order
processed). With act-order the columns are processed by decreasing ``diag(H)``, and the caller physically
permutes ``K`` in the graph, so the groups are contiguous in the stored weight and no ``g_idx`` is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "QuantizedWeight",
    "act_order_permutation",
    "gptq",
    "inverse_hessian_factor",
    "output_error",
    "pack_matmulnbits",
    "quantize_rtn",
]


@dataclass
class QuantizedWeight:
    """One quantized weight in output-channel-major layout.

    Attributes:
        q: int16 ``(N, K)`` quantized values (signed when ``zero_point`` is None, else unsigned).
        scale: float32 ``(N, n_blocks)``.
        zero_point: int16 ``(N, n_blocks)`` for asymmetric weights, else None.
        bits: 4 or 8.
        block_size: input channels per block (``K`` rounded up for per-channel).
    """

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    bits: int
    block_size: int

    @property
    def n_blocks(self) -> int:
        """Blocks per output channel, ``ceil(K / block_size)``."""
        return self.scale.shape[1]

    def dequantize(self) -> np.ndarray:
        """Float32 ``(N, K)``: ``(q - zero_point) * scale`` per block."""
        n, k = self.q.shape
        scale = np.repeat(self.scale, self.block_size, axis=1)[:, :k]
        q = self.q.astype(np.float32)
        if self.zero_point is not None:
            q = q - np.repeat(self.zero_point, self.block_size, axis=1)[:, :k]
        return q * scale


def _levels(bits: int, symmetric: bool) -> tuple[int, int]:
    """The integer range ``(qmin, qmax)`` of ``bits``-bit values."""
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1)


def _block_params(block: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale and zero point of each row of ``block`` ``(N, b)`` (MLAS rules; see the module docstring)."""
    if symmetric:
        vmax = block.max(axis=1)
        vmin = block.min(axis=1)
        extreme = np.where(np.abs(vmin) > np.abs(vmax), vmin, vmax)
        scale = extreme / -float(1 << (bits - 1))
        return np.where(scale == 0, 1.0, scale).astype(np.float32), None
    qmax = (1 << bits) - 1
    lo = np.minimum(block.min(axis=1), 0.0)
    hi = np.maximum(block.max(axis=1), 0.0)
    scale = (hi - lo) / qmax
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    zero = np.clip(np.rint(-lo / scale), 0, qmax)
    return scale, zero


def _round(w: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int, symmetric: bool) -> np.ndarray:
    """Quantize ``w`` ``(N, ...)`` with per-row ``scale``/``zero`` ``(N,)``; returns float values on the grid."""
    qmin, qmax = _levels(bits, symmetric)
    shape = (-1,) + (1,) * (w.ndim - 1)
    q = np.rint(w / scale.reshape(shape))
    if zero is not None:
        q = q + zero.reshape(shape)
    return np.clip(q, qmin, qmax)


def quantize_rtn(wt: np.ndarray, *, bits: int, block_size: int, symmetric: bool) -> QuantizedWeight:
    """Round-to-nearest block quantization of ``wt`` float ``(N, K)``.

    Args:
        wt: the weight, output-channel-major.
        bits: 4 or 8.
        block_size: input channels per block; the last block may be partial (``K`` not a multiple).
        symmetric: signed values without zero point, else unsigned with one.

    Returns:
        The quantized weight.
    """
    wt = np.asarray(wt, dtype=np.float32)
    n, k = wt.shape
    n_blocks = -(-k // block_size)
    padded = np.zeros((n, n_blocks * block_size), dtype=np.float32)
    padded[:, :k] = wt
    blocks = padded.reshape(n, n_blocks, block_size)
    scales = np.empty((n, n_blocks), dtype=np.float32)
    zeros = None if symmetric else np.empty((n, n_blocks), dtype=np.int16)
    q = np.empty((n, n_blocks, block_size), dtype=np.int16)
    for b in range(n_blocks):
        width = min(block_size, k - b * block_size)
        real = blocks[:, b, :width]
        scale, zero = _block_params(real, bits, symmetric)
        scales[:, b] = scale
        if zeros is not None:
            zeros[:, b] = zero
        q[:, b, :] = _round(blocks[:, b, :], scale, zero, bits, symmetric)
    return QuantizedWeight(q.reshape(n, -1)[:, :k], scales, zeros, bits, block_size)


def act_order_permutation(importance: np.ndarray) -> np.ndarray:
    """Input channels by decreasing importance (``diag(X^T X)``); ties keep channel order.

    Args:
        importance: float ``(K,)``.

    Returns:
        int64 ``(K,)``: ``perm[j]`` is the original channel placed at position ``j``.
    """
    return np.argsort(-np.asarray(importance, dtype=np.float64), kind="stable").astype(np.int64)


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

    Returns:
        The quantized weight (same layout and group scheme as :func:`quantize_rtn`).
    """
    w = np.array(wt, dtype=np.float64)
    n, k = w.shape
    # Upper Cholesky factor of H^-1: row i holds the update weights for the columns after i.
    hinv, dead = factor if factor is not None else inverse_hessian_factor(hessian, damp)
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
                scale, zero = _block_params(group.astype(np.float32), bits, symmetric)
                scales[:, g] = scale
                if zeros is not None:
                    zeros[:, g] = zero
            qcol = _round(w1[:, j], scale, zero, bits, symmetric)
            q[:, col] = qcol
            deq = (qcol - (zero if zero is not None else 0)) * scale
            err = (w1[:, j] - deq) / hinv1[j, j]
            w1[:, j:] -= np.outer(err, hinv1[j, j:])
            err1[:, j] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return QuantizedWeight(q, scales, zeros, bits, block_size)


def output_error(wt: np.ndarray, deq: np.ndarray, hessian_diag_or_full: np.ndarray) -> float:
    """Calibration-weighted weight error ``tr((W - Q) H (W - Q)^T) / (N · tr(H))``, or plain MSE without data.

    Args:
        wt: float ``(N, K)`` original weight.
        deq: float ``(N, K)`` dequantized weight (same column order as ``wt``).
        hessian_diag_or_full: ``X^T X`` ``(K, K)``, its diagonal ``(K,)``, or an empty array for plain MSE.

    Returns:
        The error (mean squared output error per output channel and unit activation energy).
    """
    d = np.asarray(wt, dtype=np.float64) - np.asarray(deq, dtype=np.float64)
    h = np.asarray(hessian_diag_or_full, dtype=np.float64)
    if h.size == 0:
        return float(np.mean(d * d))
    if h.ndim == 1:
        return float(np.einsum("nk,k,nk->", d, h, d) / (d.shape[0] * max(h.sum(), 1e-30)))
    return float(np.einsum("nk,kl,nl->", d, h, d) / (d.shape[0] * max(np.trace(h), 1e-30)))


def pack_matmulnbits(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The ``com.microsoft::MatMulNBits`` initializers of ``qw`` (layout of ORT's ``MatMulNBitsQuantizer``).

    ``K`` is padded to ``n_blocks * block_size`` with the zero level. Symmetric weights are shifted to
    unsigned (``q + 2^(b-1)``) and carry no zero point (the op's default is ``2^(b-1)``).

    Args:
        qw: the quantized weight.

    Returns:
        ``(B, scales, zero_points)``: B uint8 ``(N, n_blocks, block_size * bits / 8)``, scales float32
        ``(N * n_blocks,)``, zero points uint8 ``(N, ceil(n_blocks * bits / 8))`` (two 4-bit values a byte,
        low nibble first) or None when symmetric.
    """
    n, k = qw.q.shape
    nb, bs, bits = qw.n_blocks, qw.block_size, qw.bits
    offset = (1 << (bits - 1)) if qw.zero_point is None else 0
    pad_value = offset if qw.zero_point is None else qw.zero_point
    u = np.empty((n, nb * bs), dtype=np.uint8)
    if qw.zero_point is None:
        u[:, k:] = pad_value
    else:
        u[:, k:] = np.repeat(qw.zero_point.astype(np.uint8), bs, axis=1)[:, k:]
    u[:, :k] = (qw.q + offset).astype(np.uint8)
    zp = None
    if bits == 4:
        u = u.reshape(n, nb, bs // 2, 2)
        packed = (u[..., 0] | (u[..., 1] << 4)).astype(np.uint8)
        if qw.zero_point is not None:
            z = np.full((n, 2 * (-(-nb // 2))), 8, dtype=np.uint8)  # an unused last nibble holds 8, as in ORT
            z[:, :nb] = qw.zero_point.astype(np.uint8)
            zp = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
    else:
        packed = u.reshape(n, nb, bs)
        if qw.zero_point is not None:
            zp = qw.zero_point.astype(np.uint8)
    return packed, qw.scale.reshape(-1).astype(np.float32), zp
