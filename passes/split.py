"""``split``: cut every static graph at layer boundaries into K parts that a host runs in sequence.

A model whose weights exceed what one NPU context or model file may hold (a Hexagon HTP context holds at most
4 GB) runs as a chain of graphs (README, "Passes" → ``split``). For each graph of the set (``static_kv``'s graphs,
after the cache passes):

* the hidden state between two layers is found by data flow (:mod:`onnxdeploy.passes._layer_cuts`);
* part ``p`` holding layers ``[a, b)`` is a structural copy of the graph (:func:`~onnxdeploy.passes._edit.clone`:
  the same weight tensors) whose hidden state ``h_a`` becomes the input ``hidden_states.{a}`` and whose outputs are
  its layers' present caches plus ``hidden_states.{b}`` (the last part: the logits); what nothing of that reads is
  removed, graph inputs it no longer reads too (part 0 keeps ``input_ids``; every part keeps ``cache_position``,
  and the ``position_ids``/``attention_mask`` it reads: RoPE and the mask are recomputed in each part);
* every part's contract has its own cache entries (the layers keep their whole-model indices), ``part`` (index,
  count, hidden size, the hidden-state names) and ``parts`` (the chain in order), ``contract_version`` 5.

The layers are shared out once, for the primary graph, and every graph of the set is cut at the same layers, so
a host's per-part buffers move between graphs as they do for a whole graph. ``parts: K`` shares them out so the
largest part's weight bytes are as small as they can be; ``max_part_bytes`` takes the fewest parts K whose weights
each fit, and ``parts: auto`` takes that limit from the target's matrix (its ``context_bytes`` limit, e.g.
ort-qnn's 4 GB HTP context), both then sharing the layers out over K as ``parts: K`` does; a model that fits in one
part is kept whole. A limit one layer's weights exceed is refused before any pass, on the export's own weights
(:func:`~onnxdeploy.passes._layer_cuts.export_layer_weights`, a lower bound of the static graph's).

Part 0 of a graph keeps its file name (``model.onnx``, ``model.s16.c64.onnx``); part ``i`` is
``<stem>.part<i>.onnx``. All parts share the run's one weights file (``weights: shared``), or each part index has a
data file of its own (``weights: per_part``: ``<stem>.part<i>.data``, named in the part's contract, which the
writer follows); a tensor several parts read (a tied embedding/LM head) is stored once, or once in each of their
files, and the report names it.
"""

from __future__ import annotations

from pathlib import PurePath

import onnx_ir as ir

from onnxdeploy.artifacts import Artifact, ArtifactSet
from onnxdeploy.contract import DecodeContract, PartEntry, PartInfo, read_contract, write_contract
from onnxdeploy.contract_parts import PART_VERSION
from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.kv_cache import find_kv_cache
from onnxdeploy.passes._catalog import SplitConfig
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import clone, remove_dead_nodes
from onnxdeploy.passes._layer_cuts import LayerCuts, export_layer_weights, find_layer_cuts
from onnxdeploy.passes._order import CONTRACT, WHOLE_MODEL
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.report import PassReport
from onnxdeploy.settings import PipelineSettings

__all__ = ["SplitConfig", "SplitPass", "hidden_name", "part_data_name", "part_file_name", "share_layers"]


def part_file_name(graph: str, index: int) -> str:
    """File name of part ``index`` of graph file ``graph``: part 0 keeps it, ``model.onnx`` → ``model.part1.onnx``."""
    if index == 0:
        return graph
    path = PurePath(graph)
    return f"{path.stem}.part{index}{path.suffix}"


def part_data_name(primary: str, index: int) -> str:
    """Data file of part ``index`` with ``weights: per_part``: ``model.onnx`` → ``model.part0.data``."""
    return f"{PurePath(primary).stem}.part{index}.data"


def hidden_name(layer: int) -> str:
    """Name of the hidden state entering layer ``layer`` (a part's input and the part before it's output)."""
    return f"hidden_states.{layer}"


def _segment_note(layer: int, layers: int) -> str:
    """What layer ``layer``'s segment holds besides the layer (:meth:`LayerCuts.segment_weights`)."""
    return (
        " (with the embedding)" if layer == 0 else " (with the final norm and LM head)" if layer == layers - 1 else ""
    )


