"""Find a decoder's KV cache by data flow, not by names.

The cache path in real exports (DESIGN.md, "Passes", measured on optimum, TorchScript and dynamo
exports) is: graph input ``(B, H_kv, past, D)`` → pass-throughs (Identity; the TorchScript exporter adds a
one-input Concat) → a two-input Concat on the sequence axis (past first, the step's new K/V second) →
pass-throughs → graph output ``(B, H_kv, past + S, D)``. Which cache tensor is the key and which the
value, and which layer it belongs to, is read from the attention around it: the key reaches a MatMul
whose output flows into a Softmax; the value reaches a MatMul whose other operand comes from a Softmax;
a layer's key and value meet at the same Softmax.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Literal

import onnx

from onnxdeploy.errors import PreconditionError

__all__ = ["CacheTensor", "CacheLayer", "KVCache", "GraphIndex", "find_kv_cache", "PASS_THROUGH_OPS"]

PASS_THROUGH_OPS = frozenset({"Identity"})
"""Ops that forward a tensor unchanged; a one-input Concat counts too (TorchScript exporter)."""

_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.DOUBLE,
}


class GraphIndex:
    """Producer/consumer maps of a graph's main body (tensor name -> node indices).

    Args:
        graph: the ``GraphProto``; the index is a snapshot and must be rebuilt after edits.
    """

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = collections.defaultdict(list)
        for i, node in enumerate(graph.node):
            for out in node.output:
                if out:
                    self.producer[out] = i
            for inp in node.input:
                if inp:
                    self.consumers[inp].append(i)
        self.graph_inputs = {v.name: v for v in graph.input}
        self.graph_outputs = {v.name: v for v in graph.output}
        self.initializers = {t.name for t in graph.initializer}

    def node_label(self, idx: int) -> str:
        """Return ``'name' (OpType)`` for messages, or ``#idx (OpType)`` for unnamed nodes."""
        node = self.graph.node[idx]
        return f"'{node.name}' ({node.op_type})" if node.name else f"#{idx} ({node.op_type})"

    def is_pass_through(self, idx: int) -> bool:
        """True for nodes that forward their only input unchanged (Identity, one-input Concat)."""
        node = self.graph.node[idx]
        if node.op_type in PASS_THROUGH_OPS:
            return True
        return node.op_type == "Concat" and len([i for i in node.input if i]) == 1

    def forward_aliases(self, tensor: str) -> list[str]:
        """Return ``tensor`` and every tensor equal to it through pass-through nodes, in BFS order."""
        seen = [tensor]
        queue = collections.deque([tensor])
        while queue:
            t = queue.popleft()
            for c in self.consumers.get(t, []):
                if self.is_pass_through(c):
                    out = self.graph.node[c].output[0]
                    if out not in seen:
                        seen.append(out)
                        queue.append(out)
        return seen

    def upstream_nodes(self, tensor: str, max_depth: int) -> list[int]:
        """Return indices of nodes within ``max_depth`` hops upstream of ``tensor``."""
        found: list[int] = []
        frontier = [tensor]
        for _ in range(max_depth):
            nxt = []
            for t in frontier:
                p = self.producer.get(t)
                if p is not None and p not in found:
                    found.append(p)
                    nxt.extend(i for i in self.graph.node[p].input if i)
            frontier = nxt
        return found

    def downstream_nodes(self, tensor: str, max_depth: int) -> list[int]:
        """Return indices of nodes within ``max_depth`` hops downstream of ``tensor``."""
        found: list[int] = []
        frontier = [tensor]
        for _ in range(max_depth):
            nxt = []
            for t in frontier:
                for c in self.consumers.get(t, []):
                    if c not in found:
                        found.append(c)
                        nxt.extend(o for o in self.graph.node[c].output if o)
            frontier = nxt
        return found


