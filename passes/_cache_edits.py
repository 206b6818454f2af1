"""Cache edits several passes need, each one step on an ``onnx_ir`` graph (DESIGN.md, "Layout").

The steps ``static_kv`` chains, usable on their own by later passes (prefill buckets, ``kv_layout``):

* :func:`add_cache_position` — the int64 ``[step_len]`` input naming the cache slots a call writes.
* :func:`find_query_positions` / :func:`feed_query_positions` — find the exporter's query-position vector
  (``past_len + arange(S)``) by running the original at two past lengths, and feed ``cache_position`` there.
* :func:`rewrite_cache_writes` — past inputs become fixed buffers written at ``cache_position`` (ScatterElements,
  ScatterND or a select: :func:`build_cache_write`, any layout); every other reader of the past sees a Slice view of
  ``max_cache_len - S`` slots.
* :func:`fix_io_dims` — fixed batch, step length and cache length on the graph inputs.
* :func:`replace_neg_inf` — ``-inf`` constants become the dtype's lowest finite value.
* :func:`build_contract` — the decode contract the host reads (written with :func:`onnxdeploy.contract.write_contract`).

Weights are never read or copied: onnxsim and onnx shape inference see protos whose large initializers
are typed stand-ins (:mod:`onnxdeploy.model_io`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxdeploy import model_io
from onnxdeploy.contract import KV_DTYPES, CacheBinding, CacheWrite, ContractInputs, DecodeContract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import float32_shadow_graph
from onnxdeploy.kv_cache import KVCache, find_logits_output, upstream_nodes
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import forget_shapes
from onnxdeploy.passes._probe import open_probe, pruned_copy

__all__ = [
    "CACHE_POSITION",
    "KNOWN_INPUTS",
    "add_cache_position",
    "build_cache_write",
    "build_contract",
    "feed_query_positions",
    "find_query_positions",
    "fix_io_dims",
    "replace_neg_inf",
    "rewrite_cache_writes",
]

CACHE_POSITION = "cache_position"
"""Name of the int64 ``[step_len]`` input holding the cache slots a call writes."""

KNOWN_INPUTS = ("input_ids", "attention_mask", "position_ids")
"""Non-cache inputs of the exporter convention."""

_PREFIX = "onnxdeploy/static_kv"
_POSITION_OFFSET = 11  # position_ids fed during probing are offset so they cannot pass for past + arange(S)
_PROBE_PAST = (3, 5)
_PROBE_STEP = 2
_NEG_INF_SCAN_LIMIT = 1 << 20  # memory-mapped initializers above 1 MiB are weights, not mask constants


def _int64_const(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    """Add an int64 1-D initializer ``name`` (once) and return its value."""
    if name in graph.initializers:
        return graph.initializers[name]
    tensor = ir.tensor(np.asarray(values, dtype=np.int64), name=name)
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(ir.DataType.INT64))
    value.const_value = tensor
    graph.register_initializer(value)
    return value


def _names_in_use(graph: ir.Graph) -> set[str]:
    names = {str(v.name) for v in graph.inputs} | set(graph.initializers)
    names |= {str(o.name) for node in graph for o in node.outputs}
    return names


def _take_name(value: ir.Value, name: str) -> None:
    """Give ``value`` the name ``name``, renaming whatever value held it first."""
    graph = value.graph
    if graph is not None:
        for v in [*graph.outputs, *(o for node in graph for o in node.outputs)]:
            if v.name == name and v is not value:
                v.name = f"{name}/replaced"
    value.name = name


# ----------------------------------------------------------------------------------------- cache position


def add_cache_position(graph: ir.Graph, step_len: int, *, who: str = "static_kv") -> ir.Value:
    """Add the graph input ``cache_position``: int64 ``[step_len]``, the cache slots this call writes.

    Args:
        graph: the decoder's main graph (edited in place).
        step_len: S, tokens per call.
        who: the pass named in errors.

    Returns:
        The new input value.

    Raises:
        PreconditionError: the graph already has a value named ``cache_position``.
    """
    if CACHE_POSITION in _names_in_use(graph):
        raise PreconditionError(who, f"the graph already has a tensor named '{CACHE_POSITION}'")
    value = ir.Value(name=CACHE_POSITION, shape=ir.Shape([step_len]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(value)
    return value


def _int64_rank1_values(model: ir.Model) -> set[str]:
    """Names of values shape inference types as int64 of rank 1 (or of unknown rank), on a stand-in proto."""
    inferred = onnx.shape_inference.infer_shapes(model_io.stand_in_proto(model), strict_mode=False)
    names = set()
    for vi in inferred.graph.value_info:
        tt = vi.type.tensor_type
        if tt.elem_type == onnx.TensorProto.INT64 and (not tt.HasField("shape") or len(tt.shape.dim) == 1):
            names.add(vi.name)
    return names


def _computed_from_weights(graph: ir.Graph) -> set[str]:
    """Names of values whose computation reads a whole weight (an initializer above 1 KiB), directly or upstream.

    A Gather from a weight (the embedding lookup) reads only the rows it is asked for, so it does not count;
    any other reader of a weight (MatMul, Gemm, …) does. The query-position vector is shape arithmetic on the
    inputs and the embedding output, never on other weights, so the probe leaves these values out and maps
    next to nothing of the model's weights.
    """
    tainted: set[str] = set()
    for node in graph:  # topological order (sorted at load)
        for i, value in enumerate(node.inputs):
            if value is None:
                continue
            weight = value.const_value is not None and value.const_value.nbytes > model_io.STAND_IN_THRESHOLD_BYTES
            lookup = weight and node.op_type == "Gather" and i == 0
            if (weight and not lookup) or value.name in tainted:
                tainted.update(str(o.name) for o in node.outputs)
                break
    return tainted


def find_query_positions(model: ir.Model, kv: KVCache, context: PassContext, *, who: str = "static_kv") -> list[str]:
    """Find the exporter's query-position tensors (value ``past_len + arange(S)``, int64 ``[S]``) by running it.

    A structural copy of ``model`` pruned to the int64 rank-1 intermediate values that are not computed from
    a whole weight (see :func:`_computed_from_weights`), with those values as its outputs, is written to the
    scratch folder (:func:`onnxdeploy.model_io.write_for_ort`: the embedding table it may keep is hard-linked,
    not copied, and only the looked-up rows are read) and run twice on ONNX Runtime, at past lengths 3 and 5
    with S=2, zero caches ``(B, H_kv, past, D)``, and ``position_ids`` offset by 11 (so the RoPE positions
    cannot be mistaken for it). B is the export's own batch when ``input_ids`` has a static batch dim, else 1.
    Values equal to ``past_len + arange(S)`` in both runs are candidates; the ones not computed from another
    candidate are returned (transformers' ``cache_position``: ``Range(past_len, past_len + S)``). The session
    and the probe files are removed before returning. A bfloat16 export's probe runs as its float32 shadow
    (:func:`onnxdeploy.graph.float32_shadow_graph`; the int64 position arithmetic is the same).

    Args:
        model: the exporter-convention decoder (dynamic past length); unchanged.
        kv: its cache, from :func:`onnxdeploy.kv_cache.find_kv_cache`.
        context: gives the scratch folder and the session factory.
        who: the pass named in errors.

    Returns:
        Names of the root query-position values (empty when the export has none).

    Raises:
        PreconditionError: ONNX Runtime cannot load or run the original model.
    """
    graph = model.graph
    int64_rank1 = _int64_rank1_values(model)
    outputs_now = {o.name for o in graph.outputs}
    from_weights = _computed_from_weights(graph)
    candidates = [
        str(out.name)
        for node in graph
        if node.op_type != "Constant"
        for out in node.outputs
        if out.name in int64_rank1 and out.name not in outputs_now and out.name not in from_weights
    ]
    if not candidates:
        return []
    # A structural copy that computes the candidates only: the rest of the graph and its weights are removed,
    # so the probe maps and reads next to nothing of the model's weights.
    probe = pruned_copy(model, candidates, keep_inputs=True, shadow=False)
    for value in probe.graph.outputs:
        value.dtype = ir.DataType.INT64
    # a bfloat16 export: ORT's CPU EP has no bfloat16 kernels and its Python API feeds no bfloat16 arrays
    cache_dtype = np.dtype(np.float32) if float32_shadow_graph(probe) else np.dtype(kv.numpy_dtype)
    with open_probe(probe, context, who=who, what="the original model") as opened:
        del probe
        matches = _probe(opened.session, model, kv, candidates, who, cache_dtype)
    if not matches:
        return []
    by_name = ir.convenience.create_value_mapping(graph)
    roots = []
    for name in sorted(matches):
        value = by_name[name]
        producer = value.producer()
        derived = any(
            o.name in matches and o is not value
            for up in upstream_nodes(value, 64)
            if up is not producer
            for o in up.outputs
        )
        if not derived:
            roots.append(name)
    return roots


def _export_batch(graph: ir.Graph) -> int:
    """The export's fixed batch: dim 0 of ``input_ids`` when static, else 1."""
    ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
    if ids is not None and ids.shape is not None and len(ids.shape) >= 1 and isinstance(ids.shape[0], int):
        return ids.shape[0]
    return 1


def _probe(
    sess: ort.InferenceSession, model: ir.Model, kv: KVCache, candidates: list[str], who: str, cache_dtype: np.dtype
) -> set[str]:
    """Run the probe at each past length; return the candidates equal to ``past + arange(S)`` every time.

    The zero caches are fed as ``cache_dtype`` (float32 for the float32 shadow of a bfloat16 export).
    """
    inputs = {v.name for v in model.graph.inputs}
    batch = _export_batch(model.graph)
    s = _PROBE_STEP
    matches: set[str] | None = None
    for past in _PROBE_PAST:
        feeds: dict[str, np.ndarray] = {
            t.past_name: np.zeros((batch, kv.num_kv_heads, past, kv.head_dim), dtype=cache_dtype) for t in kv.tensors
        }
        feeds["input_ids"] = np.tile(np.array([[1, 2]], dtype=np.int64), (batch, 1))
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((batch, past + s), dtype=np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = np.tile(past + _POSITION_OFFSET + np.arange(s, dtype=np.int64), (batch, 1))
        try:
            results = sess.run(candidates, feeds)
        except Exception as exc:  # ORT raises several unrelated exception types
            raise PreconditionError(
                who, f"ONNX Runtime cannot run the original model at past length {past}: {exc}"
            ) from exc
        expected = past + np.arange(s, dtype=np.int64)
        hit = {
            n
            for n, v in zip(candidates, results, strict=True)
            if v.ndim == 1 and v.shape == (s,) and np.array_equal(v, expected)
        }
        matches = hit if matches is None else matches & hit
    return matches or set()


def feed_query_positions(graph: ir.Graph, names: list[str], cache_position: ir.Value) -> None:
    """Make every reader of the query-position values read ``cache_position`` (int64 ``[S]``) instead.

    The values' producers are left for constant folding to drop.

    Args:
        graph: the decoder's main graph (edited in place).
        names: values from :func:`find_query_positions`.
        cache_position: the input from :func:`add_cache_position`.
    """
    by_name = ir.convenience.create_value_mapping(graph)
    for name in names:
        by_name[name].replace_all_uses_with(cache_position)


# ------------------------------------------------------------------------------------------- cache writes


def rewrite_cache_writes(
    graph: ir.Graph,
    kv: KVCache,
    *,
    cache_position: ir.Value,
    seq_axis: int = 2,
    layout: Literal["BHSD"] = "BHSD",
    cache_update: Literal["full_buffer", "new_token_only"] = "full_buffer",
    max_cache_len: int,
    step_len: int,
    cache_write: CacheWrite = "scatter_elements",
    batch: int | None = None,
) -> list[str]:
    """Turn each cache Concat into a write at ``cache_position``; readers of the past see a view.

    For every cache tensor of ``kv`` (BHSD: past ``(B, H_kv, L, D)``, step's K/V ``(B, H_kv, S, D)``):

    * the Concat ``(past, new)`` becomes ``ScatterElements(past, idx, new, axis=seq_axis)``, ``idx`` being
      ``cache_position`` broadcast to ``(B, H_kv, S, D)`` — attention reads the whole ``L``-slot buffer (other
      ``cache_write`` methods: :func:`build_cache_write`);
    * every other reader of the past (the exporters' shape arithmetic: mask width, GQA head-repeat shape)
      reads ``Slice(past, 0, L - S, axis=seq_axis)``, so their ``past_len + S`` is ``L``;
    * ``full_buffer``: the present output is the updated buffer ``(B, H_kv, L, D)``; ``new_token_only``: the
      present output is the step's K/V ``(B, H_kv, S, D)`` for the host to write at ``cache_position``.

    Args:
        graph: the graph ``kv`` was found on (edited in place).
        kv: the cache, from :func:`onnxdeploy.kv_cache.find_kv_cache` on ``graph``.
        cache_position: the int64 ``[S]`` input (:func:`add_cache_position`).
        seq_axis: the sequence axis of the cache tensors (2 for BHSD).
        layout: the cache layout; only ``BHSD`` (what exporters emit) is rewritten here.
        cache_update: ``full_buffer`` or ``new_token_only`` (see above).
        max_cache_len: L, slots of the fixed buffer.
        step_len: S, tokens per call.
        cache_write: how the buffer is written (:func:`build_cache_write`); ``host`` writes by select inside
            the graph (what attention reads) and is meant with ``cache_update`` ``new_token_only``.
        batch: B, needed by ``scatter_nd`` (its index grid is a constant); default ``kv.batch`` or 1.

    Returns:
        Human-readable lines, one per rewritten Concat.

    Raises:
        ValueError: an unsupported ``layout``, ``seq_axis`` other than the Concats', or ``max_cache_len <
            step_len``.
    """
    batch = batch if batch is not None else (kv.batch or 1)
    if layout != "BHSD":
        raise ValueError(f"rewrite_cache_writes rewrites BHSD caches only, not {layout}")
    if seq_axis not in (2, -2):
        raise ValueError(f"seq_axis {seq_axis}: a BHSD cache appends on axis 2")
    if max_cache_len < step_len:
        raise ValueError(f"max_cache_len={max_cache_len} is smaller than step_len={step_len}")
    order = {id(n): i for i, n in enumerate(graph)}
    tensors = sorted(kv.tensors, key=lambda t: order[id(t.concat)])
    first = tensors[0]

    # One index tensor for every write: cache_position (S,) broadcast to the update shape (B, H_kv, S, D).
    # The update shape is read from the graph so it folds to a constant once the inputs are static.
    pos_shape = [1, 1, 1, 1]
    pos_shape[seq_axis] = step_len
    reshape = ir.node(
        "Reshape",
        [cache_position, _int64_const(graph, f"{_PREFIX}/pos_shape", pos_shape)],
        name=f"{_PREFIX}/pos_reshape",
    )
    reshape.outputs[0].name = f"{_PREFIX}/pos_4d"
    update_shape = ir.node("Shape", [first.new_operand], name=f"{_PREFIX}/update_shape")
    update_shape.outputs[0].name = f"{_PREFIX}/update_shape"
    expand = ir.node("Expand", [reshape.outputs[0], update_shape.outputs[0]], name=f"{_PREFIX}/pos_expand")
    indices = expand.outputs[0]
    indices.name = f"{_PREFIX}/scatter_indices"
    indices.dtype = ir.DataType.INT64
    graph.insert_before(first.concat, [reshape, update_shape, expand])

    starts = _int64_const(graph, f"{_PREFIX}/view_starts", [0])
    ends = _int64_const(graph, f"{_PREFIX}/view_ends", [max_cache_len - step_len])
    axes = _int64_const(graph, f"{_PREFIX}/view_axes", [seq_axis])
    changes = []
    for ct in tensors:
        past = ct.past_name
        view_node = ir.node("Slice", [ct.past_input, starts, ends, axes], name=f"{_PREFIX}/{past}/past_view/Slice")
        view = view_node.outputs[0]
        view.name = f"{_PREFIX}/{past}/past_view"
        view.dtype = kv.dtype
        graph.insert_before(graph[0], view_node)
        for alias in ct.past_aliases:
            for use in list(alias.uses()):
                if use.node is not ct.concat and use.node is not view_node:
                    use.node.replace_input_with(use.idx, view)

        if cache_write == "scatter_elements":
            scatter = ir.node(
                "ScatterElements",
                [ct.past_input, indices, ct.new_operand],
                {"axis": seq_axis},
                name=f"{_PREFIX}/{past}/ScatterElements",
            )
            written = [scatter]
        else:
            written, _ = build_cache_write(
                graph,
                ct.past_input,
                ct.new_operand,
                cache_position,
                method=cache_write,
                seq_axis=seq_axis,
                update_shape=(batch, kv.num_kv_heads, step_len, kv.head_dim),
                max_cache_len=max_cache_len,
                prefix=f"{_PREFIX}/{past}",
            )
            scatter = written[-1]
        updated = scatter.outputs[0]
        updated.name = f"{_PREFIX}/{past}/updated_buffer"
        updated.dtype = kv.dtype
        updated.shape = ir.Shape(ct.past_input.shape or [None] * 4)  # a write keeps the data's shape
        graph.insert_before(ct.concat, written)
        concat_out = ct.concat_output
        present = ct.present_output
        present_name = ct.present_name
        if cache_update == "full_buffer":
            concat_was_output = concat_out.is_graph_output()
            concat_name = str(concat_out.name)
            concat_out.replace_all_uses_with(updated, replace_graph_outputs=True)
            if concat_was_output:
                _take_name(updated, concat_name)
        else:
            new_node = ir.node("Identity", [ct.new_operand], name=f"{_PREFIX}/{present_name}/new")
            graph.insert_after(scatter, new_node)
            new_out = new_node.outputs[0]
            new_out.dtype = kv.dtype
            new_out.shape = ir.Shape(ct.new_operand.shape or [None] * 4)
            slot = next(i for i, o in enumerate(graph.outputs) if o is present)
            graph.outputs[slot] = new_out
            _take_name(new_out, present_name)
            concat_out.replace_all_uses_with(updated)
        graph.remove(ct.concat, safe=True)
        _remove_dead_chain(graph, present)
        changes.append(
            f"Concat '{ct.concat.name or '?'}' -> {scatter.op_type}(axis={seq_axis}) into '{past}' at "
            f"{cache_position.name} ({ct.kind}, present '{present_name}', {cache_update})"
        )
    return changes


def _remove_dead_chain(graph: ir.Graph, value: ir.Value) -> None:
    """Remove ``value``'s producer and its pass-through ancestors while nothing reads them."""
    while value.graph is graph and not value.uses() and not value.is_graph_output():
        node = value.producer()
        if node is None or node.graph is not graph or any(o.uses() or o.is_graph_output() for o in node.outputs):
            return
        inputs = [i for i in node.inputs if i is not None]
        graph.remove(node, safe=True)
        if len(inputs) != 1:
            return
        value = inputs[0]


def _write_node(op: str, inputs: list[ir.Value], name: str, dtype: ir.DataType, **attributes: object) -> ir.Node:
    node = ir.node(op, inputs, attributes or None, name=f"{name}/{op}")
    node.outputs[0].name = name
    node.outputs[0].dtype = dtype
    return node


def build_cache_write(
    graph: ir.Graph,
    buffer: ir.Value,
    update: ir.Value,
    cache_position: ir.Value,
    *,
    method: CacheWrite,
    seq_axis: int,
    update_shape: tuple[int, ...],
    max_cache_len: int,
    prefix: str,
) -> tuple[list[ir.Node], ir.Value]:
    """Nodes that write ``update`` into ``buffer`` at the slots ``cache_position`` names, on ``seq_axis``.

    ``buffer`` has ``max_cache_len`` slots on ``seq_axis`` (any layout: BHSD ``(B, H_kv, L, D)``, BSH2D
    ``(B, L, H_kv, 2·D)``, K of BHDS_K ``(B, H_kv, D, L)``); ``update`` has ``update_shape``, the same with ``S``
    on ``seq_axis``; ``cache_position`` is int64 ``[S]``, distinct slots. Every method gives the same buffer,
    bit for bit (each only moves elements):

    * ``scatter_elements``: ``ScatterElements(buffer, idx, update, axis=seq_axis)``, ``idx`` = ``cache_position``
      expanded to ``update_shape`` (opset ≥ 11).
    * ``scatter_nd``: ``ScatterND(buffer, idx, update)``, ``idx`` ``(*update_shape[:seq_axis + 1], seq_axis + 1)``:
      a constant index grid of the leading axes and ``cache_position`` last (opset ≥ 11).
    * ``where`` (and ``host``, the write attention reads inside a ``new_token_only`` graph): a select with ops NPU
      compilers lower where they lack a Scatter (RK3588). ``S = 1``: ``Where(Equal(slots, cache_position),
      update, buffer)``, ``slots`` the constant int64 slot index ``0..L-1`` along ``seq_axis``, ``update``
      broadcast over the slots. ``S > 1``: ``src = ArgMax(Equal(slots, cache_position))`` (which of the S rows
      lands in each slot), ``hit = Equal(Gather(cache_position, src), slots)``, ``Where(hit, Gather(update, src,
      axis=seq_axis), buffer)``.

    Args:
        graph: the graph (constants are registered on it, by name, once).
        buffer: the cache buffer, in the compute dtype.
        update: the call's K/V in the buffer's layout, ``update_shape``.
        cache_position: int64 ``[S]``.
        method: a :data:`~onnxdeploy.contract.CacheWrite`.
        seq_axis: the slot axis of ``buffer`` and ``update`` (non-negative).
        update_shape: static shape of ``update``.
        max_cache_len: L, slots of ``buffer``.
        prefix: names of the new nodes and values start with it (unique per write).

    Returns:
        ``(nodes in topological order, the updated buffer)``; the caller inserts the nodes.

    Raises:
        ValueError: an unknown ``method``.
    """
    rank = len(update_shape)
    S = update_shape[seq_axis]
    dtype = update.dtype or buffer.dtype or ir.DataType.FLOAT
    i64 = ir.DataType.INT64
    nodes: list[ir.Node] = []

    def const(name: str, values: np.ndarray) -> ir.Value:
        key = f"{_PREFIX}/write/{name}"
        if key in graph.initializers:
            return graph.initializers[key]
        tensor = ir.tensor(np.ascontiguousarray(values), name=key)
        value = ir.Value(name=key, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype))
        value.const_value = tensor
        graph.register_initializer(value)
        return value

    def add(op: str, inputs: list[ir.Value], out: str, out_dtype: ir.DataType, **attributes: object) -> ir.Value:
        node = _write_node(op, inputs, f"{prefix}/{out}", out_dtype, **attributes)
        nodes.append(node)
        return node.outputs[0]

    shape_key = "x".join(map(str, update_shape))
    if method == "scatter_elements":
        pos_shape = [1] * rank
        pos_shape[seq_axis] = S
        pos = add(
            "Reshape",
            [cache_position, const(f"shape_{'x'.join(map(str, pos_shape))}", np.array(pos_shape))],
            "positions",
            i64,
        )
        idx = add("Expand", [pos, const(f"shape_{shape_key}", np.array(update_shape))], "indices", i64)
        out = add("ScatterElements", [buffer, idx, update], "updated", dtype, axis=seq_axis)
    elif method == "scatter_nd":
        lead = list(update_shape[: seq_axis + 1])
        pos_shape = [1] * seq_axis + [S, 1]
        pos = add(
            "Reshape",
            [cache_position, const(f"shape_{'x'.join(map(str, pos_shape))}", np.array(pos_shape))],
            "positions",
            i64,
        )
        pos = add(
            "Expand", [pos, const(f"shape_{'x'.join(map(str, lead))}x1", np.array([*lead, 1]))], "slot_index", i64
        )
        if seq_axis:
            grid = np.stack(np.indices(lead, dtype=np.int64)[:seq_axis], axis=-1)
            pos = add("Concat", [const(f"grid_{'x'.join(map(str, lead))}", grid), pos], "indices", i64, axis=-1)
        out = add("ScatterND", [buffer, pos, update], "updated", dtype)
    elif method in ("where", "host"):
        slot_shape = [1] * rank
        slot_shape[seq_axis] = max_cache_len
        slot_key = "x".join(map(str, slot_shape))
        if S == 1:
            slots = const(f"slots_{slot_key}", np.arange(max_cache_len, dtype=np.int64).reshape(slot_shape))
            pos = add(
                "Reshape",
                [cache_position, const(f"shape_{'x'.join(['1'] * rank)}", np.ones(rank, np.int64))],
                "position",
                i64,
            )
            hit = add("Equal", [slots, pos], "slot_hit", ir.DataType.BOOL)
            out = add("Where", [hit, update, buffer], "updated", dtype)
        else:
            column = const(f"slots_{max_cache_len}x1", np.arange(max_cache_len, dtype=np.int64).reshape(-1, 1))
            row = add("Reshape", [cache_position, const(f"shape_1x{S}", np.array([1, S]))], "positions", i64)
            onehot = add("Equal", [column, row], "slot_of_row", ir.DataType.BOOL)
            scores = add("Cast", [onehot], "slot_of_row_float", ir.DataType.FLOAT, to=ir.DataType.FLOAT)
            src = add("ArgMax", [scores], "source_row", i64, axis=1, keepdims=0)
            written = add("Gather", [cache_position, src], "source_position", i64, axis=0)
            flat = const(f"slots_{max_cache_len}", np.arange(max_cache_len, dtype=np.int64))
            hit = add("Equal", [written, flat], "slot_hit_flat", ir.DataType.BOOL)
            hit = add("Reshape", [hit, const(f"shape_{slot_key}", np.array(slot_shape))], "slot_hit", ir.DataType.BOOL)
            rows = add("Gather", [update, src], "rows", dtype, axis=seq_axis)
            out = add("Where", [hit, rows, buffer], "updated", dtype)
    else:
        raise ValueError(f"unknown cache_write {method!r}; known: scatter_elements, scatter_nd, where, host")
    out.shape = buffer.shape
    return nodes, out


# ----------------------------------------------------------------------------------------------- I/O dims


def _dim_text(d: object) -> str:
    if d is None:
        return "?"
    return str(d.value if isinstance(d, ir.SymbolicDim) else d)


def _set_dims(value: ir.Value, dims: list[int]) -> list[str]:
    """Set ``value``'s shape to ``dims``; return ``'name[axis]: old -> new'`` for each change."""
    old = list(value.shape) if value.shape is not None else [None] * len(dims)
    changes = []
    for axis, d in enumerate(dims):
        before = old[axis] if axis < len(old) else None
        if before != d:
            changes.append(f"{value.name}[{axis}]: {_dim_text(before)} -> {d}")
    value.shape = ir.Shape(dims)
    return changes


def fix_io_dims(graph: ir.Graph, kv: KVCache, *, batch: int, step_len: int, max_cache_len: int) -> list[str]:
    """Fix every graph input's dims and forget every other shape (they are re-inferred after folding).

    Cache inputs become ``(B, H_kv, max_cache_len, D)``, ``attention_mask`` ``(B, max_cache_len)``,
    ``input_ids`` and ``position_ids`` ``(B, step_len)``; ``cache_position`` stays ``[step_len]``. Intermediate
    value infos are dropped and graph outputs keep only dtype and rank: their symbolic dims are stale.

    Args:
        graph: the decoder's main graph (edited in place).
        kv: its cache (names of the past inputs).
        batch: B.
        step_len: S, tokens per call.
        max_cache_len: L, slots of the fixed buffer.

    Returns:
        ``'tensor[axis]: old -> new'`` for every input dim changed, for the pass report.
    """
    cache_inputs = {t.past_name for t in kv.tensors}
    fixed: list[str] = []
    for value in graph.inputs:
        if value.name in graph.initializers:
            continue
        if value.name in cache_inputs:
            fixed += _set_dims(value, [batch, kv.num_kv_heads, max_cache_len, kv.head_dim])
        elif value.name == "attention_mask":
            fixed += _set_dims(value, [batch, max_cache_len])
        elif value.name in ("input_ids", "position_ids"):
            fixed += _set_dims(value, [batch, step_len])
    forget_shapes(graph)
    return fixed


# ------------------------------------------------------------------------------------------------ -inf


def _finite(tensor: ir.TensorProtocol) -> ir.TensorProtocol | None:
    """``tensor`` with ``-inf`` replaced by ``finfo(dtype).min``; None when it holds no ``-inf``."""
    if tensor.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE):
        return None
    arr = tensor.numpy()
    mask = np.isneginf(arr)
    if not mask.any():
        return None
    fixed = np.array(arr, copy=True)
    fixed[mask] = np.finfo(fixed.dtype).min  # ml_dtypes registers bfloat16's (-3.3895e38)
    return ir.tensor(fixed, name=tensor.name)


