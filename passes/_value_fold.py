"""Act-order of o_proj folded into the V projection: where V's channels may be permuted within each head.

o_proj reads the attention output ``(..., H·D)``: for each query head ``h`` the ``D`` channels of
``P_h @ V_{kv(h)}``. ``P @ V`` keeps V's channels apart (each output channel is a mix over positions of one V
channel), so permuting V's channels within each KV head by ``p_g`` — the V projection's output columns (and
bias) — permutes o_proj's input within each query head ``h`` by ``p_{kv(h)}``: exact, no Gather left. Query heads
sharing a KV head (GQA) share its permutation, chosen from their summed importance.

Whether the graph allows it is decided by data flow (:func:`plan_value_fold`), on concrete dims (onnx shape
inference with data propagation on a weightless copy whose symbolic input dims are set to small primes, two
different sets that must agree):

* walking back from o_proj's activation through layout ops (``Reshape``, ``Transpose``, ``Unsqueeze``,
  ``Squeeze``, ``Expand``, ``Slice``, ``Cast``, ``Identity``), the attention ``MatMul`` (V as its right
  operand) and elementwise ops with a constant reaches a quantized MatMul (the V projection);
* walking forward from it, every reader of its output and of what follows is one of those ops, a ``Shape``
  (reads no channel), or o_proj; nothing is a graph output and nothing else joins. Each value carries an index
  array (which V channel each element holds, and which row of ``P`` mixed it), propagated with the ops' own
  semantics (reshape, transpose, broadcast), so the head layout, the head repeat of GQA (``Unsqueeze`` +
  ``Expand`` + ``Reshape``, or a broadcasting ``MatMul``) and the head dim ``D`` are read off the graph, not
  assumed;
* at o_proj's input each block of ``D`` channels is the ``D`` channels of one KV head in order, mixed by one row of
  ``P``.

**Where V's channels leave the graph, nothing is folded.** In every decodable export V is written to the KV
cache (``present.{i}.value``, or a static graph's cache buffer): folding would store V's channels permuted in
the cache, which changes the graph's cache outputs. The logits would not change (the cache is fed back as it
was written), but a host or another graph reading or seeding that cache in the exporter's layout (a graph set's
siblings, a float prefill model, prefix caching) would silently decode wrong, and a logits-only verify would
not see it. There o_proj's permutation stays a ``Gather`` on its input, and the reason is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from onnxdeploy.graph import const_array, node_label
from onnxdeploy.model_io import stand_in_proto

__all__ = ["PROBES", "ValueFold", "concrete_dims", "plan_value_fold"]

_LAYOUT = {"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Cast", "Identity"}
_ARITH = {"Add", "Sub", "Mul", "Div"}
_ATTENTION_OPS = {"Attention", "GroupQueryAttention", "MultiHeadAttention"}
PROBES = ((3, 5, 7, 11, 13, 17, 19, 23), (7, 3, 11, 5, 17, 13, 23, 19))
"""Values given to the graph inputs' symbolic dims (one per distinct name, in order) for shape inference: small,
so the index arrays stay small; distinct, so no two axes are confused; two sets, so a channel layout that
depends on them shows."""
_MAX_STEPS = 64


@dataclass
class ValueFold:
    """A foldable o_proj permutation: permute the V projection's output channels within each KV head.

    Attributes:
        producer: the V projection node (a MatMul the pass quantizes), output ``(..., N)``, ``N = H_kv·D``.
        head_dim: ``D``, channels per head.
        kv_of_head: int ``(H,)``: the KV head (block of ``D`` of the producer's output) each o_proj input head reads.
        n_kv: ``H_kv``.
        constants: ``(node, input index)`` of ``(N,)`` constants added to or multiplying V's channels (a bias),
            permuted with them.
    """

    producer: ir.Node
    head_dim: int
    kv_of_head: np.ndarray
    n_kv: int
    constants: list[tuple[ir.Node, int]] = field(default_factory=list)

    def permutations(
        self, importance: np.ndarray, order: Callable[[np.ndarray], np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The producer's output permutation ``(N,)`` and o_proj's input permutation ``(K,)``.

        Args:
            importance: o_proj's input-channel importance float ``(K,)`` (``K = H·D``).
            order: the act-order of one KV head's importance ``(D,)`` (position -> original channel).

        Returns:
            ``(v_perm, o_perm)`` int64: ``v_perm[g·D + j] = g·D + p_g[j]`` and ``o_perm[h·D + j] = h·D +
            p_{kv(h)}[j]``, ``p_g`` the order of the importance summed over the query heads reading KV head ``g``.
        """
        d = self.head_dim
        summed = np.zeros((self.n_kv, d), dtype=np.float64)
        np.add.at(summed, self.kv_of_head, np.asarray(importance, dtype=np.float64).reshape(-1, d))
        orders = np.stack([order(summed[g]) for g in range(self.n_kv)])  # (H_kv, D)
        v_perm = np.arange(self.n_kv)[:, None] * d + orders
        o_perm = np.arange(len(self.kv_of_head))[:, None] * d + orders[self.kv_of_head]
        return v_perm.reshape(-1).astype(np.int64), o_perm.reshape(-1).astype(np.int64)


def concrete_dims(model: ir.Model, probe: tuple[int, ...] = PROBES[0]) -> dict[str, list[int | None]]:
    """Every value's dims by onnx shape inference (data propagation on), with symbolic input dims made concrete.

    Each distinct symbolic dim of the graph inputs (``batch_size``, ``sequence_length``, ...) becomes the next
    of ``probe``; the weights are not read (a weightless stand-in). Dims inference cannot tell are None.

    Returns:
        Value name -> dims (graph outputs and inner values; inputs and initializers by their declared shapes).
    """
    proto = stand_in_proto(model)
    given: dict[str, int] = {}
    values = iter(probe)
    for info in proto.graph.input:
        for dim in info.type.tensor_type.shape.dim:
            if not dim.HasField("dim_value"):
                key = dim.dim_param or f"<anonymous {len(given)}>"
                if key not in given:
                    given[key] = next(values, 29 + 2 * len(given))
                dim.dim_value = given[key]
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # noqa: BLE001  (inference refusing the graph: nothing is known)
        return {}
    dims: dict[str, list[int | None]] = {}
    for info in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            dims[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    for init in inferred.graph.initializer:
        dims.setdefault(init.name, list(init.dims))
    return dims


def _find_producer(activation: ir.Value, is_target: Callable[[ir.Node], bool]) -> tuple[ir.Node | None, str, bool]:
    """Walk back from an activation to the V projection.

    Returns:
        ``(producer, reason, attention)``: the V projection (None when not found, ``reason`` then says why) and
        whether the walk went through an attention ``MatMul`` (the activation is o_proj's input).
    """
    cur = activation
    attention = False
    for _ in range(_MAX_STEPS):
        if cur.is_graph_output() and cur is not activation:
            return None, f"V's channels reach graph output '{cur.name}' (the KV cache)", attention
        node = cur.producer()
        if node is None:
            what = "initializer" if cur.const_value is not None else "graph input"
            return None, f"V's channels come from {what} '{cur.name}' (the KV cache)", attention
        if is_target(node):
            return (node, "", attention) if attention else (None, "no attention MatMul on the way", False)
        nxt = None
        if node.op_type in _ATTENTION_OPS:
            attention = True  # fused attention (ORT's contrib ops, ONNX Attention-23): V is one of its inputs
        elif node.domain not in ("", "ai.onnx"):
            pass
        elif node.op_type in _LAYOUT or node.op_type == "Slice":
            nxt = node.inputs[0]
        elif node.op_type == "MatMul" and const_array(node.inputs[1]) is None and not attention:
            nxt, attention = node.inputs[1], True  # attention: probs @ V
        elif node.op_type in _ARITH and len(node.inputs) == 2:
            consts = [const_array(v) is not None for v in node.inputs]
            if consts.count(True) == 1:
                nxt = node.inputs[consts.index(False)]
        if nxt is None:
            cache = _cache_io(node)
            if cache:
                return None, f"V's channels are written to the KV cache by {node_label(node)} ({cache})", attention
            return None, f"V's channels pass through {node_label(node)}", attention
        cur = nxt
    return None, "no V projection within reach", attention


_PASS_THROUGH = {"Cast", "Identity", "Reshape", "Transpose", "Slice", "Unsqueeze", "Squeeze"}


def _cache_io(node: ir.Node) -> str:
    """The graph input and output a node reads and writes through layout ops and casts (a cache write), or ""."""
    found = []
    for value in node.inputs:
        for _ in range(4):
            if value is None or value.is_graph_input():
                break
            producer = value.producer()
            value = producer.inputs[0] if producer is not None and producer.op_type in _PASS_THROUGH else None
        if value is not None and value.is_graph_input():
            found.append(f"graph input '{value.name}'")
    todo = [(out, 0) for out in node.outputs]
    while todo:
        value, depth = todo.pop()
        if value.is_graph_output():
            found.append(f"graph output '{value.name}'")
        elif depth < 4:
            todo += [(u.outputs[0], depth + 1) for u, i in value.uses() if u.op_type in _PASS_THROUGH and i == 0]
    return ", ".join(found)


@dataclass
class _Carried:
    """What a region value carries, as int arrays of the value's concrete dims.

    ``ids``: which V channel each element holds; ``ctx``: which row of the attention probabilities mixed it
    (0 before the attention MatMul).
    """

    ids: np.ndarray
    ctx: np.ndarray


def _axes(node: ir.Node) -> list[int] | None:
    """The constant ``axes`` of an Unsqueeze/Squeeze (input from opset 13, attribute before), or None."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = const_array(node.inputs[1])
        return None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    if "axes" in node.attributes:
        return list(node.attributes.get_ints("axes"))
    return None


def _slice(node: ir.Node, rank: int) -> tuple[slice, ...] | None:
    """A Slice as numpy indexing (bounds from inputs, or attributes below opset 10), or None when not constant."""
    if len(node.inputs) > 1:
        parts = [None if v is None else const_array(v) for v in node.inputs[1:5]]
        given = [v is not None for v in node.inputs[1:5]]
        if any(g and p is None for g, p in zip(given, parts, strict=True)) or parts[0] is None or parts[1] is None:
            return None
    else:
        parts = [node.attributes.get_ints(k, None) for k in ("starts", "ends", "axes")]
        if parts[0] is None or parts[1] is None:
            return None
    starts, ends = (np.asarray(p).reshape(-1) for p in parts[:2])
    axes = np.arange(len(starts)) if len(parts) < 3 or parts[2] is None else np.asarray(parts[2]).reshape(-1)
    steps = np.ones(len(starts), int) if len(parts) < 4 or parts[3] is None else np.asarray(parts[3]).reshape(-1)
    window = [slice(None)] * rank
    huge = 1 << 62  # ONNX's "to the end" (INT64_MAX or the like)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        stop = None if (step > 0 and end >= huge) or (step < 0 and end <= -huge) else int(end)
        window[int(axis) % rank] = slice(int(start), stop, int(step))
    return tuple(window)


def plan_value_fold(
    activation: ir.Value,
    readers: set[int],
    is_target: Callable[[ir.Node], bool],
    dims_of: Callable[[int], dict[str, list[int | None]]],
) -> ValueFold | str | None:
    """Whether o_proj's permutation can be folded into the V projection, and how; else why not.

    The forward walk runs on two sets of concrete dims (:data:`PROBES`), which must give the same fold: a
    layout that depended on the batch or sequence length is not folded.

    Args:
        activation: o_proj's input ``(..., K)``.
        readers: ``id()`` of the nodes reading ``activation`` whose rows are permuted (the o_proj targets).
        is_target: whether a node is a MatMul the pass quantizes (the V projection must be one).
        dims_of: ``dims_of(i)`` returns :func:`concrete_dims` of the graph with ``PROBES[i]`` (called only when a
            V projection is found).

    Returns:
        The fold; or why there is none, for the report, when ``activation`` is an attention output (o_proj's
        input); else None.
    """
    producer, reason, attention = _find_producer(activation, is_target)
    if producer is None:
        return reason if attention else None
    folds = [_analyse(producer, activation, readers, dims_of(i)) for i in range(len(PROBES))]
    if any(isinstance(f, str) for f in folds):
        return next(f for f in folds if isinstance(f, str))
    first = folds[0]
    assert isinstance(first, ValueFold)
    for other in folds[1:]:
        assert isinstance(other, ValueFold)
        if other.head_dim != first.head_dim or not np.array_equal(other.kv_of_head, first.kv_of_head):
            return "the head layout at o_proj's input depends on the input dims"
    return first


def _known(value: ir.Value, dims: dict[str, list[int | None]]) -> list[int] | None:
    """``value``'s concrete dims, or None.

    An Expand whose repeat count inference cannot tell, read by one Reshape that can: solved by element count.
    """
    got = dims.get(str(value.name))
    if got is None:
        return None
    if None not in got:
        return list(got)  # type: ignore[arg-type]
    users = [u for u, _ in value.uses() if u.op_type not in ("Shape", "Size")]
    if got.count(None) == 1 and len(users) == 1 and users[0].op_type == "Reshape":
        out = dims.get(str(users[0].outputs[0].name))
        if out is not None and None not in out:
            rest = int(np.prod([d for d in got if d is not None]))
            total = int(np.prod(out))
            if rest and total % rest == 0:
                return [total // rest if d is None else d for d in got]  # type: ignore[misc]
    return None


@dataclass
class _Walk:
    """The forward walk's state: the concrete dims, ``N``, the bias constants met, whether P @ V was passed."""

    dims: dict[str, list[int | None]]
    n: int
    constants: list[tuple[ir.Node, int]] = field(default_factory=list)
    mixed: bool = False

    def step(self, node: ir.Node, index: int, here: _Carried) -> _Carried | str:
        """What ``node``'s output carries when its input ``index`` carries ``here``; else why the fold stops."""
        op = node.op_type
        if op in ("Cast", "Identity"):
            return here
        if op in ("Reshape", "Expand") and index == 0:
            return self._reshape(node, here)
        if op == "Transpose":
            perm = node.attributes.get_ints("perm", None)
            perm = list(perm) if perm is not None else list(reversed(range(here.ids.ndim)))
            return _Carried(here.ids.transpose(perm), here.ctx.transpose(perm))
        if op in ("Unsqueeze", "Squeeze") and index == 0:
            return _unsqueeze(node, here)
        if op == "Slice" and index == 0:
            window = _slice(node, here.ids.ndim)
            if window is None:
                return f"the bounds of {node_label(node)} are not constant"
            return _Carried(here.ids[window], here.ctx[window])
        if op == "MatMul" and index == 1 and not self.mixed:
            return self._attention(node, here)
        if op in _ARITH and len(node.inputs) == 2:
            return self._arith(node, index, here)
        return f"V's channels pass through {node_label(node)}"

    def _reshape(self, node: ir.Node, here: _Carried) -> _Carried | str:
        out = node.outputs[0]
        out_dims = _known(out, self.dims)
        if out_dims is None:
            return f"the shape of '{out.name}' is unknown"
        if node.op_type == "Reshape":
            if int(np.prod(out_dims)) != here.ids.size:
                return f"the shapes around {node_label(node)} do not agree"
            return _Carried(here.ids.reshape(out_dims), here.ctx.reshape(out_dims))
        try:
            return _Carried(np.broadcast_to(here.ids, out_dims), np.broadcast_to(here.ctx, out_dims))
        except ValueError:
            return f"the shapes around {node_label(node)} do not agree"

    def _attention(self, node: ir.Node, here: _Carried) -> _Carried | str:
        """Attention ``P (..., S, T) @ V (..., T, D)``: output ``[..., s, d]`` mixes ``V[..., :, d]`` by row s."""
        out = node.outputs[0]
        out_dims = _known(out, self.dims)
        if out_dims is None:
            return f"the shape of '{out.name}' is unknown"
        if here.ids.ndim < 2 or not (here.ids == here.ids[..., :1, :]).all():
            return f"{node_label(node)} mixes V's channels"
        try:
            ids = np.broadcast_to(here.ids[..., :1, :], out_dims)
        except ValueError:
            return f"the shapes around {node_label(node)} do not agree"
        rows = int(np.prod(out_dims[:-1]))
        ctx = np.broadcast_to(np.arange(1, rows + 1, dtype=np.int64).reshape(*out_dims[:-1], 1), out_dims)
        self.mixed = True
        return _Carried(ids, ctx)

    def _arith(self, node: ir.Node, index: int, here: _Carried) -> _Carried | str:
        """A scalar, or (before P @ V) a bias ``(N,)`` on the V projection's output channels, permuted with them."""
        array = const_array(node.inputs[1 - index])
        if array is None:
            return f"{node_label(node)} combines V's channels with a computed value"
        n = self.n
        if array.size == 1:
            return here
        if array.size == n and array.shape[-1] == n and not self.mixed and (here.ids == np.arange(n)).all():
            self.constants.append((node, 1 - index))
            return here
        return f"{node_label(node)} combines V's channels with a constant of shape {list(array.shape)}"


def _unsqueeze(node: ir.Node, here: _Carried) -> _Carried | str:
    """An Unsqueeze or Squeeze of what ``here`` carries (Squeeze drops only axes of size 1)."""
    axes = _axes(node)
    if node.op_type == "Unsqueeze":
        if axes is None:
            return f"the axes of {node_label(node)} are not constant"
        rank = here.ids.ndim + len(axes)
        where = tuple(sorted(a % rank for a in axes))
        return _Carried(np.expand_dims(here.ids, where), np.expand_dims(here.ctx, where))
    rank = here.ids.ndim
    where = tuple(range(rank)) if axes is None else tuple(sorted(a % rank for a in axes))
    where = tuple(a for a in where if here.ids.shape[a] == 1)
    return _Carried(np.squeeze(here.ids, where), np.squeeze(here.ctx, where))


def _analyse(
    producer: ir.Node, activation: ir.Value, readers: set[int], dims: dict[str, list[int | None]]
) -> ValueFold | str:
    """The forward walk of :func:`plan_value_fold` on one set of concrete dims."""
    v_out = producer.outputs[0]
    v_dims = _known(v_out, dims)
    if v_dims is None:
        return f"the shape of '{v_out.name}' is unknown"
    walk = _Walk(dims, v_dims[-1])
    carried = {
        id(v_out): _Carried(np.broadcast_to(np.arange(walk.n, dtype=np.int64), v_dims), np.zeros(v_dims, np.int64))
    }
    todo = [v_out]
    result: _Carried | None = None
    done: set[int] = set()
    while todo:
        value = todo.pop(0)
        here = carried[id(value)]
        if value.is_graph_output():
            return f"V's channels reach graph output '{value.name}' (the KV cache)"
        for node, index in value.uses():
            if node.op_type in ("Shape", "Size"):
                continue
            if value is activation and id(node) in readers:
                result = here
                continue
            if id(node) in done:
                return f"{node_label(node)} reads V's channels twice"
            done.add(id(node))
            if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
                return f"V's channels pass through {node_label(node)}"
            nxt = walk.step(node, index, here)
            if isinstance(nxt, str):
                return nxt
            carried[id(node.outputs[0])] = nxt
            todo.append(node.outputs[0])
    if result is None:
        return "V's channels do not reach o_proj"
    return _whole_heads(producer, result, walk)


def _whole_heads(producer: ir.Node, result: _Carried, walk: _Walk) -> ValueFold | str:
    """The fold when o_proj's input is whole heads of ``D`` V channels in order, each mixed by one row of P."""
    n = walk.n
    k = result.ids.shape[-1]
    ids = result.ids.reshape(-1, k)
    ctx = result.ctx.reshape(-1, k)
    if not (ids == ids[:1]).all():
        return "o_proj's channels hold different V channels at different positions"
    c = ids[0]
    for d in sorted((d for d in range(2, min(n, k) + 1) if n % d == 0 and k % d == 0), reverse=True):
        blocks = c.reshape(-1, d)
        if not (blocks % d == np.arange(d)).all() or not (blocks // d == blocks[:, :1] // d).all():
            continue
        if not (ctx.reshape(ctx.shape[0], -1, d) == ctx.reshape(ctx.shape[0], -1, d)[..., :1]).all():
            continue
        return ValueFold(producer, d, (blocks[:, 0] // d).astype(np.int64), n // d, walk.constants)
    return "o_proj's channels are not whole heads of V's channels"
