"""Cache edits several passes need, each one step on an ``onnx_ir`` graph.

Where this sits among the passes' modules: docs/ARCHITECTURE.md, "Where each concept lives".

The steps ``static_kv`` chains, usable on their own by later passes (prefill buckets, ``kv_layout``):

* :func:`add_cache_position` — the int64 ``[step_len]`` input naming the cache slots a call writes.
* :func:`rewrite_cache_writes` — past inputs become fixed buffers written at ``cache_position`` (ScatterElements,
  ScatterND or a select: :func:`onnxdeploy.passes._cache_write.build_cache_write`, any layout); every other reader
  of the past sees a Slice view of ``max_cache_len - S`` slots.
* :func:`fix_io_dims` — fixed batch, step length and cache length on the graph inputs.
* :func:`replace_neg_inf` — ``-inf`` constants become the dtype's lowest finite value.
* :func:`build_contract` — the decode contract the host reads (written with :func:`onnxdeploy.contract.write_contract`).
* :func:`cast_cache_boundary` — a cache stored in another dtype than the graph computes in.

The exporter's query-position vector, which ``cache_position`` replaces, is found by
:mod:`onnxdeploy.passes._query_positions`. Weights are never read or copied: onnxsim and onnx shape inference
see protos whose large initializers are typed stand-ins (:mod:`onnxdeploy.model_io`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import KV_DTYPES, CacheBinding, CacheWrite, ContractInputs, DecodeContract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import FLOAT_TYPES, value_dims
from onnxdeploy.kv_cache import CacheTensor, KVCache, find_logits_output
from onnxdeploy.passes._cache_write import build_cache_write
from onnxdeploy.passes._edit import (
    add_initializer,
    forget_shapes,
    make_node,
    names_in_use,
    remove_dead_chain,
    take_name,
)

__all__ = [
    "CACHE_POSITION",
    "KNOWN_INPUTS",
    "add_cache_position",
    "build_contract",
    "cast_cache_boundary",
    "fix_io_dims",
    "replace_neg_inf",
    "rewrite_cache_writes",
]

CACHE_POSITION = "cache_position"
"""Name of the int64 ``[step_len]`` input holding the cache slots a call writes."""

KNOWN_INPUTS = ("input_ids", "attention_mask", "position_ids")
"""Non-cache inputs of the exporter convention."""

_PREFIX = "onnxdeploy/static_kv"
_NEG_INF_SCAN_LIMIT = 1 << 20  # memory-mapped initializers above 1 MiB are weights, not mask constants


def _int64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# ----------------------------------------------------------------------------------------- cache position


def add_cache_position(graph: ir.Graph, step_len: int, *, who: str = "static_kv", rows: int | None = None) -> ir.Value:
    """Add the graph input ``cache_position``: int64 ``[step_len]``, the cache slots this call writes.

    Args:
        graph: the decoder's main graph (edited in place).
        step_len: S, tokens per call.
        who: the pass named in errors.
        rows: B for ``row_positions``: the input is ``(B, S)``, each row's own slots.

    Returns:
        The new input value.

    Raises:
        PreconditionError: the graph already has a value named ``cache_position``.
    """
    if CACHE_POSITION in names_in_use(graph):
        raise PreconditionError(who, f"the graph already has a tensor named '{CACHE_POSITION}'")
    dims = [step_len] if rows is None else [rows, step_len]
    value = ir.Value(name=CACHE_POSITION, shape=ir.Shape(dims), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(value)
    return value


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
      ``cache_write`` methods: :func:`~onnxdeploy.passes._cache_write.build_cache_write`);
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
        cache_write: how the buffer is written (:func:`~onnxdeploy.passes._cache_write.build_cache_write`);
            ``host`` writes by select inside the graph (what attention reads) and is meant with ``cache_update``
            ``new_token_only``.
        batch: B, needed by ``scatter_nd`` (its index grid is a constant); default ``kv.batch`` or 1.

    Returns:
        Human-readable lines, one per rewritten Concat.

    Raises:
        ValueError: an unsupported ``layout``, ``seq_axis`` other than the Concats', or ``max_cache_len <
            step_len``.
    """
    _check_rewrite(layout, seq_axis, max_cache_len, step_len)
    batch = batch if batch is not None else (kv.batch or 1)
    order = {id(n): i for i, n in enumerate(graph)}
    tensors = sorted(kv.tensors, key=lambda t: order[id(t.concat)])
    indices = _scatter_indices(graph, cache_position, tensors[0], seq_axis=seq_axis, step_len=step_len)
    view = _PastView(graph, seq_axis=seq_axis, slots=max_cache_len - step_len, dtype=kv.dtype)
    changes = []
    for ct in tensors:
        view.redirect_readers(ct)
        write = _write_buffer(
            graph,
            ct,
            kv,
            indices=indices,
            cache_position=cache_position,
            method=cache_write,
            seq_axis=seq_axis,
            update_shape=(batch, kv.num_kv_heads, step_len, kv.head_dim),
            max_cache_len=max_cache_len,
        )
        _route_present(graph, ct, write, dtype=kv.dtype, cache_update=cache_update)
        changes.append(
            f"Concat '{ct.concat.name or '?'}' -> {write.op_type}(axis={seq_axis}) into '{ct.past_name}' at "  # type: ignore[union-attr]
            f"{cache_position.name} ({ct.kind}, present '{ct.present_name}', {cache_update})"
        )
    return changes


