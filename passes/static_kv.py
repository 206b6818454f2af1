"""``static_kv``: fixed batch, step length and ``max_cache_len``; cache appended by Scatter, not Concat.

What the pass does (DESIGN.md, "Passes" → ``static_kv``):

* Past K/V inputs become fixed buffers ``(B, H_kv, max_cache_len, D)``. The Concat that appended the
  step's K/V ``(B, H_kv, S, D)`` becomes ``ScatterElements(axis=2)`` (ONNX opset ≥ 11) writing at the
  new int64 input ``cache_position`` of shape ``[step_len]``; attention reads the whole buffer.
* Every other reader of a past input (the exporters' shape arithmetic: mask width, GQA head-repeat
  shape) reads a Slice view of ``max_cache_len - S`` slots, so ``past_len + S`` lands on
  ``max_cache_len`` and folds away once all inputs are static.
* The exporter's internal query-position vector (``past_len + arange(S)``, transformers'
  ``cache_position``) is found by running the original at two past lengths and replaced by the
  ``cache_position`` input, so the causal (and sliding-window) mask stays right for any position.
* ``attention_mask`` becomes int64 ``(B, max_cache_len)``; the host writes 1 for slots ≤ the current
  position. A ``-inf`` float constant becomes the dtype's most negative finite value
  (``numpy.finfo(dtype).min``, what transformers itself uses) so a fully masked row cannot make NaN.
* Shape arithmetic is folded (onnxsim, constant folding only) and the decode contract is written to
  ``metadata_props`` (DESIGN.md, "The decode contract").
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from pydantic import Field

from onnxdeploy.contract import CacheBinding, ContractInputs, DecodeContract, write_contract
from onnxdeploy.errors import PostconditionError, PreconditionError
from onnxdeploy.folding import fold_constants
from onnxdeploy.graph import tensor_dims
from onnxdeploy.kv_cache import GraphIndex, KVCache, find_kv_cache
from onnxdeploy.passes.base import Pass, PassConfig
from onnxdeploy.report import PassReport

__all__ = ["StaticKVConfig", "StaticKVCachePass", "find_query_positions"]

_PREFIX = "onnxdeploy/static_kv"
_KNOWN_INPUTS = ("input_ids", "attention_mask", "position_ids")
_POSITION_OFFSET = 11  # position_ids fed during probing are offset so they cannot pass for past + arange(S)
_PROBE_PAST = (3, 5)
_PROBE_STEP = 2
_FOLDED_AWAY = ("Shape", "Range", "Trilu")


class StaticKVConfig(PassConfig):
    """Config of ``static_kv``."""

    batch: int = Field(1, ge=1, description="Fixed batch size B of every input.")
    step_len: int = Field(1, ge=1, description="Tokens per call S (1 for the decode graph).")
    max_cache_len: int = Field(
        ..., ge=1, description="Slots of the fixed cache buffer (B, H_kv, max_cache_len, D); bounds the context."
    )
    cache_update: Literal["full_buffer", "new_token_only"] = Field(
        "full_buffer",
        description="full_buffer: present.* outputs are the updated buffers (B, H_kv, max_cache_len, D); "
        "new_token_only: present.* are the step's K/V (B, H_kv, step_len, D) for the host to write at "
        "cache_position.",
    )


def _const(graph: onnx.GraphProto, name: str, values: list[int]) -> str:
    """Add an int64 1-D initializer (once) and return its name."""
    if not any(t.name == name for t in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
    return name


def _set_dims(vi: onnx.ValueInfoProto, dims: list[int]) -> list[str]:
    """Set a value info's dims to ``dims``; return 'name[axis]: old -> new' for each change."""
    old = tensor_dims(vi) or [None] * len(dims)
    changes = []
    shape = vi.type.tensor_type.shape
    shape.ClearField("dim")
    for axis, d in enumerate(dims):
        shape.dim.add().dim_value = d
        before = old[axis] if axis < len(old) else None
        if before != d:
            changes.append(f"{vi.name}[{axis}]: {before if before is not None else '?'} -> {d}")
    return changes


