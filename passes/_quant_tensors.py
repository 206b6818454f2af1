"""One target's weight quantized into the tensors it is stored as: MatMulNBits' or a DequantizeLinear's.

:class:`WeightQuantizer` reads a weight (memory-mapped), quantizes it as the config asks (round-to-nearest or
GPTQ, with the act-order permutations of its input and output channels), writes the quantized tensors to the
scratch data file (:class:`~onnxdeploy.artifacts.ScratchWriter`: mapped back, so memory holds one float weight
at a time) and records the weight's error row for ``details.layers``. The numerics are
:mod:`onnxdeploy.passes._weight_quant`'s; putting the tensors into a graph is
:mod:`onnxdeploy.passes._quant_emit`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import onnx_ir as ir
from threadpoolctl import threadpool_limits

from onnxdeploy.artifacts import ScratchWriter
from onnxdeploy.graph import numpy_dtype_of
from onnxdeploy.passes._quant_gptq import gptq, inverse_hessian_factor
from onnxdeploy.passes._quant_targets import Target
from onnxdeploy.passes._weight_quant import (
    QuantizedWeight,
    output_error,
    pack_matmulnbits,
    quantize_rtn,
    quantize_rtn_kn,
    quantize_rtn_stored,
)

if TYPE_CHECKING:
    from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig

__all__ = ["QTYPES", "Quantized", "WeightQuantizer", "int8_nbits_block"]

QTYPES = {
    (4, True): ir.DataType.INT4,
    (4, False): ir.DataType.UINT4,
    (8, True): ir.DataType.INT8,
    (8, False): ir.DataType.UINT8,
}
"""The element type of ``bits``-bit quantized values, signed (symmetric) or not: ``(bits, signed) -> type``."""


@dataclass
class Quantized:
    """A quantized weight's tensors, written once (graph-independent; shared by graphs and consumers).

    Attributes:
        form: ``nbits``: ``[B, scales, zero_points?]`` of MatMulNBits; ``dq``: ``[q, scale, zero_point?]`` of a
            DequantizeLinear laid out ``(N, K)`` when ``nk`` else ``(K, N)``.
        tensors: the tensors, in the op's input order.
        nk: the ``dq`` tensors are laid out ``(N, K)``.
        bits: 4 or 8.
        block_size: input channels per block (INT8 MatMulNBits: :func:`int8_nbits_block`).
        n: output channels ``N``.
        k: input channels ``K``.
    """

    form: Literal["nbits", "dq"]
    tensors: list[ir.TensorProtocol]
    nk: bool
    bits: int
    block_size: int
    n: int
    k: int


def int8_nbits_block(k: int, *, asymmetric: bool = False, scale_bits: int = 32) -> int:
    """The block size of an INT8 ``MatMulNBits`` weight with ``K`` input channels that stores the fewest bits.

    ``MatMulNBits`` takes a power-of-two ``block_size`` of at least 16 (com.microsoft contrib op schema) and pads
    ``K`` to whole blocks, so one block spanning ``K`` costs ``8 · 2^ceil(log2 K) / K`` bits a weight (14.2 for
    ``K = 576``). Per output channel each block stores ``8 · block`` bits of values (padding included),
    ``scale_bits`` of scale and, when ``asymmetric``, 8 of zero point; this returns the block in
    ``[16, next power of two >= K]`` with the fewest, the larger on a tie (so a power-of-two ``K`` keeps one
    block: per channel). ``K = 576`` → 64 (8.5 bits a weight, symmetric float32 scales); ``K = 1536`` → 512.
    """
    top = max(16, 1 << (k - 1).bit_length())
    sizes = [1 << e for e in range(4, top.bit_length())]

    def cost(b: int) -> int:
        n = -(-k // b)
        return n * (8 * b + scale_bits + (8 if asymmetric else 0))

    return min(sizes, key=lambda b: (cost(b), -b))


def _error_weights(h: np.ndarray | None) -> np.ndarray:
    """The calibration statistics for :func:`output_error`, or an empty array (plain MSE) without them."""
    return np.array([]) if h is None else h


def _permuted(h: np.ndarray | None, pin: np.ndarray | None) -> np.ndarray | None:
    """``X^T X`` ``(K, K)`` or its diagonal ``(K,)`` in the permuted input-channel order ``pin``."""
    if h is None or pin is None:
        return h
    return h[np.ix_(pin, pin)] if h.ndim == 2 else h[pin]


class WeightQuantizer:
    """Quantizes target weights one at a time into written tensors, keeping each one's error row.

    Args:
        config: the pass config (symmetry, method, scale search, GPTQ dampening); bits and block size are each
            target's (:attr:`Target.bits`, :attr:`Target.block_size`, from the rules).
        writer: the scratch data file the quantized tensors go to.

    Attributes:
        layers: one row per weight quantized, for ``details.layers``: ``weight``, ``node``, ``n``, ``k``,
            ``error_rtn_natural`` (round-to-nearest in natural order), ``error`` (what was emitted), ``method``,
            ``removed`` (the fraction of the former the latter removed), ``bits``, ``block_size`` (INT4),
            ``bytes`` (packed values + scales + zero points written), ``bits_per_weight`` (``8 · bytes / (N·K)``)
            and ``scale_dtype``.
    """

    def __init__(self, config: QuantizeWeightsConfig, writer: ScratchWriter):
        self.config = config
        self.writer = writer
        self.layers: list[dict] = []
        self._factor: tuple[tuple, tuple[np.ndarray, np.ndarray]] | None = None  # the last GPTQ factor, by key
        self._bits, self._block_size = 4, 32  # the weight being quantized's (its target's, from the rules)

    def _block(self, k: int, nbits: bool) -> int:
        """Input channels per block: ``block_size`` for INT4; for INT8 one block spanning ``K`` (QDQ per channel).

        INT8 MatMulNBits needs a power-of-two block (at least 16): :func:`int8_nbits_block`, the one storing
        the fewest bytes (``K`` itself when ``K`` is a power of two; 64 for ``K = 576``: 8.5 bits a weight where
        the next power of two, 1024, padded it to 14.2).
        """
        if self._bits == 4:
            return self._block_size
        return int8_nbits_block(k, asymmetric=not self.config.symmetric) if nbits else k

    def quantize(
        self,
        t: Target,
        pin: np.ndarray | None,
        pout: np.ndarray | None,
        hessian: np.ndarray | None,
        *,
        nbits: bool,
    ) -> Quantized:
        """Read ``t``'s weight, quantize it (RTN or GPTQ, permuted as asked), write its tensors, record its error.

        BLAS and LAPACK run on one thread here (``threadpoolctl``): the factors and updates are small
        (``K`` ≤ a few thousand), and OpenBLAS's threads on a busy machine cost more than they save (a 384²
        Cholesky took 0.2 s with two threads on the project's loaded 2-core machine, 0.013 s with one); the
        round-to-nearest chunks run on every core through :mod:`._weight_quant`'s own pool.

        Args:
            t: the target.
            pin: int64 ``(K,)`` act-order permutation of its input channels, or None.
            pout: int64 ``(N,)`` permutation of its output channels (it produces a folded activation), or None.
            hessian: ``X^T X`` float64 ``(K, K)``, its diagonal ``(K,)``, or None (plain MSE, no GPTQ).
            nbits: emit MatMulNBits tensors, else DequantizeLinear ones.

        Returns:
            The written tensors.
        """
        self._bits, self._block_size = t.bits or self.config.bits, t.block_size or self.config.block_size
        with threadpool_limits(limits=1, user_api="blas"):
            q = self._quantize(t, pin, pout, hessian, nbits=nbits)
        row = self.layers[-1]
        row["bits"], row["block_size"] = q.bits, q.block_size if q.bits == 4 else None
        row["bytes"] = sum(int(x.nbytes) for x in q.tensors)
        row["bits_per_weight"] = 8 * row["bytes"] / (q.n * q.k)
        row["scale_dtype"] = q.tensors[1].dtype.name
        return q

    def _quantize(
        self,
        t: Target,
        pin: np.ndarray | None,
        pout: np.ndarray | None,
        hessian: np.ndarray | None,
        *,
        nbits: bool,
    ) -> Quantized:
        """:meth:`quantize`'s work."""
        # What the consumer reads: an fp16 weight cast to float32 keeps its fp16 values; the reverse rounds.
        read = t.weight.tensor.numpy().astype(numpy_dtype_of(t.weight.dtype), copy=False)
        n, k = read.shape if t.root_nk else read.shape[::-1]
        block = self._block(k, nbits)
        diagonal = hessian is None or hessian.ndim == 1
        if not t.root_nk and pout is None and pin is None and diagonal and (nbits or not t.nk):
            # What is emitted is this RTN (GPTQ needs a full H): quantized from the stored (K, N) layout straight
            # into the tensors the consumer stores, chunk by chunk (an fp16 weight is widened a chunk at a time).
            return self._stored(t, read, block, hessian, nbits=nbits)
        wt = read.astype(np.float32, copy=False)
        wt = wt if t.root_nk else wt.T  # a view: RTN reads it in row chunks, so no full (N, K) copy is made
        if pout is not None:
            wt = wt[pout, :]
        natural = self._natural(wt, block, hessian, kn=not t.root_nk and pout is None and diagonal)
        qw = self._emitted(wt, natural, block, hessian, pin)
        assert natural.error is not None and qw.error is not None
        self._record(t, n, k, natural.error, qw.error, self._method(pin is not None))
        if nbits:
            packed, scales, zp = pack_matmulnbits(qw)
            return self._write_nbits(t, packed, scales, zp, block, n, k)
        per_channel = self._bits == 8
        q, scale, zp = qw.q, qw.scale, qw.zero_point
        if per_channel:
            scale, zp = scale[:, 0], None if zp is None else zp[:, 0]
        if not t.nk:  # laid out as the first consumer reads it: (K, N) for MatMul, (N, K) for Gemm transB=1/Gather
            q, scale, zp = q.T, scale if per_channel else scale.T, zp if per_channel or zp is None else zp.T
        return self._write_dq(t, q, scale, zp, t.nk, block, n, k)

    @property
    def _search(self) -> bool:
        return self.config.scale_search != "none"

    def _method(self, act_order: bool) -> str:
        """The method's name for ``details.layers``: ``rtn``/``gptq``, ``act-order``, ``mse search``."""
        return self.config.method + (" act-order" if act_order else "") + (" mse-search" if self._search else "")

    def _natural(self, wt: np.ndarray, block: int, h: np.ndarray | None, *, kn: bool) -> QuantizedWeight:
        """RTN of ``wt`` ``(N, K)`` in natural input order, with its error.

        ``kn``: ``wt`` is a transposed view of a ``(K, N)`` weight and ``h`` at most diagonal: it is read in
        contiguous K chunks, never transposed whole.
        """
        cfg = self.config
        rtn = quantize_rtn_kn if kn else quantize_rtn
        natural = rtn(
            wt.T if kn else wt,
            bits=self._bits,
            block_size=block,
            symmetric=cfg.symmetric,
            error_weights=_error_weights(h),
        )
        if natural.error is None:
            natural.error = output_error(wt, natural.dequantize(), _error_weights(h))
        return natural

    def _emitted(
        self, wt: np.ndarray, natural: QuantizedWeight, block: int, hessian: np.ndarray | None, pin: np.ndarray | None
    ) -> QuantizedWeight:
        """What is emitted, with its error: GPTQ (full ``H``) or RTN in the act-order ``pin``; else ``natural``."""
        cfg = self.config
        h = _permuted(hessian, pin)
        wt = wt if pin is None else wt[:, pin]
        qw = natural
        if cfg.method == "gptq" and h is not None and h.ndim == 2:
            # Weights reading one activation (q/k/v, gate/up) share H and the permutation: factor it once.
            key = (id(hessian), None if pin is None else pin.tobytes())
            if self._factor is None or self._factor[0] != key:
                self._factor = key, inverse_hessian_factor(h, cfg.gptq_damp)
            qw = gptq(
                wt,
                None,
                bits=self._bits,
                block_size=block,
                symmetric=cfg.symmetric,
                factor=self._factor[1],
                search=self._search,
                search_weights=np.diag(h),
            )
        elif pin is not None or self._search:
            qw = quantize_rtn(
                wt,
                bits=self._bits,
                block_size=block,
                symmetric=cfg.symmetric,
                error_weights=_error_weights(h),
                search=self._search,
            )
        if qw.error is None:
            qw.error = output_error(wt, qw.dequantize(), _error_weights(h))
        return qw

    def _stored(self, t: Target, w_kn: np.ndarray, block: int, h: np.ndarray | None, *, nbits: bool) -> Quantized:
        """RTN of a weight stored ``(K, N)`` that a MatMul reads, written as MatMulNBits or ``(K, N)`` DQ tensors."""
        cfg = self.config
        k, n = w_kn.shape
        form: Literal["nbits", "kn"] = "nbits" if nbits else "kn"
        st = quantize_rtn_stored(
            w_kn,
            bits=self._bits,
            block_size=block,
            symmetric=cfg.symmetric,
            form=form,
            error_weights=_error_weights(h),
            search=self._search,
        )
        natural = st.error
        if self._search:  # the reference row: plain RTN's error on the same weights
            natural = quantize_rtn_kn(
                w_kn, bits=self._bits, block_size=block, symmetric=cfg.symmetric, error_weights=_error_weights(h)
            ).error
        assert st.error is not None and natural is not None
        self._record(t, n, k, natural, st.error, self._method(False))
        if nbits:
            return self._write_nbits(t, st.values, st.scale, st.zero_point, block, n, k)
        per_channel = self._bits == 8  # one block spanning K: per-axis scales (N,)
        scale = st.scale[0] if per_channel else st.scale
        zp = None if st.zero_point is None else (st.zero_point[0] if per_channel else st.zero_point)
        return self._write_dq(t, st.values, scale, zp, False, block, n, k)

    def _record(self, t: Target, n: int, k: int, natural: float, error: float, method: str) -> None:
        """Append the weight's row to :attr:`layers`."""
        removed = 1 - error / natural if natural > 0 else 0.0
        row = {"weight": _base_name(t), "node": str(t.node.name), "n": n, "k": k, "error_rtn_natural": natural}
        self.layers.append(row | {"error": error, "method": method, "removed": removed})

    def _write_nbits(
        self, t: Target, packed: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, block: int, n: int, k: int
    ) -> Quantized:
        """Write MatMulNBits' ``B`` uint8, ``scales`` (the weight's dtype) and ``zero_points`` uint8 (asymmetric)."""
        base, bits, dtype = _base_name(t), self._bits, t.weight.dtype
        tensors = [
            self.writer.tensor(packed, ir.DataType.UINT8, f"{base}_Q{bits}"),
            self.writer.tensor(scales.astype(numpy_dtype_of(dtype)), dtype, f"{base}_scales"),
        ]
        if zp is not None:
            tensors.append(self.writer.tensor(zp, ir.DataType.UINT8, f"{base}_zero_points"))
        return Quantized("nbits", tensors, False, bits, block, n, k)

    def _write_dq(
        self,
        t: Target,
        q: np.ndarray,
        scale: np.ndarray,
        zp: np.ndarray | None,
        nk: bool,
        block: int,
        n: int,
        k: int,
    ) -> Quantized:
        """Write a DequantizeLinear's ``q`` (INT4/INT8, unsigned when asymmetric), ``scale`` and ``zero_point``.

        The arrays arrive in the emitted layout (``(N, K)`` when ``nk``, else ``(K, N)``; scales ``(N,)``
        per channel or blocked along K); they are cast to the quantized and the weight's types here.
        """
        base, bits, dtype = _base_name(t), self._bits, t.weight.dtype
        signed = zp is None
        qtype, ztype = QTYPES[(bits, signed)], QTYPES[(bits, False)]
        tensors = [
            self.writer.tensor(
                np.ascontiguousarray(q.astype(numpy_dtype_of(qtype), copy=False)), qtype, f"{base}_Q{bits}"
            ),
            self.writer.tensor(np.ascontiguousarray(scale.astype(numpy_dtype_of(dtype))), dtype, f"{base}_scale"),
        ]
        if zp is not None:
            z = np.ascontiguousarray(zp.astype(numpy_dtype_of(ztype), copy=False))
            tensors.append(self.writer.tensor(z, ztype, f"{base}_zero_point"))
        return Quantized("dq", tensors, nk, bits, block, n, k)


def _base_name(t: Target) -> str:
    """The stem of a weight's quantized tensor names: its initializer's name (else its node's)."""
    return str(t.weight.root.name or t.node.name or "weight")
