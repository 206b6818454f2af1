"""Position and latency bookkeeping shared by the decode loops."""

from __future__ import annotations

__all__ = ["DecodeState"]


class DecodeState:
    """Counts tokens fed (the next absolute position) and records per-``session.run`` latencies (ms)."""

    def __init__(self) -> None:
        self._position = 0
        self._latencies: list[float] = []

    @property
    def position(self) -> int:
        """Number of tokens fed since the last :meth:`reset` (the next token's absolute position)."""
        return self._position

    @property
    def call_latencies_ms(self) -> list[float]:
        """Wall time of every ``session.run`` since the last :meth:`reset`, in ms."""
        return list(self._latencies)

    def _reset_counters(self) -> None:
        self._position = 0
        self._latencies = []
