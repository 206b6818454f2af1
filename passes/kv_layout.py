"""``kv_layout``: the static cache in the layout an NPU wants, head dim padded, written in that layout.

What the pass does (README, "Passes" → ``kv_layout``), on every graph of the artifact set (decode graph and
prefill buckets; each carries its own contract). Input: static BHSD graphs (``static_kv`` ran first); shapes
below use ``B`` batch, ``H`` = ``H_kv``, ``L`` = ``max_cache_len``, ``S`` = ``step_len``, ``D`` the model's head
dim and ``Dp`` the padded one (``D`` rounded up to a multiple of ``pad_head_dim_to``):

* ``BHSD``: past K and V ``(B, H, L, Dp)`` (only padding changes).
* ``BSH2D``: one packed input per layer ``(B, L, H, 2·Dp)``, K in ``[..., :Dp]`` and V in ``[..., Dp:]`` (one
  load fetches both), and one packed output.
* ``BHDS_K``: K transposed ``(B, H, Dp, L)`` (what ``Q·Kᵀ`` multiplies: no transpose per step), V ``(B, H, L, Dp)``.

The call's K/V ``(B, H, S, D)`` are padded with zeros to ``Dp`` (Pad), put into the target layout (a Concat and
a Transpose of ``S`` rows, never of the buffer) and written into the buffer **in the target layout** at
``cache_position`` (:func:`onnxdeploy.passes._cache_edits.build_cache_write`: ScatterElements, ScatterND or the
select write). Attention then reads K and V by Slice (dropping the padding) and, where its layout differs, a
Transpose back to ``(B, H, L, D)``; for ``BHDS_K`` a reader that transposes K itself (``Transpose(0, 1, 3, 2)``,
as attention does after ``grouped_attention``) reads the stored K directly. Padding is zeros and only moved, so
the logits are bit-identical to the BHSD graph's.

The contract records ``kv_layout``, ``head_dim_padded``, the cache names (``kv_in``/``kv_out`` for BSH2D) and
``contract_version`` (3 for ``BHDS_K``: :data:`~onnxdeploy.contract.LAYOUT_VERSIONS`). A cache that stays inside
``com.microsoft::GroupQueryAttention`` (or opset-23 ``Attention``) is refused: the op takes its cache only as BNSH
``(B, H, S, D)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.contract import (
    LAYOUT_VERSIONS,
    CacheBinding,
    CacheWrite,
    DecodeContract,
    read_contract,
    write_contract,
)
from onnxdeploy.errors import ConfigError, OnnxDeployError, PostconditionError, PreconditionError
from onnxdeploy.graph import node_label
from onnxdeploy.kv_cache import find_kv_cache
from onnxdeploy.passes._cache_write import build_cache_write
from onnxdeploy.passes._catalog import KVLayoutConfig, Layout
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import add_initializer, clone, infer_shapes, make_node, remove_dead_nodes
from onnxdeploy.passes._order import BHSD_CACHE, CONTRACT, WHOLE_MODEL, OrderFact
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.passes._window_cache import ring_slots
from onnxdeploy.report import PassReport
from onnxdeploy.settings import PipelineSettings

__all__ = ["KVLayoutConfig", "KVLayoutPass", "padded_head_dim"]

_PREFIX = "onnxdeploy/kv_layout"
_CACHE_IN_OP = frozenset({"GroupQueryAttention", "Attention", "MultiHeadAttention"})
_WRITE_METHODS = {"ScatterElements": "scatter_elements", "ScatterND": "scatter_nd", "Where": "where"}
_SWAP_LAST = (0, 1, 3, 2)
_BSH = (0, 2, 1, 3)  # (B, H, S, D) <-> (B, S, H, D)


def padded_head_dim(head_dim: int, pad_to: int | None) -> int:
    """``head_dim`` rounded up to a multiple of ``pad_to`` (``head_dim`` itself when ``pad_to`` is None)."""
    return head_dim if not pad_to else math.ceil(head_dim / pad_to) * pad_to


@dataclass
class _CacheTensor:
    """One BHSD cache tensor of a static graph: its input, the write static_kv made, and its output."""

    past: ir.Value  # graph input (B, H, L, D), kv dtype
    buffer: ir.Value  # past, or its Cast to the compute dtype
    write: ir.Node  # ScatterElements / ScatterND / Where writing the call's K/V into buffer
    new: ir.Value  # the call's K/V (B, H, S, D), compute dtype
    updated: ir.Value  # write output (B, H, L, D): what attention reads
    present_index: int  # position of the present output in graph.outputs
    method: CacheWrite


def _find_tensor(
    graph: ir.Graph, contract: DecodeContract, past_name: str, present_name: str, who: str
) -> _CacheTensor:
    """Find the write static_kv made into ``past_name`` by data flow (input → optional Cast → write)."""
    inputs = {str(v.name): v for v in graph.inputs}
    past = inputs[past_name]
    buffer = past
    uses = list(past.uses())
    if len(uses) == 1 and uses[0].node.op_type == "Cast":  # kv_dtype apart from the compute dtype
        buffer = uses[0].node.outputs[0]
    inside = [u.node for u in buffer.uses() if u.node.op_type in _CACHE_IN_OP]
    if inside:
        raise PreconditionError(
            who,
            f"the cache '{past_name}' stays inside {node_label(inside[0])}, which takes its cache only as BNSH "
            "(B, H_kv, S, D); kv_layout cannot repack it unless the op is decomposed",
        )
    writes = [
        u.node
        for u in buffer.uses()
        if (u.node.op_type in ("ScatterElements", "ScatterND") and u.idx == 0)
        or (u.node.op_type == "Where" and u.idx == 2)
    ]
    if len(writes) != 1:
        raise PreconditionError(
            who,
            f"expected one cache write (ScatterElements/ScatterND/Where, as static_kv makes) reading '{past_name}'; "
            f"found {[node_label(n) for n in writes] or 'none'}",
        )
    write = writes[0]
    others = [node_label(u.node) for u in buffer.uses() if u.node is not write]
    if others:
        raise PreconditionError(who, f"'{past_name}' is read before its write by {others[:3]}; expected only the write")
    new = write.inputs[1] if write.op_type == "Where" else write.inputs[2]
    producer = new.producer() if new is not None else None
    if (
        write.op_type == "Where" and producer is not None and producer.op_type in ("Gather", "GatherElements")
    ):  # S > 1 select
        new = producer.inputs[0]
    want = (contract.batch, contract.num_kv_heads, contract.step_len, contract.head_dim)
    if new is None or new.shape is None or tuple(new.shape) != want:
        raise PreconditionError(
            who, f"the K/V {node_label(write)} writes into '{past_name}' is {new.shape if new else None}, not {want}"
        )
    index = next(i for i, v in enumerate(graph.outputs) if v.name == present_name)
    method = _WRITE_METHODS[write.op_type]
    if method == "where" and contract.cache_update == "new_token_only":
        method = "host"
    return _CacheTensor(past, buffer, write, new, write.outputs[0], index, method)  # type: ignore[arg-type]


class _Builder:
    """Appends nodes under one layer's name prefix, their outputs typed and shaped (the graph is sorted later).

    Beside the node itself (:func:`~onnxdeploy.passes._edit.make_node`), it knows the few layout steps of the
    rewrite and skips the ones that would change nothing (a full Slice, a Pad to the same size, a Cast to the
    same type).
    """

    def __init__(self, graph: ir.Graph, prefix: str):
        self.graph = graph
        self.prefix = prefix

    def const(self, name: str, values: list[int]) -> ir.Value:
        """The int64 initializer ``{_PREFIX}/{name}`` holding ``values`` (made once, shared by every layer)."""
        return add_initializer(self.graph, f"{_PREFIX}/{name}", np.asarray(values, dtype=np.int64), reuse=True)

    def node(self, op: str, inputs: list[ir.Value], out: str, shape: tuple[int, ...], dtype: ir.DataType, **attrs):
        """Append ``op`` whose output ``{prefix}/{out}`` has ``shape`` and ``dtype``; return the output."""
        node = make_node(
            op,
            inputs,
            name=f"{self.prefix}/{out}/{op}",
            output=f"{self.prefix}/{out}",
            dtype=dtype,
            shape=shape,
            **attrs,
        )
        self.graph.append(node)
        return node.outputs[0]

    def slice_last_or_axis(self, value: ir.Value, start: int, stop: int, axis: int, out: str) -> ir.Value:
        shape = list(value.shape)  # type: ignore[arg-type]
        if start == 0 and stop == shape[axis]:
            return value
        shape[axis] = stop - start
        consts = [
            self.const(f"i64_{start}", [start]),
            self.const(f"i64_{stop}", [stop]),
            self.const(f"i64_{axis}", [axis]),
        ]
        return self.node("Slice", [value, *consts], out, tuple(shape), value.dtype)  # type: ignore[arg-type]

    def transpose(self, value: ir.Value, perm: tuple[int, ...], out: str) -> ir.Value:
        shape = tuple(value.shape[i] for i in perm)  # type: ignore[index]
        return self.node("Transpose", [value], out, shape, value.dtype, perm=list(perm))  # type: ignore[arg-type]

    def cast(self, value: ir.Value, dtype: ir.DataType, out: str) -> ir.Value:
        if value.dtype == dtype:
            return value
        return self.node("Cast", [value], out, tuple(value.shape), dtype, to=dtype)  # type: ignore[arg-type]

    def pad_last(self, value: ir.Value, padded: int, out: str) -> ir.Value:
        shape = tuple(value.shape)  # type: ignore[arg-type]
        if shape[-1] == padded:
            return value
        pads = [0] * (2 * len(shape))
        pads[-1] = padded - shape[-1]
        return self.node(
            "Pad",
            [value, self.const(f"pads_{'_'.join(map(str, pads))}", pads)],
            out,
            (*shape[:-1], padded),
            value.dtype,
        )  # type: ignore[arg-type]


def _write(
    b: _Builder,
    buffer: ir.Value,
    update: ir.Value,
    axis: int,
    tag: str,
    method: CacheWrite,
    cache_position: ir.Value,
    max_cache_len: int,
) -> ir.Value:
    """Append the write of ``update`` into ``buffer`` on ``axis`` (:func:`build_cache_write`); return the result."""
    nodes, updated = build_cache_write(
        b.graph,
        buffer,
        update,
        cache_position,
        method=method,
        seq_axis=axis,
        update_shape=tuple(update.shape),  # type: ignore[arg-type]
        max_cache_len=max_cache_len,
        prefix=f"{b.prefix}/{tag}",
    )
    for node in nodes:
        b.graph.append(node)
    updated.shape = buffer.shape
    return updated


def _reroute(old: _CacheTensor, view: ir.Value) -> None:
    """Every reader of the old updated buffer reads ``view`` (the same values, from the new layout) instead."""
    for use in list(old.updated.uses()):
        use.node.replace_input_with(use.idx, view)


def _new_input(graph: ir.Graph, old: ir.Value, name: str, shape: tuple[int, ...], dtype: ir.DataType) -> ir.Value:
    """A graph input ``name`` in place of ``old`` (same position); ``old`` is renamed out of the way."""
    index = next(i for i, v in enumerate(graph.inputs) if v is old)
    old.name = f"{old.name}/bhsd"
    value = ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(dtype))
    graph.inputs[index] = value
    return value


def _write_method(found: list[list[_CacheTensor]], c: DecodeContract, cfg: KVLayoutConfig) -> tuple[CacheWrite, str]:
    """How the new layout is written, and the cache update mode that goes with it.

    The configured method, else the one the graph already uses (ScatterElements when its layers disagree);
    a host write means ``new_token_only``, and a ``new_token_only`` graph keeps its host write.
    """
    methods = {t.method for layer in found for t in layer}
    method: CacheWrite = cfg.cache_write or (methods.pop() if len(methods) == 1 else "scatter_elements")
    update_mode = "new_token_only" if method == "host" else c.cache_update
    if update_mode == "new_token_only" and method != "host" and cfg.cache_write is None:
        method = "host"
    return method, update_mode


@dataclass
class _Relayout:
    """One graph's cache rewrite in progress: what each layer gets, the new outputs, the Transposes counted.

    Shapes: ``B`` batch, ``H`` = ``H_kv``, ``L`` = ``max_cache_len``, ``S`` = ``step_len``, ``D`` the head dim,
    ``Dp`` the padded one.
    """

    graph: ir.Graph
    contract: DecodeContract
    layout: Layout
    Dp: int
    method: CacheWrite
    update_mode: str
    slots: dict[int, tuple[int, ir.Value]]  # layer -> (its buffers' slots, the int64 [S] slots a call writes)
    new_outputs: dict[int, ir.Value] = field(default_factory=dict)
    drop_outputs: set[int] = field(default_factory=set)
    entries: list[CacheBinding] = field(default_factory=list)
    kept_transposes: int = 0
    back_transposes: int = 0

    def layer(self, entry: CacheBinding, key: _CacheTensor, value: _CacheTensor) -> None:
        """Rewrite one layer's K and V: pad the call's K/V to ``Dp``, then store them in the layout."""
        b = _Builder(self.graph, f"{_PREFIX}/layer{entry.layer}")
        new_k = b.pad_last(key.new, self.Dp, "key_padded")
        new_v = b.pad_last(value.new, self.Dp, "value_padded")
        compute = key.new.dtype or self.contract.kv_onnx_type  # what the layer's attention computes in
        if self.layout == "BSH2D":
            self.entries.append(self._packed(b, entry, key, value, (new_k, new_v), compute))
            return
        names = {
            tag: self._separate(b, t, tag, new, compute, self.slots[entry.layer])
            for t, tag, new in ((key, "key", new_k), (value, "value", new_v))
        }
        self.entries.append(
            CacheBinding(
                layer=entry.layer,
                key_in=names["key"][0],
                key_out=names["key"][1],
                value_in=names["value"][0],
                value_out=names["value"][1],
            )
        )

    def _packed(
        self,
        b: _Builder,
        entry: CacheBinding,
        key: _CacheTensor,
        value: _CacheTensor,
        new_kv: tuple[ir.Value, ir.Value],
        compute: ir.DataType,
    ) -> CacheBinding:
        """BSH2D: one input and one output ``(B, L, H, 2·Dp)``, K in ``[..., :Dp]``, V in ``[..., Dp:]``."""
        c, Dp, graph = self.contract, self.Dp, self.graph
        (L, slots), B, H, S, D = self.slots[entry.layer], c.batch, c.num_kv_heads, c.step_len, c.head_dim
        kv_type = c.kv_onnx_type
        bhsd = b.node("Concat", list(new_kv), "kv_new_bhsd", (B, H, S, 2 * Dp), compute, axis=3)
        packed_new = b.transpose(bhsd, _BSH, "kv_new")
        base = _packed_name(entry.key_in or "", entry.value_in or "")
        past = _new_input(graph, key.past, base, (B, L, H, 2 * Dp), kv_type)
        graph.inputs.remove(value.past)
        buffer = b.cast(past, compute, "kv_compute")
        updated = _write(b, buffer, packed_new, 1, "kv_write", self.method, slots, L)
        for t, start, tag in ((key, 0, "key"), (value, Dp, "value")):
            part = b.slice_last_or_axis(updated, start, start + D, 3, f"{tag}_bshd")
            _reroute(t, b.transpose(part, _BSH, f"{tag}_view"))
            self.back_transposes += 1
        out = b.cast(updated if self.update_mode == "full_buffer" else packed_new, kv_type, "kv_out_cache")
        out_name = _packed_name(entry.key_out or "", entry.value_out or "")
        _rename_output(graph, key.present_index, out_name)
        out.name = out_name
        self.new_outputs[key.present_index] = out
        self.drop_outputs.add(value.present_index)
        return CacheBinding(layer=entry.layer, kv_in=base, kv_out=out_name)

    def _separate(
        self,
        b: _Builder,
        t: _CacheTensor,
        tag: str,
        new: ir.Value,
        compute: ir.DataType,
        layer_slots: tuple[int, ir.Value],
    ) -> tuple[str, str]:
        """BHSD or BHDS_K: one buffer per tensor, K transposed ``(B, H, Dp, L)`` for BHDS_K; its in/out names.

        ``layer_slots``: the layer's buffer slots ``L`` (a ring's length) and the int64 ``[S]`` slots a call writes.
        """
        c, graph = self.contract, self.graph
        (L, slots), B, H, D = layer_slots, c.batch, c.num_kv_heads, c.head_dim
        kv_type = c.kv_onnx_type
        transposed = self.layout == "BHDS_K" and tag == "key"
        update = b.transpose(new, _SWAP_LAST, f"{tag}_new_t") if transposed else new
        shape = (B, H, self.Dp, L) if transposed else (B, H, L, self.Dp)
        past_name = str(t.past.name)
        past = _new_input(graph, t.past, past_name, shape, kv_type)
        buffer = b.cast(past, compute, f"{tag}_compute")
        updated = _write(b, buffer, update, 3 if transposed else 2, f"{tag}_write", self.method, slots, L)
        if transposed:
            self._read_stored_key(b, t, b.slice_last_or_axis(updated, 0, D, 2, "key_t_view"))  # (B, H, D, L)
        else:
            _reroute(t, b.slice_last_or_axis(updated, 0, D, 3, f"{tag}_view"))
        out = b.cast(updated if self.update_mode == "full_buffer" else update, kv_type, f"{tag}_out_cache")
        present_name = str(graph.outputs[t.present_index].name)
        _rename_output(graph, t.present_index, present_name)
        out.name = present_name
        self.new_outputs[t.present_index] = out
        return past_name, present_name

    def _read_stored_key(self, b: _Builder, t: _CacheTensor, stored: ir.Value) -> None:
        """Attention's ``Transpose(0, 1, 3, 2)`` of K becomes the stored Kᵀ; other readers share one Transpose back."""
        back = None
        for use in list(t.updated.uses()):
            node = use.node
            if node.op_type == "Transpose" and tuple(node.attributes.get_ints("perm", [])) == _SWAP_LAST:
                node.outputs[0].replace_all_uses_with(stored)
                self.kept_transposes += 1
                continue
            if back is None:
                back = b.transpose(stored, _SWAP_LAST, "key_view")
                self.back_transposes += 1
            node.replace_input_with(use.idx, back)

    def finish(self, model: ir.Model) -> None:
        """Put the new cache outputs in place, drop V's outputs of packed layers, sort, prune and re-infer."""
        graph = self.graph
        for index, out in self.new_outputs.items():
            graph.outputs[index] = out
        for index in sorted(self.drop_outputs, reverse=True):
            graph.outputs.pop(index)
        graph.sort()
        remove_dead_nodes(model)
        infer_shapes(model)

    def changes(self) -> list[str]:
        """The report lines of this graph's rewrite."""
        c = self.contract
        changes = [
            f"cache {self.layout}, head dim {c.head_dim} -> {self.Dp}, written by {self.method} ({self.update_mode}) "
            f"in the new layout; {len(c.cache)} layers"
        ]
        if self.layout == "BHDS_K":
            changes.append(
                f"{self.kept_transposes} K Transpose(s) now read the stored Kᵀ directly; {self.back_transposes} "
                "reader(s) of K transpose it back (run grouped_attention before kv_layout so attention reads K "
                "through one Transpose)"
            )
        return changes


