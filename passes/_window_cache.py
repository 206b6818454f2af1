"""Ring caches for windowed layers (``static_kv {window_cache: true}``): their window, their length, their slots.

A layer whose attention has a sliding window ``W`` never reads more than the last ``W`` keys, so its buffer can
be a ring of ``W + max(step_lens) − 1`` slots (the room a chunk of the largest bucket needs: its first query sees
``W`` keys ending at itself, its last one ``S − 1`` more) with position ``p`` at slot ``p mod length``. The length
is one for the whole graph set, so a host never re-slots a ring buffer when it switches graphs
(:func:`onnxdeploy.runner.host.move_slots` takes a buffer of the same shape as it is).

:func:`probe_layer_windows` reads each layer's window as ``mask_rewrite`` does (the exporter's integer
constants, confirmed by running the old mask and the candidate at every chunk start:
:func:`~onnxdeploy.passes._mask_windows.choose_windows`), on a first static build of the primary graph.
:func:`ring_slots` adds the slot a call writes (``Mod(cache_position, length)``); ``cache_position`` itself stays
the positions, so the exporter's query positions (and RoPE) are unchanged. ``mask_rewrite`` then masks each ring
slot by the position it holds (:func:`onnxdeploy.passes._slot_mask.mask_from_ring`).

Two forms. When every layer has the one window (Mistral-style exports) the whole graph is built at the ring length
(attention reads ``length`` slots; ``mask_rewrite`` masks by what each slot holds). When windowed and global layers
mix (Gemma 2/3: 5 local : 1 global) the shape arithmetic the layers share must stay at ``max_cache_len``, so a
windowed layer's ring is read through a **view** (:func:`ring_views`): ``Gather(ring, arange(L) mod length)``, whose
slot ``j`` shows ring slot ``j mod length``. Every slot inside the window shows its own position (the ring holds the
last ``length ≥ W + S − 1`` positions), the others are hidden by the layer's window mask, which stays the linear one;
the call's K/V are written into the ring at ``cache_position mod length`` by the run's ``cache_write`` (any
full-buffer method of :func:`~onnxdeploy.passes._cache_write.build_cache_write`, on ``length`` slots), and that
updated ring is both the present output and what the view reads. The cache is the ring; attention still spans
``L`` slots. ``kv_layout`` repacks such a graph as any other, each layer at its own length and slots.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import CacheWrite, DecodeContract
from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.kv_cache import KVCache
from onnxdeploy.passes._attention_decompose import decompose_attention
from onnxdeploy.passes._attention_sites import find_attention_sites, key_cache_inputs
from onnxdeploy.passes._cache_write import build_cache_write
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import add_initializer, clone, infer_shapes, make_node
from onnxdeploy.passes._mask_windows import choose_windows, window_candidates
from onnxdeploy.passes._position_mask import PositionMaskBuilder

__all__ = [
    "plan_rings",
    "probe_layer_windows",
    "refuse_oversized_window",
    "refuse_window_cache",
    "ring_length",
    "ring_slots",
    "ring_views",
]


def ring_length(window: int, step_lens: list[int]) -> int:
    """Slots of a windowed layer's ring: ``W + max(step_lens) − 1``."""
    return window + max(step_lens) - 1


def plan_rings(
    windows: list[int | None], step_lens: list[int], smallest_cache: int, *, who: str
) -> tuple[int | None, dict[int, int], str]:
    """Which form the rings take (module docstring), from each layer's window.

    Args:
        windows: per layer its window, None for a global layer (:func:`probe_layer_windows`).
        step_lens: the set's step lengths.
        smallest_cache: the smallest ``max_cache_len`` of the set.
        who: the pass named in errors.

    Returns:
        ``(uniform length or None, {layer: ring length} for the view form, a line for the report)``: every layer
        with the one window gives the uniform form, anything else the view form.

    Raises:
        PreconditionError: no layer has a window.
        ConfigError: a ring not shorter than ``smallest_cache``.
    """
    if all(w is None for w in windows):
        raise PreconditionError(
            who, f"window_cache: the layers' windows are {windows} (None: global): no layer has a sliding window"
        )
    rings = {i: ring_length(w, step_lens) for i, w in enumerate(windows) if w is not None}
    if max(rings.values()) >= smallest_cache:
        raise ConfigError(
            f"window_cache: a window + max(step_lens) - 1 = {max(rings.values())} slots is not smaller than "
            f"max_cache_len {smallest_cache}; raise max_cache_len or drop window_cache"
        )
    if None not in windows and len(set(windows)) == 1:
        length = rings[0]
        return (
            length,
            {},
            (
                f"window_cache: every layer has sliding window {windows[0]} (confirmed by running): ring buffers of "
                f"{length} slots (W + max(step_lens) - 1), slot = position mod {length}"
            ),
        )
    return (
        None,
        rings,
        (
            f"window_cache: layer windows {windows} (None: global, confirmed by running): windowed layers are rings of "
            f"{sorted(set(rings.values()))} slots read through a view of max_cache_len"
        ),
    )


