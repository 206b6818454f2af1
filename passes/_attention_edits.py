"""Attention edits on a static graph: no copy of the cache on its way into attention.

Why: the exporters' GQA head repeat copies the whole cache every step (README, "Benchmarks").

A cache read :func:`~onnxdeploy.passes._cache_reads.find_cache_reads` recognises as the head repeat of the
buffer (K transposed or V as it is) times scalars is replaced by grouped attention: the small operand,
Q ``(B, H_q, S, D)`` or the probabilities ``(B, H_q, S, L)``, is reshaped to ``(B, H_kv, G·S, ·)`` (query head
``h`` reads KV head ``h // G``, so the heads of one group are adjacent), the scalars move onto it, and the
MatMul reads the buffer itself (K through one Transpose, which ONNX Runtime fuses into
``FusedMatMul(transB=1)`` and device compilers into the MatMul; a Cast in the chain is applied to the buffer,
``L · H_kv · D`` elements, before it); its output is reshaped back to what the chain gave, so everything after
it is unchanged. Nothing of size ``L · H_q · D`` is made. A head repeat of a buffer that is left (a chain
through an op not listed there, or read by another node too) is found by
:func:`~onnxdeploy.passes._cache_reads.head_repeats` whatever reads it, and the pass names it in a warning.

Exact up to float rounding: every score and output is the same dot product over the same elements; the scalar
lands on ``q`` instead of ``k`` (``(q·a)·(k·a)`` becomes ``(q·a·a)·k``), a relative difference of a few ulp.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxdeploy.graph import node_label, static_dims
from onnxdeploy.passes._cache_reads import CAST_OPS, REPEAT_OPS, AttentionRead, find_cache_reads
from onnxdeploy.passes._edit import add_initializer, make_node, remove_dead_nodes

__all__ = ["group_query_heads"]

_PREFIX = "onnxdeploy/grouped_attention"


@dataclass(frozen=True)
class _Grouping:
    """The dims of one grouped rewrite: the buffer ``(B, H_kv, L, D)``, G, the query rows S and the layout.

    ``inner`` is the contracted axis (D for the key read, L for the value read), ``last`` the product's last
    axis; ``leading`` puts the query groups first, ``(G, B, H_kv, S, ·)`` (see :func:`_rewrite`).
    """

    read: AttentionRead
    b: int
    h_kv: int
    length: int
    d: int
    steps: int
    leading: bool
    tag: str

    @property
    def inner(self) -> int:
        return self.d if self.read.form == "key" else self.length

    @property
    def last(self) -> int:
        return self.length if self.read.form == "key" else self.d

    def rows(self, last: int) -> list[int]:
        """The grouped shape with last axis ``last``: ``(B, H_kv, G·S, ·)``, or ``(G, B, H_kv, S, ·)`` leading."""
        g = self.read.group
        return [g, self.b, self.h_kv, self.steps, last] if self.leading else [self.b, self.h_kv, g * self.steps, last]


def _grouping(read: AttentionRead, index: int, max_rank: int) -> _Grouping | None:
    """The dims of the rewrite of ``read``, or None when its operands broadcast or are laid out otherwise."""
    matmul = read.matmul
    small, operand, out = matmul.inputs[0], matmul.inputs[1], matmul.outputs[0]
    small_shape = static_dims(small) if small is not None else None
    operand_shape = static_dims(operand) if operand is not None else None
    buffer_shape = static_dims(read.buffer)
    if small_shape is None or operand_shape is None or static_dims(out) is None or buffer_shape is None:
        return None
    b, h_kv, length, d = buffer_shape
    inner = d if read.form == "key" else length
    if small_shape[:-2] != operand_shape[:-2] or small_shape[-1] != inner:
        return None  # the small operand broadcasts or is laid out otherwise: keep the chain
    steps = small_shape[-2]
    leading = steps == 1 and read.group > 1 and max_rank >= 5  # (G, B, H_kv, 1, ·): the buffer broadcasts over G
    return _Grouping(read, b, h_kv, length, d, steps, leading, f"{_PREFIX}/{matmul.name or index}")


def _grouped_query(graph: ir.Graph, p: _Grouping, dtype: ir.DataType) -> tuple[ir.Value, list[ir.Node]]:
    """The small operand (Q or the probabilities) reshaped to the grouped rows, the chain's scalars applied."""
    small = p.read.matmul.inputs[0]
    assert small is not None
    tag, group, new_nodes = p.tag, p.read.group, []
    q = small
    grouped_shape = [p.b, p.h_kv, group, p.steps, p.inner] if p.leading else p.rows(p.inner)
    if static_dims(small) != grouped_shape:
        shape = add_initializer(graph, f"{tag}/grouped_shape", np.asarray(grouped_shape, np.int64), reuse=True)
        node = make_node(
            "Reshape",
            [q, shape],
            name=f"{tag}/Reshape_grouped",
            output=f"{tag}/grouped",
            dtype=small.dtype or dtype,
            shape=grouped_shape,
        )
        q = node.outputs[0]
        new_nodes.append(node)
    if p.leading:
        grouped_shape = p.rows(p.inner)
        node = make_node(
            "Transpose",
            [q],
            name=f"{tag}/Transpose_groups_first",
            output=f"{tag}/groups_first",
            dtype=q.dtype or dtype,
            shape=grouped_shape,
            perm=[2, 0, 1, 3, 4],
        )
        q = node.outputs[0]
        new_nodes.append(node)
    for i, (op, scalar) in enumerate(p.read.scales):
        if q.dtype is not None and scalar.dtype is not None and scalar.dtype != q.dtype:
            # a scale applied before a Cast in the chain: the same value, in the query's type
            node = make_node(
                "Cast",
                [scalar],
                name=f"{tag}/Cast_scale_{i}",
                output=f"{tag}/scale_{i}",
                dtype=q.dtype,
                shape=list(scalar.shape or []),
                to=int(q.dtype),
            )
            scalar = node.outputs[0]
            new_nodes.append(node)
        node = make_node(
            op,
            [q, scalar],
            name=f"{tag}/{op}_scale_{i}",
            output=f"{tag}/scaled_{i}",
            dtype=q.dtype or dtype,
            shape=grouped_shape,
        )
        q = node.outputs[0]
        new_nodes.append(node)
    return q, new_nodes