def _relayout(
    model: ir.Model, contract: DecodeContract, cfg: KVLayoutConfig, who: str
) -> tuple[DecodeContract, list[str]]:
    """Rewrite one static graph's cache into ``cfg.layout`` (module docstring); returns its contract and changes.

    Raises:
        PreconditionError: no cache_position input, a cache inside an attention op, or not one write per input.
    """
    graph, c = model.graph, contract
    inputs = {str(v.name): v for v in graph.inputs}
    cache_position = inputs[c.inputs.cache_position] if c.inputs.cache_position else None
    if cache_position is None:
        raise PreconditionError(who, "the contract names no cache_position input; run static_kv first")
    found = [
        [_find_tensor(graph, c, past, present, who) for past, present in c.layer_cache_pairs(entry)]
        for entry in c.cache
    ]
    method, update_mode = _write_method(found, c, cfg)
    Dp = padded_head_dim(c.head_dim, cfg.pad_head_dim_to)
    slots = {  # window_cache: a ring layer's slot is its position mod its length (passes/_window_cache.py)
        e.layer: (n, ring_slots(graph, cache_position, n, c.step_len) if e.slot_mapping == "ring" else cache_position)
        for e in c.cache
        for n in [c.layer_cache_len(e)]
    }
    state = _Relayout(graph, c, cfg.layout, Dp, method, update_mode, slots)
    for entry, (key, value) in zip(c.cache, found, strict=True):
        state.layer(entry, key, value)
    state.finish(model)
    rings = {e.layer: {"cache_len": e.cache_len, "slot_mapping": e.slot_mapping} for e in c.cache}
    new_contract = c.model_copy(
        update={
            "kv_layout": cfg.layout,
            "head_dim_padded": Dp,
            "cache": [e.model_copy(update=rings[e.layer]) for e in state.entries],
            "cache_update": update_mode,
            "contract_version": max(c.contract_version, LAYOUT_VERSIONS[cfg.layout]),
        }
    )
    DecodeContract.model_validate(new_contract.model_dump())  # the layout's names and version hold
    return new_contract, state.changes()


