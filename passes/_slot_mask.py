"""The mask from the position each slot holds (``mask: slot_positions``), for caches written as a ring.

``mask_rewrite`` builds its mask from ``cache_position`` (:mod:`onnxdeploy.passes._position_mask`): slot ``j`` is
visible to the query at ``p`` iff ``j <= p`` (and ``p - j < W``), with the slot index ``j`` a constant
``arange(L)`` and ``p`` the slot written. That holds while slot = position. A host that writes position ``p`` at
another slot (``cache_policy``'s sinks + ring of recent tokens) needs the same comparisons on the position each
slot *holds*: :func:`mask_from_slot_positions` feeds the constant from a new int64 input ``slot_positions``
``(L,)`` (the host's record; :data:`~onnxdeploy.contract_cache.EMPTY_SLOT` above every position where a slot holds
none, so it is hidden) and the query positions from ``position_ids`` row 0 instead of ``cache_position``, which
keeps naming the slots the call writes. Causal, window and padding logic stay as they were.

A windowed layer's ring (``window_cache``: slot = position mod ``n``) needs no host input:
:func:`mask_from_ring` computes what slot ``j`` holds once the call wrote its last position ``p_last`` =
``cache_position[S-1]``, ``p_last − ((p_last − j) mod n)``; a slot not written yet (that value negative) holds
:data:`~onnxdeploy.contract_cache.EMPTY_SLOT`, so the causal test hides it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract_cache import EMPTY_SLOT
from onnxdeploy.errors import PreconditionError
from onnxdeploy.passes._edit import add_initializer, make_node

__all__ = ["SLOT_POSITIONS", "mask_from_ring", "mask_from_slot_positions"]

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


def mask_from_ring(graph: ir.Graph, prefix: str, cache_position: ir.Value, length: int, step_len: int) -> None:
    """Rewire the mask ``mask_rewrite`` built under ``prefix`` to the positions a ring of ``length`` slots holds.

    Args:
        graph: the graph after the select mask was written (its ``{prefix}/slots`` constant ``(1, length)``).
        prefix: the name prefix of the mask builder's nodes and initializers.
        cache_position: the int64 ``[S]`` input (the call's positions; the ring slots are its ``mod length``).
        length: the ring's slots.
        step_len: S.

    Raises:
        PreconditionError: the builder's slot constant is not in the graph.
    """
    slots = graph.initializers.get(f"{prefix}/slots")
    if slots is None:
        raise PreconditionError("mask_rewrite", f"window_cache: the mask's slot index '{prefix}/slots' was not found")
    last = add_initializer(graph, f"{prefix}/ring/last", np.array([step_len - 1], dtype=np.int64))
    modulus = add_initializer(graph, f"{prefix}/ring/length", np.array(length, dtype=np.int64))
    index = add_initializer(graph, f"{prefix}/ring/index", np.arange(length, dtype=np.int64).reshape(1, length))
    nodes = [make_node("Gather", [cache_position, last], name=f"{prefix}/ring/last_position", axis=0)]
    p_last = nodes[-1].outputs[0]  # [1]
    nodes.append(make_node("Sub", [p_last, index], name=f"{prefix}/ring/age"))
    nodes.append(make_node("Mod", [nodes[-1].outputs[0], modulus], name=f"{prefix}/ring/age_mod"))
    nodes.append(make_node("Sub", [p_last, nodes[-1].outputs[0]], name=f"{prefix}/ring/held_or_negative"))
    held = nodes[-1].outputs[0]
    zero = add_initializer(graph, f"{prefix}/ring/zero", np.array(0, dtype=np.int64))
    empty = add_initializer(graph, f"{prefix}/ring/empty", np.array(EMPTY_SLOT, dtype=np.int64))
    nodes.append(make_node("Less", [held, zero], name=f"{prefix}/ring/unwritten"))
    nodes.append(make_node("Where", [nodes[-1].outputs[0], empty, held], name=f"{prefix}/ring/held_positions"))
    first = next(u.node for u in slots.uses())
    graph.insert_before(first, nodes)
    slots.replace_all_uses_with(nodes[-1].outputs[0])
