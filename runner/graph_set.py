"""Decode loop over a graph set: prefill buckets and decode graphs of several cache lengths sharing one weights file.

A set is written by ``static_kv {step_lens, max_cache_lens}``; every graph's contract lists it (``graph_set``:
file, ``step_len``, ``max_cache_len``, ``prefill_logits``, role), the primary decode graph first. How a host
drives it, and how :class:`GraphSetDecoder` does (README, "Graph sets"):

* **Chunks.** Tokens are fed through the largest step length that still fits; what is left when no bucket
  fits whole (fewer tokens than the largest bucket) goes either through smaller buckets (``remainder:
  buckets``: greedy, largest first) or as one chunk of the smallest bucket that holds it, padded at its end
  (``remainder: padded``; the contract's ``padding: trailing`` says how). A single token uses the step-1 graph.
* **Cache length.** Each call runs the graph of its step length with the smallest ``max_cache_len`` that is at
  least the current one and holds every slot the call writes (``position + step_len``, padding included). The
  decoder never moves to a smaller cache within a sequence.
* **Switching.** Graphs of one cache length share the host buffers as they are. When a call needs a larger
  cache, slots ``[0, position)`` of every buffer are copied on its sequence axis (axis 2 for BHSD, 1 for BSH2D;
  3 for BHDS_K's K, 2 for its V) into zeroed buffers of the larger length; the slots after ``position`` are
  never read before they are written, so they are dropped (:func:`onnxdeploy.runner.host.move_slots`).

Other hosts drive the same graphs through :meth:`GraphSetDecoder.member` and the host API
(:mod:`onnxdeploy.runner.host`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import numpy as np

from onnxdeploy.contract import DecodeContract, GraphSetEntry, read_contract
from onnxdeploy.errors import CacheOverflowError, ContractError
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.decode_state import CallRecord
from onnxdeploy.runner.parts import open_part_chain
from onnxdeploy.runner.session import DEFAULT_PROVIDERS, ModelSession, open_session

__all__ = ["REMAINDER_POLICIES", "GraphSetDecoder", "Remainder", "open_graph_set"]

Remainder = Literal["padded", "buckets"]
"""How the tokens left after the largest bucket are fed: one padded chunk, or smaller buckets."""

REMAINDER_POLICIES: tuple[Remainder, ...] = ("padded", "buckets")

_SHARED_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "head_dim_padded", "kv_layout", "kv_dtype")
"""Contract fields every graph of a set must agree on (the buffers move between them); ``batch`` too, except that a
graph of batch 1 (``static_kv prefill_batch: 1``) joins graphs of B rows (:func:`~onnxdeploy.runner.host.move_slots`
broadcasts its row)."""


class GraphSetDecoder:
    """Greedy-decode driver for a graph set (module docstring): chunks, cache lengths and buffer moves.

    Args:
        members: one :class:`ContractDecoder` per graph; the decoder closes them in :meth:`close`.
        remainder: ``padded`` or ``buckets`` (module docstring).

    Attributes:
        source: the primary graph's path (the first member), for messages.

    Raises:
        ContractError: two graphs share a ``(step_len, max_cache_len)``, disagree on a field the buffers
            depend on (batch, layers, heads, head dim, layout, dtype) or on the cache input names, or no graph
            can take a single token (no step 1 graph and no padding).
    """

    def __init__(self, members: Sequence[ContractDecoder], *, remainder: Remainder = "padded"):
        if remainder not in REMAINDER_POLICIES:
            raise ContractError(f"remainder must be one of {list(REMAINDER_POLICIES)}, got {remainder!r}")
        self.source = members[0].source
        self.remainder: Remainder = remainder
        self._members = {(m.contract.step_len, m.contract.max_cache_len): m for m in members}
        if len(self._members) != len(members):
            raise ContractError(f"{self.source}: two graphs of the set have the same step_len and max_cache_len")
        first = members[0].contract
        names = [past for past, _ in first.cache_pairs()]
        for member in members[1:]:
            c = member.contract
            differ = [f for f in _SHARED_FIELDS if getattr(c, f) != getattr(first, f)]
            if c.batch != first.batch and 1 not in (c.batch, first.batch):  # prefill_batch 1: rows broadcast
                differ.append("batch")
            if differ or [past for past, _ in c.cache_pairs()] != names:
                raise ContractError(
                    f"{member.source}: its contract differs from {self.source}'s in "
                    f"{differ or ['cache input names']}; the graphs of a set share their cache buffers"
                )
        self._steps = sorted({s for s, _ in self._members})
        self._caches = sorted({c for _, c in self._members})
        if 1 not in self._steps and all(m.contract.padding is None for m in members):
            raise ContractError(f"{self.source}: the set has no step_len 1 graph and no graph that takes padding")
        self._position = 0
        self._calls: list[CallRecord] = []
        self._current: ContractDecoder = self._members[(self._steps[0], self._caches[0])]
        self.reset()

    # -- Decoder interface -------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Number of tokens fed since the last reset (the next token's absolute position)."""
        return self._position

    @property
    def call_latencies_ms(self) -> list[float]:
        """Wall time of every ``session.run`` since the last reset, in ms."""
        return [call.ms for call in self._calls]

    @property
    def call_records(self) -> list[CallRecord]:
        """Every ``session.run`` since the last reset: graph file, positions fed, padding, wall time."""
        return list(self._calls)

    @property
    def model_session(self) -> ModelSession:
        """The primary graph's session (its providers stand for the set's)."""
        return next(iter(self._members.values())).model_session

    @property
    def fallbacks(self) -> list[str]:
        """Every requested execution provider that is not active, over all graphs of the set."""
        return [line for session in self.sessions() for line in session.fallbacks]

    def sessions(self) -> list[ModelSession]:
        """Every graph's session, primary first (each opened with the same options: :func:`open_graph_set`)."""
        return [m.model_session for m in self._members.values()]

    @property
    def every_position_logits(self) -> bool:
        """Whether every graph returns the logits of every position it is fed (no ``prefill_logits: last``)."""
        return all(m.contract.prefill_logits == "all" for m in self._members.values())

    def can_take(self, step_len: int, tokens: int) -> bool:
        """Whether the ``step_len`` graphs take a call of ``tokens`` real tokens (fewer only with padding)."""
        return 0 < tokens <= step_len and (tokens == step_len or self._can_pad(step_len))

    def member(self, step_len: int, max_cache_len: int) -> ContractDecoder:
        """The decoder of the graph ``(step_len, max_cache_len)``, whose ``call`` other hosts run on their buffers.

        :meth:`ContractDecoder.call` is the step call of the host API (:mod:`onnxdeploy.runner.host`).

        Raises:
            ContractError: the set has no such graph.
        """
        member = self._members.get((step_len, max_cache_len))
        if member is None:
            raise ContractError(f"{self.source}: the set has no graph of step_len {step_len}, cache {max_cache_len}")
        return member

    def graphs(self) -> list[tuple[str, int, int]]:
        """``(file name, step_len, max_cache_len)`` of every graph, primary first."""
        return [(Path(m.source).name, s, c) for (s, c), m in self._members.items()]

    def reset(self) -> None:
        """Zero the buffers; the next feed starts at position 0 on the smallest cache length."""
        for member in self._members.values():
            member.reset()
        self._current = self._members[(self._steps[0], self._caches[0])]
        self._position = 0
        self._calls = []

    def close(self) -> None:
        """Close every graph's session. Safe to call twice."""
        for member in self._members.values():
            member.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def warm_up(self) -> None:
        """Run every graph once on zeroed buffers (first-call allocations stay out of timed calls), then reset.

        Each graph's buffers are zeroed again after its call: its presents (resident: a ``full_buffer`` call returns
        the whole cache) are dropped before the next graph runs, so one graph's cache is resident at a time, not
        every graph's (SmolLM2-135M's set of four: 2 x 23.6 MB at cache 512 and 2 x 5.9 MB at 128).
        """
        for member in self._members.values():
            member.reset()
            member.run_chunk([0] * member.contract.step_len)
            member.reset()
        self.reset()

    def plan(self, count: int, position: int | None = None) -> list[tuple[int, int, int]]:
        """The calls that would feed ``count`` tokens from ``position`` (default: the current one).

        Args:
            count: tokens to feed.
            position: the first token's position.

        Returns:
            ``(step_len, max_cache_len, real tokens)`` per call, in order.

        Raises:
            CacheOverflowError: a token would land at or beyond the largest ``max_cache_len`` (nothing runs).
        """
        pos = self._position if position is None else position
        cache = self._current.contract.max_cache_len
        calls = []
        left = count
        while left > 0:
            step, real = self._next_chunk(left, pos)
            holds = [c for c in self._caches if c >= cache and pos + step <= c and (step, c) in self._members]
            if not holds:
                raise CacheOverflowError(max(pos, self._caches[-1]), self._caches[-1])
            cache = holds[0]
            calls.append((step, cache, real))
            pos += real
            left -= real
        return calls

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray | None, float]]:
        """Feed ``tokens`` through the set (module docstring): chunks, cache lengths, buffer moves.

        The whole feed is planned first; if any token would pass the largest cache nothing runs.

        Args:
            tokens: token ids for positions ``position .. position + len(tokens) - 1``.

        Returns:
            One ``(logits float32 (V,) of batch row 0 or None, latency_ms)`` per token; logits are None where
            the graph that ran computes none (``prefill_logits: last``: all but a chunk's last real token).

        Raises:
            CacheOverflowError: the feed passes the largest ``max_cache_len`` (before any call).
            DecodeRunError: ONNX Runtime failed, or the decoder is closed.
        """
        results: list[tuple[np.ndarray | None, float]] = []
        start = 0
        for step, cache, real in self.plan(len(tokens)):
            results += self._run_on(self._members[(step, cache)], tokens[start : start + real])
            start += real
        return results

    def feed_through(
        self, tokens: Sequence[int], step_len: int, max_cache_len: int
    ) -> list[tuple[np.ndarray | None, float]]:
        """Feed 1..``step_len`` tokens in one call of the graph ``(step_len, max_cache_len)``, whatever the plan says.

        Verification drives so a graph the plan did not use for the prompt and steps. The buffers move to that
        graph as in :meth:`feed` (slots ``[0, position)`` kept), to a smaller cache length too when the call fits it.

        Args:
            tokens: token ids for positions ``position .. position + len(tokens) - 1``.
            step_len: the graph's tokens per call.
            max_cache_len: the graph's cache slots.

        Returns:
            As :meth:`feed`.

        Raises:
            ContractError: the set has no such graph, or it cannot take that many tokens (padding).
            CacheOverflowError: the call's slots pass the graph's ``max_cache_len``.
            DecodeRunError: ONNX Runtime failed, or the decoder is closed.
        """
        member = self._members.get((step_len, max_cache_len))
        if member is None:
            raise ContractError(f"{self.source}: the set has no graph of step_len {step_len}, cache {max_cache_len}")
        return self._run_on(member, tokens)

    def _run_on(self, member: ContractDecoder, tokens: Sequence[int]) -> list[tuple[np.ndarray | None, float]]:
        """One call of ``member`` on ``tokens`` at the current position, its buffers taken over first."""
        if member is not self._current:
            member.load_cache(self._current.cache_buffers(), self._position)
            self._current = member
        results = member.run_chunk(tokens)
        self._calls.append(member.call_records[-1])
        self._position += len(tokens)
        return results

    # -- planning ----------------------------------------------------------------------------------

    def _next_chunk(self, left: int, position: int) -> tuple[int, int]:
        """``(step_len, real tokens)`` of the next call feeding ``left`` tokens from ``position``."""
        largest = self._caches[-1]
        fitting = [s for s in self._steps if position + s <= largest]
        if position + min(left, 1) > largest or not fitting:
            raise CacheOverflowError(max(position, largest), largest)
        whole = [s for s in fitting if s <= left]
        padded = [s for s in fitting if s >= left and self._can_pad(s)]
        if whole and (self.remainder == "buckets" or whole[-1] == fitting[-1] or not padded):
            return whole[-1], whole[-1]
        if padded:
            return padded[0], min(left, padded[0])
        raise CacheOverflowError(max(position, largest), largest)

    def _can_pad(self, step: int) -> bool:
        """Whether the ``step`` graphs take a short chunk (step 1 never needs to)."""
        members = [m for (s, _), m in self._members.items() if s == step]
        return step == 1 or all(m.contract.padding is not None for m in members)


