"""A cache held inside ``com.microsoft::GroupQueryAttention`` made static at the op (onnxruntime-genai exports).

The genai builder feeds each layer's past K and V ``(B, H_kv, past, D)`` straight into GroupQueryAttention
(inputs 3 and 4) with ``seqlens_k = ReduceSum(attention_mask) - 1`` (int32 ``(B,)``) and
``total_sequence_length = Shape(attention_mask)[1]`` (int32 scalar); the op appends the step's K/V inside and
returns present K and V. There is no Concat to turn into a Scatter, and none is needed: the op already takes a
fixed-length past buffer (genai's ``past_present_share_buffer``). With a buffer of ``L`` slots ORT's CPU kernel
(1.32, ``group_query_attention_helper.h`` / ``gqa_attention_base.h``):

* outputs present K/V of ``max(L, total_sequence_length) = L`` slots: the buffer with the step written at
  ``seqlens_k + 1 - S .. seqlens_k``; when past and present are bound to one buffer it writes there in place,
  else it copies the used slots into a new buffer (slots past ``total_sequence_length`` are then
  uninitialised memory);
* attends, for batch row ``b``, to slots ``0 .. seqlens_k[b]`` only, causally inside the chunk, and derives
  the RoPE positions (``do_rotary``) from ``seqlens_k``, so no slot past the current position is ever read
  (NaN there cannot leak).

So :func:`rewrite_gqa_cache` only replaces the two length inputs: from ``cache_position`` (int64 ``[S]``, the
slots this call writes), ``seqlens_k = cache_position[S-1]`` broadcast to ``(B,)`` and
``total_sequence_length = cache_position[S-1] + 1``, both int32. ``attention_mask`` is then unread and removed.
What the cache cannot do while inside the op is refused here or by the later pass that needs it:
``new_token_only`` (the op outputs the whole buffer), ``kv_dtype`` other than the compute dtype
(:func:`~onnxdeploy.passes._cache_edits.cast_cache_boundary`), other layouts than BNSH (the op reads
``(B, H_kv, L, D)`` only), a step of S > 1 tokens at batch > 1 (ORT's CPU kernel refuses it after a past),
and cache lengths beyond the op's cos/sin cache rows.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import node_label
from onnxdeploy.kv_cache import GQA_OP, KVCache
from onnxdeploy.passes._edit import add_initializer, make_node, remove_dead_nodes

__all__ = ["rewrite_gqa_cache"]

_PREFIX = "onnxdeploy/static_kv/gqa"
_SEQLENS_K, _TOTAL_SEQUENCE_LENGTH, _COS_CACHE = 5, 6, 7


def _check(kv: KVCache, *, batch: int, step_len: int, max_cache_len: int, cache_update: str, who: str) -> None:
    """Refuse what the cache cannot do while GroupQueryAttention holds it (module docstring)."""
    first = kv.attention_nodes[0]
    if cache_update != "full_buffer":
        raise PreconditionError(
            who,
            f"cache_update {cache_update}: {node_label(first)} holds the cache and outputs the whole buffer (present = "
            "past buffer with the step written in), never the step's K/V alone; use cache_update: full_buffer (bind "
            "past and present to one buffer and the op writes in place)",
        )
    if step_len > 1 and batch > 1:
        raise PreconditionError(
            who,
            f"step_len {step_len} at batch {batch}: ONNX Runtime's CPU kernel of {node_label(first)} refuses a chunk "
            "of S > 1 tokens after a past at batch > 1 ('batch_size must be 1 when sequence_length > 1 and past "
            "context is given'); use batch 1 for prefill graphs",
        )
    for node in kv.attention_nodes:
        if node.attributes.get_int("do_rotary", 0) and len(node.inputs) > _COS_CACHE:
            cos = node.inputs[_COS_CACHE]
            shape = cos.shape if cos is not None else None
            rows = shape[0] if shape is not None and len(shape) == 2 else None
            if isinstance(rows, int) and max_cache_len > rows:
                raise PreconditionError(
                    who,
                    f"max_cache_len {max_cache_len}: {node_label(node)} reads RoPE from cos_cache '{cos.name}' "  # type: ignore[union-attr]
                    f"of {rows} rows, so positions from {rows} on have none; use max_cache_len <= {rows} (rebuild the "
                    "model with a longer context_length for more)",
                )


def rewrite_gqa_cache(
    model: ir.Model,
    kv: KVCache,
    *,
    cache_position: ir.Value,
    batch: int,
    step_len: int,
    max_cache_len: int,
    cache_update: str,
    who: str = "static_kv",
) -> list[str]:
    """Feed every GroupQueryAttention node its lengths from ``cache_position``; drop the unread ``attention_mask``.

    ``seqlens_k`` int32 ``(B,)`` = ``cache_position[S-1]`` (the last slot written, i.e. total length - 1) and
    ``total_sequence_length`` int32 scalar = ``cache_position[S-1] + 1``; ``cache_position`` must hold
    consecutive slots ``p .. p+S-1`` (the contract's meaning). The past inputs keep feeding the op (their dims
    are fixed to ``(B, H_kv, L, D)`` by :func:`~onnxdeploy.passes._cache_edits.fix_io_dims`), and present is the
    whole updated buffer. Nodes that computed the old lengths are removed (with every other node and
    initializer nothing reads), and ``attention_mask`` with them when nothing else reads it.

    Args:
        model: the model whose graph ``kv`` was found on (edited in place).
        kv: its cache, held by GroupQueryAttention (``kv.attention_op`` set).
        cache_position: the int64 ``[S]`` input.
        batch: B.
        step_len: S.
        max_cache_len: L.
        cache_update: must be ``full_buffer``.
        who: the pass named in errors.

    Returns:
        Human-readable lines for the pass report.

    Raises:
        PreconditionError: ``new_token_only``; S > 1 at B > 1; L above the rows of a node's cos/sin cache
            (the message names the node).
    """
    _check(kv, batch=batch, step_len=step_len, max_cache_len=max_cache_len, cache_update=cache_update, who=who)
    graph = model.graph
    nodes = kv.attention_nodes
    seqlens, total = _lengths(graph, cache_position, batch=batch, step_len=step_len, before=nodes[0])
    for node in nodes:
        node.replace_input_with(_SEQLENS_K, seqlens)
        node.replace_input_with(_TOTAL_SEQUENCE_LENGTH, total)
    remove_dead_nodes(model)
    changes = [
        f"{len(nodes)} {GQA_OP} node(s): seqlens_k = cache_position[{step_len - 1}] (int32, per row) and "
        f"total_sequence_length = cache_position[{step_len - 1}] + 1 (int32) instead of attention_mask's sum/width; "
        f"past K/V are the fixed {max_cache_len}-slot buffers the op writes into (present = whole buffer)"
    ]
    mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    if mask is not None and not mask.uses():
        graph.inputs.remove(mask)
        changes.append(
            "input attention_mask removed (only the old lengths read it); contract inputs.attention_mask = null"
        )
    return changes


def _lengths(
    graph: ir.Graph, cache_position: ir.Value, *, batch: int, step_len: int, before: ir.Node
) -> tuple[ir.Value, ir.Value]:
    """``(seqlens_k int32 (B,), total_sequence_length int32 scalar)`` from ``cache_position``, inserted ``before``."""
    last_index = add_initializer(graph, f"{_PREFIX}/last_index", np.array([step_len - 1], dtype=np.int64))
    one = add_initializer(graph, f"{_PREFIX}/one", np.array([1], dtype=np.int64))
    rows = add_initializer(graph, f"{_PREFIX}/batch_shape", np.array([batch], dtype=np.int64))
    scalar = add_initializer(graph, f"{_PREFIX}/scalar_shape", np.zeros((0,), dtype=np.int64))
    last = make_node("Gather", [cache_position, last_index], name=f"{_PREFIX}/last_slot", axis=0)
    per_row = make_node("Expand", [last.outputs[0], rows], name=f"{_PREFIX}/seqlens_rows")
    seqlens = make_node("Cast", [per_row.outputs[0]], name=f"{_PREFIX}/seqlens_k", to=ir.DataType.INT32)
    plus_one = make_node("Add", [last.outputs[0], one], name=f"{_PREFIX}/total")
    flat = make_node("Reshape", [plus_one.outputs[0], scalar], name=f"{_PREFIX}/total_scalar")
    total = make_node("Cast", [flat.outputs[0]], name=f"{_PREFIX}/total_sequence_length", to=ir.DataType.INT32)
    graph.insert_before(before, [last, per_row, seqlens, plus_one, flat, total])
    return seqlens.outputs[0], total.outputs[0]