def refuse_oversized_window(graph: ir.Graph, step_lens: list[int], smallest_cache: int, key: str) -> None:
    """Refuse, before any pass, a ring not smaller than the cache whatever window the graph turns out to have.

    Read off the input graph without running it (no weight read): per attention Softmax, the exporter's window
    constants (:func:`~onnxdeploy.passes._mask_windows.window_candidates`, the ones ``mask_rewrite`` and
    :func:`probe_layer_windows` try). A layer's window is one of its candidates or none (global), so the smallest
    candidate of the graph bounds every window from below: when even its ring (:func:`ring_length`) is not smaller
    than ``smallest_cache``, :func:`plan_rings` would refuse after the probe. A window above that bound, or one held
    by an attention op's attribute, is still refused by :func:`plan_rings` inside the pass.

    Args:
        graph: the input export.
        step_lens: the set's step lengths.
        smallest_cache: the smallest ``max_cache_len`` of the set.
        key: the config key naming it (``max_cache_len=8``), for the message.

    Raises:
        ConfigError: naming the Softmax node, its window and the ring's arithmetic.
    """
    found = [(min(c), str(n.name)) for n in graph if n.op_type == "Softmax" and (c := window_candidates(n.inputs[0]))]
    if not found:
        return
    window, node = min(found)
    length = ring_length(window, step_lens)
    if length >= smallest_cache:
        raise ConfigError(
            f"{key}: window_cache: the smallest sliding window in the graph is {window} (the mask Softmax '{node}' "
            f"reads), so a ring needs at least {window} + max(step_lens) {max(step_lens)} - 1 = {length} slots, not "
            f"smaller than max_cache_len {smallest_cache}; raise max_cache_len above {length} or drop window_cache"
        )


def refuse_window_cache(graph: ir.Graph, kv: KVCache, step_lens: list[int], smallest_cache: int, key: str) -> None:
    """Refuse, before any pass, a ``window_cache`` the input graph cannot give, from the graph alone (no weight read).

    * The cache is held inside an attention op (``com.microsoft::GroupQueryAttention``): the op reads its whole
      cache buffer, so no ring can be written in front of it.
    * No attention mask has a window constant: neither the mask operand of an attention Softmax nor the mask
      input of an opset-23 ``Attention`` reaches a comparison with an integer constant
      (:func:`~onnxdeploy.passes._mask_windows.window_candidates`, what the probe tries), so every layer is global
      and :func:`plan_rings` would refuse after ``static_kv`` built its probe graph (a fresh user's case).
    * A ring not smaller than the cache (:func:`refuse_oversized_window`).

    Args:
        graph: the input export.
        kv: its cache (:func:`onnxdeploy.kv_cache.find_kv_cache`).
        step_lens: the set's step lengths.
        smallest_cache: the smallest ``max_cache_len`` of the set.
        key: the config key naming the cache length (``max_cache_len=8``), for the message.

    Raises:
        ConfigError: naming ``window_cache`` and what the graph lacks (the pipeline prefixes the pass's key).
    """
    if kv.attention_op is not None:
        raise ConfigError(
            f"window_cache: true, but the cache is held inside {kv.attention_op}, which reads the whole cache "
            "buffer itself: no ring can be written in front of it; drop window_cache or use a decomposed export"
        )
    masks = [n.inputs[0] for n in graph if n.op_type == "Softmax"]
    masks += [
        n.inputs[3] for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx") and len(n.inputs) > 3
    ]
    if not any(m is not None and window_candidates(m) for m in masks):
        raise ConfigError(
            f"window_cache: true, but no attention mask of the graph ({len(masks)} read) compares positions with a "
            "window constant: no layer has a sliding window, so there is nothing to make a ring of; drop "
            "window_cache (max_cache_len slots per layer are what a global layer needs)"
        )
    refuse_oversized_window(graph, step_lens, smallest_cache, key)


