"""Find a decoder's KV cache by data flow, not by names (on an ``onnx_ir`` graph; no weights read).

The cache path in real exports (README, "Passes" → ``static_kv``, measured on optimum, TorchScript and dynamo
exports) is: graph input ``(B, H_kv, past, D)`` → pass-throughs (Identity; the TorchScript exporter adds a
one-input Concat) → a two-input Concat on the sequence axis (past first, the step's new K/V second) →
pass-throughs → graph output ``(B, H_kv, past + S, D)``. Which cache tensor is the key and which the
value, and which layer it belongs to, is read from the attention around it: the key reaches a MatMul
whose output flows into a Softmax; the value reaches a MatMul whose other operand comes from a Softmax;
a layer's key and value meet at the same Softmax.

onnxruntime-genai builder exports have no Concat: each layer's past K and V enter
``com.microsoft::GroupQueryAttention`` (inputs 3 and 4), which appends the step's K/V inside and outputs
present K and V (outputs 1 and 2). Such a cache is found too (``KVCache.attention_op``); its head dim may be
the symbol ``kv_cache_dim`` and is then read from the op's packed QKV projection weight (its shape, never
its data) or given by the caller (genai_config.json's ``head_size``, :func:`genai_head_size`). A past input
that enters another attention op that concatenates inside (opset-23 ``Attention`` as ``past_key``) is
refused, naming the op and the node.

The result holds ``ir.Value`` / ``ir.Node`` references into the graph it was found on (valid until that
graph is edited or replaced) and their names (valid on any copy of it).
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import onnx_ir as ir

from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import FLOAT_TYPES, consumers, downstream_nodes, upstream_nodes, value_dims

__all__ = [
    "GQA_OP",
    "PASS_THROUGH_OPS",
    "CacheLayer",
    "CacheTensor",
    "KVCache",
    "find_kv_cache",
    "find_logits_output",
    "forward_aliases",
    "genai_head_size",
    "is_pass_through",
]

PASS_THROUGH_OPS = frozenset({"Identity"})
"""Ops that forward a tensor unchanged; a one-input Concat counts too (TorchScript exporter)."""

GQA_OP = "com.microsoft::GroupQueryAttention"
"""The attention op of onnxruntime-genai builder exports; it holds the cache (past_key/past_value inputs 3, 4)."""
_GQA_PAST_INPUTS = {3: "key", 4: "value"}
_CONCATENATING_ATTENTION = {("", "Attention"): {4: "past_key", 5: "past_value"}}
"""Attention ops that take a past and concatenate inside (ONNX opset 23 Attention): refused, op and node named."""


def _live_inputs(node: ir.Node) -> list[ir.Value]:
    return [v for v in node.inputs if v is not None]


def is_pass_through(node: ir.Node) -> bool:
    """True for nodes that forward their only input unchanged (Identity, one-input Concat)."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in PASS_THROUGH_OPS:
        return True
    return node.op_type == "Concat" and len(_live_inputs(node)) == 1


def forward_aliases(value: ir.Value) -> list[ir.Value]:
    """Return ``value`` and every value equal to it through pass-through nodes, in BFS order."""
    seen = [value]
    queue = collections.deque([value])
    while queue:
        v = queue.popleft()
        for node in consumers(v):
            if is_pass_through(node):
                out = node.outputs[0]
                if all(out is not s for s in seen):
                    seen.append(out)
                    queue.append(out)
    return seen


def _node_ref(node: ir.Node, order: dict[int, int]) -> str:
    """``'name' (OpType)`` for messages, or ``#index (OpType)`` for unnamed nodes (the index in graph order).

    Unlike :func:`onnxdeploy.graph.node_label`, an unnamed node is named by its position, which a user can
    find in a viewer, rather than by an output name the exporter generated.
    """
    return f"'{node.name}' ({node.op_type})" if node.name else f"#{order.get(id(node), '?')} ({node.op_type})"


