"""Ring caches for windowed layers (``static_kv {window_cache: true}``): their window, their length, their slots.

A layer whose attention has a sliding window ``W`` never reads more than the last ``W`` keys, so its buffer can
be a ring of ``W + max(step_lens) − 1`` slots (the room a chunk of the largest bucket needs: its first query sees
``W`` keys ending at itself, its last one ``S − 1`` more) with position ``p`` at slot ``p mod length``. The length
is one for the whole graph set, so a host never re-slots a ring buffer when it switches graphs
(:func:`onnxdeploy.runner.host.move_slots` takes a buffer of the same shape as it is).

:func:`probe_windows` reads each attention site's window as ``mask_rewrite`` does (the exporter's integer
constants, confirmed by running the old mask and the candidate at every chunk start:
:func:`~onnxdeploy.passes._mask_windows.choose_windows`), on a first static build of the primary graph.
:func:`ring_slots` adds the slot a call writes (``Mod(cache_position, length)``); ``cache_position`` itself stays
the positions, so the exporter's query positions (and RoPE) are unchanged. ``mask_rewrite`` then masks each ring
slot by the position it holds (:func:`onnxdeploy.passes._slot_mask.mask_from_ring`).

Today every layer must have the same window (Mistral-style exports); a model mixing windowed and global layers is
refused naming the layers' windows.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import DecodeContract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.passes._attention_decompose import decompose_attention
from onnxdeploy.passes._attention_sites import find_attention_sites, key_cache_inputs
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import add_initializer, clone, infer_shapes, make_node
from onnxdeploy.passes._mask_windows import choose_windows
from onnxdeploy.passes._position_mask import PositionMaskBuilder

__all__ = ["probe_windows", "ring_length", "ring_slots"]


def ring_length(window: int, step_lens: list[int]) -> int:
    """Slots of a windowed layer's ring: ``W + max(step_lens) − 1``."""
    return window + max(step_lens) - 1


def probe_windows(model: ir.Model, contract: DecodeContract, context: PassContext, *, source: str, who: str) -> int:
    """The one sliding window every attention site of a static graph applies (module docstring).

    Args:
        model: a static graph with its decode contract (not edited: probed on a structural copy).
        contract: its contract.
        context: the pass context (the probe's ORT session).
        source: the graph named in errors.
        who: the pass named in errors.

    Returns:
        W, in positions.

    Raises:
        PreconditionError: a site without a window, or sites with different windows (names them).
    """
    copy = clone(model)
    g = copy.graph
    decompose_attention(g, who=who)
    infer_shapes(copy)
    sites = find_attention_sites(g, key_cache_inputs(contract), contract.max_cache_len, who=who)
    inputs = {str(v.name): v for v in g.inputs}
    cache_position = inputs[str(contract.inputs.cache_position)]
    attention_mask = inputs.get(str(contract.inputs.attention_mask))
    S, L = contract.step_len, contract.max_cache_len
    builder = PositionMaskBuilder(g, cache_position, None, contract.batch, S, L, "onnxdeploy/window_probe")
    windows = choose_windows(copy, sites, builder, contract, padding=False, context=context, source=source, who=who)
    del attention_mask
    if None in windows or len(set(windows)) != 1:
        raise PreconditionError(
            who,
            f"window_cache: the attention sites' windows are {windows} (None: global); ring caches need every layer "
            "windowed with one window (a mix of local and global layers is not supported yet)",
        )
    return int(windows[0])  # type: ignore[arg-type]


def ring_slots(graph: ir.Graph, cache_position: ir.Value, length: int, step_len: int) -> ir.Value:
    """``Mod(cache_position, length)``: the ring slots a call writes, int64 ``[S]`` (nodes at the graph's front).

    The graph's own such node is reused when it has one (``kv_layout`` rewriting ``static_kv``'s writes).
    """
    name = "onnxdeploy/window_cache/ring_slots"
    existing = next((n for n in graph if n.name == name), None)
    if existing is not None:
        return existing.outputs[0]
    modulus = add_initializer(
        graph, "onnxdeploy/window_cache/ring_length", np.array(length, dtype=np.int64), reuse=True
    )
    node = make_node(
        "Mod",
        [cache_position, modulus],
        name=name,
        dtype=ir.DataType.INT64,
        shape=[step_len],
    )
    graph.insert_before(graph[0], node)
    return node.outputs[0]
