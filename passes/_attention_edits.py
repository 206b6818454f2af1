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
import onnx_ir.passes.common as ir_common

from onnxdeploy.contract import read_contract
from onnxdeploy.errors import PreconditionError

__all__ = [
    "AttentionRead",
    "attention_nodes",
    "cache_buffers",
    "decompose_attention",
    "decompose_refusal",
    "find_cache_reads",
    "group_query_heads",
    "head_repeats",
    "repeat_label",
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
    shape = value.shape if value is not None else None
    return shape is not None and all(isinstance(d, int) for d in shape) and math.prod(shape) == 1


def _static(value: ir.Value | None) -> tuple[int, ...] | None:
    shape = value.shape if value is not None else None
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
            tensor = producer.attributes["value"].value
    return None if tensor is None else tensor.numpy()


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
            shape, rank = _static(data), len(scalar.shape or ())
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
        axes = _const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
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
    param = _const(node.inputs[1]) if len(node.inputs) > 1 else None
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
        c = _const(value)
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
            shape = _static(buffer)
            form, group = _classify(shape, nodes, memo) if shape is not None else (None, 0)
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


def repeat_label(node: ir.Node) -> str:
    """How reports name a head-repeat node: ``Expand 'name'``."""
    return f"{node.op_type} '{node.name}'"


def _int64(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    if name in graph.initializers:
        return graph.initializers[name]
    value = ir.Value(name=name, shape=ir.Shape([len(values)]), type=ir.TensorType(ir.DataType.INT64))
    value.const_value = ir.tensor(np.asarray(values, dtype=np.int64), name=name)
    graph.register_initializer(value)
    return value


def _typed(node: ir.Node, name: str, shape: list[int], dtype: ir.DataType) -> ir.Value:
    out = node.outputs[0]
    out.name, out.shape, out.dtype = name, ir.Shape(shape), dtype
    return out


def _rewrite(graph: ir.Graph, read: AttentionRead, index: int, max_rank: int = 4) -> str | None:
    """Replace one classified read by grouped attention; None (nothing changed) when shapes do not fit.

    With one query position (``S == 1``), ``G > 1`` and ``max_rank`` 5, the query heads of a group lead:
    ``(G, B, H_kv, 1, ·) @ buffer (B, H_kv, ·, ·)`` broadcasts the buffer over G, so each query head is a
    one-row product: ONNX Runtime's CPU MatMul then takes its matrix-vector path and never packs the cache
    (the fold packs the buffer into panels every call), but the whole decode step of ``benchmarks/decode.py``'s
    125M model is the same within noise either way (its ``rank5`` column), so rank 4 is the default.
    Otherwise G folds into the rows.
    """
    matmul, buffer, group = read.matmul, read.buffer, read.group
    b, h_kv, length, d = _static(buffer) or (0, 0, 0, 0)
    small, operand, out = matmul.inputs[0], matmul.inputs[1], matmul.outputs[0]
    small_shape, operand_shape, out_shape = _static(small), _static(operand), _static(out)
    if small_shape is None or operand_shape is None or out_shape is None or small is None:
        return None
    inner = d if read.form == "key" else length  # the contracted axis
    if small_shape[:-2] != operand_shape[:-2] or small_shape[-1] != inner:
        return None  # the small operand broadcasts or is laid out otherwise: keep the chain
    steps = small_shape[-2]
    dtype = buffer.dtype or ir.DataType.FLOAT
    tag = f"{_PREFIX}/{matmul.name or index}"
    new_nodes: list[ir.Node] = []
    q = small
    leading = steps == 1 and group > 1 and max_rank >= 5  # (G, B, H_kv, 1, ·): the buffer broadcasts over G
    grouped_shape = [b, h_kv, group, steps, inner] if leading else [b, h_kv, group * steps, inner]
    if list(small_shape) != grouped_shape:
        shape = _int64(graph, f"{tag}/grouped_shape", grouped_shape)
        node = ir.node("Reshape", [q, shape], name=f"{tag}/Reshape_grouped")
        q = _typed(node, f"{tag}/grouped", grouped_shape, small.dtype or dtype)
        new_nodes.append(node)
    if leading:
        grouped_shape = [group, b, h_kv, steps, inner]
        node = ir.node("Transpose", [q], {"perm": [2, 0, 1, 3, 4]}, name=f"{tag}/Transpose_groups_first")
        q = _typed(node, f"{tag}/groups_first", grouped_shape, q.dtype or dtype)
        new_nodes.append(node)
    for i, (op, scalar) in enumerate(read.scales):
        if q.dtype is not None and scalar.dtype is not None and scalar.dtype != q.dtype:
            # a scale applied before a Cast in the chain: the same value, in the query's type
            node = ir.node("Cast", [scalar], {"to": int(q.dtype)}, name=f"{tag}/Cast_scale_{i}")
            scalar = _typed(node, f"{tag}/scale_{i}", list(scalar.shape or []), q.dtype)
            new_nodes.append(node)
        node = ir.node(op, [q, scalar], name=f"{tag}/{op}_scale_{i}")
        q = _typed(node, f"{tag}/scaled_{i}", grouped_shape, q.dtype or dtype)
        new_nodes.append(node)
    rhs = buffer
    for i, cast in enumerate(n for n in read.nodes if n.op_type in CAST_OPS):
        # the chain's Casts, in order, on the buffer (H_kv heads): what the repeat copied, converted once
        to = ir.DataType(cast.attributes.get_int("to"))
        node = ir.node("Cast", [rhs], {"to": int(to)}, name=f"{tag}/Cast_buffer_{i}")
        rhs = _typed(node, f"{tag}/buffer_cast_{i}", [b, h_kv, length, d], to)
        dtype = to
        new_nodes.append(node)
    if read.form == "key":
        node = ir.node("Transpose", [rhs], {"perm": [0, 1, 3, 2]}, name=f"{tag}/Transpose_key")
        rhs = _typed(node, f"{tag}/key_t", [b, h_kv, d, length], dtype)
        new_nodes.append(node)
    last = length if read.form == "key" else d
    product_shape = [group, b, h_kv, steps, last] if leading else [b, h_kv, group * steps, last]
    node = ir.node("MatMul", [q, rhs], name=f"{tag}/MatMul_grouped")
    result = _typed(node, f"{tag}/grouped_out", product_shape, out.dtype or dtype)
    new_nodes.append(node)
    if leading:
        node = ir.node("Transpose", [result], {"perm": [1, 2, 0, 3, 4]}, name=f"{tag}/Transpose_groups_back")
        product_shape = [b, h_kv, group, steps, last]
        result = _typed(node, f"{tag}/groups_back", product_shape, out.dtype or dtype)
        new_nodes.append(node)
    if list(out_shape) != product_shape:
        shape = _int64(graph, f"{tag}/out_shape", list(out_shape))
        node = ir.node("Reshape", [result, shape], name=f"{tag}/Reshape_back")
        result = _typed(node, f"{tag}/out", list(out_shape), out.dtype or dtype)
        new_nodes.append(node)
    graph.insert_before(matmul, new_nodes)
    name = str(out.name)
    out.replace_all_uses_with(result, replace_graph_outputs=True)
    out.name = f"{name}/replaced"
    result.name = name  # what reads the scores / attention output keeps reading a tensor of that name
    graph.remove(matmul, safe=True)
    for node in reversed(read.nodes):
        if not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)
    kinds = sorted({n.op_type for n in read.nodes})
    scale = f", {len(read.scales)} scale(s) moved onto the {'query' if read.form == 'key' else 'probabilities'}"
    form = (
        f"(G={group}, B={b}, H_kv={h_kv}, S={steps}), buffer broadcast"
        if leading
        else (f"(B={b}, H_kv={h_kv}, G={group}, S={steps})")
    )
    return (
        f"MatMul '{matmul.name}': {read.form} read of '{buffer.name}' through {kinds} -> grouped "
        f"{form}{scale if read.scales else ''}"
    )


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
            repeats = [repeat_label(n) for n in read.nodes if n.op_type in REPEAT_OPS]
            also = f" (head repeat {', '.join(repeats)} kept: it copies the cache every call)" if repeats else ""
            warnings.append(
                f"MatMul '{read.matmul.name}' reads '{read.buffer.name}' through {ops}: not rewritten{also}"
            )
        else:
            changes.append(line)
    if changes:
        ir_common.RemoveUnusedNodesPass()(model)  # the chains' shape constants
    return changes, warnings


# ------------------------------------------------------------------------ opset-23 Attention, decomposed


def attention_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The ONNX ``Attention`` (opset 23+) nodes of ``graph``, in graph order."""
    return [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]


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


def repeating_attention_nodes(model: ir.Model) -> list[ir.Node]:
    """``Attention`` nodes whose K or V input is a copying chain (head repeat) of a cache buffer.

    These hide the chain's consumer from :func:`find_cache_reads` (which starts at MatMuls): decomposed, their
    K/V reads become MatMul operands :func:`group_query_heads` can rewrite.

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


def _const_of(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType(ir.tensor(array).dtype)))
    value.const_value = ir.tensor(array, name=name)
    graph.register_initializer(value)
    return value


