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

GPTQ, on the same representation, is :mod:`._quant_gptq`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from onnxdeploy.passes._quant_search import searched_params

__all__ = [
    "QuantizedWeight",
    "StoredWeight",
    "act_order_permutation",
    "block_scales",
    "output_error",
    "pack_matmulnbits",
    "quantize_rtn",
    "quantize_rtn_kn",
    "quantize_rtn_stored",
    "round_to_grid",
]


@dataclass
class QuantizedWeight:
    """One quantized weight in output-channel-major layout.

    Attributes:
        q: int8 ``(N, K)`` quantized values when ``zero_point`` is None, else uint8 (or int16 from GPTQ).
        scale: float32 ``(N, n_blocks)``.
        zero_point: ``(N, n_blocks)`` integers for asymmetric weights, else None.
        bits: 4 or 8.
        block_size: input channels per block (``K`` rounded up for per-channel).
        error: :func:`output_error` of this quantization, when it was computed along.
    """

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    bits: int
    block_size: int
    error: float | None = None

    @property
    def n_blocks(self) -> int:
        """Blocks per output channel, ``ceil(K / block_size)``."""
        return self.scale.shape[1]

    def dequantize(self) -> np.ndarray:
        """Float32 ``(N, K)``: ``(q - zero_point) * scale`` per block."""
        n, k = self.q.shape
        nb, bs = self.n_blocks, self.block_size
        q = np.zeros((n, nb * bs), dtype=np.float32)
        q[:, :k] = self.q
        q = q.reshape(n, nb, bs)
        if self.zero_point is not None:
            q -= self.zero_point[:, :, None]
        q *= self.scale[:, :, None]
        return q.reshape(n, nb * bs)[:, :k]


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


def block_scales(
    block: np.ndarray, bits: int, symmetric: bool, search: bool, weights: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Block scale and zero point (blocks along axis 1): the MLAS rule, or the clipping search.

    The search is :func:`~onnxdeploy.passes._quant_search.searched_params`; ``weights`` are its per-element
    error weights (None: plain squared error).
    """
    if search:
        return searched_params(block, bits, symmetric, weights)
    return _block_params(block, bits, symmetric)


def _diagonal(error_weights: np.ndarray | None) -> np.ndarray | None:
    """The per-input-channel weights ``(K,)`` of error weights (a full ``H``'s diagonal), None for plain MSE."""
    if error_weights is None or error_weights.size == 0:
        return None
    return np.diag(error_weights) if error_weights.ndim == 2 else error_weights


def round_to_grid(w: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int, symmetric: bool) -> np.ndarray:
    """Quantize ``w`` ``(N, ...)`` with per-row ``scale``/``zero`` ``(N,)``; returns float values on the grid."""
    qmin, qmax = _levels(bits, symmetric)
    shape = (-1,) + (1,) * (w.ndim - 1)
    q = w / scale.reshape(shape)
    np.rint(q, out=q)
    if zero is not None:
        q += zero.reshape(shape)
    return np.clip(q, qmin, qmax, out=q)


CHUNK_ELEMENTS = 1 << 20
"""Weights are quantized in row chunks of about this many elements (4 MiB of float32): temporaries stay small
and in cache whatever the weight's size."""


_POOL: list[ThreadPoolExecutor] = []
"""One worker per core, started on first use and kept: a pass quantizes hundreds of weights, and starting threads
per weight cost more than the small ones' arithmetic."""


def _sum_over_chunks(chunk: Callable[[Any], Any], starts: Sequence[Any]) -> Any:
    """``sum(chunk(start) for start in starts)``, the chunks on every core (numpy releases the GIL in its loops)."""
    workers = os.cpu_count() or 1
    if len(starts) > 1 and workers > 1:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="onnxdeploy-quant"))
        return sum(_POOL[0].map(chunk, starts))
    return sum(map(chunk, starts))