@dataclass
class CacheTensor:
    """One cache tensor (a layer's key or value) found by data flow.

    Shapes: ``past_input`` ``(B, H_kv, past, D)``; ``new_operand`` ``(B, H_kv, S, D)``;
    ``concat_output`` and ``present_output`` ``(B, H_kv, past + S, D)``.
    """

    past_input: str
    present_output: str
    concat_index: int
    concat_name: str
    past_aliases: list[str]
    new_operand: str
    concat_output: str
    kind: Literal["key", "value", "unknown"] = "unknown"
    softmax_index: int | None = None


@dataclass
class CacheLayer:
    """A decoder layer's key and value cache tensors."""

    layer: int
    key: CacheTensor
    value: CacheTensor


@dataclass
class KVCache:
    """The decoder's KV cache: layers in graph order, heads, head dim and dtype of the cache tensors."""

    layers: list[CacheLayer]
    num_kv_heads: int
    head_dim: int
    elem_type: int
    warnings: list[str] = field(default_factory=list)

    @property
    def tensors(self) -> list[CacheTensor]:
        """All cache tensors, layer by layer, key before value."""
        return [t for layer in self.layers for t in (layer.key, layer.value)]

    def pairs(self) -> list[tuple[str, str]]:
        """``(past_input, present_output)`` name pairs, layer by layer, key before value."""
        return [(t.past_input, t.present_output) for t in self.tensors]


def _static_dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    dims: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return dims


def _classify(index: GraphIndex, ct: CacheTensor) -> None:
    """Set ``ct.kind`` and ``ct.softmax_index`` from the first MatMul the cache tensor reaches."""
    g = index.graph
    frontier = [ct.concat_output]
    seen: set[int] = set()
    matmul = None
    via = None
    for _ in range(12):
        nxt = []
        for t in frontier:
            for c in index.consumers.get(t, []):
                if c in seen:
                    continue
                seen.add(c)
                if g.node[c].op_type == "MatMul":
                    matmul, via = c, t
                    break
                nxt.extend(o for o in g.node[c].output if o)
            if matmul is not None:
                break
        if matmul is not None or not nxt:
            break
        frontier = nxt
    if matmul is None:
        return
    node = g.node[matmul]
    other = [i for i in node.input if i and i != via]
    for o in other:
        for up in index.upstream_nodes(o, 6):
            if g.node[up].op_type == "Softmax":
                ct.kind, ct.softmax_index = "value", up
                return
    for down in index.downstream_nodes(node.output[0], 8):
        if g.node[down].op_type == "Softmax":
            ct.kind, ct.softmax_index = "key", down
            return


