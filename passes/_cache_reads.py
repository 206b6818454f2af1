"""How attention reads the static cache: MatMul operands computed from a cache buffer, classified exactly.

The exporters' attention reads each layer's cache buffer ``(B, H_kv, L, D)`` through a chain of layout ops
before its two MatMuls (``L`` = ``max_cache_len``):

* the GQA head repeat (transformers' ``repeat_kv``: Unsqueeze → Expand → Reshape, or Tile) copies the whole
  buffer to every query head, ``(B, H_q, L, D)`` with ``H_q = G · H_kv``, twice per layer and step;
* K is transposed to ``(B, H_q, D, L)`` and multiplied by a scalar (the SDPA exports scale Q and K by
  ``sqrt(1/sqrt(D))`` each), another full-size copy;
* the dynamo exporter adds Reshapes to and from ``(B·H_q, L, D)`` around the transpose;
* a float16 export whose attention computes in float32 casts the repeated V up (``Cast(to=float)`` after the
  repeat: the TorchScript exporter's fp16 LLaMA).

:func:`find_cache_reads` finds these chains by data flow, backwards from every MatMul operand to a cache
buffer (:func:`cache_buffers`), and confirms what a chain computes by running it on numpy with an index
tensor in place of the buffer (layout ops only move elements, so the result says exactly which buffer
element lands where). :func:`head_repeats` finds every head repeat of a buffer forwards, whatever reads it.
A recognised read is rewritten by :mod:`onnxdeploy.passes._attention_edits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import read_contract
from onnxdeploy.graph import const_array, static_dims
from onnxdeploy.passes._attention_decompose import attention_nodes

__all__ = [
    "CAST_OPS",
    "LAYOUT_OPS",
    "REPEAT_OPS",
    "SCALE_OPS",
    "AttentionRead",
    "cache_buffers",
    "find_cache_reads",
    "head_repeats",
    "repeating_attention_nodes",
]

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
