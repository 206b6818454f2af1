"""Attention edits on a static graph: no copy of the cache on its way into attention.

DESIGN.md, "What a static decode step costs", says why.

The exporters' attention reads each layer's cache buffer ``(B, H_kv, L, D)`` through a chain of layout ops
before its two MatMuls (``L`` = ``max_cache_len``):

* the GQA head repeat (transformers' ``repeat_kv``: Unsqueeze → Expand → Reshape, or Tile) copies the whole
  buffer to every query head, ``(B, H_q, L, D)`` with ``H_q = G · H_kv``, twice per layer and step;
* K is transposed to ``(B, H_q, D, L)`` and multiplied by a scalar (the SDPA exports scale Q and K by
  ``sqrt(1/sqrt(D))`` each), another full-size copy;
* the dynamo exporter adds Reshapes to and from ``(B·H_q, L, D)`` around the transpose;
* a float16 export whose attention computes in float32 casts the repeated V up (``Cast(to=float)`` after the
  repeat: the TorchScript exporter's fp16 LLaMA).

:func:`group_query_heads` finds these chains by data flow, backwards from every MatMul operand to a cache
buffer, and confirms what a chain computes by running it on numpy with an index tensor in place of the buffer
(layout ops only move elements, so the result says exactly which buffer element lands where). A chain that
equals the head repeat of the buffer (K transposed or V as it is) times scalars is replaced by grouped
attention: the small operand, Q ``(B, H_q, S, D)`` or the probabilities ``(B, H_q, S, L)``, is reshaped to
``(B, H_kv, G·S, ·)`` (query head ``h`` reads KV head ``h // G``, so the heads of one group are adjacent),
the scalars move onto it, and the MatMul reads the buffer itself (K through one Transpose, which ONNX Runtime
fuses into ``FusedMatMul(transB=1)`` and device compilers into the MatMul; a Cast in the chain is applied to
the buffer, ``L · H_kv · D`` elements, before it); its output is reshaped back to what the chain gave, so
everything after it is unchanged. Nothing of size ``L · H_q · D`` is made. A head repeat of a buffer that is
left (a chain through an op not listed here, or read by another node too) is found by :func:`head_repeats`
whatever reads it, and the pass names it in a warning.

Exact up to float rounding: every score and output is the same dot product over the same elements; the scalar
lands on ``q`` instead of ``k`` (``(q·a)·(k·a)`` becomes ``(q·a·a)·k``), a relative difference of a few ulp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import read_contract
from onnxdeploy.graph import const_array, node_label, static_dims
from onnxdeploy.passes._attention_decompose import attention_nodes
from onnxdeploy.passes._edit import add_initializer, make_node, remove_dead_nodes

__all__ = [
    "AttentionRead",
    "cache_buffers",
    "find_cache_reads",
    "group_query_heads",
    "head_repeats",
    "repeating_attention_nodes",
]

_PREFIX = "onnxdeploy/grouped_attention"
LAYOUT_OPS = frozenset({"Identity", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Tile", "Transpose", "Flatten"})
"""Ops that only move elements: a chain of them is simulated exactly on an index tensor."""
SCALE_OPS = frozenset({"Mul", "Div"})
"""Ops by a one-element tensor that commute with the layout ops (moved onto the other MatMul operand)."""
REPEAT_OPS = frozenset({"Expand", "Tile"})
"""Layout ops that copy elements (the head repeat)."""
CAST_OPS = frozenset({"Cast"})
"""Elementwise type conversion: commutes with the layout ops (applied to the buffer by the rewrite)."""
_CACHE_WRITES = frozenset({"ScatterElements", "ScatterND", "TensorScatter", "Identity"})
_MAX_CHAIN = 16


@dataclass(frozen=True)
class AttentionRead:
    """One MatMul operand computed from a cache buffer by layout ops and scalars.

    Attributes:
        matmul: the MatMul node.
        buffer: the cache buffer ``(B, H_kv, L, D)`` the chain starts from.
        nodes: the chain, buffer side first (layout ops and scalar Mul/Div).
        scales: ``(op_type, one-element tensor)`` of each scalar Mul/Div in the chain, in order.
        form: ``"key"`` when the operand is the head repeat of K transposed (``(…, D, L)``), ``"value"`` for V
            (``(…, L, D)``), None when the chain is something else (left as it is).
        group: G = H_q / H_kv, query heads per KV head (0 when ``form`` is None).
    """

    matmul: ir.Node
    buffer: ir.Value
    nodes: tuple[ir.Node, ...]
    scales: tuple[tuple[str, ir.Value], ...]
    form: str | None
    group: int

    @property
    def copies(self) -> bool:
        """Whether the chain holds a node that copies the buffer (Expand, Tile, or a Transpose it cannot drop)."""
        if any(n.op_type in REPEAT_OPS for n in self.nodes):
            return True
        moved = [n.op_type for n in self.nodes if n.op_type not in ("Identity", *CAST_OPS)]
        return moved not in ([], ["Transpose"])  # a Cast of the buffer is what the rewrite itself reads


def cache_buffers(model: ir.Model) -> set[ir.Value]:
    """The values that are a whole cache buffer: the past inputs named by the contract and what writes them.

    A buffer is a past input (BHSD ``(B, H_kv, L, D)``) or the output of a ScatterElements / ScatterND /
    TensorScatter / Identity whose data input is a buffer, or of a Where selecting into a buffer (the updated
    buffer static_kv writes).

    Args:
        model: a static graph carrying a decode contract.

    Returns:
        The buffer values (empty without a contract).
    """
    contract = read_contract(model)
    if contract is None:
        return set()
    by_name = {str(v.name): v for v in model.graph.inputs}
    todo = [by_name[past] for past, _ in contract.cache_pairs() if past in by_name]
    found: set[ir.Value] = set()
    while todo:
        value = todo.pop()
        if value in found:
            continue
        found.add(value)
        for use in value.uses():
            # the select write (cache_write where/host) takes the buffer as Where's third input
            if (use.node.op_type in _CACHE_WRITES and use.idx == 0) or (use.node.op_type == "Where" and use.idx == 2):
                todo.extend(use.node.outputs[:1])
    return found


def _one_element(value: ir.Value | None) -> bool:
    dims = static_dims(value) if value is not None else None
    return dims is not None and math.prod(dims) == 1


def _trace(
    operand: ir.Value, buffers: set[ir.Value]
) -> tuple[ir.Value, list[ir.Node], list[tuple[str, ir.Value]]] | None:
    """Walk back from a MatMul operand through single-use layout ops and scalars to a cache buffer."""
    nodes: list[ir.Node] = []
    scales: list[tuple[str, ir.Value]] = []
    value = operand
    while value not in buffers:
        node = value.producer()
        if node is None or len(nodes) >= _MAX_CHAIN or len(value.uses()) != 1 or value.is_graph_output():
            return None
        if node.op_type in LAYOUT_OPS or node.op_type in CAST_OPS:
            data = node.inputs[0]
        elif node.op_type in SCALE_OPS and len(node.inputs) == 2:
            a, b = node.inputs
            if _one_element(b):
                data, scalar = a, b
            elif node.op_type == "Mul" and _one_element(a):
                data, scalar = b, a
            else:
                return None
            shape, rank = static_dims(data) if data is not None else None, len(scalar.shape or ())
            if shape is None or rank > len(shape):
                return None  # a scalar of higher rank would add axes
            scales.append((node.op_type, scalar))
        else:
            return None
        if data is None:
            return None
        nodes.append(node)
        value = data
    nodes.reverse()
    scales.reverse()
    return value, nodes, scales


def _apply(node: ir.Node, x: np.ndarray) -> np.ndarray | None:
    """Run one layout op on numpy (None when its parameters are not constants or the op is a scalar op)."""
    op = node.op_type
    attrs = node.attributes
    if op in ("Identity", "Mul", "Div", *CAST_OPS):
        return x
    if op == "Transpose":
        perm = attrs["perm"].value if "perm" in attrs else list(range(x.ndim))[::-1]
        return np.transpose(x, tuple(perm))
    if op == "Flatten":
        axis = attrs["axis"].value if "axis" in attrs else 1
        axis = axis % x.ndim if x.ndim else 0
        return x.reshape(math.prod(x.shape[:axis]), -1)
    if op in ("Unsqueeze", "Squeeze"):
        axes = const_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if axes is None and "axes" in attrs:
            axes = np.asarray(attrs["axes"].value)
        if op == "Squeeze":
            return np.squeeze(x, axis=None if axes is None else tuple(int(a) for a in axes.ravel()))
        if axes is None:
            return None
        rank = x.ndim + axes.size
        out = x
        for a in sorted(int(a) % rank for a in axes.ravel()):
            out = np.expand_dims(out, a)
        return out
    param = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if param is None:
        return None
    param = param.astype(np.int64).ravel()
    if op == "Expand":
        return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(param)))
    if op == "Tile":
        return np.tile(x, tuple(param))
    if op == "Reshape":
        shape = list(param)
        if not (attrs["allowzero"].value if "allowzero" in attrs else 0):
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return x.reshape(shape)
    return None


def _classify(
    buffer_shape: tuple[int, ...], nodes: list[ir.Node], memo: dict[tuple, tuple[str | None, int]]
) -> tuple[str | None, int]:
    """What a layout chain computes from a buffer: ``("key" | "value", G)`` for the head repeat, else (None, 0)."""
    key = (buffer_shape, tuple(_signature(n) for n in nodes))
    if key in memo:
        return memo[key]
    result: tuple[str | None, int] = (None, 0)
    if len(buffer_shape) == 4:
        b, h_kv, length, d = buffer_shape
        ids = np.arange(math.prod(buffer_shape), dtype=np.int32).reshape(buffer_shape)
        x: np.ndarray | None = ids
        for node in nodes:
            x = _apply(node, x)
            if x is None:
                break
        if x is not None and x.size % (b * length * d) == 0 and (x.size // (b * length * d)) % h_kv == 0:
            group = x.size // (b * length * d) // h_kv
            repeated = np.repeat(ids, group, axis=1)  # query head h reads KV head h // G (transformers' repeat_kv)
            for form, want in (("key", repeated.transpose(0, 1, 3, 2)), ("value", repeated)):
                if x.shape[-2:] == want.shape[-2:] and math.prod(x.shape[:-2]) == b * h_kv * group:
                    if x.ndim in (3, 4) and np.array_equal(x.reshape(want.shape), want):
                        result = (form, group)
                        break
    memo[key] = result
    return result


def _signature(node: ir.Node) -> tuple:
    params = []
    for value in node.inputs[1:]:
        c = const_array(value)
        params.append(None if c is None else (c.dtype.str, c.shape, c.tobytes()))
    attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))
    return (node.op_type, attrs, tuple(params))


def find_cache_reads(model: ir.Model) -> list[AttentionRead]:
    """Every MatMul operand computed from a cache buffer by layout ops and scalars, classified.

    Args:
        model: a static graph carrying a decode contract (BHSD cache).

    Returns:
        One :class:`AttentionRead` per such operand, in graph order.
    """
    buffers = cache_buffers(model)
    memo: dict[tuple, tuple[str | None, int]] = {}
    reads = []
    for node in model.graph:
        if node.op_type != "MatMul":
            continue
        for operand in node.inputs:
            traced = _trace(operand, buffers) if operand is not None else None
            if traced is None:
                continue
            buffer, nodes, scales = traced
            shape = static_dims(buffer)
            form, group = _classify(tuple(shape), nodes, memo) if shape is not None else (None, 0)
            if form is not None and operand is not node.inputs[1]:
                form, group = None, 0  # the cache as the left operand: not an exporter's attention
            reads.append(AttentionRead(node, buffer, tuple(nodes), tuple(scales), form, group))
    return reads


def head_repeats(model: ir.Model) -> list[ir.Node]:
    """Expand/Tile nodes that copy a cache buffer, whatever reads the copy (what :func:`group_query_heads` removes).

    Found forwards from every buffer through layout ops, Casts and scalar Mul/Div (the ops a head-repeat chain
    is made of), so a repeat stays visible when the chain's consumer or an op in it is one the rewrite does not
    take (an ``Attention`` node, another elementwise op).

    Args:
        model: a static graph carrying a decode contract.

    Returns:
        The nodes, in graph order.
    """
    passing = LAYOUT_OPS | CAST_OPS | SCALE_OPS
    seen: set[ir.Value] = set()
    found: set[ir.Node] = set()
    todo = list(cache_buffers(model))
    while todo:
        value = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        for use in value.uses():
            node = use.node
            if node.op_type not in passing or (node.op_type not in SCALE_OPS and use.idx != 0):
                continue
            if node.op_type in REPEAT_OPS:
                found.add(node)
            todo.extend(node.outputs[:1])
    return [node for node in model.graph if node in found]


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


def repeating_attention_nodes(model: ir.Model) -> list[ir.Node]:
    """``Attention`` nodes whose K or V input is a copying chain (head repeat) of a cache buffer.

    These hide the chain's consumer from :func:`find_cache_reads` (which starts at MatMuls): decomposed
    (:func:`~onnxdeploy.passes._attention_decompose.decompose_attention`), their K/V reads become MatMul
    operands :func:`group_query_heads` can rewrite.

    Args:
        model: a static graph carrying a decode contract.

    Returns:
        The nodes, in graph order.
    """
    buffers = cache_buffers(model)
    found = []
    for node in attention_nodes(model.graph):
        for operand in node.inputs[1:3]:
            traced = _trace(operand, buffers) if operand is not None else None
            if traced is not None and any(n.op_type in REPEAT_OPS for n in traced[1]):
                found.append(node)
                break
    return found
