"""``mask_rewrite``: the exporter's mask construction becomes an O(max_cache_len) mask from ``cache_position``.

What the pass does (README, "Passes" → ``mask_rewrite``), on every graph of the artifact set (the decode
graph and prefill buckets; each carries its own contract):

* Finds each attention Softmax by data flow: its input comes from ``MatMul(Q, Kᵀ)`` (through scale
  Mul/Div) and reaches a cache buffer named by the contract; the exporter's mask is the other operand of the
  ``Add`` (additive 0 / large-negative mask) or the condition of the ``Where`` on that path.
* Builds one boolean mask ``(…, S, L)`` per window from ``cache_position`` (int64 ``[S]``): slot ``j`` is
  visible to the query at position ``p`` iff ``j <= p`` and, for sliding-window models, ``p - j < window``
  (this includes the causal triangle inside a chunk when ``step_len > 1``); with ``padding: true`` it is also
  ANDed with ``attention_mask`` ``(B, L)``. It costs an int64 ``[1, L]`` slot index and an ``(S, L)`` compare.
* Masks by **select**: ``Softmax(Where(mask, scores, lowest))`` with ``lowest`` the lowest finite value of
  the scores' dtype (``-3.40e38`` in fp32, ``-65504`` in fp16), so a NaN/inf/stale value in an unused K
  slot never reaches the output, a fully masked row stays finite (uniform) in fp16, and masked probabilities
  are exactly 0. The exporter's ``Add`` of the mask is bypassed, and its NaN guard on the probabilities
  (``Where(IsNaN(p), 0, p)``; RK3588 has no NPU lowering for IsNaN) is removed with it.
* The old mask subgraph becomes dead and is removed; ``attention_mask`` is removed from the inputs unless
  ``padding: true``; the graph is refolded (:func:`~onnxdeploy.passes._edit.fold_and_infer`).

The window is read from the graph (integer constants the exporter compares query positions against) and
confirmed by running: the old mask and each candidate new mask are computed on ONNX Runtime for every
chunk start (sampled above 384 starts) with the contract's ``attention_mask`` (and random padding bits with
``padding: true``); a candidate is used only if it selects exactly the slots the old mask selected. A mask
that is not a plain 0 / large-negative mask (a bias such as ALiBi) or matches no candidate is refused.

A graph whose cache enters ``com.microsoft::GroupQueryAttention`` (onnxruntime-genai; ``static_kv`` already
feeds its ``seqlens_k`` / ``total_sequence_length`` from ``cache_position``, contract ``mask: cache_position``)
has no exporter mask to replace: the op masks by length inside and never reads a slot past the current
position. Such a graph passes through unchanged (reported); ``padding: true`` is refused there (the op takes
per-row lengths, not a padding mask).

Masked probabilities are exactly 0, and ``0 × NaN`` is still NaN: unused V slots must hold finite values.
Sanitising V would copy the cache every step, so the contract states instead that the host zeroes every
buffer once when it allocates it (``cache_init: zeros``); stale finite values from earlier use are harmless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.contract import DecodeContract, read_contract, write_contract
from onnxdeploy.errors import PostconditionError, PreconditionError
from onnxdeploy.graph import default_opset, node_label
from onnxdeploy.kv_cache import GQA_OP
from onnxdeploy.passes._attention_decompose import decompose_attention
from onnxdeploy.passes._attention_sites import (
    AttentionSite,
    find_attention_sites,
    key_cache_inputs,
    masking_attention_op,
)
from onnxdeploy.passes._catalog import MaskRewriteConfig
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import add_initializer, clone, fold_and_infer, infer_shapes, make_node, remove_dead_nodes
from onnxdeploy.passes._mask_windows import choose_windows
from onnxdeploy.passes._order import CONTRACT, WHOLE_MODEL
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.passes._position_mask import PositionMaskBuilder, lowest_finite
from onnxdeploy.passes._slot_mask import mask_from_ring, mask_from_slot_positions
from onnxdeploy.report import PassReport

__all__ = [
    "AttentionSite",
    "MaskRewriteConfig",
    "MaskRewritePass",
    "find_attention_sites",
    "lowest_finite",
    "masking_attention_op",
]

_PREFIX = "onnxdeploy/mask_rewrite"


@dataclass
class _GraphResult:
    model: ir.Model
    contract: DecodeContract
    windows: set[int | None]
    sites: int
    guards: int
    decomposed: list[str] = field(default_factory=list)


def _static_sites(graph: ir.Graph, contract: DecodeContract, source: str, who: str) -> list[AttentionSite]:
    """The attention sites, each Softmax input of static shape ``(…, step_len, max_cache_len)``.

    Raises:
        PreconditionError: a Softmax input of another shape (names the graph and the node).
    """
    S, L = contract.step_len, contract.max_cache_len
    sites = find_attention_sites(graph, key_cache_inputs(contract), L, who=who)
    for site in sites:
        shape = site.softmax.inputs[0].shape  # type: ignore[union-attr]
        dims = list(shape) if shape is not None else []
        if len(dims) < 2 or dims[-1] != L or dims[-2] != S or not all(isinstance(d, int) for d in dims):
            raise PreconditionError(
                who,
                f"{source}: Softmax {node_label(site.softmax)} input has shape {dims}; expected static (…, {S}, {L}) "
                "(step_len, max_cache_len)",
            )
    return sites


def _select_scores(graph: ir.Graph, sites: list[AttentionSite], masks: list[ir.Value], source: str, who: str) -> int:
    """Mask each site's scores by ``Where(mask, scores, lowest)``, bypassing the old mask; return the guards removed.

    Raises:
        PreconditionError: a Softmax input without a dtype.
    """
    guards = 0
    for i, (site, mask) in enumerate(zip(sites, masks, strict=True)):
        if site.masked is not None and site.scores is not None:
            site.masked.replace_all_uses_with(site.scores)
        x = site.softmax.inputs[0]
        assert x is not None
        if x.dtype is None:
            raise PreconditionError(who, f"{source}: Softmax {node_label(site.softmax)} input has no dtype")
        lowest = add_initializer(graph, f"{_PREFIX}/lowest_{x.dtype.name.lower()}", lowest_finite(x.dtype), reuse=True)
        tag = f"{_PREFIX}/{site.softmax.name or i}"
        where = make_node(
            "Where", [mask, x, lowest], name=f"{tag}/select", output=f"{tag}/masked_scores", dtype=x.dtype
        )
        graph.insert_before(site.softmax, where)
        site.softmax.replace_input_with(0, where.outputs[0])
        for _isnan, guard in site.nan_guards:
            guard.outputs[0].replace_all_uses_with(site.softmax.outputs[0], replace_graph_outputs=True)
            guards += 1
    return guards


def _masked_contract(contract: DecodeContract, windows: set[int | None], attention_mask: str | None) -> DecodeContract:
    """The contract of the rewritten graph: masked from cache_position, buffers zeroed once, its window."""
    windowed = sorted(w for w in windows if w is not None)
    return contract.model_copy(
        update={
            "contract_version": max(contract.contract_version, 2),
            "mask": "cache_position",
            "sliding_window": windowed[0] if len(windowed) == 1 else None,
            "cache_init": "zeros",
            "inputs": contract.inputs.model_copy(update={"attention_mask": attention_mask}),
        }
    )


@register_pass
class MaskRewritePass(Pass):
    """Replace the exporter's mask by a select on the scores from ``cache_position`` (see the module docstring).

    Input: static graphs with a decode contract (``static_kv`` ran first), each with a ``cache_position``
    input. Output: per graph, ``Softmax(Where(mask, scores, lowest))`` at every attention, no
    ``attention_mask`` input unless ``padding: true``, no exporter mask or IsNaN guard, and the contract
    updated (``mask: cache_position``, ``sliding_window``, ``cache_init: zeros``, ``inputs.attention_mask``).
    The pass is functional: it rewrites structural copies (weights shared) and returns a new set.

    Raises:
        PreconditionError: a graph without a contract or ``cache_position``, already rewritten, opset < 12
            (LessOrEqual), no attention Softmax found, a mask that is not a position mask (a bias, weights, an
            unknown input) or whose window cannot be confirmed, or ``attention_mask`` still read by other nodes
            without ``padding``.
        PostconditionError: an exporter mask, IsNaN guard or unwanted ``attention_mask`` input is left.
    """

    name = "mask_rewrite"
    config_model = MaskRewriteConfig
    config: MaskRewriteConfig
    in_place = False
    needs = frozenset({CONTRACT, WHOLE_MODEL})
    keeps_opset = True

    def min_opset(self, model: ir.Model | None) -> tuple[int, str] | None:
        """ai.onnx opset 12 for the select mask (LessOrEqual); none for a graph whose GroupQueryAttention masks.

        Unknown (None) without the graph: a ``com.microsoft::GroupQueryAttention`` cache graph is left as it is
        (:meth:`requires` checks the opset only for the other graphs).
        """
        if model is None or any(f"{n.domain}::{n.op_type}" == GQA_OP for n in model.graph):
            return None
        return 12, "the mask it writes uses LessOrEqual-12"

    def requires(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Every graph carries a contract with ``cache_position``, not rewritten yet, ai.onnx opset ≥ 12.

        Raises:
            PreconditionError: naming the graph and what is missing.
        """
        for artifact, contract in artifacts.contracts(self.name):
            if contract.inputs.cache_position is None:
                raise PreconditionError(self.name, f"{artifact.name}: the contract names no cache_position input")
            op = masking_attention_op(artifact.model, contract)
            if op is not None and self.config.padding:
                raise PreconditionError(
                    self.name,
                    f"{artifact.name}: padding: true, but {GQA_OP} node '{op.name}' holds the cache and masks by "
                    "per-row lengths (seqlens_k), not by a padding mask; use padding: false",
                )
            if op is not None:
                continue
            if contract.mask in ("cache_position", "slot_positions"):
                raise PreconditionError(self.name, f"{artifact.name}: the mask was already rewritten")
            opset = default_opset(artifact.model)
            if opset < 12:
                raise PreconditionError(self.name, f"{artifact.name}: ai.onnx opset {opset} < 12 (LessOrEqual)")

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Rewrite the mask of every graph of the set; see the class docstring."""
        models = []
        for artifact in artifacts.artifacts:
            contract = read_contract(artifact.model, source=artifact.name)
            op = masking_attention_op(artifact.model, contract) if contract is not None else None
            if op is not None:
                models.append(artifact.model)
                report.changes.append(
                    f"{artifact.name}: unchanged: {GQA_OP} node '{op.name}' masks inside the op by seqlens_k, "
                    "computed from cache_position (no exporter mask, no attention_mask input)"
                )
                continue
            result = self._rewrite(clone(artifact.model), artifact.name, context)
            models.append(result.model)
            report.changes += [f"{artifact.name}: {line}" for line in result.decomposed]
            windows = sorted(w for w in result.windows if w is not None)
            report.changes.append(
                f"{artifact.name}: {result.sites} attention Softmax(es) masked by select from cache_position "
                f"(step_len {result.contract.step_len}, {'sliding window ' + str(windows) if windows else 'causal'}"
                f"{', padding' if self.config.padding else ''}); {result.guards} IsNaN guard(s) removed"
            )
        if not self.config.padding:
            report.changes.append("input attention_mask removed; contract inputs.attention_mask = null")
        return artifacts.with_models(models), True

    def _mask_inputs(self, graph: ir.Graph, contract: DecodeContract) -> tuple[ir.Value, ir.Value | None]:
        """``cache_position`` and the graph's ``attention_mask`` (added as an input with padding when absent)."""
        inputs = {str(v.name): v for v in graph.inputs}
        cache_position = inputs[contract.inputs.cache_position]  # type: ignore[index]
        am_name = contract.inputs.attention_mask
        attention_mask = inputs.get(am_name) if am_name else None
        if self.config.padding and attention_mask is None:
            shape = ir.Shape([contract.batch, contract.max_cache_len])
            attention_mask = ir.Value(name="attention_mask", shape=shape, type=ir.TensorType(ir.DataType.INT64))
            graph.inputs.append(attention_mask)
        return cache_position, attention_mask

    def _drop_attention_mask(self, graph: ir.Graph, attention_mask: ir.Value | None, source: str) -> None:
        """Without padding, remove the ``attention_mask`` input the exporter's mask read.

        Raises:
            PreconditionError: another node still reads it.
        """
        if attention_mask is None or self.config.padding:
            return
        readers = sorted({node_label(u.node) for u in attention_mask.uses()})
        if readers:
            raise PreconditionError(
                self.name,
                f"{source}: attention_mask is still read by {readers[:3]} after the exporter's mask was removed; "
                "use padding: true to keep it",
            )
        graph.inputs.remove(attention_mask)

    def _rewrite(self, model: ir.Model, source: str, context: PassContext) -> _GraphResult:
        """Rewrite one graph (a structural copy, edited in place): sites, windows, select, contract, refold."""
        contract = read_contract(model, source=source)
        assert contract is not None  # requires() checked
        g = model.graph
        decomposed = decompose_attention(g, who=self.name)  # opset-23 Attention: its scores become reachable
        infer_shapes(model)  # the sites are told apart by their static shapes; an earlier pass may have dropped them
        ring = {e.cache_len for e in contract.cache if e.slot_mapping == "ring"}  # window_cache: one ring length
        every = all(e.slot_mapping == "ring" for e in contract.cache) and len(ring) == 1  # else rings read by a view
        view = contract.model_copy(update={"max_cache_len": ring.pop()}) if every else contract  # the buffers' slots
        sites = _static_sites(g, view, source, self.name)
        cache_position, attention_mask = self._mask_inputs(g, view)
        padding = attention_mask if self.config.padding else None
        S, L = contract.step_len, view.max_cache_len
        builder = PositionMaskBuilder(g, cache_position, padding, contract.batch, S, L, _PREFIX)
        chosen = choose_windows(
            model, sites, builder, view, padding=self.config.padding, context=context, source=source, who=self.name
        )
        masks = [builder.visible(w, len(site.scores_shape)) for site, w in zip(sites, chosen, strict=True)]
        guards = _select_scores(g, sites, masks, source, self.name)
        if view is not contract:  # ring slots: mask by the position each slot holds
            mask_from_ring(g, _PREFIX, cache_position, L, S)
        slot_positions = None
        if contract.cache_policy is not None:  # a ring past max_cache_len: mask from the positions slots hold
            slot_positions = mask_from_slot_positions(g, _PREFIX, contract.inputs.position_ids, L, who=self.name)
        remove_dead_nodes(model)
        self._drop_attention_mask(g, attention_mask, source)
        folded = fold_and_infer(model)
        windows = set(chosen)
        new_contract = _masked_contract(contract, windows, str(padding.name) if padding is not None else None)
        if slot_positions is not None:
            inputs = new_contract.inputs.model_copy(update={"slot_positions": slot_positions})
            new_contract = new_contract.model_copy(update={"mask": "slot_positions", "inputs": inputs})
        write_contract(folded, new_contract)
        return _GraphResult(folded, new_contract, windows, len(sites), guards, decomposed)

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Each graph: every attention Softmax reads this pass's select, no NaN guard, attention_mask as asked.

        Raises:
            PostconditionError: naming the graph and the node or input.
        """
        for artifact in artifacts.artifacts:
            g = artifact.model.graph
            contract = read_contract(artifact.model, source=artifact.name)
            assert contract is not None
            names = {str(v.name) for v in g.inputs}
            kept = contract.inputs.attention_mask
            if self.config.padding != (kept is not None and kept in names):
                raise PostconditionError(
                    self.name, f"{artifact.name}: attention_mask input {'missing' if self.config.padding else 'left'}"
                )
            if not self.config.padding and "attention_mask" in names:
                raise PostconditionError(self.name, f"{artifact.name}: the attention_mask input is still there")
            if masking_attention_op(artifact.model, contract) is not None:
                continue
            slots = max(contract.layer_cache_len(e) for e in contract.cache)  # a ring's slots (window_cache)
            for site in find_attention_sites(g, key_cache_inputs(contract), slots, who=self.name):
                x = site.softmax.inputs[0]
                producer = x.producer() if x is not None else None
                if producer is None or producer.op_type != "Where" or not producer.name.startswith(_PREFIX):
                    raise PostconditionError(
                        self.name,
                        f"{artifact.name}: Softmax {node_label(site.softmax)} is not masked by this pass's select",
                    )
                if site.nan_guards:
                    raise PostconditionError(
                        self.name, f"{artifact.name}: an IsNaN guard is left after Softmax {node_label(site.softmax)}"
                    )