def ring_slots(graph: ir.Graph, cache_position: ir.Value, length: int, step_len: int) -> ir.Value:
    """``Mod(cache_position, length)``: the ring slots a call writes, int64 ``[S]`` (nodes at the graph's front).

    The graph's own such node is reused when it has one (``kv_layout`` rewriting ``static_kv``'s writes).
    """
    name = f"onnxdeploy/window_cache/ring_slots{length}"
    existing = next((n for n in graph if n.name == name), None)
    if existing is not None:
        return existing.outputs[0]
    modulus = add_initializer(
        graph, f"onnxdeploy/window_cache/ring_length{length}", np.array(length, dtype=np.int64), reuse=True
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


def probe_layer_windows(
    model: ir.Model, contract: DecodeContract, kv: KVCache, context: PassContext, *, source: str, who: str
) -> list[int | None]:
    """Each layer's sliding window (None: global), read and confirmed by running as ``mask_rewrite`` does.

    Args:
        model: a static graph with its decode contract (probed on a structural copy).
        contract: its contract.
        kv: the cache found on ``model`` (each layer's key tensor names the Softmax it feeds).
        context: the pass context.
        source: the graph named in errors.
        who: the pass named in errors.

    Raises:
        PreconditionError: a layer whose Softmax is not among the attention sites.
    """
    copy = clone(model)
    g = copy.graph
    decompose_attention(g, who=who)
    infer_shapes(copy)
    sites = find_attention_sites(g, key_cache_inputs(contract), contract.max_cache_len, who=who)
    inputs = {str(v.name): v for v in g.inputs}
    S, L = contract.step_len, contract.max_cache_len
    builder = PositionMaskBuilder(
        g, inputs[str(contract.inputs.cache_position)], None, contract.batch, S, L, "onnxdeploy/window_probe"
    )
    windows = choose_windows(copy, sites, builder, contract, padding=False, context=context, source=source, who=who)
    by_softmax = {str(site.softmax.name): w for site, w in zip(sites, windows, strict=True)}
    found = []
    for layer in kv.layers:
        softmax = layer.key.softmax
        if softmax is None or str(softmax.name) not in by_softmax:
            raise PreconditionError(who, f"window_cache: layer {layer.layer}'s attention Softmax was not found")
        found.append(by_softmax[str(softmax.name)])
    return found


def ring_views(
    graph: ir.Graph,
    kv: KVCache,
    rings: dict[int, int],
    cache_position: ir.Value,
    *,
    L: int,
    S: int,
    B: int,
    method: CacheWrite = "scatter_elements",
) -> list[str]:
    """Make each layer of ``rings`` (layer -> ring length) a ring read through a view (module docstring), in place.

    Called on a graph ``rewrite_cache_writes`` made (``full_buffer``, any ``cache_write``): each ring layer's past
    input ``(B, H, L, D)`` becomes a ring input of the same name ``(B, H, n, D)``; the call's K/V ``(B, H, S, D)``
    are written into it at ``Mod(cache_position, n)`` by ``method``
    (:func:`~onnxdeploy.passes._cache_write.build_cache_write` on ``n`` slots), and that updated ring is both the
    present output ``(B, H, n, D)`` and, read as ``Gather(ring, arange(L) mod n, axis=2)`` ``(B, H, L, D)``, what
    attention reads (slot ``j`` shows position ``j`` for every ``j`` the layer's window and causal mask let through:
    the ring holds the last ``n ≥ W + S − 1`` positions). Other readers of the past (the exporter's shape
    arithmetic, folded away later) read the same view of the ring input. The linear write is left dead.

    Returns:
        One line per rewritten tensor.

    Raises:
        PreconditionError: a present output not written by ScatterElements / ScatterND / Where
            (``cache_update: new_token_only``, which ``window_cache`` refuses).
    """
    changes = []
    outputs = list(graph.outputs)
    for layer in kv.layers:
        n = rings.get(layer.layer)
        if n is None:
            continue
        for t in (layer.key, layer.value):
            past = next(v for v in graph.inputs if v.name == t.past_name)
            present_index = next(i for i, v in enumerate(outputs) if v.name == t.present_name)
            present = outputs[present_index]
            write = present.producer()
            if write is None or write.op_type not in ("ScatterElements", "ScatterND", "Where") or t.new_operand is None:
                raise PreconditionError(
                    "static_kv", f"window_cache: {t.present_name!r} is not the updated buffer (needs full_buffer)"
                )
            shape = list(past.shape)  # type: ignore[arg-type]
            ring = ir.Value(name=str(past.name), shape=ir.Shape([*shape[:2], n, *shape[3:]]), type=past.type)
            past.name = f"{t.past_name}/linear_view"
            tag = f"onnxdeploy/window_cache/{t.past_name}"
            index = add_initializer(graph, f"{tag}/view_index", np.arange(L, dtype=np.int64) % n)
            past_view = make_node("Gather", [ring, index], name=f"{tag}/past_view", axis=2)
            graph.insert_before(graph[0], past_view)
            past.replace_all_uses_with(past_view.outputs[0])
            graph.inputs[graph.inputs.index(past)] = ring
            slots = ring_slots(graph, cache_position, n, S)  # one per length (reused by name: lengths differ)
            nodes, written = build_cache_write(
                graph,
                ring,
                t.new_operand,
                slots,
                method=method,
                seq_axis=2,
                update_shape=(B, int(shape[1]), S, int(shape[3])),  # type: ignore[arg-type]
                max_cache_len=n,
                prefix=f"{tag}/ring_write",
            )
            view = make_node("Gather", [written, index], name=f"{tag}/view", axis=2)
            graph.insert_after(write, [*nodes, view])
            present.name = f"{t.present_name}/linear"
            written.name = str(t.present_name)
            written.type, written.shape = ring.type, ring.shape
            graph.outputs[present_index] = written
            write.outputs[0].replace_all_uses_with(view.outputs[0])
            changes.append(
                f"'{t.past_name}': ring of {n} slots written by {method} at {cache_position.name} mod {n}, read "
                f"through a view of {L} (window layer {layer.layer})"
            )
    return changes
