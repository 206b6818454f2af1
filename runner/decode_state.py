"""Session ownership, position and latency bookkeeping shared by the decode loops."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import numpy as np
import onnxruntime as ort

from onnxdeploy.errors import DecodeRunError
from onnxdeploy.runner.session import ModelSession

__all__ = ["CallRecord", "DecodeState"]


@dataclass(frozen=True)
class CallRecord:
    """One ``session.run``: which graph ran, which positions it fed and how long it took.

    Attributes:
        graph: file name of the graph that ran.
        start: absolute position of its first token.
        tokens: real tokens fed (positions ``start .. start + tokens - 1``).
        step_len: positions the graph computes per call; ``step_len - tokens`` of them were padding.
        ms: wall time of the call, in ms.
    """

    graph: str
    start: int
    tokens: int
    step_len: int
    ms: float


class DecodeState:
    """Owns a decoder's :class:`ModelSession`, counts tokens fed and records per-``session.run`` latencies (ms).

    A decoder is a context manager; :meth:`close` closes its session (and removes any scratch copy).

    Args:
        model_session: the open session the decoder runs; closed by :meth:`close`.

    Attributes:
        source: the model path, for messages.
        model_session: the session.
        extra_outputs: further outputs every ``session.run`` (without IOBinding) fetches, e.g. activations
            for calibration; the decode loop never sees them.
        extra_results: one ``name -> array`` of ``extra_outputs`` per such run, until the caller clears it.
    """

    def __init__(self, model_session: ModelSession) -> None:
        self.source = model_session.path
        self.model_session = model_session
        self._position = 0
        self._latencies: list[float] = []
        self._calls: list[CallRecord] = []
        self.extra_outputs: list[str] = []
        self.extra_results: list[dict[str, np.ndarray]] = []

    @property
    def position(self) -> int:
        """Number of tokens fed since the last reset (the next token's absolute position)."""
        return self._position

    @property
    def call_latencies_ms(self) -> list[float]:
        """Wall time of every ``session.run`` since the last reset, in ms."""
        return list(self._latencies)

    @property
    def call_records(self) -> list[CallRecord]:
        """Every ``session.run`` since the last reset: graph, positions fed, padding and wall time."""
        return list(self._calls)

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
        self._calls = []

    def _timed_run(
        self,
        names: Sequence[str],
        feeds: dict[str, np.ndarray],
        *,
        tokens: int | None = None,
        binding: ort.IOBinding | None = None,
    ) -> tuple[list[np.ndarray], float]:
        """Run the session once, record and return its wall time (ms).

        Args:
            names: outputs to fetch.
            feeds: inputs by name (``input_ids`` (B, S) among them).
            tokens: real tokens among the S fed (default S: no padding), for the call record.
            binding: run this IOBinding instead of ``feeds`` (already bound); the results are then empty
                (read them from the binding).

        Raises:
            DecodeRunError: ONNX Runtime failed, or the session is closed (names the model and the position).
        """
        session = self.model_session.session
        if session is None:
            raise DecodeRunError(f"{self.source}: the decoder is closed")
        start = time.perf_counter()
        try:
            if binding is not None:
                session.run_with_iobinding(binding)
                results = []
            else:
                results = session.run([*names, *self.extra_outputs], feeds)
                if self.extra_outputs:  # e.g. activations for calibration: kept apart from the decode loop's
                    self.extra_results.append(dict(zip(self.extra_outputs, results[len(names) :], strict=True)))
                    results = results[: len(names)]
        except Exception as exc:  # ORT raises its own types (InvalidArgument, Fail, ...)
            raise DecodeRunError(f"{self.source}: ONNX Runtime failed at position {self._position}: {exc}") from exc
        latency_ms = (time.perf_counter() - start) * 1e3
        self._latencies.append(latency_ms)
        ids = next((v for k, v in feeds.items() if k == "input_ids"), None)
        step_len = int(ids.shape[-1]) if ids is not None else 1
        self._calls.append(
            CallRecord(
                graph=Path(self.source).name,
                start=self._position,
                tokens=step_len if tokens is None else tokens,
                step_len=step_len,
                ms=latency_ms,
            )
        )
        return results, latency_ms