def open_graph_set(
    path: str | Path,
    contract: DecodeContract | None = None,
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    remainder: Remainder = "padded",
    opened: ModelSession | None = None,
    bind_buffers: bool = False,
    config_entries: Mapping[str, str] | None = None,
    threads: int | None = None,
    opener: Callable[[Path], ModelSession] | None = None,
) -> GraphSetDecoder:
    """Open every graph of the set ``path``'s contract lists (files beside ``path``) and drive them together.

    Every graph opens with the same session options: the same providers, config entries and threads, and (float
    weights on CPU) the set's weights file mapped once for all of them (``open_session(share_weights=True)``); or, with
    ``opener``, on another runtime (``verify.runtimes``: :mod:`onnxdeploy.runner.runtimes` opens each graph on
    OpenVINO or the RKNN simulator and drives the set exactly as on ONNX Runtime).

    Args:
        path: one graph of the set (usually the primary ``model.onnx``).
        contract: its contract, if already read.
        providers: ORT execution providers in priority order, for every graph.
        remainder: ``padded`` or ``buckets`` (module docstring).
        opened: ``path``'s session when the caller already opened it (the decoder owns it from here).
        bind_buffers: every graph binds past and present to one buffer (ORT IOBinding; see :class:`ContractDecoder`).
        config_entries: ORT session config entries for every graph (e.g. ``verify.accuracy``'s weight-only and
            default settings); None: ``opened``'s (none without it).
        threads: intra-op threads of every graph; None: ``opened``'s (1 without it).
        opener: opens one graph file as a :class:`ModelSession` of another runtime (then ``providers``,
            ``config_entries`` and ``threads`` are not used); None: ONNX Runtime's :func:`open_session`.

    Returns:
        The decoder, reset to position 0; close it (or use it as a context manager).

    Raises:
        ModelLoadError: a graph cannot be loaded (names its path).
        ContractError: no graph set in the contract, ``path`` not in its own set, a sibling whose contract
            disagrees with its ``graph_set`` entry, or graphs that cannot share buffers.
    """
    path = Path(path)
    if contract is None:
        from onnxdeploy.runner.session import read_header  # noqa: PLC0415

        contract = read_contract(read_header(path), source=str(path))
    if contract is None or not contract.graph_set:
        raise ContractError(f"{path}: its contract lists no graph set")
    entries = contract.graph_set
    if len(entries) == 1:  # a graph made alone: whatever its file is called now
        entries = [entries[0].model_copy(update={"file": path.name})]
    if path.name not in {e.file for e in entries}:
        raise ContractError(f"{path}: not among the files of its own graph_set {[e.file for e in entries]}")
    if config_entries is None:
        config_entries = opened.config_entries if opened is not None else {}
    if threads is None:
        threads = opened.threads if opened is not None else 1
    members: list[ContractDecoder] = []

    def open_file(file: Path) -> ModelSession:
        if opener is not None:
            return opener(file)
        return open_session(  # one map of the set's weights file for all graphs (and parts)
            file, providers=providers, config_entries=config_entries, threads=threads, share_weights=True
        )

    try:
        for entry in entries:
            if opened is not None and entry.file == path.name:
                model_session, opened = opened, None  # owned by its member from here
            else:
                model_session = open_file(path.with_name(entry.file))
            members.append(_member(model_session, entry, path.name, bind_buffers, open_file))
        return GraphSetDecoder(members, remainder=remainder)
    except BaseException:
        for member in members:
            member.close()
        if opened is not None:
            opened.close()
        raise