def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def find_query_positions(model: onnx.ModelProto, kv: KVCache) -> list[str]:
    """Find the exporter's query-position tensors (value ``past_len + arange(S)``) by running the model.

    The original is run twice, at past lengths 3 and 5 with S=2 and ``position_ids`` offset by 11 (so
    the RoPE positions cannot be mistaken for it); int64 rank-1 intermediate tensors equal to
    ``past_len + arange(S)`` in both runs are candidates, and the ones not computed from another candidate
    are returned (transformers' ``cache_position``: ``Range(past_len, past_len + S)``).

    Args:
        model: the exporter-convention decoder (dynamic past length).
        kv: its cache, from :func:`onnxdeploy.kv_cache.find_kv_cache`.

    Returns:
        Names of the root query-position tensors (empty when the export has none).

    Raises:
        PreconditionError: ONNX Runtime cannot run the original model.
    """
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    int64_rank1 = set()
    for vi in list(inferred.graph.value_info):
        tt = vi.type.tensor_type
        if tt.elem_type == TensorProto.INT64 and (not tt.HasField("shape") or len(tt.shape.dim) == 1):
            int64_rank1.add(vi.name)
    g = model.graph
    outputs_now = {o.name for o in g.output}
    candidates = []
    for node in g.node:
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if out and out in int64_rank1 and out not in outputs_now:
                candidates.append(out)
    if not candidates:
        return []
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in candidates:
        probe.graph.output.append(helper.make_tensor_value_info(name, TensorProto.INT64, None))
    try:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises several unrelated exception types
        raise PreconditionError("static_kv", f"ONNX Runtime cannot load the original model: {exc}") from exc
    pasts = {t.past_input for t in kv.tensors}
    dtype = _np_dtype(kv.elem_type)
    inputs = {i.name for i in g.input}
    matches: set[str] | None = None
    for past in _PROBE_PAST:
        s = _PROBE_STEP
        feeds: dict[str, np.ndarray] = {}
        for name in pasts:
            feeds[name] = np.zeros((1, kv.num_kv_heads, past, kv.head_dim), dtype=dtype)
        feeds["input_ids"] = np.array([[1, 2]], dtype=np.int64)
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, past + s), dtype=np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = (past + _POSITION_OFFSET + np.arange(s, dtype=np.int64))[None, :]
        try:
            values = sess.run(candidates, feeds)
        except Exception as exc:  # ORT raises several unrelated exception types
            raise PreconditionError(
                "static_kv", f"ONNX Runtime cannot run the original model at past length {past}: {exc}"
            ) from exc
        expected = past + np.arange(s, dtype=np.int64)
        hit = {
            n
            for n, v in zip(candidates, values, strict=True)
            if v.ndim == 1 and v.shape == (s,) and np.array_equal(v, expected)
        }
        matches = hit if matches is None else matches & hit
    if not matches:
        return []
    index = GraphIndex(g)
    roots = []
    for name in matches:
        prod = index.producer.get(name)
        upstream = index.upstream_nodes(name, 64)
        derived = any(o in matches and o != name for up in upstream if up != prod for o in g.node[up].output)
        if not derived:
            roots.append(name)
    return sorted(roots)


def _replace_neg_inf(graph: onnx.GraphProto) -> int:
    """Replace ``-inf`` in float initializers and Constant/ConstantOfShape values; return how many tensors."""
    count = 0

    def fix(t: onnx.TensorProto) -> onnx.TensorProto | None:
        if t.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
            return None
        arr = numpy_helper.to_array(t)
        mask = np.isneginf(arr)
        if not mask.any():
            return None
        arr = arr.copy()
        arr[mask] = np.finfo(arr.dtype).min
        return numpy_helper.from_array(arr, t.name)

    for i, init in enumerate(graph.initializer):
        new = fix(init)
        if new is not None:
            graph.initializer[i].CopyFrom(new)
            count += 1
    for node in graph.node:
        if node.op_type not in ("Constant", "ConstantOfShape"):
            continue
        for attr in node.attribute:
            if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                new = fix(attr.t)
                if new is not None:
                    attr.t.CopyFrom(new)
                    count += 1
    return count


