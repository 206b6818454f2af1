"""Find a decoder's KV cache by data flow, not by names (on an ``onnx_ir`` graph; no weights read).

The cache path in real exports (DESIGN.md, "Passes", measured on optimum, TorchScript and dynamo
exports) is: graph input ``(B, H_kv, past, D)`` → pass-throughs (Identity; the TorchScript exporter adds a
one-input Concat) → a two-input Concat on the sequence axis (past first, the step's new K/V second) →
pass-throughs → graph output ``(B, H_kv, past + S, D)``. Which cache tensor is the key and which the
value, and which layer it belongs to, is read from the attention around it: the key reaches a MatMul
whose output flows into a Softmax; the value reaches a MatMul whose other operand comes from a Softmax;
a layer's key and value meet at the same Softmax.

The result holds ``ir.Value`` / ``ir.Node`` references into the graph it was found on (valid until that
graph is edited or replaced) and their names (valid on any copy of it).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx_ir as ir

from onnxdeploy.errors import PreconditionError

__all__ = [
    "PASS_THROUGH_OPS",
    "CacheLayer",
    "CacheTensor",
    "KVCache",
    "find_kv_cache",
    "find_logits_output",
    "forward_aliases",
    "is_pass_through",
    "upstream_nodes",
]

PASS_THROUGH_OPS = frozenset({"Identity"})
"""Ops that forward a tensor unchanged; a one-input Concat counts too (TorchScript exporter)."""

_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


def _live_inputs(node: ir.Node) -> list[ir.Value]:
    return [v for v in node.inputs if v is not None]


def is_pass_through(node: ir.Node) -> bool:
    """True for nodes that forward their only input unchanged (Identity, one-input Concat)."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in PASS_THROUGH_OPS:
        return True
    return node.op_type == "Concat" and len(_live_inputs(node)) == 1


def _consumers(value: ir.Value) -> list[ir.Node]:
    """Distinct consumer nodes of ``value``, in use order."""
    seen: dict[int, ir.Node] = {}
    for use in value.uses():
        seen.setdefault(id(use.node), use.node)
    return list(seen.values())


def forward_aliases(value: ir.Value) -> list[ir.Value]:
    """Return ``value`` and every value equal to it through pass-through nodes, in BFS order."""
    seen = [value]
    queue = collections.deque([value])
    while queue:
        v = queue.popleft()
        for node in _consumers(v):
            if is_pass_through(node):
                out = node.outputs[0]
                if all(out is not s for s in seen):
                    seen.append(out)
                    queue.append(out)
    return seen


def upstream_nodes(value: ir.Value, max_depth: int) -> list[ir.Node]:
    """Return the nodes within ``max_depth`` hops upstream of ``value`` (its producer first)."""
    found: dict[int, ir.Node] = {}
    frontier = [value]
    for _ in range(max_depth):
        nxt = []
        for v in frontier:
            p = v.producer()
            if p is not None and id(p) not in found:
                found[id(p)] = p
                nxt.extend(_live_inputs(p))
        frontier = nxt
    return list(found.values())


def _downstream_nodes(value: ir.Value, max_depth: int) -> list[ir.Node]:
    found: dict[int, ir.Node] = {}
    frontier = [value]
    for _ in range(max_depth):
        nxt = []
        for v in frontier:
            for c in _consumers(v):
                if id(c) not in found:
                    found[id(c)] = c
                    nxt.extend(c.outputs)
        frontier = nxt
    return list(found.values())


def _label(node: ir.Node, order: dict[int, int]) -> str:
    """``'name' (OpType)`` for messages, or ``#index (OpType)`` for unnamed nodes."""
    return f"'{node.name}' ({node.op_type})" if node.name else f"#{order.get(id(node), '?')} ({node.op_type})"


def _dims(value: ir.Value) -> list[int | str | None]:
    if value.shape is None:
        return []
    return [d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None) for d in value.shape]


@dataclass
class CacheTensor:
    """One cache tensor (a layer's key or value) found by data flow.

    Shapes (BHSD): ``past_input`` ``(B, H_kv, past, D)``; ``new_operand`` ``(B, H_kv, S, D)``;
    ``concat_output`` and ``present_output`` ``(B, H_kv, past + S, D)``, all of the cache dtype.

    Attributes:
        past_input: the graph input holding the past K or V.
        present_output: the graph output holding past and new K or V.
        concat: the two-input Concat appending the step's K/V to the past.
        past_aliases: ``past_input`` and every value equal to it through pass-throughs.
        new_operand: the Concat's second input, the step's K or V.
        concat_output: the Concat's output.
        kind: ``key`` or ``value`` (``unknown`` until classified).
        softmax: the attention Softmax the tensor was matched to (None when not found).
        past_name: the past input's name when found (the static graph keeps it).
        present_name: the present output's name when found (the static graph keeps it).
    """

    past_input: ir.Value
    present_output: ir.Value
    concat: ir.Node
    past_aliases: list[ir.Value]
    new_operand: ir.Value
    concat_output: ir.Value
    kind: Literal["key", "value", "unknown"] = "unknown"
    softmax: ir.Node | None = None
    past_name: str = field(init=False)
    present_name: str = field(init=False)

    def __post_init__(self) -> None:
        # Names as found: the rewrite keeps them on the graph's inputs and outputs, though the values change.
        self.past_name = str(self.past_input.name)
        self.present_name = str(self.present_output.name)