def _member(
    model_session: ModelSession,
    entry: GraphSetEntry,
    primary: str,
    bind_buffers: bool,
    open_file: Callable[[Path], ModelSession],
) -> ContractDecoder:
    """The decoder of one graph of the set, once its own contract agrees with its ``graph_set`` entry.

    A split graph (its contract names a ``part``) is the chain of its parts
    (:class:`~onnxdeploy.runner.parts.PartChain`, the other parts opened by ``open_file``), driven as one member.

    Raises:
        ContractError: the graph carries no contract, or its lengths disagree with ``entry`` (the session is
            closed again).
    """
    sibling = model_session.path
    try:
        own = read_contract(model_session.model, source=sibling)
        if own is None:
            raise ContractError(f"{sibling}: listed in {primary}'s graph_set but carries no contract")
        said = (entry.step_len, entry.max_cache_len, entry.prefill_logits)
        if (own.step_len, own.max_cache_len, own.prefill_logits) != said:
            raise ContractError(
                f"{sibling}: its contract says step_len {own.step_len}, max_cache_len {own.max_cache_len}, "
                f"prefill_logits {own.prefill_logits}; {primary}'s graph_set says {said}"
            )
        if own.part is not None:
            if bind_buffers:
                raise ContractError(f"{sibling}: a split graph's parts are not driven on bound buffers")
            return open_part_chain(model_session, own, open_file)  # type: ignore[return-value]
        return ContractDecoder(model_session, own, bind_buffers=bind_buffers)
    except BaseException:
        model_session.close()
        raise
