"""What a static graph's cache buffers and folded constants cost in memory, with the arithmetic spelled out.

``static_kv`` refuses, before any work, a ``max_cache_len`` whose buffers (or whose folding) cannot fit in
the memory available (:meth:`onnxdeploy.passes.static_kv.StaticKVCachePass.check_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

from onnxdeploy.kv_cache import KVCache
from onnxdeploy.resources import format_bytes

__all__ = [
    "FOLDED_BYTES_PER_SLOT",
    "FOLDING_PEAK_BYTES_PER_SLOT",
    "RUNTIME_CACHE_COPIES",
    "MemoryEstimate",
    "estimate_memory",
]

RUNTIME_CACHE_COPIES = 3
"""Cache buffers alive while decoding: the past inputs, the present outputs and the runner's host copies."""
FOLDED_BYTES_PER_SLOT = 32
"""Bytes per cache slot (per batch row and token of step_len) that folding stores as constants, an upper bound.

Measured on the fixtures: folding the exporters' mask and position arithmetic over ``max_cache_len`` slots
stores 8-24 bytes per slot (int64 ranges, bool and float masks): 10^7 slots give ~241 MB of constants.
"""
FOLDING_PEAK_BYTES_PER_SLOT = 320
"""Peak bytes per cache slot (per batch row and token of step_len) while onnxsim folds, an upper bound.

Measured on the fixtures: folding at 10^6 slots grows the process by ~280 MB (onnxsim evaluates the masks
in ONNX Runtime and serialises them into protos, several copies at once).
"""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a static graph needs while it is built and at run time, with the arithmetic spelled out.

    Attributes:
        cache_bytes: ``2 × layers × B × H_kv × max_cache_len × D × dtype bytes × copies`` (bytes).
        cache_text: that product written out, e.g. ``2 × 2 layers × 1 × 2 heads × 64 slots × 16 × 4 bytes × 3
            copies = 96.0 KiB``.
        folded_bytes: constants of ``max_cache_len`` slots folding stores in the graph (bytes, upper bound).
        folding_peak_bytes: what folding holds at its peak (bytes, upper bound).
        folding_text: the folding arithmetic written out.
    """

    cache_bytes: int
    cache_text: str
    folded_bytes: int
    folding_peak_bytes: int
    folding_text: str

    @property
    def run_bytes(self) -> int:
        """Bytes resident while decoding: the cache copies and the folded constants."""
        return self.cache_bytes + self.folded_bytes

    def refusal(self, available: int) -> str | None:
        """Why ``available`` bytes are not enough (the arithmetic and the comparison), or None when they are."""
        if self.run_bytes > available:
            extra = f" + {format_bytes(self.folded_bytes)} folded constants" if self.folded_bytes else ""
            return f"{self.cache_text}{extra} > {format_bytes(available)} available"
        if self.folding_peak_bytes > available:
            return f"folding the mask arithmetic needs {self.folding_text} > {format_bytes(available)} available"
        return None


def estimate_memory(
    kv: KVCache, *, batch: int, step_len: int, max_cache_len: int, copies: int = RUNTIME_CACHE_COPIES
) -> MemoryEstimate:
    """Estimate the bytes of the cache buffers at run time and of the constants folding makes.

    Args:
        kv: the cache of the input model (layers, H_kv, D, dtype).
        batch: B.
        step_len: S of the largest graph (of a set: its largest step length).
        max_cache_len: L of the largest graph (of a set: its largest cache length).
        copies: cache buffers alive at once while decoding.

    Returns:
        The estimate with its arithmetic.
    """
    itemsize = kv.numpy_dtype.itemsize
    layers = len(kv.layers)
    cache = 2 * layers * batch * kv.num_kv_heads * max_cache_len * kv.head_dim * itemsize * copies
    slots = max_cache_len * step_len * batch
    peak = FOLDING_PEAK_BYTES_PER_SLOT * slots
    return MemoryEstimate(
        cache_bytes=cache,
        cache_text=(
            f"2 × {layers} layers × {batch} × {kv.num_kv_heads} heads × {max_cache_len} slots × "
            f"{kv.head_dim} × {itemsize} bytes × {copies} copies = {format_bytes(cache)}"
        ),
        folded_bytes=FOLDED_BYTES_PER_SLOT * slots,
        folding_peak_bytes=peak,
        folding_text=(
            f"~{FOLDING_PEAK_BYTES_PER_SLOT} bytes × {max_cache_len} slots × {step_len} × {batch} = "
            f"{format_bytes(peak)}"
        ),
    )
