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
largest part's weight bytes are as small as they can be; ``max_part_bytes`` takes the fewest parts whose weights
each fit. Part 0 of a graph keeps its file name (``model.onnx``, ``model.s16.c64.onnx``); part ``i`` is
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
from onnxdeploy.passes._layer_cuts import LayerCuts, find_layer_cuts
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


def share_layers(layer_bytes: list[dict[int, int]], *, parts: int | None, max_bytes: int | None) -> list[int]:
    """First layer of each part: ``parts`` parts minimising the largest, or the fewest within ``max_bytes``.

    Args:
        layer_bytes: per layer, ``id(tensor) -> bytes`` of the weights its segment reads (a tensor two layers
            read counts once per part).
        parts: K, the number of parts (2 ≤ K ≤ layers), or None.
        max_bytes: the largest weight bytes a part may hold, or None (one of the two is given).

    Returns:
        The first layer of every part, ascending, starting with 0.

    Raises:
        ConfigError: ``max_bytes`` below the weights of one layer's segment (names the layer and its bytes), or
            it fits the whole model in one part.
    """
    n = len(layer_bytes)

    def size(a: int, b: int) -> int:
        merged: dict[int, int] = {}
        for i in range(a, b):
            merged.update(layer_bytes[i])
        return sum(merged.values())

    if max_bytes is not None:
        starts, a = [0], 0
        for b in range(1, n + 1):
            if size(a, b) > max_bytes:
                if b - 1 == a:
                    raise ConfigError(
                        f"max_part_bytes={max_bytes}: layer {a}'s weights alone are {size(a, a + 1)} bytes; raise it"
                    )
                starts.append(b - 1)
                a = b - 1
        if len(starts) == 1:
            raise ConfigError(
                f"max_part_bytes={max_bytes} holds the whole model ({size(0, n)} bytes): nothing to split"
            )
        return starts
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


@register_pass
class SplitPass(Pass):
    """Cut each static graph into parts at layer boundaries (module docstring).

    Input: a set of static graphs with decode contracts (``static_kv``, then the cache passes). Output: K graphs
    per input graph, part 0 first, in the input's order; every part's contract lists the chain.

    Raises:
        ConfigError: from :meth:`check_model`, ``parts`` above the decoder's layer count (before any pass); from
            :meth:`call`, a ``max_part_bytes`` one layer does not fit.
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

    def check_model(self, model: ir.Model, settings: PipelineSettings) -> None:
        """Refuse more parts than the input decoder has layers (its cache, found by data flow; no weights read).

        Raises:
            ConfigError: ``parts`` above the layer count (the message names both).
        """
        parts = self.config.parts
        if parts is None:
            return
        contract = read_contract(model)
        layers = contract.num_layers if contract is not None else len(find_kv_cache(model, who=self.name).layers)
        if parts > layers:
            raise ConfigError(f"parts={parts} is more than the model's {layers} decoder layers; use 2..{layers}")

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Cut every graph of the set at the same layers (module docstring)."""
        contracts = list(artifacts.contracts(self.name))
        first = contracts[0][1]
        if self.config.parts is not None and self.config.parts > first.num_layers:
            raise ConfigError(f"parts={self.config.parts} is more than the model's {first.num_layers} decoder layers")
        primary = artifacts.primary
        cuts = find_layer_cuts(primary.graph, first, who=self.name)
        layer_bytes = [
            {k: b for k, (_, b) in cuts.segment_weights(primary.graph, i).items()} for i in range(first.num_layers)
        ]
        starts = share_layers(layer_bytes, parts=self.config.parts, max_bytes=self.config.max_part_bytes)
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