def replace_neg_inf(graph: ir.Graph) -> int:
    """Replace ``-inf`` in float constants by the dtype's lowest finite value (``numpy.finfo(dtype).min``).

    What transformers itself uses for masks: a fully masked row then stays finite (no NaN in fp16).
    Scanned: initializers held in memory or mapped and at most 1 MiB (larger mapped ones are weights and
    are never read), and the ``value`` of Constant / ConstantOfShape nodes. Tensors are replaced, never
    written into (mapped input files stay untouched).

    Args:
        graph: the main graph (edited in place).

    Returns:
        How many tensors were replaced.
    """
    count = 0
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is None or (isinstance(tensor, ir.ExternalTensor) and tensor.nbytes > _NEG_INF_SCAN_LIMIT):
            continue
        new = _finite(tensor)
        if new is not None:
            value.const_value = new
            count += 1
    for node in graph:
        if node.op_type not in ("Constant", "ConstantOfShape") or node.domain not in ("", "ai.onnx"):
            continue
        attr = node.attributes.get("value")
        if attr is None or attr.type != ir.AttributeType.TENSOR:
            continue
        new = _finite(attr.as_tensor())
        if new is not None:
            node.attributes["value"] = ir.AttrTensor("value", new)
            count += 1
    return count


# ---------------------------------------------------------------------------------------------- contract


