"""``static_kv``: fixed batch, step length and ``max_cache_len``; cache appended by Scatter, not Concat.

What the pass does (README, "Passes" → ``static_kv``), each step a function of
:mod:`onnxdeploy.passes._cache_edits` (query positions: :mod:`onnxdeploy.passes._query_positions`):

* Past K/V inputs become fixed buffers ``(B, H_kv, max_cache_len, D)``. The Concat that appended the
  step's K/V ``(B, H_kv, S, D)`` becomes ``ScatterElements(axis=2)`` (ONNX opset ≥ 11) writing at the
  new int64 input ``cache_position`` of shape ``[step_len]``; attention reads the whole buffer.
* Every other reader of a past input (the exporters' shape arithmetic: mask width, GQA head-repeat shape) reads
  a Slice view of ``max_cache_len - S`` slots, so ``past_len + S`` lands on ``max_cache_len`` and folds away.
* The exporter's internal query-position vector (``past_len + arange(S)``, transformers' ``cache_position``) is
  found by running the original at two past lengths and replaced by the ``cache_position`` input, so the causal
  (and sliding-window) mask stays right for any position.
* ``attention_mask`` becomes int64 ``(B, max_cache_len)``; the host writes 1 for slots ≤ the current position. A
  ``-inf`` float constant becomes ``numpy.finfo(dtype).min`` (what transformers uses): no NaN from a masked row.
* Shape arithmetic is folded (onnxsim, constant folding only, on a weightless copy) and the decode contract is
  written to ``metadata_props`` (docs/ARCHITECTURE.md, "The decode contract").

A graph set (``step_lens`` and/or ``max_cache_lens`` lists): one graph per (step length S, cache length L),
each the rewrite above of its own structural copy of the input (:func:`onnxdeploy.passes._edit.clone`: the copies
hold the very same weight tensors, so the writer puts each weight once into one data file). The primary
graph (smallest S, largest L) keeps the pipeline's file name; the others are ``<stem>.s<S>.c<L>.onnx``.
A prefill graph (S > 1) with ``prefill_logits: last`` gathers the hidden state of the position named by the
new int64 input ``last_token_index`` ``(B,)`` before the LM head, so its logits are ``(B, 1, V)`` and the LM
head runs once per call. Every contract lists the set (``graph_set``).
"""

from __future__ import annotations

from typing import Literal

import onnx_ir as ir

from onnxdeploy.artifacts import Artifact, ArtifactSet, graph_file_name
from onnxdeploy.contract import CONTRACT_KEY, CacheWrite, DecodeContract, GraphSetEntry, write_contract
from onnxdeploy.errors import ConfigError, PostconditionError, PreconditionError
from onnxdeploy.graph import default_opset
from onnxdeploy.kv_cache import KVCache, find_kv_cache, find_logits_output, genai_head_size
from onnxdeploy.passes._attention_cache import rewrite_gqa_cache
from onnxdeploy.passes._attention_decompose import causal_refusal
from onnxdeploy.passes._cache_edits import (
    CACHE_POSITION,
    KNOWN_INPUTS,
    add_cache_position,
    build_contract,
    cast_cache_boundary,
    fix_io_dims,
    replace_neg_inf,
    rewrite_cache_writes,
)
from onnxdeploy.passes._cache_memory import (
    FOLDED_BYTES_PER_SLOT,
    FOLDING_PEAK_BYTES_PER_SLOT,
    RUNTIME_CACHE_COPIES,
    MemoryEstimate,
    estimate_memory,
)
from onnxdeploy.passes._catalog import StaticKVConfig
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import clone, fold_and_infer
from onnxdeploy.passes._last_position import LAST_TOKEN_INDEX, gather_last_position
from onnxdeploy.passes._order import BHSD_CACHE, CONTRACT
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.passes._query_positions import export_batch, feed_query_positions, find_query_positions
from onnxdeploy.passes._window_cache import (
    plan_rings,
    probe_layer_windows,
    refuse_window_cache,
    ring_slots,
    ring_views,
)
from onnxdeploy.report import PassReport
from onnxdeploy.resources import available_memory_bytes
from onnxdeploy.settings import PipelineSettings, SettingsConflict

