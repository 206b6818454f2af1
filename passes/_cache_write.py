"""Write a call's K/V into a fixed cache buffer at ``cache_position``: the four ``cache_write`` methods, any layout.

:func:`build_cache_write` returns the nodes of one write (``scatter_elements``, ``scatter_nd``, or the select
``where`` / ``host`` for NPU compilers without a Scatter lowering); every method gives the same buffer, bit for
bit. ``static_kv`` (:func:`onnxdeploy.passes._cache_edits.rewrite_cache_writes`) and ``kv_layout`` (BSH2D,
BHDS_K buffers) insert them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import CacheWrite
from onnxdeploy.passes._edit import add_initializer, make_node

__all__ = ["build_cache_write"]

_PREFIX = "onnxdeploy/static_kv/write"


def _int64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@dataclass
class _Write:
    """One cache write: what it writes where, and its nodes in topological order (constants registered once).

    Attributes:
        graph: the graph the constants are registered on.
        prefix: the new nodes' and values' names start with it.
        buffer: the cache buffer, ``max_cache_len`` slots on ``seq_axis``.
        update: the call's K/V, ``update_shape``.
        cache_position: int64 ``[S]``.
        seq_axis: the slot axis.
        update_shape: static shape of ``update``.
        max_cache_len: L.
        dtype: the buffer's element type.
        nodes: the nodes built so far.
    """

    graph: ir.Graph
    prefix: str
    buffer: ir.Value
    update: ir.Value
    cache_position: ir.Value
    seq_axis: int
    update_shape: tuple[int, ...]
    max_cache_len: int
    dtype: ir.DataType
    nodes: list[ir.Node] = field(default_factory=list)

    @property
    def rows(self) -> int | None:
        """B when ``cache_position`` is ``(B, S)`` (``row_positions``: each row its own slots), else None."""
        shape = self.cache_position.shape
        return int(shape[0]) if shape is not None and len(shape) == 2 else None  # type: ignore[arg-type]

    def position_shape(self) -> list[int]:
        """``cache_position``'s shape broadcast to the update's rank: S on ``seq_axis``, B on axis 0 with rows."""
        dims = [1] * len(self.update_shape)
        dims[self.seq_axis] = self.update_shape[self.seq_axis]
        if self.rows is not None:
            dims[0] = self.rows
        return dims

    def const(self, name: str, values: np.ndarray) -> ir.Value:
        """The initializer ``onnxdeploy/static_kv/write/{name}`` (shared by every write of the graph)."""
        return add_initializer(self.graph, f"{_PREFIX}/{name}", np.ascontiguousarray(values), reuse=True)

    def shape(self, dims: Sequence[int]) -> ir.Value:
        """The int64 shape constant ``dims``, named by them (``shape_1x1x2x1``)."""
        return self.const(f"shape_{'x'.join(map(str, dims))}", _int64(dims))

    def add(self, op: str, inputs: list[ir.Value], out: str, dtype: ir.DataType, **attributes: object) -> ir.Value:
        """Append ``op`` whose output is ``{prefix}/{out}`` of ``dtype``; return that output."""
        name = f"{self.prefix}/{out}"
        node = make_node(op, inputs, name=f"{name}/{op}", output=name, dtype=dtype, **attributes)
        self.nodes.append(node)
        return node.outputs[0]


def build_cache_write(
    graph: ir.Graph,
    buffer: ir.Value,
    update: ir.Value,
    cache_position: ir.Value,
    *,
    method: CacheWrite,
    seq_axis: int,
    update_shape: tuple[int, ...],
    max_cache_len: int,
    prefix: str,
) -> tuple[list[ir.Node], ir.Value]:
    """Nodes that write ``update`` into ``buffer`` at the slots ``cache_position`` names, on ``seq_axis``.

    ``buffer`` has ``max_cache_len`` slots on ``seq_axis`` (any layout: BHSD ``(B, H_kv, L, D)``, BSH2D
    ``(B, L, H_kv, 2·D)``, K of BHDS_K ``(B, H_kv, D, L)``); ``update`` has ``update_shape``, the same with ``S``
    on ``seq_axis``; ``cache_position`` is int64 ``[S]``, distinct slots, or ``(B, S)`` (``row_positions``: row
    ``b`` writes its own slots, the batch on axis 0). Every method gives the same buffer, bit for bit (each only
    moves elements):

    * ``scatter_elements``: ``ScatterElements(buffer, idx, update, axis=seq_axis)``, ``idx`` = ``cache_position``
      expanded to ``update_shape`` (opset ≥ 11).
    * ``scatter_nd``: ``ScatterND(buffer, idx, update)``, ``idx`` ``(*update_shape[:seq_axis + 1], seq_axis + 1)``:
      a constant index grid of the leading axes and ``cache_position`` last (opset ≥ 11).
    * ``where`` (and ``host``, the write attention reads inside a ``new_token_only`` graph): a select with ops NPU
      compilers lower where they lack a Scatter (RK3588). ``S = 1``: ``Where(Equal(slots, cache_position),
      update, buffer)``, ``slots`` the constant int64 slot index ``0..L-1`` along ``seq_axis``, ``update``
      broadcast over the slots. ``S > 1``: ``src = ArgMax(Equal(slots, cache_position))`` (which of the S rows
      lands in each slot), ``hit = Equal(Gather(cache_position, src), slots)``, ``Where(hit, Gather(update, src,
      axis=seq_axis), buffer)``.

    Args:
        graph: the graph (constants are registered on it, by name, once).
        buffer: the cache buffer, in the compute dtype.
        update: the call's K/V in the buffer's layout, ``update_shape``.
        cache_position: int64 ``[S]``.
        method: a :data:`~onnxdeploy.contract.CacheWrite`.
        seq_axis: the slot axis of ``buffer`` and ``update`` (non-negative).
        update_shape: static shape of ``update``.
        max_cache_len: L, slots of ``buffer``.
        prefix: names of the new nodes and values start with it (unique per write).

    Returns:
        ``(nodes in topological order, the updated buffer)``; the caller inserts the nodes.

    Raises:
        ValueError: an unknown ``method``.
    """
    build = _WRITES.get(method)
    if build is None:
        raise ValueError(f"unknown cache_write {method!r}; known: scatter_elements, scatter_nd, where, host")
    dtype = update.dtype or buffer.dtype or ir.DataType.FLOAT
    w = _Write(graph, prefix, buffer, update, cache_position, seq_axis, tuple(update_shape), max_cache_len, dtype)
    out = build(w)
    out.shape = buffer.shape
    return w.nodes, out


_WriteBuilder = Callable[[_Write], ir.Value]


def _scatter_elements_write(w: _Write) -> ir.Value:
    """``ScatterElements(buffer, Expand(Reshape(cache_position), update_shape), update, axis=seq_axis)``."""
    pos = w.add("Reshape", [w.cache_position, w.shape(w.position_shape())], "positions", ir.DataType.INT64)
    idx = w.add("Expand", [pos, w.shape(w.update_shape)], "indices", ir.DataType.INT64)
    return w.add("ScatterElements", [w.buffer, idx, w.update], "updated", w.dtype, axis=w.seq_axis)


def _scatter_nd_write(w: _Write) -> ir.Value:
    """``ScatterND(buffer, idx, update)``: ``idx`` the constant grid of the leading axes, ``cache_position`` last."""
    i64 = ir.DataType.INT64
    lead = list(w.update_shape[: w.seq_axis + 1])
    pos_shape = [*w.position_shape()[: w.seq_axis + 1], 1]
    pos = w.add("Reshape", [w.cache_position, w.shape(pos_shape)], "positions", i64)
    pos = w.add("Expand", [pos, w.shape([*lead, 1])], "slot_index", i64)
    if w.seq_axis:
        grid = np.stack(np.indices(lead, dtype=np.int64)[: w.seq_axis], axis=-1)
        pos = w.add("Concat", [w.const(f"grid_{'x'.join(map(str, lead))}", grid), pos], "indices", i64, axis=-1)
    return w.add("ScatterND", [w.buffer, pos, w.update], "updated", w.dtype)


def _select_write(w: _Write) -> ir.Value:
    """``Where`` over the slots: the one written slot (S = 1), or the row each slot takes (S > 1)."""
    rank = len(w.update_shape)
    slot_shape = [1] * rank
    slot_shape[w.seq_axis] = w.max_cache_len
    slot_key = "x".join(map(str, slot_shape))
    if w.update_shape[w.seq_axis] == 1:
        slots = w.const(f"slots_{slot_key}", np.arange(w.max_cache_len, dtype=np.int64).reshape(slot_shape))
        pos = w.add("Reshape", [w.cache_position, w.shape(w.position_shape())], "position", ir.DataType.INT64)
        hit = w.add("Equal", [slots, pos], "slot_hit", ir.DataType.BOOL)
        return w.add("Where", [hit, w.update, w.buffer], "updated", w.dtype)
    if w.rows is not None:
        return _select_write_rows(w, slot_shape)
    hit, src = _rows_per_slot(w)
    hit = w.add("Reshape", [hit, w.shape(slot_shape)], "slot_hit", ir.DataType.BOOL)
    rows = w.add("Gather", [w.update, src], "rows", w.dtype, axis=w.seq_axis)
    return w.add("Where", [hit, rows, w.buffer], "updated", w.dtype)


def _select_write_rows(w: _Write, slot_shape: list[int]) -> ir.Value:
    """The S > 1 select with ``cache_position`` ``(B, S)``: per row, which of its S tokens lands in each slot.

    ``src (B, L) = ArgMax(Equal(slots, positions))``, ``hit (B, L) = Equal(GatherElements(positions, src), slots)``;
    the rows are ``GatherElements(update, src expanded on the other axes, axis=seq_axis)``.
    """
    i64, B, L = ir.DataType.INT64, w.rows, w.max_cache_len
    step = w.update_shape[w.seq_axis]
    column = w.const(f"slots_1x{L}x1", np.arange(L, dtype=np.int64).reshape(1, L, 1))
    row = w.add("Reshape", [w.cache_position, w.shape([B, 1, step])], "positions", i64)
    onehot = w.add("Equal", [column, row], "slot_of_row", ir.DataType.BOOL)  # (B, L, S)
    scores = w.add("Cast", [onehot], "slot_of_row_float", ir.DataType.FLOAT, to=ir.DataType.FLOAT)
    src = w.add("ArgMax", [scores], "source_row", i64, axis=2, keepdims=0)  # (B, L)
    written = w.add("GatherElements", [w.cache_position, src], "source_position", i64, axis=1)
    flat = w.const(f"slots_1x{L}", np.arange(L, dtype=np.int64).reshape(1, L))
    hit = w.add("Equal", [written, flat], "slot_hit_rows", ir.DataType.BOOL)  # (B, L)
    per_row = [B if i == 0 else d for i, d in enumerate(slot_shape)]
    hit = w.add("Reshape", [hit, w.shape(per_row)], "slot_hit", ir.DataType.BOOL)
    index = w.add("Reshape", [src, w.shape(per_row)], "source_index", i64)
    full = [L if i == w.seq_axis else d for i, d in enumerate(w.update_shape)]
    index = w.add("Expand", [index, w.shape(full)], "source_indices", i64)
    rows = w.add("GatherElements", [w.update, index], "rows", w.dtype, axis=w.seq_axis)
    return w.add("Where", [hit, rows, w.buffer], "updated", w.dtype)


def _rows_per_slot(w: _Write) -> tuple[ir.Value, ir.Value]:
    """``(hit (L,) bool, src (L,) int64)``: slot ``l`` takes row ``src[l]`` of the S rows when ``hit[l]``."""
    i64 = ir.DataType.INT64
    cache_position, step, max_cache_len = w.cache_position, w.update_shape[w.seq_axis], w.max_cache_len
    column = w.const(f"slots_{max_cache_len}x1", np.arange(max_cache_len, dtype=np.int64).reshape(-1, 1))
    row = w.add("Reshape", [cache_position, w.shape([1, step])], "positions", i64)
    onehot = w.add("Equal", [column, row], "slot_of_row", ir.DataType.BOOL)
    scores = w.add("Cast", [onehot], "slot_of_row_float", ir.DataType.FLOAT, to=ir.DataType.FLOAT)
    src = w.add("ArgMax", [scores], "source_row", i64, axis=1, keepdims=0)
    written = w.add("Gather", [cache_position, src], "source_position", i64, axis=0)
    flat = w.const(f"slots_{max_cache_len}", np.arange(max_cache_len, dtype=np.int64))
    return w.add("Equal", [written, flat], "slot_hit_flat", ir.DataType.BOOL), src


_WRITES: dict[str, _WriteBuilder] = {
    "scatter_elements": _scatter_elements_write,
    "scatter_nd": _scatter_nd_write,
    "where": _select_write,
    "host": _select_write,
}
"""How each :data:`~onnxdeploy.contract.CacheWrite` method builds its nodes (:func:`build_cache_write`)."""