def _check_rewrite(layout: str, seq_axis: int, max_cache_len: int, step_len: int) -> None:
    """Refuse what :func:`rewrite_cache_writes` does not rewrite (its ``Raises``)."""
    if layout != "BHSD":
        raise ValueError(f"rewrite_cache_writes rewrites BHSD caches only, not {layout}")
    if seq_axis not in (2, -2):
        raise ValueError(f"seq_axis {seq_axis}: a BHSD cache appends on axis 2")
    if max_cache_len < step_len:
        raise ValueError(f"max_cache_len={max_cache_len} is smaller than step_len={step_len}")


def _scatter_indices(
    graph: ir.Graph, cache_position: ir.Value, first: CacheTensor, *, seq_axis: int, step_len: int
) -> ir.Value:
    """One index tensor for every ScatterElements write: ``cache_position`` (S,) broadcast to ``(B, H_kv, S, D)``.

    The update shape is read from the graph (``Shape`` of the first cache tensor's new K/V, inserted before its
    Concat) so it folds to a constant once the inputs are static.
    """
    pos_shape = [1, 1, 1, 1]
    pos_shape[seq_axis] = step_len
    if cache_position.shape is not None and len(cache_position.shape) == 2:  # row_positions: (B, S)
        pos_shape[0] = int(cache_position.shape[0])  # type: ignore[arg-type]
    shape = add_initializer(graph, f"{_PREFIX}/pos_shape", _int64(pos_shape), reuse=True)
    reshape = make_node("Reshape", [cache_position, shape], name=f"{_PREFIX}/pos_reshape", output=f"{_PREFIX}/pos_4d")
    update_shape = make_node("Shape", [first.new_operand], name=f"{_PREFIX}/update_shape")
    expand = make_node(
        "Expand",
        [reshape.outputs[0], update_shape.outputs[0]],
        name=f"{_PREFIX}/pos_expand",
        output=f"{_PREFIX}/scatter_indices",
        dtype=ir.DataType.INT64,
    )
    graph.insert_before(first.concat, [reshape, update_shape, expand])  # type: ignore[arg-type]
    return expand.outputs[0]


def _write_buffer(
    graph: ir.Graph,
    ct: CacheTensor,
    kv: KVCache,
    *,
    indices: ir.Value,
    cache_position: ir.Value,
    method: CacheWrite,
    seq_axis: int,
    update_shape: tuple[int, ...],
    max_cache_len: int,
) -> ir.Node:
    """Insert, before ``ct``'s Concat, the write of its new K/V into the past buffer; return the last node.

    ``scatter_elements`` shares ``indices`` (:func:`_scatter_indices`) across the cache tensors; the other
    methods build their own (:func:`~onnxdeploy.passes._cache_write.build_cache_write`). The updated buffer is
    named ``onnxdeploy/static_kv/<past>/updated_buffer`` and keeps the past's dtype and shape.
    """
    if method == "scatter_elements":
        write = make_node(
            "ScatterElements",
            [ct.past_input, indices, ct.new_operand],
            name=f"{_PREFIX}/{ct.past_name}/ScatterElements",
            axis=seq_axis,
        )
        written = [write]
    else:
        written, _ = build_cache_write(
            graph,
            ct.past_input,
            ct.new_operand,  # type: ignore[arg-type]  (a Concat-appended cache has one)
            cache_position,
            method=method,
            seq_axis=seq_axis,
            update_shape=update_shape,
            max_cache_len=max_cache_len,
            prefix=f"{_PREFIX}/{ct.past_name}",
        )
        write = written[-1]
    updated = write.outputs[0]
    updated.name = f"{_PREFIX}/{ct.past_name}/updated_buffer"
    updated.dtype = kv.dtype
    updated.shape = ir.Shape(ct.past_input.shape or [None] * 4)  # a write keeps the data's shape
    graph.insert_before(ct.concat, written)  # type: ignore[arg-type]
    return write


