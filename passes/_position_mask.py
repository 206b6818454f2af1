"""The mask ``mask_rewrite`` writes: which cache slots each query sees, computed from ``cache_position`` alone.

Slot ``j`` is visible to the query at position ``p`` iff ``j <= p`` and, for a sliding window ``w``,
``p - j < w`` (this includes the causal triangle inside a chunk when ``step_len > 1``); with padding it is
also ANDed with ``attention_mask`` ``(B, L)``. It costs an int64 ``[1, L]`` slot index and an ``(S, L)``
compare. The scores are then masked by select with :func:`lowest_finite` of their dtype.

With ``row_positions`` (``cache_position`` int64 ``(B, S)``) each row's queries have their own positions: the
compare is ``(B, S, L)`` and the mask ``[B] + [1]*(rank-3) + [S, L]``, so no row sees another's slots or
positions.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnxdeploy.graph import numpy_dtype_of
from onnxdeploy.passes._edit import add_initializer, make_node

__all__ = ["PositionMaskBuilder", "lowest_finite"]


def lowest_finite(dtype: ir.DataType) -> np.ndarray:
    """The lowest finite value of a float dtype, as a 0-d array of that dtype.

    ``-3.4028235e38`` for float32, ``-65504`` for float16, ``-3.3895e38`` for bfloat16 (``ml_dtypes.finfo``).
    Never ``-inf``: a fully masked row of ``lowest`` gives a uniform Softmax, not NaN.

    Raises:
        ValueError: ``dtype`` is not a floating-point type.
    """
    np_dtype = numpy_dtype_of(dtype)
    if not (np.issubdtype(np_dtype, np.floating) or np_dtype == ml_dtypes.bfloat16):
        raise ValueError(f"{dtype} is not a floating-point type")
    return np.array(ml_dtypes.finfo(np_dtype).min, dtype=np_dtype)


class PositionMaskBuilder:
    """Builds the boolean masks ``(…, S, L)`` from ``cache_position``, each once per (window, rank).

    The nodes are inserted at the front of the graph (they read only graph inputs and initializers), named
    under ``prefix``.

    Args:
        graph: the graph (edited in place).
        cache_position: the int64 ``[S]`` input: the positions of the call's queries.
        attention_mask: the int64 ``(B, L)`` padding mask to AND in (1 = the slot may be attended), or None.
        B: batch.
        S: ``step_len``, queries per call.
        L: ``max_cache_len``, slots per cache buffer.
        prefix: the name prefix of every node and initializer made.
    """

    def __init__(
        self,
        graph: ir.Graph,
        cache_position: ir.Value,
        attention_mask: ir.Value | None,
        B: int,
        S: int,
        L: int,
        prefix: str,
    ):
        self.graph = graph
        self.cache_position = cache_position
        self.attention_mask = attention_mask
        self.B, self.S, self.L = B, S, L
        self.prefix = prefix
        shape = cache_position.shape
        self.rows = shape is not None and len(shape) == 2  # row_positions: (B, S)
        self._anchor = graph[0]  # new nodes go before it, in creation order (producers first)
        self._cache: dict[Any, ir.Value] = {}

    def _node(self, op: str, inputs: list[ir.Value], name: str, **attrs: Any) -> ir.Value:
        node = make_node(op, inputs, name=f"{self.prefix}/{name}", **attrs)
        self.graph.insert_before(self._anchor, node)
        return node.outputs[0]

    def _initializer(self, name: str, array: np.ndarray) -> ir.Value:
        return add_initializer(self.graph, f"{self.prefix}/{name}", array, reuse=True)

    def _query(self) -> ir.Value:
        if "q" not in self._cache:
            dims = [self.B, self.S, 1] if self.rows else [self.S, 1]
            shape = self._initializer("query_shape", np.array(dims, dtype=np.int64))
            q = self._node("Reshape", [self.cache_position, shape], "query_positions")
            q.dtype, q.shape = ir.DataType.INT64, ir.Shape(dims)
            self._cache["q"] = q
        return self._cache["q"]

    def _window(self, window: int | None) -> ir.Value:
        """The ``(S, L)`` mask of one window (None: causal only), before reshaping to a rank."""
        key = ("base", window)
        if key in self._cache:
            return self._cache[key]
        q = self._query()
        slots = self._initializer("slots", np.arange(self.L, dtype=np.int64).reshape(1, self.L))
        if ("base", None) not in self._cache:
            self._cache[("base", None)] = self._node("LessOrEqual", [slots, q], "causal")  # (S, L): j <= p
        mask = self._cache[("base", None)]
        if window is not None:
            tag = f"window{window}"
            w = self._initializer(tag, np.array(window, dtype=np.int64))
            oldest = self._node("Sub", [q, w], f"{tag}/past_edge")  # p - w
            inside = self._node("Greater", [slots, oldest], f"{tag}/inside")  # j > p - w
            mask = self._node("And", [mask, inside], f"{tag}/visible")
        self._cache[key] = mask
        return mask

    def _padding(self, rank: int) -> ir.Value:
        """``attention_mask`` as bool, shape ``[B] + [1]*(rank-3) + [L]`` broadcastable to the scores."""
        key = ("am", rank)
        if key not in self._cache:
            am_shape = self._initializer(f"padding_shape{rank}", np.array([self.B] + [1] * (rank - 2) + [self.L]))
            am_bool = self._node("Cast", [self.attention_mask], "padding_bool", to=int(ir.DataType.BOOL))  # type: ignore[list-item]
            self._cache[key] = self._node("Reshape", [am_bool, am_shape], f"padding_rank{rank}")
        return self._cache[key]

    def visible(self, window: int | None, rank: int) -> ir.Value:
        """The bool mask, shape ``[1]*(rank-2) + [S, L]`` (``[B] + [1]*(rank-3) + [S, L]`` with padding or rows).

        Args:
            window: the sliding window in slots, or None for a causal mask.
            rank: the rank of the scores it masks (>= 3 with rows: batch on axis 0).

        Raises:
            ValueError: rows and scores of rank < 3 (no batch axis to mask per row).
        """
        key = (window, rank)
        if key in self._cache:
            return self._cache[key]
        base = self._window(window)
        tag = ("causal" if window is None else f"window{window}") + f"/rank{rank}"
        if self.rows and rank < 3:
            raise ValueError(f"row_positions: scores of rank {rank} have no batch axis to mask per row")
        lead = [self.B] + [1] * (rank - 3) if self.rows else [1] * (rank - 2)
        shape = self._initializer(f"mask_shape{rank}", np.array([*lead, self.S, self.L]))
        mask = self._node("Reshape", [base, shape], f"{tag}/mask")
        if self.attention_mask is not None:
            mask = self._node("And", [mask, self._padding(rank)], f"{tag}/padded")
        mask.dtype = ir.DataType.BOOL
        self._cache[key] = mask
        return mask