def decompose_attention(graph: ir.Graph, *, who: str = "mask_rewrite", nodes: list[ir.Node] | None = None) -> list[str]:
    """Replace ONNX ``Attention`` (opset 23) nodes by MatMul → scale → mask → Softmax → MatMul.

    The dynamo opset-23 exporter puts SDPA in one ``Attention`` node whose scores are out of reach: a mask can
    only be added inside it, where a NaN in an unused K slot still reaches the Softmax, and its K/V inputs are
    the exporter's head repeat of the cache, ``(B, H_q, L, D)``, which only a MatMul can read grouped. Both
    :mod:`~onnxdeploy.passes.mask_rewrite` (to mask the scores by select) and
    :mod:`~onnxdeploy.passes.grouped_attention` (to read the cache without the copy) split the op with this.
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
        q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        label = f"ai.onnx::Attention node '{node.name or '?'}'"
        why = decompose_refusal(node)
        if why is not None:
            raise PreconditionError(who, f"{label} {why}; only the exporters' plain SDPA form is decomposed")
        assert q is not None and k is not None and v is not None and q.shape is not None
        head_dim = q.shape[3]
        default = 1.0 / float(np.sqrt(head_dim)) if isinstance(head_dim, int) else 1.0
        scale = node.attributes.get_float("scale", default)
        dtype = q.dtype or ir.DataType.FLOAT
        np_dtype = dtype.numpy()
        base = f"onnxdeploy/attention/{node.name or len(changes)}"
        scale_c = _const_of(graph, f"{base}/scale", np.array(scale, dtype=np_dtype))
        kt = ir.node("Transpose", [k], {"perm": [0, 1, 3, 2]}, name=f"{base}/Transpose")
        qk = ir.node("MatMul", [q, kt.outputs[0]], name=f"{base}/MatMul_qk")
        scaled = ir.node("Mul", [qk.outputs[0], scale_c], name=f"{base}/scale_mul")
        made = [kt, qk, scaled]
        scores = scaled.outputs[0]
        if mask is not None and mask.dtype == ir.DataType.BOOL:
            lowest = _const_of(graph, f"{base}/lowest", np.array(np.finfo(np_dtype).min, dtype=np_dtype))
            made.append(ir.node("Where", [mask, scores, lowest], name=f"{base}/mask_select"))
            scores = made[-1].outputs[0]
        elif mask is not None:
            made.append(ir.node("Add", [scores, mask], name=f"{base}/mask_add"))
            scores = made[-1].outputs[0]
        softmax = ir.node("Softmax", [scores], {"axis": -1}, name=f"{base}/Softmax")
        pv = ir.node("MatMul", [softmax.outputs[0], v], name=f"{base}/MatMul_pv")
        made += [softmax, pv]
        for n in made:
            n.outputs[0].name = n.name
            n.outputs[0].dtype = dtype
        graph.insert_before(node, made)
        node.outputs[0].replace_all_uses_with(pv.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        changes.append(f"{label} decomposed into MatMul/Mul(scale {scale:g})/{made[3].op_type}/Softmax/MatMul")
    return changes
