"""Layer boundaries of a static decoder, found by data flow: the hidden state that separates layer k-1 from layer k.

A decoder's residual stream carries one tensor from each layer to the next. :func:`find_layer_cuts` finds it for
every boundary ``k`` (1 ≤ k < L) of a graph with a decode contract without reading names: each value gets the set
of cache layers whose past input it depends on, and whether it depends on ``input_ids`` (a bit mask, forwards in
topological order); a candidate ``h_k`` depends on ``input_ids`` and the pasts of layers ``0 .. k-1`` exactly, and
it is the cut when everything the later layers and the logits compute reaches ``input_ids`` and the earlier
layers' pasts through ``h_k`` only (a backward walk from those outputs that stops at ``h_k``; counting
``input_ids`` keeps the embedding and the earlier layers' residual adds out of the later part). What they read
that depends on no past or token at all — RoPE's cos/sin from ``position_ids``, the mask from ``cache_position``,
constants — is computed again in the later part, so the one tensor crossing a boundary
is the hidden state. The last such candidate in graph order is taken: the residual sum after layer ``k-1``'s
MLP (the sum after its attention also separates, moving the MLP into the later part), or a weightless Cast/Identity
of it that layer ``k`` reads.

A graph whose layers exchange more than one tensor that depends on the earlier caches has no such cut (e.g.
onnxruntime-genai's ``SkipSimplifiedLayerNormalization``, which outputs the residual sum and its norm to the
next layer): it is refused, naming the boundary.

Before any pass runs, :func:`export_layer_weights` applies the same search to the dynamic export itself (its
cache found by :func:`~onnxdeploy.kv_cache.find_kv_cache`), so ``split``'s size limit can be checked on the input:
there the exporters' shape arithmetic (``Shape`` of an earlier layer's past feeding every mask) would tie every
layer to layer 0, so shape-only ops (:data:`SHAPE_ONLY`) carry no data dependence and the segment walk does not
pass through them. The bytes it finds are the weights each layer reads in the export; ``static_kv`` only adds
folded constants (RoPE tables, masks), so on every fixture they are a lower bound of the static graph's, within
1.1% (``tests/passes/test_split_limits.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from onnxdeploy.contract import DecodeContract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.kv_cache import find_kv_cache, find_logits_output

__all__ = ["SHAPE_ONLY", "LayerCuts", "closure_nodes", "export_layer_weights", "find_layer_cuts"]

SHAPE_ONLY = frozenset({"Shape", "Size"})
"""Ops whose output depends on their input's shape only, not its data (ONNX operator docs: Shape, Size)."""


@dataclass(frozen=True)
class LayerCuts:
    """The hidden-state values between the layers of one graph, and what each layer segment reads.

    Attributes:
        hidden: ``hidden[k - 1]`` is the value entering layer ``k`` (k = 1 .. L-1), float ``(B, S, hidden)``.
        layer_outputs: per layer (contract order) the names of the graph outputs it computes (its present cache
            outputs; the last layer's list also holds the logits).
        layer_pasts: per layer the names of its past cache inputs.
        shape_free: shape-only ops (:data:`SHAPE_ONLY`) carry no dependence and end the segment walk (the
            dynamic export's estimate, :func:`export_layer_weights`); False for the static graphs ``split`` cuts.
    """

    hidden: list[ir.Value]
    layer_outputs: list[list[str]]
    layer_pasts: list[list[str]]
    shape_free: bool = False

    def segment_weights(self, graph: ir.Graph, layer: int) -> dict[int, tuple[str, int]]:
        """The initializers layer ``layer``'s segment reads: ``id(tensor) -> (name, bytes)``.

        Segment ``k`` is what computes layer k's outputs and the hidden state after it from the one before it
        (segment 0 holds the embedding, the last one the final norm and the LM head).
        """
        outs = _named_outputs(graph, self.layer_outputs[layer])
        if layer + 1 < len(self.layer_outputs):
            outs.append(self.hidden[layer])
        stop = self.hidden[layer - 1] if layer > 0 else None
        found: dict[int, tuple[str, int]] = {}
        for node in closure_nodes(outs, stop, shape_free=self.shape_free):
            for value in node.inputs:
                if value is not None and value.const_value is not None and value.is_initializer():
                    found[id(value.const_value)] = (str(value.name), value.const_value.nbytes)
        return found


def _named_outputs(graph: ir.Graph, names: Iterable[str]) -> list[ir.Value]:
    by_name = {v.name: v for v in graph.outputs}
    return [by_name[n] for n in names]


def closure_nodes(outputs: Sequence[ir.Value], stop: ir.Value | None, *, shape_free: bool = False) -> list[ir.Node]:
    """Every node ``outputs`` need, walking backwards from them and not through ``stop`` (an input there).

    Args:
        outputs: values of one graph.
        stop: a value treated as given (its producer and what only it needs are left out), or None.
        shape_free: do not walk on from a shape-only node (:data:`SHAPE_ONLY`): it reads no data.

    Returns:
        The nodes, in no particular order.
    """
    seen: set[int] = set()
    nodes: list[ir.Node] = []
    todo = [v for v in outputs if v is not stop]
    while todo:
        value = todo.pop()
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        if shape_free and node.op_type in SHAPE_ONLY:
            continue
        todo += [i for i in node.inputs if i is not None and i is not stop]
    return nodes