@dataclass
class CacheTensor:
    """One cache tensor (a layer's key or value) found by data flow.

    Shapes (BHSD): ``past_input`` ``(B, H_kv, past, D)``; ``new_operand`` ``(B, H_kv, S, D)``;
    ``concat_output`` and ``present_output`` ``(B, H_kv, past + S, D)``, all of the cache dtype.

    Attributes:
        past_input: the graph input holding the past K or V.
        present_output: the graph output holding past and new K or V.
        concat: the two-input Concat appending the step's K/V to the past; None when an attention op holds the
            cache (``attention``).
        past_aliases: ``past_input`` and every value equal to it through pass-throughs.
        new_operand: the Concat's second input, the step's K or V (None with ``attention``).
        concat_output: the Concat's output (with ``attention``: the op's present output).
        kind: ``key`` or ``value`` (``unknown`` until classified).
        softmax: the attention Softmax the tensor was matched to (None when not found).
        past_name: the past input's name when found (the static graph keeps it).
        present_name: the present output's name when found (the static graph keeps it).
    """

    past_input: ir.Value
    present_output: ir.Value
    concat: ir.Node | None
    past_aliases: list[ir.Value]
    new_operand: ir.Value | None
    concat_output: ir.Value
    kind: Literal["key", "value", "unknown"] = "unknown"
    softmax: ir.Node | None = None
    attention: ir.Node | None = None
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
        attention_op: :data:`GQA_OP` when the cache enters that op (no Concat; ``CacheTensor.attention`` is
            the layer's node), None for a Concat-appended cache.
        head_dim_source: where ``head_dim`` was read: ``input shape``, ``weights`` or ``given``.
    """

    layers: list[CacheLayer]
    num_kv_heads: int
    head_dim: int
    dtype: ir.DataType
    batch: int | None = None
    seq_axis: int = 2
    warnings: list[str] = field(default_factory=list)
    attention_op: str | None = None
    head_dim_source: str = "input shape"

    @property
    def attention_nodes(self) -> list[ir.Node]:
        """The attention op nodes holding the cache, one per layer (empty for a Concat-appended cache)."""
        return [layer.key.attention for layer in self.layers if layer.key.attention is not None]

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
            for c in consumers(v):
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
    for down in downstream_nodes(matmul.outputs[0], 8):
        if down.op_type == "Softmax":
            ct.kind, ct.softmax = "key", down
            return


def find_kv_cache(model: ir.Model | ir.Graph, *, who: str = "kv cache", head_dim: int | None = None) -> KVCache:
    """Find every (past input → Concat → present output) cache path of a decoder by data flow.

    Only the graph structure and the inputs' types are read, never initializer data. A cache that enters
    ``com.microsoft::GroupQueryAttention`` instead (onnxruntime-genai) is found as well (module docstring).

    Args:
        model: an exporter-convention decoder (past inputs ``(B, H_kv, past, D)`` of a float dtype), or its
            main graph.
        who: the name used in error messages (usually the pass name).
        head_dim: D when known from elsewhere (genai_config.json's ``head_size``); it must agree with the
            inputs' static D or the weights' where those give one.

    Returns:
        The cache, layers in graph order; key/value told apart by the attention around them. Its
        values and nodes belong to ``model``'s graph.

    Raises:
        PreconditionError: no cache path was found, or the paths found are inconsistent
            (odd count, concat not on the sequence axis, mixed head counts or dtypes, dynamic H_kv or D, a head
            dim that disagrees with ``head_dim``), or a past input enters an attention op that concatenates
            inside (named with its node). The message says what was looked for and what was found.
    """
    g = model.graph if isinstance(model, ir.Model) else model
    order = {id(n): i for i, n in enumerate(g)}
    outputs = {id(v) for v in g.outputs}
    found: list[CacheTensor] = []
    problems: list[str] = []
    for vi in g.inputs:
        if vi.name in g.initializers:
            continue
        if vi.dtype not in FLOAT_TYPES or vi.shape is None or len(vi.shape) != 4:
            continue
        path = _cache_path(vi, outputs, order)
        if isinstance(path, CacheTensor):
            found.append(path)
        else:
            problems.append(path)
    _refuse_paths(g, found, problems, who)
    return _cache_of(found, _layers(found, order, who), head_dim, who)


def _cache_path(past: ir.Value, outputs: set[int], order: dict[int, int]) -> CacheTensor | str:
    """The cache tensor of the graph input ``past`` (Concat-appended or held by an op), else why it is none."""
    aliases = forward_aliases(past)
    concats = [
        (c, a)
        for a in aliases
        for c in consumers(a)
        if c.op_type == "Concat" and c.domain in ("", "ai.onnx") and len(_live_inputs(c)) == 2
    ]
    if not concats:
        return _attention_holding(past, aliases, outputs, order)
    if len(concats) > 1:
        return f"input '{past.name}' reaches {len(concats)} two-input Concats; expected one"
    cnode, via = concats[0]
    axis_attr = cnode.attributes.get("axis")
    axis = axis_attr.as_int() if axis_attr is not None else None
    if axis not in (2, -2):
        return f"Concat {_node_ref(cnode, order)} of '{past.name}' is on axis {axis}, not the sequence axis 2"
    if cnode.inputs[0] is not via:
        return f"Concat {_node_ref(cnode, order)} takes '{past.name}' second; expected the past first"
    outs = [a for a in forward_aliases(cnode.outputs[0]) if id(a) in outputs]
    if len(outs) != 1:
        return f"Concat {_node_ref(cnode, order)} of '{past.name}' reaches {len(outs)} graph outputs; expected one"
    new = cnode.inputs[1]
    assert new is not None
    ct = CacheTensor(
        past_input=past,
        present_output=outs[0],
        concat=cnode,
        past_aliases=aliases,
        new_operand=new,
        concat_output=cnode.outputs[0],
    )
    _classify(ct)
    return ct


def _refuse_paths(g: ir.Graph, found: list[CacheTensor], problems: list[str], who: str) -> None:
    """Raise when no cache path was found, a past input's path is not recognised, or the paths are unpaired."""
    if not found:
        inputs = ", ".join(f"'{v.name}' {value_dims(v) or []}" for v in g.inputs) or "none"
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


def _layers(found: list[CacheTensor], order: dict[int, int], who: str) -> list[CacheLayer]:
    """The cache tensors as layers in graph order (sorts ``found``): one op node per layer, or by Softmax."""
    held_by_op = [c for c in found if c.attention is not None]
    if held_by_op and len(held_by_op) != len(found):
        raise PreconditionError(
            who,
            f"{len(held_by_op)} cache inputs enter {GQA_OP} and {len(found) - len(held_by_op)} a Concat; expected one",
        )
    if not held_by_op:
        found.sort(key=lambda c: order[id(c.concat)])
        return _pair_layers(found, order)
    found.sort(key=lambda c: (order[id(c.attention)], c.kind != "key"))
    layers = [CacheLayer(layer=i // 2, key=found[i], value=found[i + 1]) for i in range(0, len(found), 2)]
    if any(la.key.attention is not la.value.attention or la.key.kind != "key" for la in layers):
        raise PreconditionError(who, f"each {GQA_OP} node must take one past key and one past value input")
    return layers


def _cache_of(found: list[CacheTensor], layers: list[CacheLayer], head_dim: int | None, who: str) -> KVCache:
    """The cache of ``layers``: H_kv, D (where read), dtype and batch the past inputs agree on, or raise."""
    dims = [value_dims(c.past_input) or [None] * 4 for c in found]
    shapes = {(d[1], d[3]) for d in dims}
    if len(shapes) != 1:
        raise PreconditionError(who, f"cache inputs disagree on (H_kv, D): {sorted(map(str, shapes))}")
    heads, static_dim = next(iter(shapes))
    held_by_op = layers[0].key.attention is not None
    source = "input shape"
    resolved: int | str | None = static_dim
    if held_by_op and not isinstance(static_dim, int):
        resolved, source = _gqa_head_dim(layers[0].key.attention), "weights"  # type: ignore[arg-type]
    if head_dim is not None:
        if isinstance(resolved, int) and resolved != head_dim:
            raise PreconditionError(
                who, f"head dim {head_dim} (given, e.g. genai_config.json head_size) but the {source} give {resolved}"
            )
        resolved, source = head_dim, "given" if not isinstance(resolved, int) else source
    if not isinstance(heads, int) or not isinstance(resolved, int):
        raise PreconditionError(
            who, f"cache inputs need static H_kv and D (dims 1 and 3); found H_kv={heads}, D={static_dim}"
        )
    dtypes = {c.past_input.dtype for c in found}
    if len(dtypes) != 1:
        raise PreconditionError(who, f"cache inputs have mixed dtypes: {sorted(str(d) for d in dtypes)}")
    batches = {d[0] for d in dims}
    batch = next(iter(batches)) if len(batches) == 1 and isinstance(next(iter(batches)), int) else None
    dtype = dtypes.pop()
    assert dtype is not None
    return KVCache(
        layers=layers,
        num_kv_heads=heads,
        head_dim=resolved,
        dtype=dtype,
        batch=batch,  # type: ignore[arg-type]
        attention_op=GQA_OP if held_by_op else None,
        head_dim_source=source,
    )


def _attention_holding(
    past: ir.Value, aliases: list[ir.Value], outputs: set[int], order: dict[int, int]
) -> CacheTensor | str:
    """The cache tensor of ``past`` when it enters GroupQueryAttention, else why it is not a cache path."""
    for alias in aliases:
        for use in alias.uses():
            node, index = use.node, use.idx
            op = f"{node.domain or 'ai.onnx'}::{node.op_type}"
            if op == GQA_OP and index in _GQA_PAST_INPUTS:
                kind = _GQA_PAST_INPUTS[index]
                present = node.outputs[1 if kind == "key" else 2]
                outs = [a for a in forward_aliases(present) if id(a) in outputs]
                if len(outs) != 1:
                    return f"{GQA_OP} {_node_ref(node, order)}'s present {kind} reaches {len(outs)} graph outputs"
                return CacheTensor(
                    past_input=past,
                    present_output=outs[0],
                    concat=None,
                    past_aliases=aliases,
                    new_operand=None,
                    concat_output=present,
                    kind=kind,  # type: ignore[arg-type]
                    attention=node,
                )
            slot = _CONCATENATING_ATTENTION.get((node.domain if node.domain != "ai.onnx" else "", node.op_type), {})
            if index in slot:
                return (
                    f"input '{past.name}' enters {op} {_node_ref(node, order)} as {slot[index]}: the op concatenates "
                    "the cache inside, which static_kv does not rewrite (export with the cache Concat outside the op, "
                    "as torch.onnx.export(dynamo=True, opset_version=23) of transformers models does)"
                )
    users = sorted(
        {
            f"{u.node.domain or 'ai.onnx'}::{u.node.op_type} {_node_ref(u.node, order)}"
            for a in aliases
            for u in a.uses()
        }
    )
    return f"input '{past.name}' reaches no two-input Concat (read by {', '.join(users) or 'nothing'})"


_PROJECTION_HOPS = 3


def _projection_width(value: ir.Value) -> int | None:
    """Output width of the MatMul / MatMulNBits projecting ``value`` (from the weight's shape or N), or None."""
    for _ in range(_PROJECTION_HOPS):
        node = value.producer()
        if node is None:
            return None
        if node.op_type == "MatMulNBits":
            n = node.attributes.get("N")
            return n.as_int() if n is not None else None
        if node.op_type in ("MatMul", "Gemm") and node.inputs[1] is not None:
            weight = node.inputs[1]
            shape = weight.const_value.shape if weight.const_value is not None else weight.shape
            if shape is not None and len(shape) == 2 and isinstance(shape[1], int):
                return int(shape[1])
            return None
        if node.op_type != "Add" or node.inputs[0] is None:  # a bias Add between projection and attention
            return None
        value = node.inputs[0]
    return None


def _gqa_head_dim(node: ir.Node) -> int | None:
    """D of a GroupQueryAttention node from its query projection's width (packed QKV or Q alone), or None.

    Packed QKV (no key input): width = (num_heads + 2 · kv_num_heads) · D; separate Q: width = num_heads · D.
    """
    heads = node.attributes.get_int("num_heads", 0)
    kv_heads = node.attributes.get_int("kv_num_heads", 0)
    query = node.inputs[0]
    width = _projection_width(query) if query is not None else None
    packed = len(node.inputs) < 2 or node.inputs[1] is None
    per_head = heads + 2 * kv_heads if packed else heads
    if width is None or per_head <= 0 or width % per_head:
        return None
    return width // per_head


def genai_head_size(model_path: str | Path | None) -> int | None:
    """``model.decoder.head_size`` of the ``genai_config.json`` beside ``model_path`` (onnxruntime-genai), or None.

    Args:
        model_path: the ``.onnx`` file (its folder is searched), or None.

    Returns:
        The head size, or None when there is no such file or key.

    Raises:
        PreconditionError: the file exists but is not JSON, or ``head_size`` is not a positive integer.
    """
    if model_path is None:
        return None
    config = Path(model_path).parent / "genai_config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get("model", {}).get("decoder", {}).get("head_size")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise PreconditionError("kv cache", f"{config}: not a genai config ({exc})") from exc
    if value is None:
        return None
    if not isinstance(value, int) or value < 1:
        raise PreconditionError("kv cache", f"{config}: model.decoder.head_size {value!r} is not a positive integer")
    return value


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
