"""Session ownership, position and latency bookkeeping shared by the decode loops."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Self

import numpy as np

from onnxdeploy.errors import DecodeRunError
from onnxdeploy.runner.session import ModelSession

__all__ = ["DecodeState"]


class DecodeState:
    """Owns a decoder's :class:`ModelSession`, counts tokens fed and records per-``session.run`` latencies (ms).

    A decoder is a context manager; :meth:`close` closes its session (and removes any scratch copy).

    Args:
        model_session: the open session the decoder runs; closed by :meth:`close`.

    Attributes:
        source: the model path, for messages.
        model_session: the session.
    """

    def __init__(self, model_session: ModelSession) -> None:
        self.source = model_session.path
        self.model_session = model_session
        self._position = 0
        self._latencies: list[float] = []

    @property
    def position(self) -> int:
        """Number of tokens fed since the last reset (the next token's absolute position)."""
        return self._position

    @property
    def call_latencies_ms(self) -> list[float]:
        """Wall time of every ``session.run`` since the last reset, in ms."""
        return list(self._latencies)

    def close(self) -> None:
        """Close the session; the decoder cannot run afterwards. Safe to call twice."""
        self.model_session.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _reset_counters(self) -> None:
        self._position = 0
        self._latencies = []

    def _timed_run(self, names: Sequence[str], feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], float]:
        """Run the session once, record and return its wall time (ms).

        Raises:
            DecodeRunError: ONNX Runtime failed, or the session is closed (names the model and the position).
        """
        session = self.model_session.session
        if session is None:
            raise DecodeRunError(f"{self.source}: the decoder is closed")
        start = time.perf_counter()
        try:
            results = session.run(list(names), feeds)
        except Exception as exc:  # ORT raises its own types (InvalidArgument, Fail, ...)
            raise DecodeRunError(f"{self.source}: ONNX Runtime failed at position {self._position}: {exc}") from exc
        latency_ms = (time.perf_counter() - start) * 1e3
        self._latencies.append(latency_ms)
        return results, latency_ms