def _buffer_operand(p: _Grouping, dtype: ir.DataType) -> tuple[ir.Value, list[ir.Node], ir.DataType]:
    """The buffer as the MatMul reads it: the chain's Casts, then K through one Transpose; with its dtype."""
    tag, new_nodes = p.tag, []
    rhs = p.read.buffer
    for i, cast in enumerate(n for n in p.read.nodes if n.op_type in CAST_OPS):
        # the chain's Casts, in order, on the buffer (H_kv heads): what the repeat copied, converted once
        to = ir.DataType(cast.attributes.get_int("to"))
        node = make_node(
            "Cast",
            [rhs],
            name=f"{tag}/Cast_buffer_{i}",
            output=f"{tag}/buffer_cast_{i}",
            dtype=to,
            shape=[p.b, p.h_kv, p.length, p.d],
            to=int(to),
        )
        rhs, dtype = node.outputs[0], to
        new_nodes.append(node)
    if p.read.form == "key":
        node = make_node(
            "Transpose",
            [rhs],
            name=f"{tag}/Transpose_key",
            output=f"{tag}/key_t",
            dtype=dtype,
            shape=[p.b, p.h_kv, p.d, p.length],
            perm=[0, 1, 3, 2],
        )
        rhs = node.outputs[0]
        new_nodes.append(node)
    return rhs, new_nodes, dtype


def _grouped_product(
    graph: ir.Graph, p: _Grouping, q: ir.Value, rhs: ir.Value, dtype: ir.DataType
) -> tuple[ir.Value, list[ir.Node]]:
    """The grouped MatMul and its way back to the shape the old MatMul gave."""
    tag, out = p.tag, p.read.matmul.outputs[0]
    out_dtype = out.dtype or dtype
    product_shape = p.rows(p.last)
    node = make_node(
        "MatMul",
        [q, rhs],
        name=f"{tag}/MatMul_grouped",
        output=f"{tag}/grouped_out",
        dtype=out_dtype,
        shape=product_shape,
    )
    new_nodes = [node]
    if p.leading:
        product_shape = [p.b, p.h_kv, p.read.group, p.steps, p.last]
        node = make_node(
            "Transpose",
            [node.outputs[0]],
            name=f"{tag}/Transpose_groups_back",
            output=f"{tag}/groups_back",
            dtype=out_dtype,
            shape=product_shape,
            perm=[1, 2, 0, 3, 4],
        )
        new_nodes.append(node)
    out_shape = static_dims(out)
    if out_shape != product_shape:
        shape = add_initializer(graph, f"{tag}/out_shape", np.asarray(out_shape, np.int64), reuse=True)
        node = make_node(
            "Reshape",
            [node.outputs[0], shape],
            name=f"{tag}/Reshape_back",
            output=f"{tag}/out",
            dtype=out_dtype,
            shape=out_shape,
        )
        new_nodes.append(node)
    return node.outputs[0], new_nodes