def _packed_name(key: str, value: str) -> str:
    """``past_key_values.0.key`` + ``past_key_values.0.value`` -> ``past_key_values.0.key_value``."""
    if key.endswith("key") and value == key[: -len("key")] + "value":
        return key + "_value"
    return f"{key}+{value}"


def _rename_output(graph: ir.Graph, index: int, name: str) -> None:
    old = graph.outputs[index]
    if old.name == name:
        old.name = f"{name}/bhsd"


@register_pass
class KVLayoutPass(Pass):
    """Repack every graph's static cache into ``layout``, head dim padded (module docstring).

    Raises:
        PreconditionError: a graph without a decode contract (run ``static_kv`` first), a layout other than BHSD
            or a padded head dim already (run ``kv_layout`` once), a cache inside GroupQueryAttention/Attention
            (BNSH only), or no single cache write per cache input.
        PostconditionError: a cache input or output whose shape differs from the new contract's.
    """

    name = "kv_layout"
    config_model = KVLayoutConfig
    config: KVLayoutConfig
    in_place = False
    needs = frozenset({CONTRACT, BHSD_CACHE, WHOLE_MODEL})  # Pass.requires checks each on every graph
    keeps_opset = True

    def removes(self) -> frozenset[OrderFact]:
        """What ``grouped_attention`` can no longer rewrite after this pass: a plain BHSD cache.

        A layout other than BHSD, or a padded head dim (attention then reads a Slice view of the buffer).
        """
        cfg = self.config
        return frozenset({BHSD_CACHE}) if cfg.layout != "BHSD" or cfg.pad_head_dim_to is not None else frozenset()

    def check_model(self, model: ir.Model, settings: PipelineSettings) -> None:
        """Refuse, from the input graph, an export whose cache lives inside an attention op (genai's GQA).

        ``static_kv`` keeps such a cache inside ``com.microsoft::GroupQueryAttention``, which takes it only as BNSH
        ``(B, H_kv, S, D)``: no layout can be written, so this is known before the first pass.

        Raises:
            ConfigError: the input's cache enters an attention op (names the op and the node).
        """
        if read_contract(model) is not None:
            return  # a static input: requires() reads its contract and graph
        try:
            kv = find_kv_cache(model, who=self.name)
        except OnnxDeployError:
            return  # static_kv refuses the cache with its own message
        if kv.attention_op is not None:
            raise ConfigError(
                f"the cache stays inside {node_label(kv.attention_nodes[0])}, which takes its cache only as BNSH "
                "(B, H_kv, S, D) and keeps it there after static_kv; kv_layout cannot repack it: leave kv_layout out "
                "for this export"
            )

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Rewrite a structural copy of every graph (no weight copied)."""
        models = []
        for artifact in artifacts.artifacts:
            model = clone(artifact.model)
            contract = read_contract(model, source=artifact.name)
            assert contract is not None  # requires() checked
            try:
                new_contract, changes = _relayout(model, contract, self.config, self.name)
            except PreconditionError as exc:
                raise PreconditionError(self.name, f"graph '{artifact.name}': {exc.detail}") from exc
            write_contract(model, new_contract)
            prefix = f"{artifact.name}: " if len(artifacts.artifacts) > 1 else ""
            report.changes += [prefix + line for line in changes]
            models.append(model)
        return artifacts.with_models(models), True

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Every cache input and output has the shape and dtype its contract states.

        Raises:
            PostconditionError: naming the graph and the tensor.
        """
        for artifact in artifacts.artifacts:
            contract = read_contract(artifact.model, source=artifact.name)
            assert contract is not None
            g = artifact.model.graph
            values = {str(v.name): v for v in [*g.inputs, *g.outputs]}
            pairs = contract.cache_pairs()
            wanted = [
                *zip([p for p, _ in pairs], contract.pair_input_shapes(), strict=True),
                *zip([o for _, o in pairs], contract.pair_output_shapes(), strict=True),
            ]
            for name, shape in wanted:
                value = values.get(name)
                got = tuple(value.shape) if value is not None and value.shape is not None else None
                if got != shape or value.dtype != contract.kv_onnx_type:  # type: ignore[union-attr]
                    raise PostconditionError(
                        self.name,
                        f"graph '{artifact.name}': '{name}' is {got} {value.dtype if value else ''}; the contract "
                        f"says {shape} {contract.kv_dtype}",
                    )