def build_contract(
    model: ir.Model,
    kv: KVCache,
    *,
    batch: int,
    step_len: int,
    max_cache_len: int,
    cache_update: Literal["full_buffer", "new_token_only"],
    who: str = "static_kv",
) -> DecodeContract:
    """The decode contract of a rewritten graph (DESIGN.md, "The decode contract").

    Cache tensors ``(batch, H_kv, max_cache_len, D)`` of the cache dtype, layout ``BHSD``; names are read
    from ``kv`` (found on the original: the rewrite keeps input and output names) and ``model``'s inputs.

    Args:
        model: the rewritten model.
        kv: the cache found on the original graph.
        batch: B.
        step_len: S, tokens per call.
        max_cache_len: L, slots per cache buffer.
        cache_update: how the present outputs are meant (``full_buffer`` / ``new_token_only``).
        who: the pass named in errors.

    Returns:
        The contract.

    Raises:
        PreconditionError: the graph has no single logits output besides the cache.
    """
    graph = model.graph
    has = {v.name for v in graph.inputs}
    logits = find_logits_output(graph, {t.present_name for t in kv.tensors}, who=who)
    return DecodeContract(
        batch=batch,
        step_len=step_len,
        max_cache_len=max_cache_len,
        num_layers=len(kv.layers),
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        head_dim_padded=kv.head_dim,
        kv_layout="BHSD",
        kv_dtype=str(kv.numpy_dtype),
        cache_update=cache_update,
        inputs=ContractInputs(
            input_ids="input_ids",
            cache_position=CACHE_POSITION if CACHE_POSITION in has else None,
            position_ids="position_ids" if "position_ids" in has else None,
            attention_mask="attention_mask" if "attention_mask" in has else None,
        ),
        logits=str(logits.name),
        cache=[
            CacheBinding(
                layer=layer.layer,
                key_in=layer.key.past_name,
                value_in=layer.value.past_name,
                key_out=layer.key.present_name,
                value_out=layer.value.present_name,
            )
            for layer in kv.layers
        ],
    )