class _PastView:
    """``Slice(past, 0, slots, axis)``: what the readers of a past input other than its write see."""

    def __init__(self, graph: ir.Graph, *, seq_axis: int, slots: int, dtype: ir.DataType) -> None:
        self.graph, self.dtype = graph, dtype
        self.bounds = [
            add_initializer(graph, f"{_PREFIX}/view_{key}", _int64(values), reuse=True)
            for key, values in (("starts", [0]), ("ends", [slots]), ("axes", [seq_axis]))
        ]

    def redirect_readers(self, ct: CacheTensor) -> None:
        """Insert ``ct``'s view first in the graph and make every reader of the past but its Concat read it."""
        past = ct.past_name
        node = make_node(
            "Slice",
            [ct.past_input, *self.bounds],
            name=f"{_PREFIX}/{past}/past_view/Slice",
            output=f"{_PREFIX}/{past}/past_view",
            dtype=self.dtype,
        )
        self.graph.insert_before(self.graph[0], node)
        for alias in ct.past_aliases:
            for use in list(alias.uses()):
                if use.node is not ct.concat and use.node is not node:
                    use.node.replace_input_with(use.idx, node.outputs[0])


def _route_present(
    graph: ir.Graph,
    ct: CacheTensor,
    write: ir.Node,
    *,
    dtype: ir.DataType,
    cache_update: Literal["full_buffer", "new_token_only"],
) -> None:
    """Make ``ct``'s present output the updated buffer (``full_buffer``) or the step's K/V (``new_token_only``).

    ``write`` is the node whose output is the updated buffer; attention reads it either way. The Concat and
    the pass-throughs that led only to the old present output are removed; the present output keeps its name.
    """
    updated = write.outputs[0]
    concat_out = ct.concat_output
    present = ct.present_output
    if cache_update == "full_buffer":
        concat_was_output = concat_out.is_graph_output()
        concat_name = str(concat_out.name)
        concat_out.replace_all_uses_with(updated, replace_graph_outputs=True)
        if concat_was_output:
            take_name(updated, concat_name)
    else:
        new = ct.new_operand
        assert new is not None  # a Concat-appended cache has its step's K/V
        node = make_node(
            "Identity",
            [new],
            name=f"{_PREFIX}/{ct.present_name}/new",
            dtype=dtype,
            shape=list(new.shape) if new.shape is not None else [None] * 4,
        )
        graph.insert_after(write, node)
        slot = next(i for i, o in enumerate(graph.outputs) if o is present)
        graph.outputs[slot] = node.outputs[0]
        take_name(node.outputs[0], ct.present_name)
        concat_out.replace_all_uses_with(updated)
    graph.remove(ct.concat, safe=True)  # type: ignore[arg-type]
    remove_dead_chain(graph, present)


# ----------------------------------------------------------------------------------------------- I/O dims


def _set_dims(value: ir.Value, dims: list[int]) -> list[str]:
    """Set ``value``'s shape to ``dims``; return ``'name[axis]: old -> new'`` for each change."""
    old = value_dims(value) or [None] * len(dims)
    changes = []
    for axis, d in enumerate(dims):
        before = old[axis] if axis < len(old) else None
        if before != d:
            changes.append(f"{value.name}[{axis}]: {'?' if before is None else before} -> {d}")
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
    if tensor.dtype not in FLOAT_TYPES:
        return None
    arr = tensor.numpy()
    mask = np.isneginf(arr)
    if not mask.any():
        return None
    fixed = np.array(arr, copy=True)
    fixed[mask] = ml_dtypes.finfo(fixed.dtype).min  # np.finfo knows bfloat16 (-3.3895e38) only from ml_dtypes 0.7
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
    """The decode contract of a rewritten graph (docs/ARCHITECTURE.md, "The decode contract").

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
        cast_in = make_node(
            "Cast", [value], name=f"{past}/cast_to_compute", output=f"{past}/compute", dtype=compute, to=compute
        )
        cast_in.outputs[0].shape = value.shape
        for node, index in readers:
            node.replace_input_with(index, cast_in.outputs[0])
        graph.insert_before(graph.node(0), cast_in)
        value.dtype = target
        i, out = outputs[present]
        cast_out = make_node("Cast", [out], name=f"{present}/cast_to_cache", dtype=target, to=target)
        cast_out.outputs[0].shape = out.shape
        graph.append(cast_out)
        out.name = f"{present}/compute"
        cast_out.outputs[0].name = present
        graph.outputs[i] = cast_out.outputs[0]
    name = next((k for k, v in KV_DTYPES.items() if v == compute), str(compute))
    return f"cache stored as {kv_dtype} (compute {name}): Cast at each past input and present output"