def _dependencies(graph: ir.Graph, pasts: dict[str, int], shape_free: bool) -> dict[int, int]:
    """``id(value) -> bit mask`` of the inputs ``value`` depends on (``pasts``: input name -> bit; graph order)."""
    deps: dict[int, int] = {id(v): 1 << pasts[v.name] for v in graph.inputs if v.name in pasts}
    for node in graph:
        mask = 0
        for value in node.inputs if not (shape_free and node.op_type in SHAPE_ONLY) else ():
            if value is not None:
                mask |= deps.get(id(value), 0)
        for out in node.outputs:
            deps[id(out)] = mask
    return deps


def _separates(outputs: Sequence[ir.Value], cut: ir.Value, earlier: int, deps: dict[int, int]) -> bool:
    """Whether ``outputs`` reach the values depending on the ``earlier`` layers' pasts only through ``cut``."""
    seen: set[int] = set()
    todo = [v for v in outputs]
    while todo:
        value = todo.pop()
        if value is cut or not deps.get(id(value), 0) & earlier or id(value) in seen:
            continue
        seen.add(id(value))
        node = value.producer()
        if node is None:  # input_ids or a past input of an earlier layer, read around the cut
            return False
        todo += [i for i in node.inputs if i is not None]
    return True


def find_layer_cuts(graph: ir.Graph, contract: DecodeContract, *, who: str) -> LayerCuts:
    """The hidden state entering each layer after the first (module docstring).

    Args:
        graph: a static decoder (topologically sorted) whose I/O is what ``contract`` says.
        contract: its decode contract (the cache entries name each layer's past inputs and present outputs).
        who: the pass name, for errors.

    Returns:
        The cuts, one per boundary between two layers.

    Raises:
        PreconditionError: a layer's past input or present output is not in the graph, or a boundary has no single
            tensor separating the layers before it from those after it (names the boundary and the candidates).
    """
    layer_pasts = [[past for past, _ in contract.layer_cache_pairs(e)] for e in contract.cache]
    layer_outputs = [[present for _, present in contract.layer_cache_pairs(e)] for e in contract.cache]
    if contract.logits is not None:
        layer_outputs[-1].append(contract.logits)
    missing = sorted({n for names in layer_pasts for n in names} - {v.name for v in graph.inputs})
    if contract.inputs.input_ids is None:
        missing.append("input_ids")
    missing += sorted({n for names in layer_outputs for n in names} - {v.name for v in graph.outputs})
    if missing:
        raise PreconditionError(who, f"the contract names {missing}, which the graph does not have as inputs/outputs")
    return _search(graph, layer_pasts, layer_outputs, str(contract.inputs.input_ids), who=who, shape_free=False)


def export_layer_weights(model: ir.Model, *, who: str) -> list[dict[int, int]] | None:
    """Per layer of a dynamic export, the weights its segment reads: ``id(tensor) -> bytes`` (no weight read).

    The cuts are searched on the export as on a static graph (module docstring), shape-only ops aside; the bytes
    come from each initializer's shape and dtype (``nbytes``), so external data is not read.

    Args:
        model: the run's input, an export with a KV cache and an ``input_ids`` input.
        who: the pass name, for errors.

    Returns:
        One dict per layer (the cache's data-flow order), or None when no single tensor separates two layers in
        the export (then ``split`` decides on the static graph, where it refuses such a model naming the boundary).

    Raises:
        PreconditionError: the export has no KV cache or no single logits output (:mod:`onnxdeploy.kv_cache`).
    """
    graph = model.graph
    kv = find_kv_cache(model, who=who)
    layer_pasts = [[layer.key.past_name, layer.value.past_name] for layer in kv.layers]
    layer_outputs = [[layer.key.present_name, layer.value.present_name] for layer in kv.layers]
    layer_outputs[-1].append(str(find_logits_output(graph, {n for o in layer_outputs for n in o}, who=who).name))
    if "input_ids" not in {v.name for v in graph.inputs}:
        return None
    try:
        cuts = _search(graph, layer_pasts, layer_outputs, "input_ids", who=who, shape_free=True)
    except PreconditionError:
        return None
    return [{k: b for k, (_, b) in cuts.segment_weights(graph, i).items()} for i in range(len(layer_pasts))]


def _search(
    graph: ir.Graph,
    layer_pasts: list[list[str]],
    layer_outputs: list[list[str]],
    input_ids: str,
    *,
    who: str,
    shape_free: bool,
) -> LayerCuts:
    """The cut at every boundary (:func:`find_layer_cuts`; the names are known to be the graph's)."""
    pasts = {name: i + 1 for i, names in enumerate(layer_pasts) for name in names}  # bit 0: input_ids
    pasts[input_ids] = 0
    deps = _dependencies(graph, pasts, shape_free)
    produced = [out for node in graph for out in node.outputs]
    hidden: list[ir.Value] = []
    for k in range(1, len(layer_pasts)):
        earlier = (1 << (k + 1)) - 1  # input_ids and layers 0 .. k-1
        later = _named_outputs(graph, [n for names in layer_outputs[k:] for n in names])
        candidates = [v for v in produced if deps.get(id(v), 0) == earlier]
        cut = next((v for v in reversed(candidates) if _separates(later, v, earlier, deps)), None)
        if cut is None:
            raise PreconditionError(
                who,
                f"no single tensor separates layer {k - 1} from layer {k}: the later layers read more than one value "
                f"computed from the earlier caches ({len(candidates)} candidate(s) tried, e.g. "
                f"{[str(v.name) for v in candidates[-3:]]}); this graph cannot be cut there",
            )
        hidden.append(cut)
    return LayerCuts(hidden=hidden, layer_outputs=layer_outputs, layer_pasts=layer_pasts, shape_free=shape_free)
