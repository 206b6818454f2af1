"""Position and latency bookkeeping shared by the decode loops."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from onnxdeploy.errors import DecodeRunError

__all__ = ["DecodeState"]


class DecodeState:
    """Counts tokens fed (the next absolute position) and records per-``session.run`` latencies (ms).

    Subclasses set ``source`` (the model path, for messages).
    """

    source: str

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

    def _timed_run(
        self, session: ort.InferenceSession, names: Sequence[str], feeds: dict[str, np.ndarray]
    ) -> tuple[list[np.ndarray], float]:
        """Run ``session`` once, record and return its wall time (ms).

        Raises:
            DecodeRunError: ONNX Runtime failed (names the model and the position).
        """
        start = time.perf_counter()
        try:
            results = session.run(list(names), feeds)
        except Exception as exc:  # ORT raises its own types (InvalidArgument, Fail, ...)
            raise DecodeRunError(f"{self.source}: ONNX Runtime failed at position {self._position}: {exc}") from exc
        latency_ms = (time.perf_counter() - start) * 1e3
        self._latencies.append(latency_ms)
        return results, latency_ms
