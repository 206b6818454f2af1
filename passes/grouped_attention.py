"""``grouped_attention``: attention reads the static cache buffer itself, with no head repeat or scale copy.

Run it after ``static_kv`` (it needs the fixed shapes and the contract's cache names); it applies to every
graph of the set (decode graph and prefill buckets), before or after ``mask_rewrite``. Which reads of the cache
it recognises: :mod:`onnxdeploy.passes._cache_reads`; what it rewrites them to and why that is exact:
:mod:`onnxdeploy.passes._attention_edits`. An opset-23 ``Attention`` node whose K/V are the exporter's head
repeat of the cache (dynamo-23 exports) is first split into primitive ops by the same helper ``mask_rewrite``
uses (:func:`~onnxdeploy.passes._attention_decompose.decompose_attention`), so its reads of the cache become
MatMul operands this pass can rewrite. On the 125M LLaMA export of ``benchmarks/decode.py`` the head repeat
alone is two copies of ``3 × max_cache_len × 64`` floats per head group and layer per step.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.graph import node_label
from onnxdeploy.passes._attention_decompose import decompose_attention, decompose_refusal
from onnxdeploy.passes._attention_edits import group_query_heads
from onnxdeploy.passes._cache_reads import head_repeats, repeating_attention_nodes
from onnxdeploy.passes._catalog import GroupedAttentionConfig
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import clone, infer_shapes
from onnxdeploy.passes._order import BHSD_CACHE, CONTRACT, WHOLE_MODEL
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.report import PassReport

__all__ = ["GroupedAttentionConfig", "GroupedAttentionPass"]


@register_pass
class GroupedAttentionPass(Pass):
    """Replace the exporters' GQA head repeat and K-side scale by grouped attention over the cache buffer.

    Input: static graphs with a decode contract and a BHSD cache ``(B, H_kv, max_cache_len, D)``. For each
    attention MatMul that reads a buffer through Unsqueeze/Expand/Reshape (or Tile), Transpose and scalar
    Mul/Div, Q ``(B, H_q, S, D)`` (or the probabilities ``(B, H_q, S, max_cache_len)``) is reshaped to
    ``(B, H_kv, G·S, ·)`` — or, in a one-token graph with ``max_rank`` 5, to ``(G, B, H_kv, 1, ·)`` so the
    buffer broadcasts over G — the scalars move onto it, and the MatMul reads the buffer (K through one
    Transpose); the product is reshaped back to ``(B, H_q, S, ·)``. Graph inputs, outputs and the contract
    are unchanged. An opset-23 ``Attention`` node that reads a head repeat of the cache is decomposed first
    (MatMul/scale/mask/Softmax/MatMul, shapes re-inferred); one the decomposition does not take (past inputs,
    ``is_causal``, ...) is left as it is, with a warning. Every head repeat of a cache buffer still in a graph
    after the rewrite (:func:`~onnxdeploy.passes._cache_reads.head_repeats`, whatever reads it) is named in
    a warning: the graph still decodes the same, but copies the cache every call. The pass is functional: it
    rewrites structural copies (no weight copied).

    Raises:
        PreconditionError: a graph without a decode contract (run ``static_kv`` first) or with a cache layout
            other than BHSD (run ``grouped_attention`` before ``kv_layout``).
    """

    name = "grouped_attention"
    config_model = GroupedAttentionConfig
    in_place = False
    needs = frozenset({CONTRACT, BHSD_CACHE, WHOLE_MODEL})  # Pass.requires checks each on every graph
    keeps_opset = True

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Rewrite a structural copy of every graph; see the class docstring."""
        models: list[ir.Model] = []
        modified = False
        for artifact in artifacts.artifacts:
            model = clone(artifact.model)
            split, warnings = [], []
            for node in repeating_attention_nodes(model):
                why = decompose_refusal(node)
                if why is None:
                    split.append(node)
                else:
                    warnings.append(f"Attention node '{node.name}' reads a head repeat of the cache but {why}: kept")
            decomposed = decompose_attention(model.graph, who=self.name, nodes=split) if split else []
            if decomposed:
                infer_shapes(model)  # the new MatMuls' static shapes decide the grouped rewrite
            changes, unrewritten = group_query_heads(model, self.config.max_rank)  # type: ignore[attr-defined]
            changes, warnings = decomposed + changes, warnings + unrewritten
            for repeat in head_repeats(model):  # whatever is left is named: a repeat is never kept silently
                label = node_label(repeat)
                if not any(label in line for line in warnings):
                    warnings.append(
                        f"{label} still repeats a cache buffer (read through ops the rewrite does not take): not "
                        "rewritten, it copies the cache every call"
                    )
            modified |= bool(changes)
            prefix = f"{artifact.name}: " if len(artifacts.artifacts) > 1 else ""
            report.changes += [prefix + line for line in changes]
            report.warnings += [prefix + line for line in warnings]
            if not changes and not warnings:
                report.changes.append(f"{prefix}no attention read of the cache to rewrite")
            models.append(model)
        return artifacts.with_models(models), modified
