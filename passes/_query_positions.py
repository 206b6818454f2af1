"""The exporter's query-position vector (``past_len + arange(S)``): found by running the original, fed from the input.

transformers computes ``cache_position = Range(past_len, past_len + S)`` inside the graph and builds the causal
(and sliding-window) mask and the RoPE positions from it. A static graph has no ``past_len`` any more, so
``static_kv`` feeds its new ``cache_position`` input there instead:

* :func:`find_query_positions` — run a pruned copy of the original at two past lengths and keep the int64
  ``[S]`` values equal to ``past_len + arange(S)`` both times (the roots among them);
* :func:`feed_query_positions` — make their readers read ``cache_position``.

The probe never reads the model's weights beyond the looked-up rows of the embedding table
(:func:`_computed_from_weights`), and runs through :mod:`onnxdeploy.passes._probe`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxdeploy import model_io
from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import float32_shadow_graph, upstream_nodes
from onnxdeploy.kv_cache import KVCache
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._probe import open_probe, pruned_copy

__all__ = ["export_batch", "feed_query_positions", "find_query_positions"]

_POSITION_OFFSET = 11  # position_ids fed during probing are offset so they cannot pass for past + arange(S)
_PROBE_PAST = (3, 5)
_PROBE_STEP = 2
_ROOT_SEARCH_DEPTH = 64  # hops upstream of a match searched for another match it is computed from


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
    candidates = _candidates(model)
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
    return _roots(model.graph, matches)


def feed_query_positions(graph: ir.Graph, names: list[str], cache_position: ir.Value, *, rows: bool = False) -> None:
    """Make every reader of the query-position values read ``cache_position`` (int64 ``[S]``) instead.

    The values' producers are left for constant folding to drop. With ``rows`` (``cache_position`` ``(B, S)``)
    they read row 0's positions: the exporter's mask takes one query-position vector, so rows at different
    positions need ``mask_rewrite`` (contract ``row_positions``); RoPE reads each row's ``position_ids``.

    Args:
        graph: the decoder's main graph (edited in place).
        names: values from :func:`find_query_positions`.
        cache_position: the int64 ``[S]`` (or ``(B, S)``) input
            (:func:`onnxdeploy.passes._cache_edits.add_cache_position`).
        rows: ``cache_position`` is ``(B, S)``.

    Raises:
        KeyError: a name is not a value of ``graph``.
    """
    if not names:
        return
    by_name = ir.convenience.create_value_mapping(graph)
    source = cache_position
    if rows:
        first = ir.Value(name="onnxdeploy/static_kv/row0_index", const_value=ir.tensor(np.array(0, dtype=np.int64)))
        graph.register_initializer(first)
        node = ir.node("Gather", [cache_position, first], attributes={"axis": 0}, name="onnxdeploy/static_kv/row0")
        node.outputs[0].name = "onnxdeploy/static_kv/row0_positions"
        node.outputs[0].dtype = ir.DataType.INT64
        graph.insert_before(graph[0], node)
        source = node.outputs[0]
    for name in names:
        by_name[name].replace_all_uses_with(source)


def _candidates(model: ir.Model) -> list[str]:
    """Intermediate int64 rank-1 values (not graph outputs, not Constants) that no whole weight computes."""
    graph = model.graph
    int64_rank1 = _int64_rank1_values(model)
    outputs_now = {o.name for o in graph.outputs}
    from_weights = _computed_from_weights(graph)
    return [
        str(out.name)
        for node in graph
        if node.op_type != "Constant"
        for out in node.outputs
        if out.name in int64_rank1 and out.name not in outputs_now and out.name not in from_weights
    ]


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


def export_batch(graph: ir.Graph) -> int | None:
    """The batch the export fixed: dim 0 of ``input_ids`` ``(B, S)`` when it is a static int, else None."""
    ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
    if ids is not None and ids.shape is not None and len(ids.shape) >= 1 and isinstance(ids.shape[0], int):
        return ids.shape[0]
    return None


def _probe_feeds(model: ir.Model, kv: KVCache, past: int, cache_dtype: np.dtype) -> dict[str, np.ndarray]:
    """One call's inputs at past length ``past``: zero caches, ``S`` = 2 tokens, offset ``position_ids``."""
    inputs = {v.name for v in model.graph.inputs}
    batch, s = export_batch(model.graph) or 1, _PROBE_STEP
    feeds: dict[str, np.ndarray] = {
        t.past_name: np.zeros((batch, kv.num_kv_heads, past, kv.head_dim), dtype=cache_dtype) for t in kv.tensors
    }
    feeds["input_ids"] = np.tile(np.array([[1, 2]], dtype=np.int64), (batch, 1))
    if "attention_mask" in inputs:
        feeds["attention_mask"] = np.ones((batch, past + s), dtype=np.int64)
    if "position_ids" in inputs:
        feeds["position_ids"] = np.tile(past + _POSITION_OFFSET + np.arange(s, dtype=np.int64), (batch, 1))
    return feeds


def _probe(
    sess: ort.InferenceSession, model: ir.Model, kv: KVCache, candidates: list[str], who: str, cache_dtype: np.dtype
) -> set[str]:
    """Run the probe at each past length; return the candidates equal to ``past + arange(S)`` every time.

    The zero caches are fed as ``cache_dtype`` (float32 for the float32 shadow of a bfloat16 export).
    """
    s = _PROBE_STEP
    matches: set[str] | None = None
    for past in _PROBE_PAST:
        try:
            results = sess.run(candidates, _probe_feeds(model, kv, past, cache_dtype))
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


def _roots(graph: ir.Graph, matches: set[str]) -> list[str]:
    """The matches not computed from another match (sorted by name): the ones to feed ``cache_position``."""
    by_name = ir.convenience.create_value_mapping(graph)
    roots = []
    for name in sorted(matches):
        value = by_name[name]
        producer = value.producer()
        derived = any(
            o.name in matches and o is not value
            for up in upstream_nodes(value, _ROOT_SEARCH_DEPTH)
            if up is not producer
            for o in up.outputs
        )
        if not derived:
            roots.append(name)
    return roots