def _replace_matmul(graph: ir.Graph, read: AttentionRead, new_nodes: list[ir.Node], result: ir.Value) -> None:
    """Insert ``new_nodes`` for the MatMul; ``result`` takes its output's name; the dead chain goes."""
    matmul = read.matmul
    out = matmul.outputs[0]
    graph.insert_before(matmul, new_nodes)
    name = str(out.name)
    out.replace_all_uses_with(result, replace_graph_outputs=True)
    out.name = f"{name}/replaced"
    result.name = name  # what reads the scores / attention output keeps reading a tensor of that name
    graph.remove(matmul, safe=True)
    for node in reversed(read.nodes):
        if not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def _rewrite_line(p: _Grouping) -> str:
    read = p.read
    kinds = sorted({n.op_type for n in read.nodes})
    scale = f", {len(read.scales)} scale(s) moved onto the {'query' if read.form == 'key' else 'probabilities'}"
    dims = f"B={p.b}, H_kv={p.h_kv}"
    form = (
        f"(G={read.group}, {dims}, S={p.steps}), buffer broadcast"
        if p.leading
        else f"({dims}, G={read.group}, S={p.steps})"
    )
    return (
        f"{node_label(read.matmul)}: {read.form} read of '{read.buffer.name}' through {kinds} -> grouped "
        f"{form}{scale if read.scales else ''}"
    )


def _rewrite(graph: ir.Graph, read: AttentionRead, index: int, max_rank: int = 4) -> str | None:
    """Replace one classified read by grouped attention; None (nothing changed) when shapes do not fit.

    With one query position (``S == 1``), ``G > 1`` and ``max_rank`` 5, the query heads of a group lead:
    ``(G, B, H_kv, 1, ·) @ buffer (B, H_kv, ·, ·)`` broadcasts the buffer over G, so each query head is a
    one-row product: ONNX Runtime's CPU MatMul then takes its matrix-vector path and never packs the cache
    (the fold packs the buffer into panels every call), but the whole decode step of ``benchmarks/decode.py``'s
    125M model is the same within noise either way (its ``rank5`` column), so rank 4 is the default.
    Otherwise G folds into the rows.
    """
    p = _grouping(read, index, max_rank)
    if p is None:
        return None
    dtype = read.buffer.dtype or ir.DataType.FLOAT
    q, query_nodes = _grouped_query(graph, p, dtype)
    rhs, buffer_nodes, dtype = _buffer_operand(p, dtype)
    result, product_nodes = _grouped_product(graph, p, q, rhs, dtype)
    _replace_matmul(graph, read, [*query_nodes, *buffer_nodes, *product_nodes], result)
    return _rewrite_line(p)


def group_query_heads(model: ir.Model, max_rank: int = 4) -> tuple[list[str], list[str]]:
    """Replace every recognised head repeat / transpose / scale chain on a cache buffer by grouped attention.

    Edits ``model.graph`` in place (new nodes and int64 shape initializers; weights untouched). Recognised
    reads whose chain already is the buffer itself (or K through one Transpose, no scalar) are left alone.

    Args:
        model: a static graph carrying a decode contract with a BHSD cache ``(B, H_kv, L, D)``.
        max_rank: 5 lets a one-token graph lead with the query groups ``(G, B, H_kv, 1, ·)`` (see
            :func:`_rewrite`); 4 always folds G into the query rows ``(B, H_kv, G·S, ·)``.

    Returns:
        ``(changes, warnings)``: one line per rewritten MatMul; one per cache read that copies the buffer but
        was not recognised (e.g. an intermediate read by another node as well).
    """
    changes: list[str] = []
    warnings: list[str] = []
    for index, read in enumerate(find_cache_reads(model)):
        if not read.copies and not read.scales:
            continue
        line = _rewrite(model.graph, read, index, max_rank) if read.form is not None else None
        if line is None:
            ops = [n.op_type for n in read.nodes]
            repeats = [node_label(n) for n in read.nodes if n.op_type in REPEAT_OPS]
            also = f" (head repeat {', '.join(repeats)} kept: it copies the cache every call)" if repeats else ""
            warnings.append(f"{node_label(read.matmul)} reads '{read.buffer.name}' through {ops}: not rewritten{also}")
        else:
            changes.append(line)
    if changes:
        remove_dead_nodes(model)  # the chains' shape constants
    return changes, warnings
