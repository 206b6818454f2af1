"""Decode loop over a model split into parts (``split``): the chain of graphs run one after another per call.

Every part's contract lists the chain (``parts``: file, first layer, layers) and says which part it is
(``part``: index, the hidden-state input and output). A host, and :class:`PartChain`, does per call:

1. part 0 gets ``input_ids``, ``cache_position``, ``position_ids`` (and ``attention_mask``) as a whole graph would
   and returns its layers' present caches and the hidden state ``(B, step_len, hidden)``;
2. each later part gets the hidden state the part before returned (``part.hidden_in`` ← ``part.hidden_out`` of the
   one before), the same position inputs it declares, and its own layers' caches; the last returns the logits.

Each part owns the cache buffers of its layers (the contract's ``cache`` entries, whole-model layer indices), so
the chain's cache is the union of the parts' buffers: :meth:`PartChain.cache_buffers` and
:meth:`PartChain.load_cache` move them as one, and a graph set of split graphs (every member a chain) switches
cache lengths exactly as a set of whole graphs (:mod:`onnxdeploy.runner.graph_set`). :class:`PartChain` is a
drop-in member there and a step of the host API (:mod:`onnxdeploy.runner.host`: ``call(buffers, inputs)`` on the
host's buffers, the whole model's): the same ``contract`` view (every layer's cache entries, the last part's logits),
``run_chunk``, ``feed``, ``reset`` and call records (one per call of the chain, its time the parts' sum).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import numpy as np

from onnxdeploy.contract import DecodeContract, read_contract
from onnxdeploy.errors import CacheOverflowError, ContractError
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.decode_state import CallRecord
from onnxdeploy.runner.host import StepInputs, allocate_buffers, move_slots, step_feeds, store_presents
from onnxdeploy.runner.session import ModelSession

__all__ = ["PartChain", "PartDecoder", "chain_contract", "open_part_chain"]


class PartDecoder(ContractDecoder):
    """One part of a chain: a :class:`ContractDecoder` whose call may take a hidden state and return one.

    Args:
        model_session: the part's session; closed by :meth:`close`.
        contract: its contract (``part`` set).

    Raises:
        ContractError: as :class:`ContractDecoder` (the graph disagrees with the contract), or no ``part``.
    """

    def __init__(self, model_session: ModelSession, contract: DecodeContract):
        if contract.part is None:
            raise ContractError(f"{model_session.path}: its contract names no part")
        super().__init__(model_session, contract)
        self.part = contract.part
        out = self.part.hidden_out if self.part.hidden_out is not None else contract.logits
        self._output_names = [str(out), *(present for _, present in self._pairs)]

    def call_part(
        self, buffers: dict[str, np.ndarray], inputs: StepInputs, hidden: np.ndarray | None
    ) -> tuple[np.ndarray, float]:
        """One ``session.run`` of this part (the host API's step call, plus the hidden state).

        Args:
            buffers: past-input name → buffer, the whole chain's (this part reads and updates its own layers').
            inputs: the call's inputs (:class:`~onnxdeploy.runner.host.StepInputs`); part 0 feeds the tokens.
            hidden: the previous part's hidden state, float ``(B, step_len, hidden)``; None for part 0.

        Returns:
            ``(hidden state out (B, S, hidden), or the last part's logits float32 (B, P, V); latency_ms)``.

        Raises:
            ContractError: no hidden state for a part that takes one, or a present output's shape disagrees with
                ``cache_update``.
            DecodeRunError: ONNX Runtime failed, or the decoder is closed.
        """
        c = self.contract
        own = {past: buffers[past] for past, _ in self._pairs}
        feeds: dict[str, np.ndarray] = {**step_feeds(c, inputs), **own}
        if self.part.hidden_in is not None:
            if hidden is None:
                raise ContractError(f"{self.source}: part {self.part.index} needs the previous part's hidden state")
            feeds[self.part.hidden_in] = hidden
        saved, self._position = self._position, int(inputs.positions[0, 0])
        try:
            results, latency_ms = self._timed_run(self._output_names, feeds, tokens=int(inputs.real.max()))
        finally:
            self._position = saved
        store_presents(c, buffers, results[1:], inputs, written_shapes=self._written_shapes, source=str(self.source))
        out = results[0]
        return (np.asarray(out, dtype=np.float32) if self.part.hidden_out is None else out), latency_ms


def chain_contract(parts: Sequence[DecodeContract]) -> DecodeContract:
    """The whole model's view of a chain: part 0's inputs, every part's cache entries, the last part's logits.

    Args:
        parts: the parts' contracts, in chain order.

    Returns:
        A contract with ``part`` None, ``cache`` the concatenation, ``num_layers`` the sum and ``logits`` the last
        part's (``parts`` kept): what a graph set compares between its members and moves buffers by.

    Raises:
        ContractError: the parts disagree on a field a chain shares (batch, step and cache lengths, layout, ...).
    """
    first = parts[0]
    shared = ("batch", "step_len", "max_cache_len", "kv_layout", "kv_dtype", "cache_update", "prefill_logits")
    for c in parts[1:]:
        differ = [f for f in shared if getattr(c, f) != getattr(first, f)]
        if differ:
            raise ContractError(f"the parts of a chain differ in {differ}")
    return first.model_copy(
        update={
            "part": None,
            "cache": [entry for c in parts for entry in c.cache],
            "num_layers": sum(c.num_layers for c in parts),
            "logits": parts[-1].logits,
        }
    )


class PartChain:
    """Drives the parts of one split graph as one decoder (module docstring).

    Implements the host API's step call (:class:`~onnxdeploy.runner.host.GraphStep`: :meth:`call` on a host's
    buffers, the whole model's) and the decoder interface a graph set's member has (own buffers, ``run_chunk``,
    ``load_cache``, ``cache_buffers``).

    Args:
        parts: one :class:`PartDecoder` per part, in chain order; closed by :meth:`close`.

    Attributes:
        source: part 0's path, for messages.
        contract: the whole model's view (:func:`chain_contract`).

    Raises:
        ContractError: the parts are not the chain their contracts list (order, indices) or disagree.
    """

    def __init__(self, parts: Sequence[PartDecoder]):
        self._parts = list(parts)
        indices = [p.part.index for p in self._parts]
        if indices != list(range(len(self._parts))) or any(p.part.count != len(self._parts) for p in self._parts):
            raise ContractError(f"{parts[0].source}: parts {indices} are not a whole chain of {parts[0].part.count}")
        self.source = self._parts[0].source
        self.contract = chain_contract([p.contract for p in self._parts])
        self._buffers: dict[str, np.ndarray] = {}
        self.reset()

    @property
    def position(self) -> int:
        """Number of tokens fed since the last reset (the next token's absolute position)."""
        return self._position

    @property
    def call_latencies_ms(self) -> list[float]:
        """Wall time of every call of the chain since the last reset (the parts' ``session.run`` summed), in ms."""
        return [c.ms for c in self._calls]

    @property
    def call_records(self) -> list[CallRecord]:
        """Every call of the chain since the last reset (graph: part 0's file; time: the parts' sum)."""
        return list(self._calls)

    @property
    def model_session(self) -> ModelSession:
        """Part 0's session (its providers stand for the chain's)."""
        return self._parts[0].model_session

    def sessions(self) -> list[ModelSession]:
        """Every part's session, in chain order."""
        return [p.model_session for p in self._parts]

    @property
    def fallbacks(self) -> list[str]:
        """Every requested execution provider that is not active, over all parts."""
        return [line for s in self.sessions() for line in s.fallbacks]

    def reset(self) -> None:
        """Zero the buffers (every part's layers); the next feed starts at position 0."""
        for p in self._parts:
            p.reset()
        self._buffers = allocate_buffers(self.contract)
        self._position = 0
        self._calls: list[CallRecord] = []

    def close(self) -> None:
        """Close every part's session. Safe to call twice."""
        for p in self._parts:
            p.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def cache_buffers(self) -> dict[str, np.ndarray]:
        """The chain's cache buffers by past-input name, every part's layers (not copies)."""
        return self._buffers

    def load_cache(self, buffers: dict[str, np.ndarray], position: int) -> None:
        """Continue another chain's decode at ``position`` (:func:`~onnxdeploy.runner.host.move_slots`).

        Raises:
            CacheOverflowError: ``position`` above ``max_cache_len``.
            ContractError: a buffer is missing or of another shape off the sequence axis.
        """
        self._buffers = move_slots(buffers, self.contract, position, source=self.source)
        self._position = position

    def call(self, buffers: dict[str, np.ndarray], inputs: StepInputs) -> tuple[np.ndarray, float]:
        """One call of the chain on a host's ``buffers`` (:class:`~onnxdeploy.runner.host.GraphStep`).

        Each part runs once, in order, the hidden state passed on; the call is recorded (:attr:`call_records`).

        Returns:
            ``(logits float32 (B, P, V), latency_ms)``: the last part's logits, the parts' wall times summed.
        """
        hidden: np.ndarray | None = None
        total = 0.0
        for p in self._parts:
            hidden, ms = p.call_part(buffers, inputs, hidden)
            total += ms
        c = self.contract
        self._calls.append(
            CallRecord(
                graph=Path(self.source).name,
                start=int(inputs.positions[0, 0]),
                tokens=int(inputs.real.max()),
                step_len=c.step_len,
                ms=total,
            )
        )
        return hidden, total  # type: ignore[return-value]

    def run_chunk(self, tokens: Sequence[int]) -> list[tuple[np.ndarray | None, float]]:
        """One call of the chain on 1..``step_len`` real tokens (as :meth:`ContractDecoder.run_chunk`).

        Raises:
            ContractError: no tokens, more than ``step_len``, or fewer on a graph without padding.
            CacheOverflowError: the call's slots pass ``max_cache_len``.
            DecodeRunError: ONNX Runtime failed, or a part is closed.
        """
        c = self.contract
        if not 0 < len(tokens) <= c.step_len:
            raise ContractError(f"{self.source}: a call takes 1..{c.step_len} tokens, got {len(tokens)}")
        if len(tokens) < c.step_len and c.padding is None:
            raise ContractError(f"{self.source}: step_len={c.step_len} chain declares no padding; got {len(tokens)}")
        if self._position + c.step_len > c.max_cache_len:
            raise CacheOverflowError(max(self._position, c.max_cache_len), c.max_cache_len)
        logits, total = self.call(self._buffers, StepInputs.uniform(c, tokens, self._position))
        real = len(tokens)
        self._position += real
        if c.prefill_logits == "last":
            return [(None, total)] * (real - 1) + [(logits[0, 0], total)]
        return [(logits[0, i], total) for i in range(real)]

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray | None, float]]:
        """Feed ``tokens``, ``step_len`` per call (a multiple of it; the whole feed checked first).

        Raises:
            ContractError: ``len(tokens)`` not a multiple of ``step_len``.
            CacheOverflowError: a slot to write is ``>= max_cache_len`` (before any call).
        """
        c = self.contract
        if len(tokens) % c.step_len:
            raise ContractError(f"{self.source}: step_len={c.step_len} chain is fed {len(tokens)} tokens")
        if self._position + len(tokens) > c.max_cache_len:
            raise CacheOverflowError(max(self._position, c.max_cache_len), c.max_cache_len)
        results: list[tuple[np.ndarray | None, float]] = []
        for start in range(0, len(tokens), c.step_len):
            results += self.run_chunk(tokens[start : start + c.step_len])
        return results


def open_part_chain(first: ModelSession, contract: DecodeContract, opener: Callable[[Path], ModelSession]) -> PartChain:
    """Open the other parts ``first``'s contract lists (files beside it) and chain them.

    Args:
        first: part 0's session (the chain owns it from here).
        contract: its contract.
        opener: opens one more part's file with the same session options.

    Returns:
        The chain, reset.

    Raises:
        ContractError: ``first`` is not part 0, a part carries no contract or another chain.
        ModelLoadError: a part cannot be loaded.
    """
    opened: list[ModelSession] = [first]
    try:
        if contract.part is None or contract.part.index != 0:
            raise ContractError(f"{first.path}: not part 0 of a chain; open the chain from its first part")
        parts = [PartDecoder(first, contract)]
        for entry in contract.parts[1:]:
            session = opener(Path(first.path).with_name(entry.file))
            opened.append(session)
            own = read_contract(session.model, source=session.path)
            if own is None or own.part is None or own.parts != contract.parts:
                raise ContractError(f"{session.path}: listed as a part of {first.path} but its contract disagrees")
            parts.append(PartDecoder(session, own))
        return PartChain(parts)
    except BaseException:
        for session in opened:
            session.close()
        raise