@dataclass
class CacheLayer:
    """A decoder layer's key and value cache tensors (``layer`` is 0-based, in data-flow order)."""

    layer: int
    key: CacheTensor
    value: CacheTensor


@dataclass
class KVCache:
    """The decoder's KV cache: layers in graph order, heads, head dim and dtype of the cache tensors.

    Attributes:
        layers: one entry per decoder layer.
        num_kv_heads: H_kv, dim 1 of every cache input.
        head_dim: D, dim 3 of every cache input.
        dtype: the cache element type (a float type).
        batch: dim 0 of the cache inputs when the export fixed it (an int), else None.
        seq_axis: the axis the Concat appends on (2 for the exporters' ``(B, H_kv, S, D)``).
    """

    layers: list[CacheLayer]
    num_kv_heads: int
    head_dim: int
    dtype: ir.DataType
    batch: int | None = None
    seq_axis: int = 2
    warnings: list[str] = field(default_factory=list)

    @property
    def tensors(self) -> list[CacheTensor]:
        """All cache tensors, layer by layer, key before value."""
        return [t for layer in self.layers for t in (layer.key, layer.value)]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The cache dtype as a numpy dtype (e.g. ``float32``)."""
        return np.dtype(self.dtype.numpy())

    def pairs(self) -> list[tuple[str, str]]:
        """``(past_input, present_output)`` name pairs, layer by layer, key before value."""
        return [(t.past_name, t.present_name) for t in self.tensors]


def _classify(ct: CacheTensor) -> None:
    """Set ``ct.kind`` and ``ct.softmax`` from the first MatMul the cache tensor reaches."""
    frontier = [ct.concat_output]
    seen: set[int] = set()
    matmul: ir.Node | None = None
    via: ir.Value | None = None
    for _ in range(12):
        nxt: list[ir.Value] = []
        for v in frontier:
            for c in _consumers(v):
                if id(c) in seen:
                    continue
                seen.add(id(c))
                if c.op_type == "MatMul":
                    matmul, via = c, v
                    break
                nxt.extend(c.outputs)
            if matmul is not None:
                break
        if matmul is not None or not nxt:
            break
        frontier = nxt
    if matmul is None:
        return
    for other in (i for i in _live_inputs(matmul) if i is not via):
        for up in upstream_nodes(other, 6):
            if up.op_type == "Softmax":
                ct.kind, ct.softmax = "value", up
                return
    for down in _downstream_nodes(matmul.outputs[0], 8):
        if down.op_type == "Softmax":
            ct.kind, ct.softmax = "key", down
            return


def find_kv_cache(model: ir.Model | ir.Graph, *, who: str = "kv cache") -> KVCache:
    """Find every (past input → Concat → present output) cache path of a decoder by data flow.

    Only the graph structure and the inputs' types are read, never initializer data.

    Args:
        model: an exporter-convention decoder (past inputs ``(B, H_kv, past, D)`` of a float dtype), or its
            main graph.
        who: the name used in error messages (usually the pass name).

    Returns:
        The cache, layers in graph order; key/value told apart by the attention around them. Its
        values and nodes belong to ``model``'s graph.

    Raises:
        PreconditionError: no cache path was found, or the paths found are inconsistent
            (odd count, concat not on the sequence axis, mixed head counts or dtypes, dynamic H_kv or D).
            The message says what was looked for and what was found.
    """
    g = model.graph if isinstance(model, ir.Model) else model
    order = {id(n): i for i, n in enumerate(g)}
    outputs = {id(v) for v in g.outputs}
    found: list[CacheTensor] = []
    problems: list[str] = []
    for vi in g.inputs:
        if vi.name in g.initializers:
            continue
        if vi.dtype not in _FLOAT_TYPES or vi.shape is None or len(vi.shape) != 4:
            continue
        aliases = forward_aliases(vi)
        concats = []
        for a in aliases:
            for c in _consumers(a):
                if c.op_type == "Concat" and c.domain in ("", "ai.onnx") and len(_live_inputs(c)) == 2:
                    concats.append((c, a))
        if not concats:
            problems.append(f"input '{vi.name}' reaches no two-input Concat")
            continue
        if len(concats) > 1:
            problems.append(f"input '{vi.name}' reaches {len(concats)} two-input Concats; expected one")
            continue
        cnode, via = concats[0]
        axis_attr = cnode.attributes.get("axis")
        axis = axis_attr.as_int() if axis_attr is not None else None
        if axis not in (2, -2):
            problems.append(f"Concat {_label(cnode, order)} of '{vi.name}' is on axis {axis}, not the sequence axis 2")
            continue
        if cnode.inputs[0] is not via:
            problems.append(f"Concat {_label(cnode, order)} takes '{vi.name}' second; expected the past first")
            continue
        outs = [a for a in forward_aliases(cnode.outputs[0]) if id(a) in outputs]
        if len(outs) != 1:
            problems.append(
                f"Concat {_label(cnode, order)} of '{vi.name}' reaches {len(outs)} graph outputs; expected one"
            )
            continue
        new = cnode.inputs[1]
        assert new is not None
        ct = CacheTensor(
            past_input=vi,
            present_output=outs[0],
            concat=cnode,
            past_aliases=aliases,
            new_operand=new,
            concat_output=cnode.outputs[0],
        )
        _classify(ct)
        found.append(ct)

    if not found:
        inputs = ", ".join(f"'{v.name}' {_dims(v)}" for v in g.inputs) or "none"
        outs_text = ", ".join(f"'{v.name}'" for v in g.outputs) or "none"
        detail = ("; ".join(problems)) if problems else "no rank-4 float graph input"
        raise PreconditionError(
            who,
            "no KV cache found. Looked for: rank-4 float graph inputs (B, H_kv, past, D) that reach, through "
            "Identity/one-input Concat, a two-input Concat on axis 2 whose output is a graph output. "
            f"Found: {detail}. Graph inputs: {inputs}. Graph outputs: {outs_text}.",
        )
    if problems:
        raise PreconditionError(who, "unrecognised cache path: " + "; ".join(problems))
    if len(found) % 2:
        raise PreconditionError(who, f"found {len(found)} cache tensors; expected key/value pairs")

    found.sort(key=lambda c: order[id(c.concat)])
    layers = _pair_layers(found, order)
    shapes = {(_dims(c.past_input)[1], _dims(c.past_input)[3]) for c in found}
    if len(shapes) != 1:
        raise PreconditionError(who, f"cache inputs disagree on (H_kv, D): {sorted(map(str, shapes))}")
    heads, head_dim = next(iter(shapes))
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        raise PreconditionError(
            who, f"cache inputs need static H_kv and D (dims 1 and 3); found H_kv={heads}, D={head_dim}"
        )
    dtypes = {c.past_input.dtype for c in found}
    if len(dtypes) != 1:
        raise PreconditionError(who, f"cache inputs have mixed dtypes: {sorted(str(d) for d in dtypes)}")
    batches = {_dims(c.past_input)[0] for c in found}
    batch = next(iter(batches)) if len(batches) == 1 and isinstance(next(iter(batches)), int) else None
    dtype = dtypes.pop()
    assert dtype is not None
    return KVCache(layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype, batch=batch)


def _pair_layers(found: list[CacheTensor], order: dict[int, int]) -> list[CacheLayer]:
    """Group cache tensors into layers: a key and a value sharing one Softmax; else in graph order."""
    by_softmax: dict[int, dict[str, CacheTensor]] = collections.defaultdict(dict)
    for c in found:
        if c.kind != "unknown" and c.softmax is not None:
            by_softmax[id(c.softmax)][c.kind] = c
    complete = [v for v in by_softmax.values() if set(v) == {"key", "value"}]
    if len(complete) * 2 == len(found):
        ordered = sorted(complete, key=lambda kv: min(order[id(kv["key"].concat)], order[id(kv["value"].concat)]))
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


def find_logits_output(graph: ir.Graph, presents: set[str], *, who: str = "kv cache") -> ir.Value:
    """Return the single graph output that is not a present (cache) output: the logits ``(B, S, V)``.

    Exporters may name it ``logits`` or ``lm_logits``; only its position among the outputs matters.

    Args:
        graph: the decoder's main graph.
        presents: names of the present K/V outputs.
        who: the name used in error messages.

    Returns:
        The logits output value.

    Raises:
        PreconditionError: there is no output besides the cache, or there are several.
    """
    others = [o for o in graph.outputs if o.name not in presents]
    if len(others) != 1:
        raise PreconditionError(
            who, f"expected one logits output besides the cache outputs; found {[o.name for o in others]}"
        )
    return others[0]