def share_layers(
    layer_bytes: list[dict[int, int]], *, parts: int | None, max_bytes: int | None, limit_name: str = ""
) -> list[int]:
    """First layer of each part: ``parts`` parts minimising the largest, or the fewest within ``max_bytes``.

    With ``max_bytes``, K is the fewest parts whose weights each fit (a greedy scan: a part's bytes only grow with
    its layers, so filling each part before starting the next needs the fewest), and the layers are then shared
    out over K parts as with ``parts: K``, so the largest part is as small as it can be (never above the limit).

    Args:
        layer_bytes: per layer, ``id(tensor) -> bytes`` of the weights its segment reads (a tensor two layers
            read counts once per part).
        parts: K, the number of parts (2 ≤ K ≤ layers), or None.
        max_bytes: the largest weight bytes a part may hold, or None (one of the two is given).
        limit_name: what the limit is, for the refusal (default ``max_part_bytes=<max_bytes>``).

    Returns:
        The first layer of every part, ascending, starting with 0 (``[0]``: the whole model fits ``max_bytes``).

    Raises:
        ConfigError: ``max_bytes`` below the weights of one layer's segment (names the layer and its bytes).
    """
    n = len(layer_bytes)

    def size(a: int, b: int) -> int:
        merged: dict[int, int] = {}
        for i in range(a, b):
            merged.update(layer_bytes[i])
        return sum(merged.values())

    if max_bytes is not None:
        parts, a = 1, 0
        for b in range(1, n + 1):
            if size(a, b) > max_bytes:
                if b - 1 == a:
                    raise ConfigError(
                        f"{limit_name or f'max_part_bytes={max_bytes}'}: layer {a}'s weights alone are "
                        f"{size(a, a + 1)} bytes{_segment_note(a, n)}, more than one "
                        "part may hold; "
                        + ("raise it" if not limit_name else "quantize the weights first or use another target")
                    )
                parts, a = parts + 1, b - 1
        if parts == 1:
            return [0]
    assert parts is not None
    # best[k][j]: the smallest largest part over layers [0, j) in k parts; a DP over contiguous cuts (L is small).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], size(i, j))
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    starts, j = [], n
    for k in range(parts, 0, -1):
        j = back[k][j]
        starts.append(j)
    return sorted(starts)


def part_limit(
    config: SplitConfig, target: str | None, context_bytes: int | None, source: str
) -> tuple[int, str] | None:
    """The weight bytes one part may hold and where that limit comes from, or None for ``parts: K``.

    Args:
        config: the pass's config.
        target: the pipeline's target id, or None.
        context_bytes: the target's ``context_bytes`` limit, or None.
        source: that limit's source (the report names it; the label only its matrix file).

    Raises:
        ConfigError: ``parts: auto`` without a target, or with a target whose matrix states no ``context_bytes``.
    """
    if config.max_part_bytes is not None:
        return config.max_part_bytes, "max_part_bytes"
    if config.parts != "auto":
        return None
    if target is None:
        raise ConfigError(
            "parts: auto takes the part size from the pipeline's target (its context_bytes limit), but the pipeline "
            "has no 'target'; set one (e.g. target: ort-qnn) or give parts: K or max_part_bytes"
        )
    if context_bytes is None:
        raise ConfigError(
            f"parts: auto: matrices/{target}.yaml states no context_bytes limit (the largest graph the target "
            "holds), so K cannot be chosen from it; give parts: K or max_part_bytes"
        )
    return context_bytes, f"parts: auto: {target}'s context_bytes {context_bytes} (matrices/{target}.yaml)"


