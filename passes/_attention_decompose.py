"""ONNX ``Attention`` (opset 23) split into primitive ops, so its scores and its reads of the cache are reachable.

The dynamo opset-23 exporter puts SDPA in one ``Attention`` node whose scores are out of reach: a mask can
only be added inside it, where a NaN in an unused K slot still reaches the Softmax, and its K/V inputs are
the exporter's head repeat of the cache, ``(B, H_q, L, D)``, which only a MatMul can read grouped. Both
:mod:`~onnxdeploy.passes.mask_rewrite` (to mask the scores by select) and
:mod:`~onnxdeploy.passes.grouped_attention` (to read the cache without the copy) split the op with
:func:`decompose_attention`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.errors import PreconditionError
from onnxdeploy.passes._edit import add_initializer, make_node
from onnxdeploy.passes._position_mask import lowest_finite

__all__ = ["attention_nodes", "causal_refusal", "decompose_attention", "decompose_refusal"]


def attention_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The ONNX ``Attention`` (opset 23+) nodes of ``graph``, in graph order."""
    return [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]


def _seq_dim(value: ir.Value | None) -> int | str | None:
    """The sequence dim of an Attention input: axis 2 of ``(B, H, S, D)``, axis 1 of ``(B, S, H·D)``."""
    if value is None or value.shape is None or len(value.shape) not in (3, 4):
        return None
    dim = value.shape[len(value.shape) - 2]
    return dim if isinstance(dim, int) else (dim.value if isinstance(dim, ir.SymbolicDim) else None)


def causal_refusal(graph: ir.Graph) -> str | None:
    """Why a graph's ``is_causal`` Attention cannot be made static exactly (None when it has none such).

    ONNX ``Attention``-23 with ``is_causal=1`` masks with the *upper-left* aligned lower triangle (query ``i``
    sees keys ``0..i``; ONNX Operators.md, Attention-23, attribute ``is_causal``: "the attention masking has the
    form of the upper left causal bias due to the alignment"). That is the decoder's causal mask only when the
    query and key lengths are equal; after a cache (``kv_len = past + q_len``) and in a static graph
    (``q_len = step_len``, ``kv_len = max_cache_len``) it hides every cached position, so an ``is_causal`` node
    whose Q and K sequence dims are not the same (an equal int or the same symbol) is refused.

    Returns:
        A sentence naming the first such node, its dims and what to do; None when every node is exact.
    """
    for node in attention_nodes(graph):
        if not node.attributes.get_int("is_causal", 0):
            continue
        q_len, kv_len = _seq_dim(node.inputs[0]), _seq_dim(node.inputs[1] if len(node.inputs) > 1 else None)
        past = len(node.inputs) > 4 and node.inputs[4] is not None
        if q_len is not None and q_len == kv_len and not past:
            continue
        return (
            f"ai.onnx::Attention node '{node.name}' has is_causal=1 with q_len {q_len or 'unknown'} and kv_len "
            f"{'past + ' if past else ''}{kv_len or 'unknown'}: Attention-23 aligns its causal mask to the upper "
            "left (query i sees keys 0..i), which hides the cache whenever q_len != kv_len, so the static graph "
            "(q_len = step_len, kv_len = max_cache_len) cannot be kept exact; re-export with an explicit attn_mask "
            "(is_causal=0, as torch.onnx's dynamo exporter writes for a cache)"
        )
    return None


def decompose_refusal(node: ir.Node) -> str | None:
    """Why :func:`decompose_attention` cannot split ``node`` (None when it can).

    Only the exporters' plain SDPA form is split: 4-D ``Q``/``K``/``V`` with as many K/V heads as Q heads (the
    head repeat done outside the op), no ``past_key``/``past_value``, no ``is_causal`` or ``softcap``, and no
    present/qk output in use.
    """
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    if any(i is not None for i in node.inputs[4:]):
        return "takes past_key/past_value (it concatenates the cache inside)"
    if any(x is None or x.shape is None or len(x.shape) != 4 for x in (q, k, v)):
        return "has inputs that are not 4-D (B, H, S, D)"
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1]:  # type: ignore[union-attr,index]
        return "repeats K/V heads inside the op (q and kv head counts differ)"
    if node.attributes.get_int("is_causal", 0) or node.attributes.get_float("softcap", 0.0):
        return "uses is_causal or softcap"
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return "has present/qk outputs in use"
    return None