# ----------------------------------------------------------------------------------------- cache dtype

_CACHE_IN_OP = {"GroupQueryAttention", "Attention", "MultiHeadAttention"}
"""Ops that take the cache themselves: their cache dtype must equal their compute dtype."""


def cast_cache_boundary(model: ir.Model, contract: DecodeContract, kv_dtype: str, *, who: str = "static_kv") -> str:
    """Store the cache in ``kv_dtype`` while the graph computes in its own dtype: Casts at the cache boundary.

    Every past input becomes ``kv_dtype`` and is cast to the compute dtype where the graph reads it; every
    present output is cast to ``kv_dtype`` on its way out (same name). Buffers a host keeps are then
    ``kv_dtype``; the values written are rounded once to it (the error this adds is what verification sees).

    Args:
        model: a static graph carrying the cache named by ``contract`` (edited in place).
        contract: its contract (the cache names).
        kv_dtype: a :data:`~onnxdeploy.contract.KV_DTYPES` key.
        who: the pass name, for errors.

    Returns:
        A line for the pass report.

    Raises:
        PreconditionError: a past input feeds an op that keeps the cache inside it (GroupQueryAttention,
            Attention): such an op needs its cache dtype to equal its compute dtype, so it cannot be split.
    """
    target = KV_DTYPES[kv_dtype]
    graph = model.graph
    inputs = {str(v.name): v for v in graph.inputs}
    outputs = {str(v.name): (i, v) for i, v in enumerate(graph.outputs)}
    compute = None
    for past, present in contract.cache_pairs():
        value = inputs[past]
        inside = [n.op_type for n, _ in value.uses() if n.op_type in _CACHE_IN_OP]
        if inside:
            raise PreconditionError(
                who,
                f"kv_dtype {kv_dtype}: '{past}' feeds {inside[0]}, which keeps the cache inside the op and needs its "
                "cache dtype to equal its compute dtype; keep kv_dtype equal to the model's dtype",
            )
        compute = value.dtype
        if compute == target:
            continue
        readers = list(value.uses())
        cast_in = ir.node("Cast", [value], attributes={"to": compute}, name=f"{past}/cast_to_compute")
        cast_in.outputs[0].name = f"{past}/compute"
        cast_in.outputs[0].dtype, cast_in.outputs[0].shape = compute, value.shape
        for node, index in readers:
            node.replace_input_with(index, cast_in.outputs[0])
        graph.insert_before(graph.node(0), cast_in)
        value.dtype = target
        i, out = outputs[present]
        cast_out = ir.node("Cast", [out], attributes={"to": target}, name=f"{present}/cast_to_cache")
        graph.append(cast_out)
        new = cast_out.outputs[0]
        new.dtype, new.shape = target, out.shape
        out.name = f"{present}/compute"
        new.name = present
        graph.outputs[i] = new
    name = next((k for k, v in KV_DTYPES.items() if v == compute), str(compute))
    return f"cache stored as {kv_dtype} (compute {name}): Cast at each past input and present output"