def find_kv_cache(model: onnx.ModelProto, *, who: str = "kv cache") -> KVCache:
    """Find every (past input → Concat → present output) cache path of a decoder by data flow.

    Args:
        model: an exporter-convention decoder (past inputs ``(B, H_kv, past, D)``).
        who: the name used in error messages (usually the pass name).

    Returns:
        The cache, layers in graph order; key/value told apart by the attention around them.

    Raises:
        PreconditionError: no cache path was found, or the paths found are inconsistent
            (odd count, concat not on the sequence axis, mixed head counts). The message says what
            was looked for and what was found.
    """
    g = model.graph
    index = GraphIndex(g)
    found: list[CacheTensor] = []
    rank4 = []
    problems: list[str] = []
    for vi in g.input:
        if vi.name in index.initializers:
            continue
        tt = vi.type.tensor_type
        if tt.elem_type not in _FLOAT_TYPES or len(tt.shape.dim) != 4:
            continue
        rank4.append(vi.name)
        aliases = index.forward_aliases(vi.name)
        concats = []
        for a in aliases:
            for c in index.consumers.get(a, []):
                node = g.node[c]
                live = [i for i in node.input if i]
                if node.op_type == "Concat" and len(live) == 2:
                    concats.append((c, a))
        if not concats:
            problems.append(f"input '{vi.name}' reaches no two-input Concat")
            continue
        if len(concats) > 1:
            problems.append(f"input '{vi.name}' reaches {len(concats)} two-input Concats; expected one")
            continue
        cidx, via = concats[0]
        cnode = g.node[cidx]
        axis = next((a.i for a in cnode.attribute if a.name == "axis"), None)
        if axis not in (2, -2):
            problems.append(
                f"Concat {index.node_label(cidx)} of '{vi.name}' is on axis {axis}, not the sequence axis 2"
            )
            continue
        if cnode.input[0] != via:
            problems.append(f"Concat {index.node_label(cidx)} takes '{vi.name}' second; expected the past first")
            continue
        outs = [a for a in index.forward_aliases(cnode.output[0]) if a in index.graph_outputs]
        if len(outs) != 1:
            problems.append(
                f"Concat {index.node_label(cidx)} of '{vi.name}' reaches {len(outs)} graph outputs; expected one"
            )
            continue
        ct = CacheTensor(
            past_input=vi.name,
            present_output=outs[0],
            concat_index=cidx,
            concat_name=cnode.name,
            past_aliases=aliases,
            new_operand=cnode.input[1],
            concat_output=cnode.output[0],
        )
        _classify(index, ct)
        found.append(ct)

    if not found:
        inputs = ", ".join(f"'{v.name}' {_static_dims(v)}" for v in g.input) or "none"
        outputs = ", ".join(f"'{v.name}'" for v in g.output) or "none"
        detail = ("; ".join(problems)) if problems else "no rank-4 float graph input"
        raise PreconditionError(
            who,
            "no KV cache found. Looked for: rank-4 float graph inputs (B, H_kv, past, D) that reach, through "
            "Identity/one-input Concat, a two-input Concat on axis 2 whose output is a graph output. "
            f"Found: {detail}. Graph inputs: {inputs}. Graph outputs: {outputs}.",
        )
    if problems:
        raise PreconditionError(who, "unrecognised cache path: " + "; ".join(problems))
    if len(found) % 2:
        raise PreconditionError(who, f"found {len(found)} cache tensors; expected key/value pairs")

    found.sort(key=lambda c: c.concat_index)
    layers = _pair_layers(found, who)
    shapes = {
        (
            tuple(_static_dims(index.graph_inputs[c.past_input]))[1],
            tuple(_static_dims(index.graph_inputs[c.past_input]))[3],
        )
        for c in found
    }
    if len(shapes) != 1:
        raise PreconditionError(who, f"cache inputs disagree on (H_kv, D): {sorted(map(str, shapes))}")
    heads, head_dim = next(iter(shapes))
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        raise PreconditionError(
            who, f"cache inputs need static H_kv and D (dims 1 and 3); found H_kv={heads}, D={head_dim}"
        )
    etypes = {index.graph_inputs[c.past_input].type.tensor_type.elem_type for c in found}
    if len(etypes) != 1:
        raise PreconditionError(who, "cache inputs have mixed dtypes")
    return KVCache(layers=layers, num_kv_heads=heads, head_dim=head_dim, elem_type=etypes.pop())


def _pair_layers(found: list[CacheTensor], who: str) -> list[CacheLayer]:
    """Group cache tensors into layers: a key and a value sharing one Softmax; else in graph order."""
    by_softmax: dict[int, dict[str, CacheTensor]] = collections.defaultdict(dict)
    for c in found:
        if c.kind != "unknown" and c.softmax_index is not None:
            by_softmax[c.softmax_index][c.kind] = c
    complete = [v for v in by_softmax.values() if set(v) == {"key", "value"}]
    if len(complete) * 2 == len(found):
        ordered = sorted(complete, key=lambda kv: min(kv["key"].concat_index, kv["value"].concat_index))
        return [CacheLayer(layer=i, key=kv["key"], value=kv["value"]) for i, kv in enumerate(ordered)]
    # Fallback: attention not recognised (fused or unusual); pair in graph order, key first.
    layers = []
    for i in range(0, len(found), 2):
        a, b = found[i], found[i + 1]
        if a.kind == "value" or b.kind == "key":
            a, b = b, a
        a.kind, b.kind = "key", "value"
        layers.append(CacheLayer(layer=i // 2, key=a, value=b))
    return layers