def _primitive_attention(graph: ir.Graph, node: ir.Node, base: str) -> tuple[list[ir.Node], float]:
    """The nodes computing ``node`` (not inserted; scale and fill initializers registered) and its scale."""
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    assert q is not None and k is not None and v is not None and q.shape is not None
    head_dim = q.shape[3]
    default = 1.0 / float(np.sqrt(head_dim)) if isinstance(head_dim, int) else 1.0
    scale = node.attributes.get_float("scale", default)
    dtype = q.dtype or ir.DataType.FLOAT
    scale_c = add_initializer(graph, f"{base}/scale", np.array(scale, dtype=dtype.numpy()))

    def op(op_type: str, inputs: list[ir.Value | None], name: str, **attrs: object) -> ir.Node:
        return make_node(op_type, inputs, name=f"{base}/{name}", dtype=dtype, **attrs)

    kt = op("Transpose", [k], "Transpose", perm=[0, 1, 3, 2])
    qk = op("MatMul", [q, kt.outputs[0]], "MatMul_qk")
    made = [kt, qk, op("Mul", [qk.outputs[0], scale_c], "scale_mul")]
    if mask is not None and mask.dtype == ir.DataType.BOOL:
        lowest = add_initializer(graph, f"{base}/lowest", lowest_finite(dtype))
        made.append(op("Where", [mask, made[-1].outputs[0], lowest], "mask_select"))
    elif mask is not None:
        made.append(op("Add", [made[-1].outputs[0], mask], "mask_add"))
    softmax = op("Softmax", [made[-1].outputs[0]], "Softmax", axis=-1)
    made += [softmax, op("MatMul", [softmax.outputs[0], v], "MatMul_pv")]
    return made, scale


def decompose_attention(graph: ir.Graph, *, who: str = "mask_rewrite", nodes: list[ir.Node] | None = None) -> list[str]:
    """Replace ONNX ``Attention`` (opset 23) nodes by MatMul → scale → mask → Softmax → MatMul.

    For 4-D ``Q (B, H, S, D)``, ``K``/``V`` ``(B, H, L, D)`` (the head repeat done outside, as exported),
    ``scale`` (default ``1/sqrt(D)``) and an optional ``attn_mask``: ``scores = MatMul(Q, Transpose(K)) ·
    scale``; a bool mask gives ``Where(mask, scores, lowest)``, a float mask ``scores + mask``;
    ``Softmax(axis=-1)``; ``MatMul(probs, V)``. Exact up to float rounding (same dot products; ORT's kernel
    scales Q first). Source of the op's meaning: the ONNX operator spec, ``Attention``-23.

    Args:
        graph: a static graph (shapes inferred), edited in place.
        who: the pass named in errors.
        nodes: the Attention nodes to split (default: every one in the graph).

    Returns:
        One line per decomposed node.

    Raises:
        PreconditionError: a node :func:`decompose_refusal` gives a reason for (names the node and the reason).
    """
    changes = []
    for node in attention_nodes(graph) if nodes is None else nodes:
        label = f"ai.onnx::Attention node '{node.name or '?'}'"
        why = decompose_refusal(node)
        if why is not None:
            raise PreconditionError(who, f"{label} {why}; only the exporters' plain SDPA form is decomposed")
        made, scale = _primitive_attention(graph, node, f"onnxdeploy/attention/{node.name or len(changes)}")
        graph.insert_before(node, made)
        node.outputs[0].replace_all_uses_with(made[-1].outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        changes.append(f"{label} decomposed into MatMul/Mul(scale {scale:g})/{made[3].op_type}/Softmax/MatMul")
    return changes