__all__ = [
    "FOLDED_BYTES_PER_SLOT",
    "FOLDING_PEAK_BYTES_PER_SLOT",
    "LAST_TOKEN_INDEX",
    "RUNTIME_CACHE_COPIES",
    "StaticKVConfig",
    "StaticKVCachePass",
    "MemoryEstimate",
    "estimate_memory",
    "gather_last_position",
    "graph_file_name",
]

_FOLDED_AWAY = ("Shape", "Range", "Trilu")


@register_pass
class StaticKVCachePass(Pass):
    """Make a decoder's KV cache static: fixed buffers updated by ScatterElements at ``cache_position``.

    Input: an exporter-convention decoder (``input_ids`` (B, S), ``attention_mask`` (B, past+S),
    optional ``position_ids`` (B, S), past K/V (B, H_kv, past, D), present K/V (B, H_kv, past+S, D),
    logits (B, S, V)). Output: the same graph with every dim static, a new ``cache_position`` int64
    ``[step_len]`` input, ``attention_mask`` int64 ``(B, max_cache_len)``, past K/V
    ``(B, H_kv, max_cache_len, D)``, and the decode contract in ``metadata_props``; with several step or
    cache lengths, one such graph per ``(step_len, max_cache_len)`` (module docstring). The pass is
    functional: it rewrites structural copies of the graph (:func:`onnxdeploy.passes._edit.clone`: no weight copied,
    the rewritten graphs hold the same weight tensors) and returns a new set; the graph it was given is left
    as it was.

    Raises:
        ConfigError: from :meth:`check_settings` / :meth:`check_model` (verification cannot fit, cache
            buffers larger than the memory available).
        PreconditionError: more than one graph, no KV cache found (the message says what was looked for and
            found), no single logits output, an unknown non-cache input, a batch other than the export's fixed
            one, a step length above a cache length, opset < 11, a contract already present, no query-position
            tensor for a step length above 1, or (``prefill_logits: last``) no LM head found.
        PostconditionError: a graph input or output is still dynamic after folding.
    """

    name = "static_kv"
    config_model = StaticKVConfig
    config: StaticKVConfig
    in_place = False
    provides = frozenset({CONTRACT, BHSD_CACHE})
    keeps_opset = True

    def needs_later(self) -> tuple[str, str] | None:
        """``window_cache``/``cache_policy``: ``mask_rewrite`` (``StaticKVConfig.mask_rewrite_reason``)."""
        why = self.config.mask_rewrite_reason()
        return None if why is None else ("mask_rewrite", why)

    def min_opset(self, model: ir.Model | None) -> tuple[int, str] | None:
        """ai.onnx opset 11: the cache writes ScatterElements (:meth:`requires` refuses below)."""
        return 11, "the cache write uses ScatterElements-11"

    # ------------------------------------------------------------------------------------- validation

    def check_settings(self, settings: PipelineSettings) -> None:
        """Refuse a verification the static graphs cannot run (the caller prefixes the pipeline key).

        Args:
            settings: the pipeline's non-pass sections.

        Raises:
            ConfigError: ``len(prompt) + steps`` above the largest cache length. The message starts with the key
                below ``passes[i].static_kv`` (``max_cache_len=…`` or ``max_cache_lens=…``).
            SettingsConflict: under ``verify.accuracy.max_tokens``, more held-out tokens than the largest cache
                length (allowed with ``cache_policy``: its quality cost is measured past the cache). (Every
                ``verify.runtimes`` entry drives graph sets and ``step_len > 1`` graphs, issue 19.)
        """
        cfg = self.config
        positions, largest = settings.verify_positions, cfg.caches()[-1]
        if positions is not None and positions > largest and cfg.cache_policy is None:  # a policy decodes on
            prompt = settings.verify_prompt_len or 0
            key = f"max_cache_len={largest}" if cfg.max_cache_lens is None else f"max_cache_lens={cfg.max_cache_lens}"
            text = f", or shorten {settings.prompt_key}" if settings.prompt_key != "verify.prompt" else ""
            raise ConfigError(
                f"{key} is smaller than the {prompt} prompt tokens + {positions - prompt} steps = {positions} "
                f"positions verification decodes; lower verify.steps or raise the largest cache length{text}"
            )
        held_out = settings.accuracy_tokens
        if held_out is not None and held_out > largest and cfg.cache_policy is None:  # a policy's cost needs more
            raise SettingsConflict(
                "verify.accuracy.max_tokens",
                f"the {held_out} held-out tokens are decoded as one teacher-forced sequence, but {{pass_key}} makes "
                f"caches of at most {largest} slots; lower verify.accuracy.max_tokens to {largest} or raise the "
                "largest cache length",
            )

    def check_model(self, model: ir.Model, settings: PipelineSettings) -> None:
        """Find the cache and the logits on the graph (no weights read) and check the buffers fit in memory.

        Args:
            model: the input model.
            settings: the pipeline's non-pass sections.

        Raises:
            PreconditionError: no KV cache, no single logits output, a batch other than the export's, or an
                ``is_causal`` Attention with q_len != kv_len (``causal_refusal``, naming the node).
            ConfigError: with ``window_cache``, no window constant in any attention mask, a cache inside an
                attention op, or a ring not smaller than the smallest cache (``refuse_window_cache``);
                ``2 × layers × B × H_kv × max_cache_len × D × dtype bytes × 3 copies`` plus the folded constants, or
                the peak of folding, exceed
                :func:`onnxdeploy.resources.available_memory_bytes`; the message spells out the arithmetic.
        """
        self._refuse_contract(model)
        if (why := causal_refusal(model.graph)) is not None:
            raise PreconditionError(self.name, why)
        if self.config.cache_policy is not None and "position_ids" not in {v.name for v in model.graph.inputs}:
            raise ConfigError(
                "cache_policy: the export has no 'position_ids' input, so kept tokens cannot be fed their true "
                "positions with a cut past (neither on the device nor in verification); re-export with position_ids"
            )
        kv = self._find(model)
        cfg = self.config
        if cfg.window_cache:
            key = (
                f"max_cache_len={cfg.caches()[0]}"
                if cfg.max_cache_lens is None
                else f"max_cache_lens={cfg.max_cache_lens}"
            )
            refuse_window_cache(model.graph, kv, cfg.steps(), cfg.caches()[0], key)
        available = available_memory_bytes()
        if available is None:
            return
        largest = self.config.caches()[-1]
        estimate = estimate_memory(kv, batch=self.config.batch, step_len=self.config.steps()[-1], max_cache_len=largest)
        why = estimate.refusal(available)
        if why is not None:
            raise ConfigError(f"max_cache_len={largest} does not fit in memory: {why}; lower max_cache_len or batch")

    def _refuse_contract(self, model: ir.Model) -> None:
        """Refuse a graph that already carries a decode contract (static_kv ran on it before)."""
        if CONTRACT_KEY in model.metadata_props:
            raise PreconditionError(
                self.name,
                f"the model already carries metadata_props['{CONTRACT_KEY}'] (it was made static before); "
                "run static_kv on the original export",
            )

    def _find(self, model: ir.Model, head_dim: int | None = None) -> KVCache:
        """The cache of ``model``, its logits output and a batch consistent with the export, or raise.

        ``head_dim`` is D from genai_config.json (:func:`~onnxdeploy.kv_cache.genai_head_size`) when known.
        """
        kv = find_kv_cache(model, who=self.name, head_dim=head_dim)
        for t in kv.tensors:
            shape = t.past_input.shape
            if shape is not None and len(shape) > kv.seq_axis and shape[kv.seq_axis] == 0:
                raise PreconditionError(
                    self.name,
                    f"past input '{t.past_input.name}' has its past-length axis {kv.seq_axis} fixed to 0 (shape "
                    f"({', '.join(str(d) for d in shape)})): this export takes no cache, so it cannot be probed or "
                    "made static; re-export with a dynamic past length (optimum: --task text-generation-with-past; "
                    "torch.onnx.export: a dynamic axis on the past_key_values inputs)",
                )
        find_logits_output(model.graph, {t.present_name for t in kv.tensors}, who=self.name)
        fixed = kv.batch if kv.batch is not None else export_batch(model.graph)
        if fixed is not None and fixed != self.config.batch:
            raise PreconditionError(
                self.name,
                f"batch={self.config.batch}, but the export fixed its batch dim to {fixed}; use batch {fixed}",
            )
        return kv

    def requires(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """One graph, every step length ≤ every cache length, ai.onnx opset ≥ 11 and no contract yet.

        Raises:
            PreconditionError: naming what is missing.
        """
        cfg = self.config
        if len(artifacts.artifacts) != 1:
            raise PreconditionError(
                self.name, f"expected one graph (the export); got {len(artifacts.artifacts)}: run static_kv first"
            )
        model = artifacts.primary
        if cfg.caches()[0] < cfg.steps()[-1]:
            raise PreconditionError(
                self.name,
                f"max_cache_len={cfg.caches()[0]} is smaller than step_len={cfg.steps()[-1]}; every graph of a set "
                "must hold its largest chunk",
            )
        opset = default_opset(model)
        if opset < 11:
            raise PreconditionError(self.name, f"ai.onnx opset {opset} < 11 has no ScatterElements; run pin_opset")
        self._refuse_contract(model)

    def _check_inputs(self, graph: ir.Graph, kv: KVCache) -> None:
        """Refuse a graph input that is neither the cache nor one of :data:`KNOWN_INPUTS`, or no ``input_ids``."""
        cache_inputs = {t.past_name for t in kv.tensors}
        other = [
            str(v.name)
            for v in graph.inputs
            if v.name not in cache_inputs and v.name not in KNOWN_INPUTS and v.name not in graph.initializers
        ]
        if other:
            raise PreconditionError(
                self.name,
                f"unknown non-cache graph input(s) {other}; static_kv knows {list(KNOWN_INPUTS)} and the cache",
            )
        if "input_ids" not in {v.name for v in graph.inputs}:
            raise PreconditionError(self.name, "the model has no 'input_ids' input")

    # ---------------------------------------------------------------------------------------- rewrite

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Rewrite one structural copy of the primary graph per ``(step_len, max_cache_len)`` (class docstring)."""
        original = artifacts.primary
        head_dim = genai_head_size(context.model_path)
        kv = self._find(original, head_dim)
        self._check_inputs(original.graph, kv)
        self._refuse_rows(original, kv)
        self._resolve_cache_write(kv, context, report)
        query_positions = self._query_positions(original, kv, context, report)
        self._ring = self._ring_length(original, query_positions, head_dim, context, report)
        built = self._build_set(original, artifacts.artifacts[0].name, query_positions, report, head_dim)
        self._write_contracts(built, report)
        out = ArtifactSet(
            [Artifact(name, model) for name, model, _ in built],
            weights=artifacts.weights,
            input_was_external=artifacts.input_was_external,
            notes=list(artifacts.notes),
        )
        return out, True

    def _query_positions(self, original: ir.Model, kv: KVCache, context: PassContext, report: PassReport) -> list[str]:
        """The exporter's query-position values to feed from ``cache_position`` (none when an op holds the cache).

        Raises:
            PreconditionError: none found while a step length above 1 needs them (the causal mask).
        """
        if kv.attention_op is not None:  # the op derives positions and the causal mask from seqlens_k
            report.changes.append(
                f"cache held by {kv.attention_op} ({len(kv.layers)} nodes); head dim {kv.head_dim} from the "
                f"{kv.head_dim_source}"
            )
            return []
        query_positions = find_query_positions(original, kv, context, who=self.name)
        if query_positions:
            report.changes.append(f"query-position tensor(s) {query_positions} now read the cache_position input")
        elif self.config.steps()[-1] > 1:
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
        return query_positions

    def _ring_length(
        self, original: ir.Model, query_positions: list[str], head_dim: int | None, context: PassContext, report
    ) -> int | None:
        """With ``window_cache``: the one ring length when every layer has it, else None (module ``_window_cache``).

        Mixed layers set ``self._layer_rings`` (layer -> ring length), read through views in :meth:`_rewrite_cache`.

        Raises:
            PreconditionError: no layer has a window.
            ConfigError: a ring not shorter than the smallest ``max_cache_len`` (the window is too large).
        """
        cfg = self.config
        self._ring, self._layer_rings = None, {}
        if not cfg.window_cache:
            return None
        S, L = cfg.steps()[0], cfg.caches()[-1]
        probe, contract = self._rewrite(clone(original), query_positions, S, L, PassReport(name=self.name), head_dim)
        write_contract(probe, contract)
        windows = probe_layer_windows(
            probe, contract, self._find(original, head_dim), context, source="the primary graph", who=self.name
        )
        uniform, self._layer_rings, line = plan_rings(windows, cfg.steps(), cfg.caches()[0], who=self.name)
        report.changes.append(line)
        return uniform

    def _build_set(
        self,
        original: ir.Model,
        primary_name: str,
        query_positions: list[str],
        report: PassReport,
        head_dim: int | None,
    ) -> list[tuple[str, ir.Model, DecodeContract]]:
        """``(file name, static graph, contract)`` per ``(S, L)`` of the config, the primary graph first.

        The primary graph's changes go to ``report``; each other graph adds one summary line and its warnings.
        """
        pairs = self.config.graphs()
        names = [primary_name] + [graph_file_name(primary_name, s, c) for s, c in pairs[1:]]
        built: list[tuple[str, ir.Model, DecodeContract]] = []
        for i, ((S, L), name) in enumerate(zip(pairs, names, strict=True)):
            graph_report = report if i == 0 else PassReport(name=self.name)
            model, contract = self._rewrite(clone(original), query_positions, S, L, graph_report, head_dim)
            built.append((name, model, contract))
            if i > 0:
                report.warnings += [f"{name}: {w}" for w in graph_report.warnings]
                report.changes.append(
                    f"{name}: step_len {S}, max_cache_len {L}, prefill_logits {contract.prefill_logits}, "
                    f"{len(graph_report.changes)} change(s) as for {primary_name}"
                )
        return built

    def _write_contracts(self, built: list[tuple[str, ir.Model, DecodeContract]], report: PassReport) -> None:
        """Write each graph's contract, listing the whole set (``graph_set``) in every one."""
        graph_set = [
            GraphSetEntry(
                file=name,
                step_len=c.step_len,
                max_cache_len=c.max_cache_len,
                prefill_logits=c.prefill_logits,
                role="decode" if c.step_len == 1 else "prefill",
            )
            for name, _, c in built
        ]
        for _, model, contract in built:
            write_contract(model, contract.model_copy(update={"graph_set": graph_set}))
        if len(built) > 1:
            report.changes.append(
                f"graph set of {len(built)} sharing one weights file: {', '.join(n for n, _, _ in built)}"
            )

    def _resolve_cache_write(self, kv: KVCache, context: PassContext, report: PassReport) -> None:
        """Set the cache write and update this run uses: the config's, else the target's default, else Scatter.

        Raises:
            PreconditionError: a ``cache_write`` other than ``scatter_elements`` where an attention op holds the
                cache (the op writes it).
        """
        cfg = self.config
        write, source = cfg.cache_write, "config"
        defaults = context.target_defaults
        if write is None and defaults is not None:
            write, source = defaults.cache_write, f"target {defaults.target} default"
        update = cfg.cache_update
        if kv.attention_op is not None:
            if write not in (None, "scatter_elements") and source == "config":
                raise PreconditionError(
                    self.name,
                    f"cache_write {write}: the cache is written inside {kv.attention_op}; leave cache_write unset",
                )
            if write not in (None, "scatter_elements"):
                report.warnings.append(f"{source} cache_write {write} ignored: {kv.attention_op} writes the cache")
            write = None
        elif write == "host" and "cache_update" not in cfg.model_fields_set:
            update = "new_token_only"
        elif write == "host" and update != "new_token_only":
            raise PreconditionError(self.name, f"{source} cache_write host needs cache_update new_token_only")
        self._cache_write: CacheWrite = write or "scatter_elements"
        self._cache_update: Literal["full_buffer", "new_token_only"] = update
        if kv.attention_op is None:
            report.changes.append(f"cache write: {self._cache_write} ({source if write else 'default'}), {update}")

    def _batch(self, S: int) -> int:
        """The batch of the step-``S`` graphs: ``prefill_batch`` for a prefill graph (S > 1) if set, else ``batch``."""
        cfg = self.config
        return cfg.prefill_batch if S > 1 and cfg.prefill_batch is not None else cfg.batch

    def _refuse_rows(self, model: ir.Model, kv: KVCache) -> None:
        """``row_positions`` needs a ``position_ids`` input (each row's RoPE) and a cache written at Concats.

        Raises:
            PreconditionError: no ``position_ids`` input, or the cache is held by an attention op.
        """
        if not self.config.row_positions:
            return
        if kv.attention_op is not None:
            raise PreconditionError(
                self.name,
                f"row_positions: the cache is held by {kv.attention_op}, whose lengths static_kv feeds "
                "from one row; use the decomposed export",
            )
        if "position_ids" not in {v.name for v in model.graph.inputs}:
            raise PreconditionError(
                self.name,
                "row_positions: the export has no position_ids input, so its rows could not take their "
                "own positions; re-export with position_ids",
            )

    def _rewrite(
        self,
        model: ir.Model,
        query_positions: list[str],
        S: int,
        L: int,
        report: PassReport,
        head_dim: int | None = None,
    ) -> tuple[ir.Model, DecodeContract]:
        """One static graph of step length ``S`` and cache length ``L`` from a structural copy of the input.

        Args:
            model: a structural copy of the input (edited, then folded into a new model).
            query_positions: the exporter's query-position values (names on the input; the copy keeps them).
            S: step_len.
            L: max_cache_len.
            report: receives changes, dims fixed and warnings.
            head_dim: D from genai_config.json, if any.

        Returns:
            The folded graph and its contract (``graph_set`` still empty).
        """
        kv = self._find(model, head_dim)
        self._rewrite_cache(model, kv, query_positions, S, L, report)
        folded = self._fold(model, report)
        contract = self._contract(folded, kv, S, L, report)
        report.changes.append(
            f"contract: {len(kv.layers)} layers, H_kv={kv.num_kv_heads}, D={kv.head_dim}, batch={self._batch(S)}, "
            f"step_len={S}, max_cache_len={L}, {self._cache_update}"
        )
        return folded, contract

    def _rewrite_cache(
        self, model: ir.Model, kv: KVCache, query_positions: list[str], S: int, L: int, report: PassReport
    ) -> None:
        """Add ``cache_position``, write the cache there (at the op, or instead of each Concat), fix the input dims."""
        B = self._batch(S)
        rows = self.config.row_positions
        graph = model.graph
        cache_position = add_cache_position(graph, S, who=self.name, rows=B if rows else None)
        report.changes.append(f"added input {CACHE_POSITION} int64 [{f'{B}, ' if rows else ''}{S}]")
        if kv.attention_op is not None:  # GroupQueryAttention holds the cache: rewrite its length inputs
            report.changes += rewrite_gqa_cache(
                model,
                kv,
                cache_position=cache_position,
                batch=B,
                step_len=S,
                max_cache_len=L,
                cache_update=self._cache_update,
                who=self.name,
            )
        else:
            ring = getattr(self, "_ring", None)  # window_cache: every layer a ring of this many slots
            report.changes += rewrite_cache_writes(
                graph,
                kv,
                cache_position=cache_position if ring is None else ring_slots(graph, cache_position, ring, S),
                seq_axis=kv.seq_axis,
                cache_update=self._cache_update,
                max_cache_len=L if ring is None else ring,
                step_len=S,
                cache_write=self._cache_write,
                batch=B,
            )
            feed_query_positions(graph, query_positions, cache_position, rows=rows)
        ring = getattr(self, "_ring", None)
        report.dims_fixed += fix_io_dims(graph, kv, batch=B, step_len=S, max_cache_len=L if ring is None else ring)
        rings = getattr(self, "_layer_rings", None)
        if rings and kv.attention_op is None:  # mixed layers: the windowed ones are rings read through a view
            report.changes += ring_views(graph, kv, rings, cache_position, L=L, S=S, B=B, method=self._cache_write)

    def _fold(self, model: ir.Model, report: PassReport) -> ir.Model:
        """Fold the shape arithmetic (a new model), ``-inf`` constants made finite before and after."""
        n_inf = replace_neg_inf(model.graph)
        folded = fold_and_infer(model)
        n_inf += replace_neg_inf(folded.graph)
        if n_inf:
            report.changes.append(f"{n_inf} -inf constant(s) replaced by the dtype's finite minimum")
        left = sorted({n.op_type for n in folded.graph if n.op_type in _FOLDED_AWAY})
        if left:
            report.warnings.append(f"ops left after folding: {left}")
        return folded

    def _contract(self, folded: ir.Model, kv: KVCache, S: int, L: int, report: PassReport) -> DecodeContract:
        """The graph's contract; a prefill graph's LM head gathered to the last token, the cache cast to kv_dtype."""
        cfg = self.config
        B = self._batch(S)
        ring = getattr(self, "_ring", None)
        contract = build_contract(
            folded, kv, batch=B, step_len=S, max_cache_len=L, cache_update=self._cache_update, who=self.name
        )
        if cfg.row_positions:
            contract = contract.model_copy(
                update={"row_positions": True, "contract_version": max(contract.contract_version, 4)}
            )
        rings = getattr(self, "_layer_rings", None) or {}
        if ring is not None:  # every layer a ring; max_cache_len stays the bound on positions
            rings = dict.fromkeys(range(len(contract.cache)), ring)
        if rings:
            cache = [
                e.model_copy(update={"cache_len": rings[e.layer], "slot_mapping": "ring"}) if e.layer in rings else e
                for e in contract.cache
            ]
            contract = contract.model_copy(update={"cache": cache, "contract_version": 5})
        if kv.attention_op is not None:  # the op masks by seqlens_k, computed from cache_position
            contract = contract.model_copy(update={"mask": "cache_position"})
        if S > 1:
            update: dict[str, object] = {"padding": "trailing"}
            if cfg.prefill_logits == "last":
                head = gather_last_position(folded, contract.logits, batch=B, who=self.name)
                report.changes.append(
                    f"LM head '{head}' reads only the position at input {LAST_TOKEN_INDEX} int64 [{B}]: logits "
                    f"(B, 1, V)"
                )
                update["prefill_logits"] = "last"
                update["inputs"] = contract.inputs.model_copy(update={"last_token_index": LAST_TOKEN_INDEX})
            contract = contract.model_copy(update=update)
        if cfg.cache_policy is not None:  # mask_rewrite then masks from slot_positions (contract_version 5)
            contract = contract.model_copy(
                update={"cache_policy": cfg.cache_policy, "contract_version": max(contract.contract_version, 5)}
            )
        if cfg.kv_dtype is not None and cfg.kv_dtype != contract.kv_dtype:
            report.changes.append(cast_cache_boundary(folded, contract, cfg.kv_dtype, who=self.name))
            contract = contract.model_copy(update={"kv_dtype": cfg.kv_dtype})
        return contract

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Every graph input and output of every graph has a fully static shape.

        Raises:
            PostconditionError: naming the graph and its first dynamic input or output and its dims.
        """
        for artifact in artifacts.artifacts:
            g = artifact.model.graph
            for value in [*g.inputs, *g.outputs]:
                shape = value.shape
                if shape is None or not all(isinstance(d, int) for d in shape):
                    raise PostconditionError(
                        self.name, f"{artifact.name}: '{value.name}' is not static after the rewrite: {shape}"
                    )
