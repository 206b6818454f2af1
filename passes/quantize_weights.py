"""``quantize_weights``: weight-only INT8/INT4 for MatMul/Gemm (and optionally embedding Gather) weights.

What the pass does (README, "Passes" → ``quantize_weights``):

* **Targets.** ``MatMul`` and ``Gemm`` (either ``transB``; ``transA=0``, ``alpha=beta=1``) whose weight input is
  constant: an initializer (or ``Constant``) reached through a chain of ``Cast``/``Transpose``/``Identity``
  nodes, which is folded (an fp16 weight reaching a float32 MatMul through a Cast is quantized from its fp16
  values and dequantized to float32). The LM head (the MatMul/Gemm feeding the logits output) is included
  unless ``lm_head: false``; embedding ``Gather`` tables only with ``embedding: true``; ``exclude`` drops nodes
  by name (shell patterns). A weight several nodes read (a tied embedding and LM head) is quantized **once**
  and every consumer reads the same quantized tensor, transposed where its layout differs.
* **Granularity.** ``bits: 8``: per output channel. ``bits: 4``: per group of ``block_size`` input channels
  (16/32/64/128); a ``K`` that is not a multiple is padded with the zero level (MatMulNBits, ORT's layout) or
  ends in a partial last block (DequantizeLinear: the scale's K dimension is ``ceil(K / block_size)``, ONNX's
  blocked form; OpenVINO 2026.4 refuses it, so the report warns). ``rules`` (:mod:`._quant_rules`) set bits and
  block size per weight by node-name pattern or kind, generalising ``lm_head``, ``embedding`` and ``exclude``.
  Symmetric (signed, no zero point) or asymmetric (unsigned with zero points); scales follow ORT's MLAS rules
  (:mod:`onnxdeploy.passes._weight_quant`).
* **Formats.** ``qdq``: ``DequantizeLinear`` feeding the original op. Per-axis INT8 needs ai.onnx opset ≥ 13
  (19 for float16/bfloat16 weights, whose scales keep that dtype),
  blocked INT4 opset ≥ 21 and IR ≥ 10: with ``raise_opset: true`` the graph is converted first (``pin_opset``'s
  converter), otherwise the pass refuses; no ``block_size`` attribute is ever written below opset 21.
  ``matmulnbits``: ``com.microsoft::MatMulNBits`` (INT8 in the power-of-two block storing the fewest bits,
  ``_quant_tensors.int8_nbits_block``: per channel when ``K`` is a power of two), with ``accuracy_level``; the
  ``com.microsoft`` import is added. Embedding
  tables are always dequantized by ``DequantizeLinear`` (ORT's ``MatMulNBits`` has no Gather form).
* **Act-order** (``act_order: true``, needs ``calibration`` in the pipeline): input-channel importance
  ``diag(X^T X)`` is collected on the calibration tokens by running the model through the runner's decode
  loop; ``K`` is permuted by decreasing importance so each group holds channels of similar importance. The
  permutation is folded into the graph exactly: into the output channels of the producing MatMuls when the
  activation is an elementwise function of them alone (the MLP's gate/up rows with down's columns); for
  o_proj, into V's output channels within each KV head where V's channels never leave the graph
  (:mod:`onnxdeploy.passes._value_fold`; with a KV cache they do, so not there); else by a ``Gather`` on the
  activation (shared by every weight reading it). No ``g_idx`` is left. ``details.act_order`` lists each
  activation's fold and, for o_proj kept as a Gather, the reason.
* **GPTQ** (``method: gptq``, needs ``calibration``): error compensation over ``X^T X`` with the act-order
  as column order (natural order without act-order).
* **Scale search** (``scale_search: mse``, :mod:`onnxdeploy.passes._quant_search`): each block's scale from the
  clipping ratio of its range with the least squared error, weighted by ``diag(X^T X)`` when calibration is
  given (in GPTQ, on each group's error-updated weights).
* **Budget** (``budget``, needs ``calibration``; :mod:`onnxdeploy.passes._quant_budget`): the fewest-bytes
  candidate of INT4 g128/g64/g32 and INT8 per channel whose mean KL / perplexity ratio on the calibration text
  meets the bounds; every candidate tried is reported.
* **Report.** ``details.layers``: per weight, the calibration-weighted weight error of plain round-to-nearest
  in natural order and of what was emitted, the fraction removed, its bits, block size, bytes and bits per
  weight; ``details.bits_per_weight`` the total (packed values + scales + zero points over the weights
  quantized, a shared weight once, the scale dtype); ``details.left_in_float`` every MatMul/Gemm/Gather with a
  constant weight left in float and why.

Weights are streamed: each is read (memory-mapped), quantized, and its quantized tensors written to a scratch
data file (mapped back) before the next is read, so memory holds one float weight at a time.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from onnxdeploy.artifacts import ArtifactSet, ScratchWriter
from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.graph import default_opset
from onnxdeploy.passes._act_order import apply_fold, plan_folds
from onnxdeploy.passes._calibration_stats import collect_statistics
from onnxdeploy.passes._catalog import QuantizeWeightsConfig
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import clone, fresh_name, names_in_use, remove_dead_nodes
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.passes._quant_budget import LADDER, calibration_logits, figures
from onnxdeploy.passes._quant_emit import Values, graph_values, rewire
from onnxdeploy.passes._quant_targets import Target, find_targets
from onnxdeploy.passes._quant_tensors import Quantized, WeightQuantizer
from onnxdeploy.report import PassReport
from onnxdeploy.settings import PipelineSettings

__all__ = ["QuantizeWeightsConfig", "QuantizeWeightsPass"]

INLINE_BYTES = 1024
"""Quantized tensors up to this size stay in memory; larger ones are written to the scratch data file."""


def _by_activation(targets: list[Target]) -> dict[int, list[Target]]:
    """The targets reading each activation (by ``id`` of the activation), in graph order."""
    groups: dict[int, list[Target]] = defaultdict(list)
    for t in targets:
        if t.activation is not None:
            groups[id(t.activation)].append(t)
    return groups


def _named_activations(graph: ir.Graph, by_activation: dict[int, list[Target]], taken: set[str]) -> list[ir.Value]:
    """One activation per group, each given a name if it had none (statistics are keyed by name)."""
    acts = []
    for group in by_activation.values():
        act = group[0].activation
        assert act is not None
        if not act.name:
            act.name = fresh_name(graph, "quantize_weights_activation", taken)
        acts.append(act)
    return acts


@register_pass
class QuantizeWeightsPass(Pass):
    """Weight-only INT8/INT4 quantization of MatMul/Gemm (and embedding) weights; see the module docstring.

    Per graph: find the targets (:mod:`~onnxdeploy.passes._quant_targets`), collect calibration statistics
    (:mod:`~onnxdeploy.passes._calibration_stats`), fold the act-order permutations
    (:mod:`~onnxdeploy.passes._act_order`), quantize each weight once (:mod:`~onnxdeploy.passes._quant_tensors`)
    and put it into the graph (:mod:`~onnxdeploy.passes._quant_emit`), then drop what nothing reads.

    Raises:
        ConfigError: from :meth:`check_settings` (act-order or GPTQ without calibration) or :meth:`check_model`
            (a QDQ request the opset cannot carry with ``raise_opset: false``).
        PreconditionError: the same refusals at run time, or no quantizable weight at all.
    """

    name = "quantize_weights"
    config_model = QuantizeWeightsConfig
    config: QuantizeWeightsConfig
    in_place = True

    def output_opset(self, opset: int | None) -> int | None:
        """The output's ``ai.onnx`` opset given the input's (None: unknown), for the pass-order check.

        Unchanged unless QDQ raises it: 21 for blocked INT4; INT8's 13 or 19 depends on the weights' dtype, so
        unknown here.
        """
        cfg = self.config
        if opset is None or not self._may_dequantize or not cfg.raise_opset:
            return opset
        return max(opset, 21) if self._any_int4 else None

    # ------------------------------------------------------------------------------------ validation

    @property
    def _needs_calibration(self) -> bool:
        return self.config.act_order or self.config.method == "gptq" or self.config.budget is not None

    def _targets(self, model: ir.Model) -> tuple[list[Target], list[str]]:
        cfg = self.config
        return find_targets(
            model,
            exclude=cfg.exclude,
            lm_head=cfg.lm_head,
            embedding=cfg.embedding,
            bits=cfg.bits,
            block_size=cfg.block_size,
            rules=cfg.rules,
        )

    @property
    def _any_int4(self) -> bool:
        """Whether the config may quantize a weight to INT4 (``bits: 4`` or a rule giving 4)."""
        return self.config.bits == 4 or any(r.bits == 4 for r in self.config.rules)

    @property
    def _may_dequantize(self) -> bool:
        """Whether DequantizeLinear nodes may be emitted: QDQ, or an embedding table some key quantizes."""
        cfg = self.config
        return cfg.format == "qdq" or cfg.embedding or any(r.kind == "embedding" for r in cfg.rules)

    def check_settings(self, settings: PipelineSettings) -> None:
        """Refuse act-order or GPTQ without a ``calibration`` section.

        Raises:
            ConfigError: naming the key.
        """
        if self._needs_calibration and not settings.calibration_tokens:
            cfg = self.config
            what = "act_order: true" if cfg.act_order else "method: gptq" if cfg.method == "gptq" else "budget"
            raise ConfigError(
                f"{what} needs calibration data: add 'calibration: {{token_ids_file: ...}}' to the pipeline"
            )

    def _opset_need(self, model: ir.Model) -> tuple[int, int]:
        """(ai.onnx opset, IR version) the emitted DequantizeLinear nodes need ((0, 0) when none is emitted).

        Blocked INT4 needs 21 and IR 10; per-axis INT8 needs 13, or 19 when a dequantized weight is float16 or
        bfloat16 (its scale has the weight's dtype, which DequantizeLinear takes from opset 19).
        """
        cfg = self.config
        if not self._may_dequantize:
            return 0, 0
        dequantized = [t for t in self._targets(model)[0] if cfg.format == "qdq" or t.kind == "gather"]
        if not dequantized:
            return 0, 0
        if any((t.bits or cfg.bits) == 4 for t in dequantized):
            return 21, 10
        half = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
        return (19, 0) if any(t.weight.dtype in half for t in dequantized) else (13, 0)

    def opset_floor(self, model: ir.Model | None) -> tuple[int, str] | None:
        """The opset the emitted ``DequantizeLinear`` nodes need (:meth:`_opset_need`), for the pass-order check.

        Without the graph an INT8 request is known to need 13 only (19 depends on the weights' dtype).
        """
        if not self._may_dequantize:
            return None
        if model is None and self._any_int4:
            return 21, "blocked INT4 DequantizeLinear (block_size)"
        need = 13 if model is None else self._opset_need(model)[0]
        if need == 0:
            return None
        if need == 21:
            return 21, "blocked INT4 DequantizeLinear (block_size)"
        return need, "per-axis DequantizeLinear" + (" with float16/bfloat16 scales" if need == 19 else "")

    def _opset_refusal(self, model: ir.Model) -> str | None:
        need_opset, need_ir = self._opset_need(model)
        opset = default_opset(model)
        if opset >= need_opset and model.ir_version >= need_ir:
            return None
        what = "blocked INT4 DequantizeLinear (block_size)" if need_opset == 21 else "per-axis DequantizeLinear"
        what += " with float16/bfloat16 scales" if need_opset == 19 else ""
        return (
            f"{what} needs ai.onnx opset >= {need_opset}"
            + (f" and IR >= {need_ir}" if need_ir else "")
            + f"; the model has opset {opset}, IR {model.ir_version}. Set raise_opset: true (converts the graph) "
            "or use format: matmulnbits"
        )

    def check_model(self, model: ir.Model, settings: PipelineSettings) -> None:
        """Refuse, from the graph alone, a QDQ request the opset cannot carry when ``raise_opset`` is false.

        Raises:
            ConfigError: the opset/IR is too low and may not be raised.
        """
        why = self._opset_refusal(model)
        if why is not None and not self.config.raise_opset:
            raise ConfigError(why)

    def requires(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Calibration tokens when act-order or GPTQ is asked for; an opset that can carry QDQ or may be raised.

        Raises:
            PreconditionError: naming what is missing.
        """
        if self._needs_calibration and not context.calibration:
            raise PreconditionError(
                self.name, "act_order / gptq / budget need calibration token ids (PassContext.calibration)"
            )
        why = self._opset_refusal(artifacts.primary)
        if why is not None and not self.config.raise_opset:
            raise PreconditionError(self.name, why)

    # ---------------------------------------------------------------------------------------- rewrite

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Quantize every target of every graph (or meet the ``budget``); see the module docstring."""
        if self.config.budget is not None:
            return self._meet_budget(artifacts, context, report), True
        return self._quantize_all(artifacts, context, report, {}), True

    def _quantize_all(
        self, artifacts: ArtifactSet, context: PassContext, report: PassReport, stats: dict[str, np.ndarray]
    ) -> ArtifactSet:
        """Quantize every graph; ``stats`` holds calibration statistics already collected (filled when empty)."""
        if self._opset_refusal(artifacts.primary) is not None:
            artifacts = self._raise_opset(artifacts, context, report)
        quantizer = WeightQuantizer(
            self.config, ScratchWriter(context.scratch() / f"quantize_weights_{id(self):x}", INLINE_BYTES)
        )
        written: dict[tuple, Quantized] = {}
        total = 0
        for index, artifact in enumerate(artifacts.artifacts):
            total += self._quantize_graph(
                artifact.model, context, report, quantizer, written, stats, first=index == 0, name=artifact.name
            )
        if not total:
            raise PreconditionError(self.name, "no MatMul/Gemm/Gather with a constant 2-D float weight to quantize")
        self._report_layers(quantizer.layers, report)
        return artifacts

    def _meet_budget(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> ArtifactSet:
        """The first candidate of :data:`~._quant_budget.LADDER` meeting the budget on the calibration text.

        Each candidate quantizes structural copies of the graphs (calibration statistics collected once); its
        report (``details.layers``, ``bits_per_weight``) becomes the pass's when it is kept, and every candidate
        tried is a row of ``details.budget.candidates``.

        Raises:
            PreconditionError: no candidate meets the budget (the message gives each one's figures).
        """
        cfg, budget = self.config, self.config.budget
        assert budget is not None
        reference, nexts = calibration_logits(artifacts.primary, context, who=self.name)
        stats: dict[str, np.ndarray] = {}
        rows: list[dict] = []
        for bits, block in LADDER:
            update: dict = {"bits": bits, "budget": None} | ({"block_size": block} if block else {})
            sub = PassReport(name=self.name)
            clones = artifacts.with_models([clone(m) for m in artifacts.models()])
            out = QuantizeWeightsPass(cfg.model_copy(update=update))._quantize_all(clones, context, sub, stats)
            kl, ppl = figures(reference, calibration_logits(out.primary, context, who=self.name)[0], nexts)
            fails = budget.failures(kl, ppl)
            layers = sub.details["layers"]
            rows.append(
                {
                    "bits": bits,
                    "block_size": block or None,
                    "bits_per_weight": sub.details["bits_per_weight"]["bits_per_weight"],
                    "bytes": sub.details["bits_per_weight"]["bytes"],
                    "weight_error": sum(r["error"] for r in layers),
                    "mean_kl": kl,
                    "ppl_ratio": ppl,
                    "meets": not fails,
                }
            )
            if not fails:
                report.changes += sub.changes
                report.warnings += sub.warnings
                report.details.update(sub.details)
                report.details["budget"] = {"positions": len(nexts), "kept": len(rows) - 1, "candidates": rows}
                what = f"INT{bits}" + (f" g{block}" if block else " per channel")
                report.changes.append(
                    f"budget: kept {what} ({rows[-1]['bits_per_weight']:.3f} bits/weight): mean KL {kl:.4g}, "
                    f"perplexity x{ppl:.4f} on {len(nexts)} calibration positions; {len(rows)} candidate(s) tried"
                )
                return out
        tried = "; ".join(
            f"INT{r['bits']}{' g' + str(r['block_size']) if r['block_size'] else ''}: KL {r['mean_kl']:.4g}, "
            f"ppl x{r['ppl_ratio']:.4f}"
            for r in rows
        )
        raise PreconditionError(self.name, f"no candidate meets budget {budget.model_dump(exclude_none=True)}: {tried}")

    def _raise_opset(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> ArtifactSet:
        """Convert the graphs to the ai.onnx opset (``pin_opset``'s converter) and IR version QDQ needs."""
        need_opset, need_ir = self._opset_need(artifacts.primary)
        if default_opset(artifacts.primary) < need_opset:
            from onnxdeploy.passes.pin_opset import PinOpsetConfig, PinOpsetPass  # noqa: PLC0415  (onnx's converter)

            artifacts, _ = PinOpsetPass(PinOpsetConfig(opset=need_opset)).call(artifacts, context, report)
        for model in artifacts.models():
            model.ir_version = max(model.ir_version, need_ir)
        report.changes.append(f"raised to ai.onnx opset {need_opset}" + (f", IR {need_ir}" if need_ir else ""))
        return artifacts

    def _report_layers(self, layers: list[dict], report: PassReport) -> None:
        """``details.layers`` and the weight error removed against RTN in natural order, over every weight."""
        report.details["layers"] = layers
        total_bytes, total_weights = sum(r["bytes"] for r in layers), sum(r["n"] * r["k"] for r in layers)
        if total_weights:
            bpw = 8 * total_bytes / total_weights
            dtypes = sorted({r["scale_dtype"] for r in layers})
            report.details["bits_per_weight"] = {
                "bits_per_weight": bpw,
                "bytes": total_bytes,
                "weights": total_weights,
                "scale_dtype": dtypes,
            }
            report.changes.append(
                f"{bpw:.3f} bits per weight over {total_weights} weights quantized (packed values + scales + zero "
                f"points, a shared weight once; scales {'/'.join(dtypes)})"
            )
        rows = [r for r in layers if r["error_rtn_natural"] > 0]
        if rows:
            removed = 1 - sum(r["error"] for r in rows) / sum(r["error_rtn_natural"] for r in rows)
            report.details["weight_error_removed"] = removed
            report.changes.append(
                f"weight error vs RTN in natural order: {100 * removed:.1f}% removed over {len(rows)} weights"
                + (" (calibration-weighted)" if self._needs_calibration else " (plain MSE: no calibration)")
            )

    def _quantize_graph(
        self,
        model: ir.Model,
        context: PassContext,
        report: PassReport,
        quantizer: WeightQuantizer,
        written: dict[tuple, Quantized],
        stats: dict[str, np.ndarray],
        *,
        first: bool,
        name: str = "",
    ) -> int:
        """Quantize one graph of the set; return how many weights were newly quantized.

        The calibration statistics are collected on the first (primary) graph into ``stats`` and reused by
        name for the others (structural copies of one export: same activation names), so every graph gets the
        same permutations and shares the same quantized tensors (``written``).
        """
        cfg = self.config
        targets, skipped = self._targets(model)
        report.warnings += skipped
        left = report.details.setdefault("left_in_float", [])
        for note in skipped:  # "<node>: <why>" per weight left in float (pattern notes have no node)
            if ": " in note and " pattern " not in note.split(": ", 1)[0]:
                node, why = note.split(": ", 1)
                left.append({"graph": name, "node": node, "reason": why})
        if not targets:
            return 0
        taken = names_in_use(model.graph)
        by_activation = _by_activation(targets)
        uses = self._needs_calibration or cfg.scale_search != "none"
        if uses and first and context.calibration and not stats:
            acts = _named_activations(model.graph, by_activation, taken)
            stats.update(collect_statistics(model, acts, cfg.method == "gptq", context, report))
        # Statistics by reader, taken before any fold re-points a reader at a Gather's output.
        hessians = {id(t.node): stats.get(str(t.activation.name)) for t in targets if t.activation is not None}
        perm_in, perm_out = self._fold_act_order(model, name, targets, by_activation, stats, taken, report)
        count = self._quantize_targets(model.graph, targets, hessians, perm_in, perm_out, quantizer, written, taken)
        self._note_partial_blocks(targets, report)
        remove_dead_nodes(model)
        if any(n.domain == "com.microsoft" for n in model.graph):
            model.opset_imports.setdefault("com.microsoft", 1)
        widths = sorted(
            {
                "INT8 per output channel"
                if t.bits == 8 and cfg.format == "qdq"
                else f"INT{t.bits} in groups of {t.block_size}"
                for t in targets
            }
        )
        report.changes.append(
            f"{count} weight(s) quantized to {' / '.join(widths)}"
            + f" ({'symmetric' if cfg.symmetric else 'asymmetric'}, {cfg.format}, {cfg.method}"
            + (", act-order" if cfg.act_order else "")
            + (", mse scale search" if cfg.scale_search != "none" else "")
            + f") for {len(targets)} node(s)"
        )
        return count

    def _note_partial_blocks(self, targets: list[Target], report: PassReport) -> None:
        """Warn about INT4 DequantizeLinear weights whose ``K`` ends in a partial last block.

        They are valid ONNX (DequantizeLinear-21 blocked form: the scale's K dimension is ``ceil(K / block_size)``,
        ONNX QuantizeLinear-21 "Blocked quantization") and ORT runs them exactly, but OpenVINO 2026.4.1's ONNX
        frontend refuses the model ("Model wasn't fully converted", measured on a K = 40, block 32 MatMul), so the
        report names them. MatMulNBits pads ``B`` with the zero level instead (ORT's layout).
        """
        cfg = self.config
        partial = [
            str(t.node.name)
            for t in targets
            if t.bits == 4
            and (cfg.format == "qdq" or t.kind == "gather")
            and t.weight.shape[1 if t.nk else 0] % (t.block_size or cfg.block_size)
        ]
        if partial:
            report.warnings.append(
                f"{len(partial)} INT4 DequantizeLinear weight(s) with K not a multiple of block_size end in a partial "
                f"last block (valid ONNX, exact on ORT; OpenVINO 2026.4 refuses them): {', '.join(partial[:5])}"
                + (" ..." if len(partial) > 5 else "")
                + " — choose a block_size dividing K (a rule) or format: matmulnbits for ORT"
            )

    def _fold_act_order(
        self,
        model: ir.Model,
        name: str,
        targets: list[Target],
        by_activation: dict[int, list[Target]],
        stats: dict[str, np.ndarray],
        taken: set[str],
        report: PassReport,
    ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Plan and apply the act-order folds; return the input and output permutations by ``id`` of the node."""
        perm_in: dict[int, np.ndarray] = {}
        perm_out: dict[int, np.ndarray] = {}
        if not (self.config.act_order and stats):
            return perm_in, perm_out
        by_node = {id(t.node): t for t in targets}
        for fold in plan_folds(model, name, by_activation, by_node, stats, report):
            readers = by_activation[id(fold.activation)]
            perm_in.update((id(t.node), fold.perm) for t in readers)
            perm_out.update((id(p.node), fold.out_perm) for p in fold.producers)
            apply_fold(model.graph, fold, readers, taken)
        return perm_in, perm_out

    def _quantize_targets(
        self,
        graph: ir.Graph,
        targets: list[Target],
        hessians: dict[int, np.ndarray | None],
        perm_in: dict[int, np.ndarray],
        perm_out: dict[int, np.ndarray],
        quantizer: WeightQuantizer,
        written: dict[tuple, Quantized],
        taken: set[str],
    ) -> int:
        """Quantize each distinct weight once and point every target at it; return how many were quantized.

        A weight is distinct by its stored tensor, the layout and dtype read, the format and its permutations,
        so the graphs of a set share one quantized copy. A weight an embedding Gather also reads is dequantized
        by DequantizeLinear for every consumer, so it is quantized once (MatMulNBits has no Gather form).
        """
        cfg = self.config
        gathered = {id(t.weight.tensor) for t in targets if t.kind == "gather"}
        count = 0
        in_graph: dict[tuple, Values] = {}
        for t in targets:
            root_tensor = t.weight.tensor
            pin, pout = perm_in.get(id(t.node)), perm_out.get(id(t.node))
            nbits = cfg.format == "matmulnbits" and id(root_tensor) not in gathered
            key = (
                id(root_tensor),
                t.bits,
                t.block_size if t.bits == 4 else 0,
                t.root_nk,
                str(t.weight.dtype),
                nbits,
                None if pin is None else pin.tobytes(),
                None if pout is None else pout.tobytes(),
            )
            if key not in written:
                written[key] = quantizer.quantize(t, pin, pout, hessians.get(id(t.node)), nbits=nbits)
                count += 1
                if isinstance(root_tensor, ir.ExternalTensor):
                    root_tensor.release()
            if key not in in_graph:
                in_graph[key] = graph_values(graph, written[key], t.weight.dtype, taken)
            rewire(graph, t, written[key], in_graph[key], taken, cfg.accuracy_level)
        return count
