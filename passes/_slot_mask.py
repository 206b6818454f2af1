"""The mask from the position each slot holds (``mask: slot_positions``), for caches written as a ring.

``mask_rewrite`` builds its mask from ``cache_position`` (:mod:`onnxdeploy.passes._position_mask`): slot ``j`` is
visible to the query at ``p`` iff ``j <= p`` (and ``p - j < W``), with the slot index ``j`` a constant
``arange(L)`` and ``p`` the slot written. That holds while slot = position. A host that writes position ``p`` at
another slot (``cache_policy``'s sinks + ring of recent tokens) needs the same comparisons on the position each
slot *holds*: :func:`mask_from_slot_positions` feeds the constant from a new int64 input ``slot_positions``
``(L,)`` (the host's record; :data:`~onnxdeploy.contract_cache.EMPTY_SLOT` above every position where a slot holds
none, so it is hidden) and the query positions from ``position_ids`` row 0 instead of ``cache_position``, which
keeps naming the slots the call writes. Causal, window and padding logic stay as they were.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.errors import PreconditionError
from onnxdeploy.passes._edit import add_initializer, make_node

__all__ = ["SLOT_POSITIONS", "mask_from_slot_positions"]

SLOT_POSITIONS = "slot_positions"
"""Name of the input: int64 ``(max_cache_len,)``, the position each slot holds."""


def mask_from_slot_positions(graph: ir.Graph, prefix: str, position_ids: str | None, L: int, *, who: str) -> str:
    """Rewire the mask ``mask_rewrite`` built under ``prefix`` to slot positions and query position ids, in place.

    Args:
        graph: the graph after the select mask was written (its ``{prefix}/slots`` constant and
            ``{prefix}/query_positions`` Reshape exist).
        prefix: the name prefix of the mask builder's nodes and initializers.
        position_ids: the graph's ``position_ids`` input (int64 ``(B, S)``).
        L: ``max_cache_len``.
        who: the pass name, for errors.

    Returns:
        The new input's name (:data:`SLOT_POSITIONS`).

    Raises:
        PreconditionError: no ``position_ids`` input (the true positions cannot reach the mask), or the builder's
            slot constant / query Reshape is not in the graph.
    """
    inputs = {str(v.name): v for v in graph.inputs}
    if position_ids is None or position_ids not in inputs:
        raise PreconditionError(who, "cache_policy: the graph has no 'position_ids' input to take query positions from")
    slots = graph.initializers.get(f"{prefix}/slots")
    query = next((n for n in graph if n.name == f"{prefix}/query_positions"), None)
    if slots is None or query is None:
        raise PreconditionError(who, f"cache_policy: the mask's slot index '{prefix}/slots' was not found")
    fed = ir.Value(name=SLOT_POSITIONS, shape=ir.Shape([L]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(fed)
    shape = add_initializer(graph, f"{prefix}/slot_positions_shape", np.array([1, L], dtype=np.int64))
    row = add_initializer(graph, f"{prefix}/row0", np.array(0, dtype=np.int64))
    held = make_node("Reshape", [fed, shape], name=f"{prefix}/held_positions")
    first = make_node("Gather", [inputs[position_ids], row], name=f"{prefix}/query_position_ids", axis=0)
    graph.insert_before(query, [held, first])
    slots.replace_all_uses_with(held.outputs[0])
    query.replace_input_with(0, first.outputs[0])
    return SLOT_POSITIONS
