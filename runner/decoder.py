"""The decode-loop interface shared by the exporter-convention and contract loops, and how one is chosen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.decode_state import CallRecord
from onnxdeploy.runner.exporter_decoder import ExporterDecoder
from onnxdeploy.runner.graph_set import GraphSetDecoder, Remainder, open_graph_set
from onnxdeploy.runner.parts import open_part_chain
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

    @property
    def call_records(self) -> list[CallRecord]:
        """Every ``session.run`` since the last reset: graph file, positions fed, padding, wall time (ms)."""
        ...

    @property
    def model_session(self) -> ModelSession:
        """The (primary) graph's session."""
        ...

    def reset(self) -> None:
        """Forget every fed token; the next feed starts at position 0."""
        ...

    def close(self) -> None:
        """Close the decoder's session (and remove any scratch copy); it cannot run afterwards."""
        ...

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray | None, float]]:
        """Feed tokens at the next positions.

        Args:
            tokens: token ids.

        Returns:
            One ``(logits float32 (V,) of batch row 0, latency_ms)`` per token fed; logits are None at positions
            the graph that ran does not compute (a ``prefill_logits: last`` bucket).
        """
        ...


def make_decoder(
    model_session: ModelSession, *, remainder: Remainder = "padded", bind_buffers: bool = False
) -> ExporterDecoder | ContractDecoder | GraphSetDecoder:
    """Pick the decode loop for a loaded model: its graph set, its contract, else the exporter convention.

    Args:
        model_session: the loaded model; the decoder owns it from here (its ``close`` closes the session).
        remainder: how a graph set feeds what is left after its largest bucket (``padded`` or ``buckets``).
        bind_buffers: contract graphs bind past and present to one buffer (ORT IOBinding; see
            :class:`ContractDecoder`); an exporter-convention model has no fixed buffer to bind (ConfigError).

    Returns:
        A :class:`GraphSetDecoder` when the contract lists a ``graph_set`` of several graphs (its sibling files
        are opened on the same providers, config entries and threads) or is a ``step_len > 1`` graph (fed in
        padded chunks), a :class:`ContractDecoder` for a lone step-1 graph, else an :class:`ExporterDecoder`.

    Raises:
        ContractError: the contract is malformed or disagrees with the graph, or (without a
            contract) the graph does not follow the exporter convention.
        ModelLoadError: a sibling graph of the set cannot be loaded.
        ConfigError: ``bind_buffers`` for a model without a contract.
    """
    contract = read_contract(model_session.model, source=model_session.path)
    if bind_buffers and contract is None:
        raise ConfigError(f"{model_session.path}: bind_buffers needs a decode contract (a static graph)")
    if contract is not None and contract.graph_set and (len(contract.graph_set) > 1 or contract.step_len > 1):
        return open_graph_set(
            model_session.path,
            contract,
            providers=model_session.providers_requested,
            remainder=remainder,
            opened=model_session,
            bind_buffers=bind_buffers,
            config_entries=model_session.config_entries,
            threads=model_session.threads,
        )
    if contract is not None and contract.part is not None:  # one split graph: the chain of its parts
        if bind_buffers:
            raise ConfigError(f"{model_session.path}: a split graph's parts are not driven on bound buffers")
        return open_part_chain(  # type: ignore[return-value]
            model_session,
            contract,
            lambda file: open_session(
                file,
                providers=model_session.providers_requested,
                config_entries=model_session.config_entries,
                threads=model_session.threads,
                share_weights=True,
            ),
        )
    if contract is not None:
        return ContractDecoder(model_session, contract, bind_buffers=bind_buffers)
    return ExporterDecoder(model_session)


def open_decoder(
    path: str | Path,
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    remainder: Remainder = "padded",
    bind_buffers: bool = False,
    config_entries: Mapping[str, str] | None = None,
) -> ExporterDecoder | ContractDecoder | GraphSetDecoder:
    """Load ``path`` on the given EPs and return the decode loop that fits it (see :func:`make_decoder`).

    Args:
        path: the ``.onnx`` file.
        providers: ORT execution providers in priority order.
        remainder: how a graph set feeds what is left after its largest bucket (``padded`` or ``buckets``).
        bind_buffers: as for :func:`make_decoder`.
        config_entries: ORT session config entries (for every graph of a set), e.g.
            ``{session.qdq_matmulnbits_accuracy_level: "0"}``.

    Returns:
        The decoder, reset to position 0; close it (or use it as a context manager) to free the session.

    Raises:
        ModelLoadError: the model cannot be loaded (names the path).
        ContractError: as for :func:`make_decoder` (the session is closed again).
    """
    model_session = open_session(path, providers=providers, config_entries=dict(config_entries or {}) or None)
    try:
        return make_decoder(model_session, remainder=remainder, bind_buffers=bind_buffers)
    except BaseException:
        model_session.close()
        raise
