"""The host API every driver of a static graph shares: buffers per row, slot copies, one step call.

A static decode graph (a :class:`~onnxdeploy.contract.DecodeContract`) is driven by a *host*: it owns the cache
buffers, says per call which tokens each batch row feeds at which positions, and moves cache contents between
graphs. Three hosts use this module: :class:`~onnxdeploy.runner.graph_set.GraphSetDecoder` (one sequence, every
row fed the same tokens, buffers moved between cache lengths), the continuous-batching host
(:mod:`onnxdeploy.runner.batching`: one sequence per row, rows refilled from batch-1 prefill buffers), and the
ring-cache hosts of issue 18.

What the module gives (each a function of the contract, nothing cached):

* :class:`StepInputs` — one call's tokens ``(B, S)``, positions ``(B, S)`` (RoPE), cache slots ``(B, S)`` (where
  each row's K/V is written; the positions unless a host maps them, e.g. a ring) and real tokens per row ``(B,)``.
  :meth:`StepInputs.uniform` is every row fed one chunk (verification); :meth:`StepInputs.rows` one chunk per row.
* :func:`step_feeds` — the graph's non-cache inputs for a call: ``input_ids``, ``cache_position`` (``(S,)``,
  row 0's slots, or ``(B, S)`` with ``row_positions``), ``position_ids``, ``attention_mask`` (1 for slots <= the
  row's last real position) and ``last_token_index``.
* :func:`allocate_buffers` — zeroed buffers of a contract's shapes (``cache_init: zeros``: zeroed once, at
  allocation; a host never needs to clear them again, because every slot above a row's position is masked).
* :func:`move_slots` — slots ``[0, count)`` of every row into zeroed buffers of another cache length (the
  graph-set switch), and :func:`copy_row_slots` — slots ``[0, count)`` of one row into one row of other buffers
  (a batch-1 prefill's cache into a free row of the B-row decode buffers). Both copy on each tensor's own
  sequence axis (:meth:`DecodeContract.pair_sequence_axes`), so every layout moves the same way.
* :func:`write_presents` — with ``cache_update: new_token_only``, the call's K/V written into the buffers at each
  row's slots (``full_buffer`` graphs return the updated buffers themselves).
* :class:`GraphStep` — what a host calls: ``step.call(buffers, inputs)`` runs one ``session.run`` of that graph on
  those buffers (updated in place or replaced in the dict) and returns the logits ``(B, P, V)`` float32 and the
  wall time. :class:`~onnxdeploy.runner.contract_decoder.ContractDecoder` implements it (with or without bound
  buffers); :meth:`GraphSetDecoder.member` gives the one of each graph of a set.

How another host plugs in: open the set with :func:`~onnxdeploy.runner.graph_set.open_graph_set` (every graph on
the same session options, the weights mapped once), take ``decoder.member(step_len, max_cache_len)`` for each
graph it runs, own its buffers (``allocate_buffers(member.contract)``), and per call build a :class:`StepInputs`
and call ``member.call(buffers, inputs)``; move contents with :func:`move_slots` / :func:`copy_row_slots`. The
member's :attr:`call_records` time every call. Nothing here knows about sequences, queues or rows' lifetimes:
that is the host's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from onnxdeploy.contract import DecodeContract
from onnxdeploy.errors import CacheOverflowError, ContractError

__all__ = [
    "GraphStep",
    "StepInputs",
    "allocate_buffers",
    "copy_row_slots",
    "move_slots",
    "step_feeds",
    "store_presents",
    "write_presents",
]

Buffers = dict[str, np.ndarray]
"""Past-input name → host cache buffer (``contract.pair_input_shapes()``, ``kv_dtype``, C-contiguous)."""


@dataclass(frozen=True)
class StepInputs:
    """One call's inputs per batch row.

    Attributes:
        tokens: int64 ``(B, S)``: the token ids, a row's trailing padding included (any id; they are hidden).
        positions: int64 ``(B, S)``: the absolute position of each token (``position_ids``).
        slots: int64 ``(B, S)``: the cache slot each token's K/V is written to (``cache_position``); equal to
            ``positions`` for a linear cache.
        real: int64 ``(B,)``: real tokens of each row (1..S); the rest of the row is trailing padding.
        slot_positions: int64 ``(max_cache_len,)``: the position each slot holds (``mask: slot_positions``, a ring
            host: :mod:`onnxdeploy.runner.cache_policy`); None: slot j holds position j (a linear host).
    """

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    real: np.ndarray
    slot_positions: np.ndarray | None = None

    @classmethod
    def uniform(cls, contract: DecodeContract, chunk: Sequence[int], position: int) -> StepInputs:
        """Every row fed ``chunk`` (1..S real tokens, padded at its end) at positions ``position ..``.

        Trailing padding repeats the last real token and continues the positions (contract ``padding``).
        """
        B, S = contract.batch, contract.step_len
        real = len(chunk)
        padded = np.asarray([*chunk, *([chunk[-1]] * (S - real))], dtype=np.int64)
        slots = np.arange(position, position + S, dtype=np.int64)
        return cls(
            tokens=np.broadcast_to(padded, (B, S)).copy(),
            positions=np.broadcast_to(slots, (B, S)).copy(),
            slots=np.broadcast_to(slots, (B, S)).copy(),
            real=np.full(B, real, dtype=np.int64),
        )

    @classmethod
    def rows(cls, contract: DecodeContract, chunks: Sequence[Sequence[int]], positions: Sequence[int]) -> StepInputs:
        """Row ``b`` fed ``chunks[b]`` (1..S real tokens, padded at its end) at positions ``positions[b] ..``.

        Args:
            contract: the graph's contract (``batch`` rows, ``step_len`` S).
            chunks: one token chunk per row; an idle row is fed ``[0]`` at a position whose slot it may overwrite
                (its next position keeps its cache; :mod:`onnxdeploy.runner.batching` feeds a free row at 0).
            positions: each row's first position.

        Raises:
            ContractError: not ``batch`` rows, or a chunk of no or more than S tokens.
        """
        B, S = contract.batch, contract.step_len
        if len(chunks) != B or len(positions) != B:
            raise ContractError(
                f"a call of this graph feeds {B} rows; got {len(chunks)} chunks, {len(positions)} positions"
            )
        tokens = np.zeros((B, S), dtype=np.int64)
        real = np.zeros(B, dtype=np.int64)
        for b, chunk in enumerate(chunks):
            if not 0 < len(chunk) <= S:
                raise ContractError(f"row {b}: a call takes 1..{S} tokens, got {len(chunk)}")
            tokens[b] = [*chunk, *([chunk[-1]] * (S - len(chunk)))]
            real[b] = len(chunk)
        pos = np.asarray(positions, dtype=np.int64)[:, None] + np.arange(S, dtype=np.int64)
        return cls(tokens=tokens, positions=pos, slots=pos.copy(), real=real)


def step_feeds(contract: DecodeContract, inputs: StepInputs) -> dict[str, np.ndarray]:
    """The non-cache inputs of one call by graph input name (int64 all; shapes from the contract).

    Without ``row_positions`` the graph's ``cache_position`` is ``(S,)``: every row must then write the same slots
    (row 0's are fed). With it but ``mask: attention_mask`` (``static_kv`` without ``mask_rewrite``) the exporter's
    mask reads row 0's positions, so rows must still be at the same positions.

    Raises:
        ContractError: rows at different slots for a graph without ``row_positions`` or without ``mask:
            cache_position``.
    """
    names = {role: name for role, name in contract.inputs.model_dump().items() if name is not None}
    feeds: dict[str, np.ndarray] = {}
    if "input_ids" in names:  # a split model's later parts take a hidden state instead (runner/parts.py)
        feeds[names["input_ids"]] = np.ascontiguousarray(inputs.tokens, dtype=np.int64)
    if "cache_position" in names:
        if contract.row_positions and contract.mask == "cache_position":
            feeds[names["cache_position"]] = np.ascontiguousarray(inputs.slots, dtype=np.int64)
        else:
            if inputs.slots.shape[0] > 1 and not (inputs.slots == inputs.slots[:1]).all():
                raise ContractError(
                    "rows at different slots need a row_positions graph (cache_position (B, S)) masked from "
                    "cache_position (mask_rewrite)"
                )
            shape = contract.cache_position_shape()
            feeds[names["cache_position"]] = np.broadcast_to(inputs.slots[0], shape).copy()
    if "position_ids" in names:
        feeds[names["position_ids"]] = np.ascontiguousarray(inputs.positions, dtype=np.int64)
    if "attention_mask" in names:
        last = inputs.positions[np.arange(len(inputs.real)), inputs.real - 1]
        slots = np.arange(contract.max_cache_len, dtype=np.int64)
        feeds[names["attention_mask"]] = (slots[None, :] <= last[:, None]).astype(np.int64)
    if "slot_positions" in names:  # None: a linear host, slot j holds position j (later slots: causally hidden)
        held = inputs.slot_positions
        feeds[names["slot_positions"]] = (
            np.arange(contract.max_cache_len, dtype=np.int64) if held is None else np.ascontiguousarray(held, np.int64)
        )
    if "last_token_index" in names:
        feeds[names["last_token_index"]] = (inputs.real - 1).astype(np.int64).reshape(contract.last_token_index_shape())
    return feeds


def allocate_buffers(contract: DecodeContract) -> Buffers:
    """Zeroed cache buffers of ``contract``'s past-input shapes and ``kv_dtype`` (``cache_init: zeros``)."""
    return {
        past: np.zeros(shape, dtype=contract.kv_numpy_dtype)
        for (past, _), shape in zip(contract.cache_pairs(), contract.pair_input_shapes(), strict=True)
    }


def _slot_index(ndim: int, axis: int, count: int, row: int | None = None) -> tuple[slice | int, ...]:
    index: list[slice | int] = [slice(None)] * ndim
    index[axis] = slice(0, count)
    if row is not None:
        index[0] = slice(row, row + 1)
    return tuple(index)


def move_slots(buffers: Mapping[str, np.ndarray], contract: DecodeContract, count: int, *, source: str = "") -> Buffers:
    """``contract``'s buffers holding slots ``[0, count)`` of ``buffers`` (every row); the rest zero.

    A buffer already of ``contract``'s shape is taken as it is (no copy). Slots from ``count`` on are never read
    before they are written, so they are not carried over. Between a batch-1 graph and a B-row one (a set made with
    ``prefill_batch: 1``) the one row is broadcast to every row, or row 0 is taken: a host that feeds every row
    the same sequence (:class:`~onnxdeploy.runner.graph_set.GraphSetDecoder`) holds it in every row.

    Args:
        buffers: past-input name → buffer of a graph with the same cache names, layout and dtype (batch the same,
            or 1 on either side).
        contract: the graph the buffers move to.
        count: tokens already in the cache (the next call's first position).
        source: the graph moved to, for messages.

    Raises:
        CacheOverflowError: ``count`` is above ``contract.max_cache_len``.
        ContractError: a buffer is missing or differs on an axis other than the sequence axis.
    """
    if count > contract.max_cache_len:
        raise CacheOverflowError(count, contract.max_cache_len)
    moved: Buffers = {}
    pairs = contract.cache_pairs()
    for (past, _), shape, axis in zip(pairs, contract.pair_input_shapes(), contract.pair_sequence_axes(), strict=True):
        old = buffers.get(past)
        if old is None:
            raise ContractError(f"{source}: no buffer for '{past}' to continue from")
        if old.shape == shape:
            moved[past] = old
            continue
        rows_differ = old.shape[0] != shape[0] and 1 in (old.shape[0], shape[0])
        if [d for i, d in enumerate(old.shape) if i not in (axis, 0 if rows_differ else -1)] != [
            d for i, d in enumerate(shape) if i not in (axis, 0 if rows_differ else -1)
        ]:
            raise ContractError(
                f"{source}: cannot continue from a '{past}' buffer of shape {list(old.shape)}; this graph's is "
                f"{list(shape)}"
            )
        new = np.zeros(shape, dtype=contract.kv_numpy_dtype)
        index = _slot_index(new.ndim, axis, count)
        if rows_differ and shape[0] == 1:
            new[index] = old[_slot_index(old.ndim, axis, count, 0)]
        else:
            new[index] = old[index]  # same rows, or one row broadcast to every row
        moved[past] = new
    return moved


def copy_row_slots(
    src: Mapping[str, np.ndarray],
    src_row: int,
    dst: Mapping[str, np.ndarray],
    dst_row: int,
    count: int,
    contract: DecodeContract,
) -> None:
    """Copy slots ``[0, count)`` of row ``src_row`` of ``src`` into row ``dst_row`` of ``dst``, in place.

    The two sets of buffers may differ in batch and in cache length (a batch-1 prefill graph's into a B-row
    decode graph's); they share names, layout and dtype. Slots of ``dst_row`` from ``count`` on keep what they
    held (stale finite values are masked: every slot above the row's position is).

    Args:
        src: past-input name → buffer (any batch, >= ``count`` slots).
        src_row: the row of ``src`` to read.
        dst: past-input name → buffer, written in place.
        dst_row: the row of ``dst`` to write.
        count: slots to copy.
        contract: either graph's contract (names and sequence axes).

    Raises:
        CacheOverflowError: ``count`` passes the slots of ``src`` or ``dst``.
    """
    for (past, _), axis in zip(contract.cache_pairs(), contract.pair_sequence_axes(), strict=True):
        s, d = src[past], dst[past]
        if count > min(s.shape[axis], d.shape[axis]):
            raise CacheOverflowError(count, min(s.shape[axis], d.shape[axis]))
        d[_slot_index(d.ndim, axis, count, dst_row)] = s[_slot_index(s.ndim, axis, count, src_row)]


def write_presents(
    contract: DecodeContract, buffers: Buffers, presents: Sequence[np.ndarray], inputs: StepInputs
) -> None:
    """Write a ``new_token_only`` call's K/V (S slots per row) into ``buffers`` at each row's slots, in place.

    Args:
        contract: the graph's contract (``cache_update: new_token_only``).
        buffers: past-input name → buffer.
        presents: the present outputs, in :meth:`DecodeContract.cache_pairs` order, S slots on the sequence axis.
        inputs: the call's inputs (``slots`` per row).
    """
    pairs, axes = contract.cache_pairs(), contract.pair_sequence_axes()
    same = bool((inputs.slots == inputs.slots[:1]).all())
    for (past, _), axis, present in zip(pairs, axes, presents, strict=True):
        buffer = buffers[past]
        rows = [None] if same else range(buffer.shape[0])
        for row in rows:
            slots = inputs.slots[0 if row is None else row]
            index: list[slice | int | np.ndarray] = [slice(None)] * present.ndim
            if row is not None:
                index[0] = slice(row, row + 1)
            src = tuple(index)
            index[axis] = slots
            buffer[tuple(index)] = present[src]


def store_presents(
    contract: DecodeContract,
    buffers: Buffers,
    presents: Sequence[np.ndarray],
    inputs: StepInputs,
    *,
    written_shapes: Mapping[str, tuple[int, ...]],
    source: str,
) -> None:
    """Put one call's present outputs into ``buffers``: replace them (``full_buffer``) or write S slots per row.

    Args:
        contract: the graph's contract.
        buffers: past-input name → buffer, updated in place.
        presents: the present outputs, in :meth:`DecodeContract.cache_pairs` order.
        inputs: the call's inputs (``slots`` per row, for ``new_token_only``).
        written_shapes: past-input name → the shape its present must have (the contract's cache_update).
        source: the graph file, for the error.

    Raises:
        ContractError: a present's shape is not what ``cache_update`` implies (names the output and both shapes).
    """
    pairs = contract.cache_pairs()
    for (past, name), present in zip(pairs, presents, strict=True):
        if present.shape != written_shapes[past]:
            raise ContractError(
                f"{source}: '{name}' has shape {list(present.shape)}; cache_update "
                f"'{contract.cache_update}' implies {list(written_shapes[past])}"
            )
    if contract.cache_update == "full_buffer":
        for (past, _), present in zip(pairs, presents, strict=True):
            buffers[past] = present
    else:
        write_presents(contract, buffers, presents, inputs)


@runtime_checkable
class GraphStep(Protocol):
    """One graph of a set as a host calls it (:class:`~onnxdeploy.runner.contract_decoder.ContractDecoder`)."""

    contract: DecodeContract
    source: str

    def call(self, buffers: Buffers, inputs: StepInputs) -> tuple[np.ndarray, float]:
        """Run one ``session.run`` on ``buffers`` (updated: replaced in the dict or written in place).

        Args:
            buffers: past-input name → buffer of this graph's shapes.
            inputs: the call's inputs (``batch`` rows of ``step_len`` tokens).

        Returns:
            ``(logits float32 (B, P, V), latency_ms)``; P = ``contract.logits_positions()``.
        """
        ...