def quantize_rtn(
    wt: np.ndarray,
    *,
    bits: int,
    block_size: int,
    symmetric: bool,
    error_weights: np.ndarray | None = None,
    search: bool = False,
) -> QuantizedWeight:
    """Round-to-nearest block quantization of ``wt`` float ``(N, K)``, in row chunks.

    A partial last block is padded with zeros, which changes neither rule: the symmetric scale follows the
    value of largest magnitude, the asymmetric range includes 0 anyway.

    Args:
        wt: the weight, output-channel-major.
        bits: 4 or 8.
        block_size: input channels per block; the last block may be partial (``K`` not a multiple).
        symmetric: signed values without zero point, else unsigned with one.
        error_weights: when given, :func:`output_error`'s weights (empty: plain MSE); the error is then
            computed chunk by chunk and stored in :attr:`QuantizedWeight.error`.
        search: choose each block's scale by the clipping search (:mod:`._quant_search`), its error weighted
            by the diagonal of ``error_weights`` when they have one.

    Returns:
        The quantized weight (``q`` int8 when symmetric, uint8 when not).
    """
    wt = np.asarray(wt, dtype=np.float32)
    n, k = wt.shape
    n_blocks = -(-k // block_size)
    diag = _diagonal(error_weights) if search else None
    block_weights = None
    if diag is not None:
        block_weights = np.zeros(n_blocks * block_size, dtype=np.float32)
        block_weights[:k] = diag
        block_weights = block_weights.reshape(n_blocks, block_size)
    q = np.empty((n, k), dtype=np.int8 if symmetric else np.uint8)
    scales = np.empty((n, n_blocks), dtype=np.float32)
    zeros = None if symmetric else np.empty((n, n_blocks), dtype=np.uint8)
    rows = max(1, CHUNK_ELEMENTS // max(k, 1))

    def chunk(r0: int) -> float:
        w = wt[r0 : r0 + rows]
        m = w.shape[0]
        if k % block_size:
            padded = np.zeros((m, n_blocks * block_size), dtype=np.float32)
            padded[:, :k] = w
        else:
            padded = w
        blocks = padded.reshape(m * n_blocks, block_size)
        bw = None if block_weights is None else np.tile(block_weights, (m, 1))
        scale, zero = block_scales(blocks, bits, symmetric, search, bw)
        grid = round_to_grid(blocks, scale, zero, bits, symmetric).reshape(m, n_blocks * block_size)
        q[r0 : r0 + m] = grid[:, :k]
        scales[r0 : r0 + m] = scale.reshape(m, n_blocks)
        if zeros is not None:
            zeros[r0 : r0 + m] = zero.reshape(m, n_blocks)
        if error_weights is None:
            return 0.0
        deq = grid.reshape(m, n_blocks, block_size)
        if zero is not None:
            deq -= zero.reshape(m, n_blocks, 1)
        deq *= scale.reshape(m, n_blocks, 1)
        return _squared_error(w, deq.reshape(m, -1)[:, :k], error_weights)

    sq = _sum_over_chunks(chunk, range(0, n, rows))
    qw = QuantizedWeight(q, scales, zeros, bits, block_size)
    if error_weights is not None:
        qw.error = _normalise_error(sq, n, k, error_weights)
    return qw


def _kn_chunks(k: int, n: int, block_size: int) -> list[tuple[int, int, int, int]]:
    """Chunks ``(b0, b1, n0, n1)`` of a ``(K, N)`` weight: whole blocks of K, all of N or, for long blocks, part of it.

    Each holds about :data:`CHUNK_ELEMENTS` elements (one block and ``CHUNK_ELEMENTS // block_size`` columns at
    least), so a per-channel block spanning a long K never makes a temporary of the whole weight.
    """
    n_blocks = -(-k // block_size)
    cols = n if n * block_size <= CHUNK_ELEMENTS else max(1, CHUNK_ELEMENTS // block_size)
    per = max(1, CHUNK_ELEMENTS // (cols * block_size))
    return [
        (b0, min(b0 + per, n_blocks), n0, min(n0 + cols, n))
        for b0 in range(0, n_blocks, per)
        for n0 in range(0, n, cols)
    ]


def _rtn_kn(
    w_kn: np.ndarray,
    *,
    bits: int,
    block_size: int,
    symmetric: bool,
    error_weights: np.ndarray | None,
    store: Callable[[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, int, int, int], int], None],
    search: bool = False,
) -> float:
    """Round-to-nearest of a ``(K, N)`` weight in its stored layout, chunk by chunk on every core.

    Blocks run along K, which is axis 1 of a chunk viewed ``(cb, block_size, nc)``, so no chunk is transposed
    in float: scales come from reductions over that axis and the values are rounded in place (the same
    arithmetic as :func:`quantize_rtn`, bit for bit). ``store(grid, scale, zero, chunk, kc)`` keeps what the
    caller emits from the chunk's values on the integer grid ``grid`` float32 ``(cb, block_size, nc)`` (rows past
    K, in a partial last block, hold the zero level), ``scale``/``zero`` ``(cb, nc)``, the chunk ``(b0, b1, n0,
    n1)`` and its ``kc`` rows of K.

    Returns:
        The chunks' summed squared error (see :func:`_squared_error`), 0 when ``error_weights`` is None.
    """
    k, _ = w_kn.shape
    qmin, qmax = _levels(bits, symmetric)
    diag = _diagonal(error_weights) if search else None

    def chunk(c: tuple[int, int, int, int]) -> float:
        b0, b1, n0, n1 = c
        k0, k1 = b0 * block_size, min(b1 * block_size, k)
        cb, kc, nc = b1 - b0, k1 - k0, n1 - n0
        src = w_kn[k0:k1, n0:n1]
        if kc == cb * block_size:
            w = np.asarray(src, dtype=np.float32).reshape(cb, block_size, nc)
        else:
            w = np.zeros((cb * block_size, nc), dtype=np.float32)
            w[:kc] = src
            w = w.reshape(cb, block_size, nc)
        bw = None
        if diag is not None:
            bw = np.zeros(cb * block_size, dtype=np.float32)
            bw[:kc] = diag[k0:k1]
            bw = bw.reshape(cb, block_size, 1)
        scale, zero = block_scales(w, bits, symmetric, search, bw)  # reduces axis 1: (cb, nc)
        grid = w / scale[:, None, :]
        np.rint(grid, out=grid)
        if zero is not None:
            grid += zero[:, None, :]
        np.clip(grid, qmin, qmax, out=grid)
        store(grid, scale, zero, c, kc)
        if error_weights is None:
            return 0.0
        if zero is not None:
            grid -= zero[:, None, :]
        grid *= scale[:, None, :]
        grid -= w
        d = grid.reshape(cb * block_size, nc)[:kc]
        if error_weights.size == 0:
            flat = d.reshape(-1)
            return float(np.dot(flat, flat))
        return float(np.dot(np.einsum("kn,kn->k", d, d).astype(np.float64), error_weights[k0:k1]))

    return _sum_over_chunks(chunk, _kn_chunks(k, w_kn.shape[1], block_size))


def quantize_rtn_kn(
    w_kn: np.ndarray,
    *,
    bits: int,
    block_size: int,
    symmetric: bool,
    error_weights: np.ndarray | None = None,
    search: bool = False,
) -> QuantizedWeight:
    """:func:`quantize_rtn` of ``w_kn.T`` for a weight stored ``(K, N)`` (a MatMul's), read in its stored layout.

    Chunks are whole blocks of K (:func:`_kn_chunks`), so a memory-mapped weight is read in order; only the
    int values are transposed into the output-channel-major result.

    Args:
        w_kn: float ``(K, N)``.
        bits: 4 or 8.
        block_size: input channels per block.
        symmetric: signed values without zero point, else unsigned with one.
        error_weights: as for :func:`quantize_rtn`, but only an empty array (plain MSE) or a diagonal ``(K,)``
            (a full ``H`` couples the chunks: the caller computes that error from :meth:`dequantize`).
        search: as for :func:`quantize_rtn`.

    Returns:
        The quantized weight in output-channel-major layout, as :func:`quantize_rtn` returns it.
    """
    w_kn = np.asarray(w_kn)
    k, n = w_kn.shape
    n_blocks = -(-k // block_size)
    q = np.empty((n, k), dtype=np.int8 if symmetric else np.uint8)
    scales = np.empty((n, n_blocks), dtype=np.float32)
    zeros = None if symmetric else np.empty((n, n_blocks), dtype=np.uint8)

    def store(grid: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, c: tuple, kc: int) -> None:
        b0, b1, n0, n1 = c
        q[n0:n1, b0 * block_size : b0 * block_size + kc] = grid.reshape(-1, n1 - n0)[:kc].astype(q.dtype).T
        scales[n0:n1, b0:b1] = scale.T
        if zeros is not None:
            zeros[n0:n1, b0:b1] = zero.T  # type: ignore[union-attr]

    sq = _rtn_kn(
        w_kn,
        bits=bits,
        block_size=block_size,
        symmetric=symmetric,
        error_weights=error_weights,
        store=store,
        search=search,
    )
    qw = QuantizedWeight(q, scales, zeros, bits, block_size)
    if error_weights is not None:
        qw.error = _normalise_error(sq, n, k, error_weights)
    return qw


@dataclass
class StoredWeight:
    """A ``(K, N)`` weight's round-to-nearest tensors, laid out as a consumer stores them (:func:`quantize_rtn_stored`).

    Attributes:
        values: ``nbits``: uint8 ``(N, n_blocks, block_size * bits / 8)`` (MatMulNBits ``B``); ``kn``: int8
            (symmetric) or uint8 ``(K, N)`` (a DequantizeLinear input read by a MatMul).
        scale: float32, ``nbits``: ``(N * n_blocks,)``; ``kn``: ``(n_blocks, N)``.
        zero_point: None when symmetric; ``nbits``: uint8 ``(N, ceil(n_blocks * bits / 8))``; ``kn``: uint8
            ``(n_blocks, N)``.
        error: :func:`output_error` of the quantization when asked for, else None.
    """

    values: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    error: float | None = None


def quantize_rtn_stored(
    w_kn: np.ndarray,
    *,
    bits: int,
    block_size: int,
    symmetric: bool,
    form: Literal["nbits", "kn"],
    error_weights: np.ndarray | None = None,
    search: bool = False,
) -> StoredWeight:
    """Round-to-nearest of a ``(K, N)`` weight straight into the tensors a consumer stores, without a ``(N, K)`` copy.

    ``nbits``: equal, bit for bit, to :func:`pack_matmulnbits` of :func:`quantize_rtn_kn`; ``kn``: its ``q``,
    ``scale`` and ``zero_point`` transposed to ``(K, N)``/``(n_blocks, N)``. The values are cast (and for
    ``nbits`` offset and packed) inside each chunk, so the float weight is read once and nothing of size
    ``N × K`` is made but the output.

    Args:
        w_kn: float ``(K, N)``.
        bits: 4 or 8.
        block_size: input channels per block (``K`` rounded up to a power of two for per-channel MatMulNBits).
        symmetric: signed values without zero point, else unsigned with one.
        form: ``nbits`` (MatMulNBits initializers) or ``kn`` (DequantizeLinear initializers for a MatMul).
        error_weights: as for :func:`quantize_rtn_kn`.
        search: as for :func:`quantize_rtn`.

    Returns:
        The stored tensors and, with ``error_weights``, the error.
    """
    w_kn = np.asarray(w_kn)
    k, n = w_kn.shape
    n_blocks = -(-k // block_size)
    offset = (1 << (bits - 1)) if symmetric else 0
    zeros = None if symmetric else np.empty((n_blocks, n) if form == "kn" else (n, n_blocks), dtype=np.uint8)
    if form == "kn":
        values = np.empty((k, n), dtype=np.int8 if symmetric else np.uint8)
        scales = np.empty((n_blocks, n), dtype=np.float32)
    else:
        values = np.empty((n, n_blocks, block_size * bits // 8), dtype=np.uint8)
        scales = np.empty((n, n_blocks), dtype=np.float32)

    def store(grid: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, c: tuple, kc: int) -> None:
        b0, b1, n0, n1 = c
        if form == "kn":
            k0 = b0 * block_size
            values[k0 : k0 + kc, n0:n1] = grid.reshape(-1, n1 - n0)[:kc]
            scales[b0:b1, n0:n1] = scale
            if zeros is not None:
                zeros[b0:b1, n0:n1] = zero
            return
        # Cast in the chunk's layout, pack pairs of K rows, then transpose the (fewer) bytes to (nc, cb, bytes).
        u = grid.astype(np.int8 if symmetric else np.uint8).view(np.uint8)
        if offset:
            u += np.uint8(offset)  # int8 wraps to two's complement: + offset gives the unsigned level
        if bits == 4:
            u = u[:, 0::2, :] | (u[:, 1::2, :] << 4)
        values[n0:n1, b0:b1] = u.transpose(2, 0, 1)
        scales[n0:n1, b0:b1] = scale.T
        if zeros is not None:
            zeros[n0:n1, b0:b1] = zero.T  # type: ignore[union-attr]

    sq = _rtn_kn(
        w_kn,
        bits=bits,
        block_size=block_size,
        symmetric=symmetric,
        error_weights=error_weights,
        store=store,
        search=search,
    )
    error = None if error_weights is None else _normalise_error(sq, n, k, error_weights)
    if form == "kn":
        return StoredWeight(values, scales, zeros, error)
    return StoredWeight(values, scales.reshape(-1), None if zeros is None else _pack_zero_points(zeros, bits), error)


def act_order_permutation(importance: np.ndarray) -> np.ndarray:
    """Input channels by decreasing importance (``diag(X^T X)``); ties keep channel order.

    Args:
        importance: float ``(K,)``.

    Returns:
        int64 ``(K,)``: ``perm[j]`` is the original channel placed at position ``j``.
    """
    return np.argsort(-np.asarray(importance, dtype=np.float64), kind="stable").astype(np.int64)


def _squared_error(wt: np.ndarray, deq: np.ndarray, h: np.ndarray) -> float:
    """``sum((W - Q) H (W - Q)^T)`` over rows (``H`` full or diagonal), or ``sum((W - Q)^2)`` for an empty ``H``."""
    d = np.asarray(wt, dtype=np.float32) - np.asarray(deq, dtype=np.float32)
    if h.size == 0:
        return float(np.einsum("nk,nk->", d, d, dtype=np.float64))
    if h.ndim == 1:
        return float(np.einsum("nk,k,nk->", d.astype(np.float64), h, d.astype(np.float64)))
    # tr(D H D^T) by BLAS row chunks (a three-operand einsum loops in C without BLAS: minutes on an LM head).
    total = 0.0
    rows = max(1, CHUNK_ELEMENTS // max(h.shape[0], 1))
    for r0 in range(0, d.shape[0], rows):
        part = d[r0 : r0 + rows].astype(np.float64)
        total += float(np.einsum("nk,nk->", part @ h, part))
    return total


def _normalise_error(total: float, n: int, k: int, h: np.ndarray) -> float:
    """Per output channel and unit activation energy (``N · tr(H)``), or per element for plain MSE."""
    if h.size == 0:
        return total / (n * k)
    return total / (n * max(float(h.sum() if h.ndim == 1 else np.trace(h)), 1e-30))


def output_error(wt: np.ndarray, deq: np.ndarray, hessian_diag_or_full: np.ndarray) -> float:
    """Calibration-weighted weight error ``tr((W - Q) H (W - Q)^T) / (N · tr(H))``, or plain MSE without data.

    Args:
        wt: float ``(N, K)`` original weight.
        deq: float ``(N, K)`` dequantized weight (same column order as ``wt``).
        hessian_diag_or_full: ``X^T X`` ``(K, K)``, its diagonal ``(K,)``, or an empty array for plain MSE.

    Returns:
        The error (mean squared output error per output channel and unit activation energy).
    """
    h = np.asarray(hessian_diag_or_full, dtype=np.float64)
    n, k = np.shape(wt)
    return _normalise_error(_squared_error(wt, deq, h), n, k, h)


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
    u[:, :k] = qw.q.astype(np.uint8)  # int8 wraps to its two's complement: + offset below restores the level
    if offset:
        u[:, :k] += np.uint8(offset)
    if bits == 4:
        u = u.reshape(n, nb, bs // 2, 2)
        packed = (u[..., 0] | (u[..., 1] << 4)).astype(np.uint8)
    else:
        packed = u.reshape(n, nb, bs)
    zp = None if qw.zero_point is None else _pack_zero_points(qw.zero_point.astype(np.uint8), bits)
    return packed, qw.scale.reshape(-1).astype(np.float32), zp


def _pack_zero_points(zeros: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits ``zero_points`` of uint8 ``(N, n_blocks)``: 4-bit ones two a byte, low nibble first; 8-bit as is."""
    if bits != 4:
        return zeros
    n, nb = zeros.shape
    z = np.full((n, 2 * (-(-nb // 2))), 8, dtype=np.uint8)  # an unused last nibble holds 8, as in ORT
    z[:, :nb] = zeros
    return (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