@register_pass
class SplitPass(Pass):
    """Cut each static graph into parts at layer boundaries (module docstring).

    Input: a set of static graphs with decode contracts (``static_kv``, then the cache passes). Output: K graphs
    per input graph, part 0 first, in the input's order; every part's contract lists the chain.

    Raises:
        ConfigError: from :meth:`check_settings`, ``parts: auto`` without a target limit; from :meth:`check_model`
            (before any pass), ``parts`` above the decoder's layer count, or a part limit one layer of the export
            does not fit; from :meth:`call`, the same on the static graph (a pass before ``split`` changed the
            weights, e.g. ``quantize_weights``, or the pass runs on its own).
        PreconditionError: a graph without a contract or already split, or a boundary with no single hidden-state
            tensor (:func:`~onnxdeploy.passes._layer_cuts.find_layer_cuts`).
    """

    name = "split"
    config_model = SplitConfig
    config: SplitConfig
    in_place = False
    needs = frozenset({CONTRACT, WHOLE_MODEL})
    keeps_opset = True

    def removes(self) -> frozenset:
        """The output is a chain of parts, no longer a whole model (the cache passes must run before)."""
        return frozenset({WHOLE_MODEL})

    def check_settings(self, settings: PipelineSettings) -> None:
        """Refuse ``parts: auto`` when the pipeline's target states no part limit (:func:`part_limit`).

        Raises:
            ConfigError: no ``target``, or its matrix has no ``context_bytes`` limit.
        """
        part_limit(self.config, settings.target, settings.target_context_bytes, settings.target_context_source)

    def check_model(self, model: ir.Model, settings: PipelineSettings) -> None:
        """Refuse more parts than the export has layers, or a part limit one of its layers exceeds (no weight read).

        The layers and their weights are found on the export by data flow
        (:func:`~onnxdeploy.passes._layer_cuts.export_layer_weights`: shapes and dtypes only). Its bytes are a
        lower bound of the static graph's, so a layer above the limit here is above it in every graph; with a
        ``quantize_weights`` before ``split`` the weights shrink first, and the pass itself decides.

        Raises:
            ConfigError: ``parts`` above the layer count (the message names both), or ``max_part_bytes`` /
                the target's ``context_bytes`` below one layer's weights (names the layer and its bytes).
        """
        parts = self.config.parts
        contract = read_contract(model)
        if isinstance(parts, int):
            layers = contract.num_layers if contract is not None else len(find_kv_cache(model, who=self.name).layers)
            if parts > layers:
                raise ConfigError(f"parts={parts} is more than the model's {layers} decoder layers; use 2..{layers}")
            return
        limit = part_limit(self.config, settings.target, settings.target_context_bytes, settings.target_context_source)
        before = settings.passes[: settings.passes.index(self.name)] if self.name in settings.passes else ()
        if limit is None or "quantize_weights" in before:
            return
        if contract is None:
            layer_bytes = export_layer_weights(model, who=self.name)
        else:  # an input made static already: its own cuts, as the pass will find them
            try:
                cuts = find_layer_cuts(model.graph, contract, who=self.name)
            except PreconditionError:
                return  # refused by the pass itself, naming the boundary
            layer_bytes = [
                {k: b for k, (_, b) in cuts.segment_weights(model.graph, i).items()} for i in range(contract.num_layers)
            ]
        if layer_bytes is not None:
            self._share(layer_bytes, limit)

    def _share(self, layer_bytes: list[dict[int, int]], limit: tuple[int, str] | None) -> list[int]:
        """:func:`share_layers` with ``parts: K`` or the limit, a refusal naming the key the limit came from."""
        if limit is None:
            return share_layers(layer_bytes, parts=int(self.config.parts or 0), max_bytes=None)
        name = "" if limit[1] == "max_part_bytes" else limit[1]
        return share_layers(layer_bytes, parts=None, max_bytes=limit[0], limit_name=name)

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Cut every graph of the set at the same layers (module docstring); kept whole when it fits one part."""
        contracts = list(artifacts.contracts(self.name))
        first = contracts[0][1]
        if isinstance(self.config.parts, int) and self.config.parts > first.num_layers:
            raise ConfigError(f"parts={self.config.parts} is more than the model's {first.num_layers} decoder layers")
        defaults = context.target_defaults
        limit = part_limit(
            self.config,
            context.target,
            None if defaults is None else defaults.context_bytes,
            "" if defaults is None else defaults.context_source,
        )
        primary = artifacts.primary
        cuts = find_layer_cuts(primary.graph, first, who=self.name)
        layer_bytes = [
            {k: b for k, (_, b) in cuts.segment_weights(primary.graph, i).items()} for i in range(first.num_layers)
        ]
        starts = self._share(layer_bytes, limit)
        if limit is not None:
            source = "" if defaults is None or self.config.max_part_bytes is not None else defaults.context_source
            report.details["part_limit"] = {"bytes": limit[0], "from": limit[1], "source": source, "parts": len(starts)}
        if len(starts) == 1:
            assert limit is not None
            total = sum({k: b for layer in layer_bytes for k, b in layer.items()}.values())
            report.changes.append(
                f"not split: the whole model's {total} weight bytes fit the {limit[0]}-byte part limit ({limit[1]})"
            )
            return artifacts, False
        if limit is not None:
            report.changes.append(
                f"K={len(starts)}: the fewest parts whose weights each fit {limit[0]} bytes ({limit[1]})"
            )
        bounds = [*zip(starts, [*starts[1:], first.num_layers], strict=True)]
        out: list[Artifact] = []
        self._primary = contracts[0][0].name
        for i, (artifact, contract) in enumerate(contracts):
            graph_cuts = cuts if i == 0 else find_layer_cuts(artifact.model.graph, contract, who=self.name)
            out += self._cut(artifact, contract, graph_cuts, bounds)
        self._report(out[: len(bounds)], cuts, primary.graph, bounds, report)
        result = ArtifactSet(
            out, weights=artifacts.weights, input_was_external=artifacts.input_was_external, notes=list(artifacts.notes)
        )
        return result, True

    def _cut(
        self, artifact: Artifact, contract: DecodeContract, cuts: LayerCuts, bounds: list[tuple[int, int]]
    ) -> list[Artifact]:
        """The parts of one graph, part 0 first, each with its contract."""
        entries = [
            PartEntry(file=part_file_name(artifact.name, p), first_layer=a, num_layers=b - a)
            for p, (a, b) in enumerate(bounds)
        ]
        hidden_size = cuts.hidden[0].shape[-1] if cuts.hidden[0].shape is not None else None
        if not isinstance(hidden_size, int):
            raise PreconditionError(
                self.name, f"{artifact.name}: the hidden state '{cuts.hidden[0].name}' is not static"
            )
        parts = []
        for p, (a, b) in enumerate(bounds):
            model = self._part_model(artifact.model, cuts, a, b)
            names = {v.name for v in model.graph.inputs}
            inputs = contract.inputs.model_copy(
                update={role: name if name in names else None for role, name in contract.inputs.model_dump().items()}
            )
            info = PartInfo(
                index=p,
                count=len(bounds),
                hidden_size=hidden_size,
                hidden_in=hidden_name(a) if a > 0 else None,
                hidden_out=hidden_name(b) if b < contract.num_layers else None,
                weights_file=part_data_name(self._primary, p) if self.config.weights == "per_part" else None,
            )
            own = contract.model_copy(
                update={
                    "contract_version": max(contract.contract_version, PART_VERSION),
                    "cache": contract.cache[a:b],
                    "num_layers": b - a,
                    "inputs": inputs,
                    "logits": contract.logits if b == contract.num_layers else None,
                    "part": info,
                    "parts": entries,
                }
            )
            write_contract(model, DecodeContract.model_validate(own.model_dump()))
            parts.append(Artifact(entries[p].file, model))
        return parts

    def _part_model(self, model: ir.Model, cuts: LayerCuts, a: int, b: int) -> ir.Model:
        """Layers ``[a, b)`` of ``model``: a structural copy cut at ``h_a`` and ``h_b`` (module docstring)."""
        copy = clone(model)
        g = copy.graph
        values = {v.name: v for node in g for v in node.outputs}
        layers = len(cuts.layer_outputs)
        if a > 0:
            h = values[cuts.hidden[a - 1].name]
            fed = ir.Value(name=hidden_name(a), shape=h.shape, type=h.type)
            ir.convenience.replace_all_uses_with(h, fed)
            g.inputs.append(fed)
        keep = {n for names in cuts.layer_outputs[a:b] for n in names}
        outputs = [v for v in g.outputs if v.name in keep]
        if b < layers:
            out = values[cuts.hidden[b - 1].name]
            out.name = hidden_name(b)
            outputs.append(out)
        g.outputs.clear()
        g.outputs.extend(outputs)
        remove_dead_nodes(copy)
        for value in [v for v in g.inputs if not v.uses() and v.name not in keep]:
            g.inputs.remove(value)
        return copy

    def _report(
        self, parts: list[Artifact], cuts: LayerCuts, graph: ir.Graph, bounds: list[tuple[int, int]], report: PassReport
    ) -> None:
        """Each part's layers and weight bytes; tensors several parts read (stored once in the shared file)."""
        readers: dict[int, list[int]] = {}
        names: dict[int, tuple[str, int]] = {}
        rows = []
        for p, (part, (a, b)) in enumerate(zip(parts, bounds, strict=True)):
            tensors = {
                id(v.const_value): (str(v.name), v.const_value.nbytes)
                for v in part.model.graph.initializers.values()
                if v.const_value is not None
            }
            for key, entry in tensors.items():
                readers.setdefault(key, []).append(p)
                names[key] = entry
            weight_bytes = sum(nbytes for _, nbytes in tensors.values())
            rows.append({"file": part.name, "first_layer": a, "num_layers": b - a, "weight_bytes": weight_bytes})
            report.changes.append(f"part {p}: layers {a}..{b - 1}, {weight_bytes} weight bytes -> {part.name}")
        shared = [
            {"tensor": names[key][0], "bytes": names[key][1], "parts": ps}
            for key, ps in readers.items()
            if len(ps) > 1 and names[key][1] > 1024
        ]
        stored = (
            "stored in each of their data files (weights: per_part)"
            if self.config.weights == "per_part"
            else "stored once in the shared weights file"
        )
        for entry in shared:
            report.changes.append(
                f"'{entry['tensor']}' ({entry['bytes']} bytes) is read by parts {entry['parts']} (e.g. a tied "
                f"embedding/LM head): {stored}"
            )
        report.details["parts"] = rows
        report.details["shared_tensors"] = shared
        report.details["cuts"] = [str(v.name) for v in cuts.hidden]
