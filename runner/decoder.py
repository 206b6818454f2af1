"""The decode-loop interface shared by the exporter-convention and contract loops, and how one is chosen."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from onnxdeploy.contract import read_contract
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.exporter_decoder import ExporterDecoder
from onnxdeploy.runner.session import DEFAULT_PROVIDERS, ModelSession, open_session

__all__ = ["Decoder", "make_decoder", "open_decoder"]


@runtime_checkable
class Decoder(Protocol):
    """A stateful decode loop over one ORT session.

    Attributes:
        source: the model path, for messages.
    """

    source: str

    @property
    def position(self) -> int:
        """Number of tokens fed since the last reset (the next token's absolute position)."""
        ...

    @property
    def call_latencies_ms(self) -> list[float]:
        """Wall time of every ``session.run`` since the last reset, in ms."""
        ...

    def reset(self) -> None:
        """Forget every fed token; the next feed starts at position 0."""
        ...

    def close(self) -> None:
        """Close the decoder's session (and remove any scratch copy); it cannot run afterwards."""
        ...

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray, float]]:
        """Feed tokens at the next positions.

        Args:
            tokens: token ids.

        Returns:
            One ``(logits float32 (V,) of batch row 0, latency_ms)`` per token fed.
        """
        ...


def make_decoder(model_session: ModelSession) -> ExporterDecoder | ContractDecoder:
    """Pick the decode loop for a loaded model: its contract if it has one, else the exporter convention.

    Args:
        model_session: the loaded model; the decoder owns it from here (its ``close`` closes the session).

    Returns:
        A :class:`ContractDecoder` when ``metadata_props`` holds a contract, else an :class:`ExporterDecoder`.

    Raises:
        ContractError: the contract is malformed or disagrees with the graph, or (without a
            contract) the graph does not follow the exporter convention.
    """
    contract = read_contract(model_session.model, source=model_session.path)
    if contract is not None:
        return ContractDecoder(model_session, contract)
    return ExporterDecoder(model_session)


def open_decoder(
    path: str | Path, *, providers: Sequence[str] = DEFAULT_PROVIDERS
) -> ExporterDecoder | ContractDecoder:
    """Load ``path`` on the given EPs and return the decode loop that fits it (see :func:`make_decoder`).

    Args:
        path: the ``.onnx`` file.
        providers: ORT execution providers in priority order.

    Returns:
        The decoder, reset to position 0; close it (or use it as a context manager) to free the session.

    Raises:
        ModelLoadError: the model cannot be loaded (names the path).
        ContractError: as for :func:`make_decoder` (the session is closed again).
    """
    model_session = open_session(path, providers=providers)
    try:
        return make_decoder(model_session)
    except BaseException:
        model_session.close()
        raise