class StaticKVCachePass(Pass):
    """Make a decoder's KV cache static: fixed buffers updated by ScatterElements at ``cache_position``.

    Input: an exporter-convention decoder (``input_ids`` (B, S), ``attention_mask`` (B, past+S),
    optional ``position_ids`` (B, S), past K/V (B, H_kv, past, D), present K/V (B, H_kv, past+S, D),
    logits (B, S, V)). Output: the same graph with every dim static, a new ``cache_position`` int64
    ``[step_len]`` input, ``attention_mask`` int64 ``(B, max_cache_len)``, past K/V
    ``(B, H_kv, max_cache_len, D)``, and the decode contract in ``metadata_props``.

    Raises:
        PreconditionError: no KV cache found (the message says what was looked for and found), an
            unknown non-cache input, or ``max_cache_len < step_len``.
        PostconditionError: a dim is still dynamic after folding.
    """

    name = "static_kv"
    summary = "Fix batch/step_len/max_cache_len; Concat-appended cache -> ScatterElements at cache_position."
    config_model = StaticKVConfig
    config: StaticKVConfig

    def requires(self, model: onnx.ModelProto) -> None:
        """Check ``max_cache_len >= step_len``, opset ≥ 11 and that no contract is present yet."""
        cfg = self.config
        if cfg.max_cache_len < cfg.step_len:
            raise PreconditionError(
                self.name, f"max_cache_len={cfg.max_cache_len} is smaller than step_len={cfg.step_len}"
            )
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset < 11:
            raise PreconditionError(self.name, f"ai.onnx opset {opset} < 11 has no ScatterElements; run pin_opset")
        if any(p.key == "onnxdeploy.contract" for p in model.metadata_props):
            raise PreconditionError(
                self.name,
                "the model already carries metadata_props['onnxdeploy.contract'] (it was made static before); "
                "run static_kv on the original export",
            )

    def call(self, model: onnx.ModelProto, report: PassReport) -> tuple[onnx.ModelProto, bool]:
        """Rewrite the cache; see the class docstring."""
        cfg = self.config
        B, S, L = cfg.batch, cfg.step_len, cfg.max_cache_len
        kv = find_kv_cache(model, who=self.name)
        g = model.graph
        cache_inputs = {t.past_input for t in kv.tensors}
        other = [i.name for i in g.input if i.name not in cache_inputs and i.name not in _KNOWN_INPUTS]
        initializer_names = {t.name for t in g.initializer}
        other = [n for n in other if n not in initializer_names]
        if other:
            raise PreconditionError(
                self.name,
                f"unknown non-cache graph input(s) {other}; static_kv knows {list(_KNOWN_INPUTS)} and the cache",
            )
        if "input_ids" not in {i.name for i in g.input}:
            raise PreconditionError(self.name, "the model has no 'input_ids' input")

        query_positions = find_query_positions(model, kv)
        if query_positions:
            report.changes.append(f"query-position tensor(s) {query_positions} now read the cache_position input")
        elif S > 1:
            raise PreconditionError(
                self.name,
                "no query-position tensor (past_len + arange(S)) found; a static step_len > 1 graph would get a "
                "wrong causal mask. Use step_len 1.",
            )
        else:
            report.warnings.append(
                "no query-position tensor found; the causal mask relies on attention_mask alone (fine for "
                "step_len 1 without sliding window)"
            )

        index = GraphIndex(g)
        new_nodes: list[onnx.NodeProto] = []
        cache_pos = "cache_position"
        if cache_pos in {i.name for i in g.input} or cache_pos in index.producer:
            raise PreconditionError(self.name, "the graph already has a tensor named 'cache_position'")
        g.input.append(helper.make_tensor_value_info(cache_pos, TensorProto.INT64, [S]))
        report.changes.append(f"added input cache_position int64 [{S}]")

        H, D = kv.num_kv_heads, kv.head_dim
        idx_name = f"{_PREFIX}/scatter_indices"
        new_nodes.append(
            helper.make_node(
                "Reshape",
                [cache_pos, _const(g, f"{_PREFIX}/pos_shape", [1, 1, S, 1])],
                [f"{_PREFIX}/pos_4d"],
                name=f"{_PREFIX}/pos_reshape",
            )
        )
        new_nodes.append(
            helper.make_node(
                "Expand",
                [f"{_PREFIX}/pos_4d", _const(g, f"{_PREFIX}/update_shape", [B, H, S, D])],
                [idx_name],
                name=f"{_PREFIX}/pos_expand",
            )
        )
        starts = _const(g, f"{_PREFIX}/view_starts", [0])
        ends = _const(g, f"{_PREFIX}/view_ends", [L - S])
        axes = _const(g, f"{_PREFIX}/view_axes", [2])

        # Rewire each cache tensor: readers of the past see a view of L - S slots; the Concat becomes a Scatter.
        remove: set[int] = set()
        replace_at: dict[int, list[onnx.NodeProto]] = {}
        rename_inputs: dict[str, str] = {}
        for ct in kv.tensors:
            view = f"{_PREFIX}/{ct.past_input}/past_view"
            new_nodes.append(
                helper.make_node("Slice", [ct.past_input, starts, ends, axes], [view], name=f"{view}/Slice")
            )
            for alias in ct.past_aliases:
                rename_inputs[alias] = view
            here = replace_at.setdefault(ct.concat_index, [])
            buffer = ct.concat_output
            if cfg.cache_update == "new_token_only":
                buffer = f"{_PREFIX}/{ct.past_input}/updated_buffer"
                rename_inputs[ct.concat_output] = buffer
                producer = index.producer[ct.present_output]
                if producer != ct.concat_index:
                    remove.add(producer)
                here.append(
                    helper.make_node(
                        "Identity", [ct.new_operand], [ct.present_output], name=f"{_PREFIX}/{ct.present_output}/new"
                    )
                )
            here.append(
                helper.make_node(
                    "ScatterElements",
                    [ct.past_input, idx_name, ct.new_operand],
                    [buffer],
                    name=f"{_PREFIX}/{ct.past_input}/ScatterElements",
                    axis=2,
                )
            )
            report.changes.append(
                f"Concat {ct.concat_name or ct.concat_index} -> ScatterElements(axis=2) into '{ct.past_input}' "
                f"at cache_position ({ct.kind}, present '{ct.present_output}')"
            )
        for qp in query_positions:
            rename_inputs[qp] = cache_pos

        nodes = list(new_nodes)
        for i, node in enumerate(g.node):
            if i in replace_at:
                nodes.extend(replace_at[i])
            elif i not in remove:
                for k, name in enumerate(node.input):
                    if name in rename_inputs:
                        node.input[k] = rename_inputs[name]
                nodes.append(node)
        del g.node[:]
        g.node.extend(nodes)

        # Fix every input dim.
        for vi in g.input:
            if vi.name in initializer_names:
                continue
            if vi.name in cache_inputs:
                report.dims_fixed += _set_dims(vi, [B, H, L, D])
            elif vi.name == "attention_mask":
                report.dims_fixed += _set_dims(vi, [B, L])
            elif vi.name in ("input_ids", "position_ids"):
                report.dims_fixed += _set_dims(vi, [B, S])
        # Outputs and intermediates are re-inferred from the fixed inputs.
        del g.value_info[:]
        for vi in g.output:
            for d in vi.type.tensor_type.shape.dim:
                d.Clear()

        n_inf = _replace_neg_inf(g)
        folded = fold_constants(model)
        n_inf += _replace_neg_inf(folded.graph)
        if n_inf:
            report.changes.append(f"{n_inf} -inf constant(s) replaced by the dtype's finite minimum")
        left = {n.op_type for n in folded.graph.node if n.op_type in _FOLDED_AWAY}
        if left:
            report.warnings.append(f"ops left after folding: {sorted(left)}")

        # Intermediate shapes are re-derived from the static inputs; stale entries (onnxsim keeps some for
        # tensors it folded away) would otherwise carry the old symbolic dims.
        del folded.graph.value_info[:]
        inferred = onnx.shape_inference.infer_shapes(folded, strict_mode=False, data_prop=True)
        folded.graph.value_info.extend(inferred.graph.value_info)
        out_types = {vi.name: vi for vi in inferred.graph.output}
        for vi in folded.graph.output:
            if vi.name in out_types:
                vi.type.CopyFrom(out_types[vi.name].type)

        has = {i.name for i in folded.graph.input}
        contract = DecodeContract(
            batch=B,
            step_len=S,
            max_cache_len=L,
            num_layers=len(kv.layers),
            num_kv_heads=H,
            head_dim=D,
            head_dim_padded=D,
            kv_layout="BHSD",
            kv_dtype=str(_np_dtype(kv.elem_type)),
            cache_update=cfg.cache_update,
            inputs=ContractInputs(
                input_ids="input_ids",
                cache_position=cache_pos,
                position_ids="position_ids" if "position_ids" in has else None,
                attention_mask="attention_mask" if "attention_mask" in has else None,
            ),
            logits=self._logits_name(folded, {t.present_output for t in kv.tensors}),
            cache=[
                CacheBinding(
                    layer=layer.layer,
                    key_in=layer.key.past_input,
                    value_in=layer.value.past_input,
                    key_out=layer.key.present_output,
                    value_out=layer.value.present_output,
                )
                for layer in kv.layers
            ],
        )
        write_contract(folded, contract)
        report.changes.append(
            f"contract: {len(kv.layers)} layers, H_kv={H}, D={D}, batch={B}, step_len={S}, max_cache_len={L}, "
            f"{cfg.cache_update}"
        )
        return folded, True

    def _logits_name(self, model: onnx.ModelProto, presents: set[str]) -> str:
        others = [o.name for o in model.graph.output if o.name not in presents]
        if len(others) != 1:
            raise PreconditionError(self.name, f"expected one logits output besides the cache; found {others}")
        return others[0]

    def ensures(self, model: onnx.ModelProto) -> None:
        """Every graph input and output has a fully static shape."""
        for vi in list(model.graph.input) + list(model.graph.output):
            dims = tensor_dims(vi)
            if dims is None or any(not isinstance(d, int) for d in dims):
                raise PostconditionError(self.name, f"'{vi.name}' is not static after the rewrite: {dims}")
