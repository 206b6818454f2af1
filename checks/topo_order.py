"""``topo_order``: nodes are topologically sorted, every tensor has exactly one producer, nodes are named.

Source: ONNX IR spec (onnx/docs/IR.md), "Graphs": nodes MUST be topologically sorted, every input of
a node is a graph input, an initializer, an output of an earlier node or (for optional inputs) the
empty name; value names are in single static assignment form; names of an outer graph are visible
in its subgraphs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence

import onnx

from onnxdeploy.checks._graph import node_ref, subgraphs
from onnxdeploy.checks.base import Check, CheckContext, register_check
from onnxdeploy.report import Finding

__all__ = ["TopoOrderCheck"]

_SORT_HINT = "Sort the nodes topologically (onnx_ir TopologicalSortPass; onnxdeploy run sorts at load)."


@register_check
class TopoOrderCheck(Check):
    """Report unsorted or undefined node inputs, tensors with several producers, and unnamed nodes.

    What is checked, in the main graph and every subgraph (outer names are visible inside):

    - each non-empty node input is defined before the node (``OD301`` when it is produced by a later
      node, ``OD302`` when nothing produces it); each graph output is defined (``OD302``). Offending
      nodes are listed in graph order, at most ``max_reported`` of them per graph;
    - each tensor has one producer: no two nodes write the same output, no node overwrites a graph
      input or initializer, no duplicate graph inputs or initializers (``OD303``);
    - nodes have names (``OD304``, warning) and the names are unique (``OD305``, warning): device
      SDKs, profilers and our own findings refer to nodes by name;
    - in the main graph, no graph output is listed twice (``OD306``) or is also a graph input (``OD307``):
      the ONNX checker accepts both, but a host binding outputs by name, IOBinding and device compilers
      (which give each output its own buffer) do not; no graph input, output or initializer has an empty
      name (``OD308``; ``""`` means "omitted optional input" in ONNX).
    """

    name = "topo_order"
    description = "Topological order, single producer per tensor, non-empty and unique node names."
    codes = {
        "OD301": "error: a node reads a tensor produced only by a later node (not topologically sorted).",
        "OD302": "error: a node input or graph output is never produced (undefined tensor).",
        "OD303": "error: a tensor has more than one producer (not in SSA form).",
        "OD304": "warning: nodes without a name.",
        "OD305": "warning: several nodes share one name.",
        "OD306": "error: a graph output is listed more than once.",
        "OD307": "error: a graph output is also a graph input (a pass-through).",
        "OD308": "error: a graph input, output or initializer has an empty name.",
    }

    max_reported: int = 20
    """Per graph, at most this many nodes get their own OD301/OD302 finding; the last one counts the rest."""

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        """Yield ``OD301``-``OD305`` findings for ``model`` (see the class docstring)."""
        unnamed: list[str] = []
        names: defaultdict[str, int] = defaultdict(int)
        yield from self._graph(model.graph, (), "", unnamed, names)
        yield from self._io_names(model.graph)
        if unnamed:
            listed = ", ".join(unnamed[: self.max_reported])
            more = f" and {len(unnamed) - self.max_reported} more" if len(unnamed) > self.max_reported else ""
            yield self.finding(
                "OD304",
                "warning",
                f"{len(unnamed)} node(s) have no name: {listed}{more}",
                nodes=unnamed,
                hint="Name every node uniquely (e.g. f'{op_type}_{index}'); SDK logs, profiles and findings "
                "refer to nodes by name.",
            )
        for name, count in names.items():
            if count > 1:
                yield self.finding(
                    "OD305",
                    "warning",
                    f"node name '{name}' is used by {count} nodes",
                    nodes=[name],
                    hint="Make node names unique (append the node index).",
                )

    def _io_names(self, graph: onnx.GraphProto) -> Iterator[Finding]:
        outputs = Counter(v.name for v in graph.output)
        inputs = {v.name for v in graph.input}
        for name, count in outputs.items():
            if count > 1:
                yield self.finding(
                    "OD306",
                    "error",
                    f"graph output '{name}' is listed {count} times",
                    nodes=[name],
                    hint="Keep one entry; where two outputs must carry one tensor, add an Identity for the second.",
                )
            if name in inputs:
                yield self.finding(
                    "OD307",
                    "error",
                    f"graph output '{name}' is also a graph input (the graph passes it through unchanged)",
                    nodes=[name],
                    hint="Drop the output (the host already has the tensor), or route it through an Identity with a "
                    "new name.",
                )
        kinds = (("graph input", graph.input), ("graph output", graph.output), ("initializer", graph.initializer))
        for kind, values in kinds:
            empty = sum(1 for v in values if not v.name)
            if empty:
                yield self.finding(
                    "OD308",
                    "error",
                    f"{empty} {kind}(s) have an empty name",
                    hint="Name every graph input, output and initializer; '' means an omitted optional input.",
                )

    def _graph(
        self,
        graph: onnx.GraphProto,
        outer: Sequence[set[str]],
        scope: str,
        unnamed: list[str],
        names: defaultdict[str, int],
    ) -> Iterator[Finding]:
        where = f" in subgraph '{scope.rstrip('/')}'" if scope else ""
        yield from self._producers(graph, where)

        producer: dict[str, int] = {}
        for index, node in enumerate(graph.node):
            for output in node.output:
                if output:
                    producer.setdefault(output, index)
        local: set[str] = {v.name for v in graph.input}
        local |= {t.name for t in graph.initializer}
        local |= {s.values.name for s in graph.sparse_initializer}

        def defined(tensor: str) -> bool:
            return tensor in local or any(tensor in names_ for names_ in outer)

        reported = 0
        skipped = 0
        for index, node in enumerate(graph.node):
            ref = node_ref(node, index)
            if node.name:
                names[node.name] += 1
            else:
                unnamed.append(f"{scope}{ref}")
            missing = [t for t in node.input if t and not defined(t)]
            if missing:
                if reported < self.max_reported:
                    reported += 1
                    yield from self._input_findings(node, ref, index, missing, producer, graph, where)
                else:
                    skipped += 1
            for attr_name, sub in subgraphs(node):
                yield from self._graph(sub, (*outer, local), f"{scope}{ref}/{attr_name}/", unnamed, names)
            local.update(o for o in node.output if o)
        if skipped:
            yield self.finding(
                "OD301",
                "error",
                f"{skipped} more node(s){where} read tensors not yet defined (not listed individually)",
                hint=_SORT_HINT,
            )
        for value in graph.output:
            if not defined(value.name):
                yield self.finding(
                    "OD302",
                    "error",
                    f"graph output '{value.name}'{where} is not produced by any node, input or initializer",
                    nodes=[value.name],
                    hint="Remove the output or connect it to the tensor that should feed it.",
                )

    def _input_findings(
        self,
        node: onnx.NodeProto,
        ref: str,
        index: int,
        missing: list[str],
        producer: dict[str, int],
        graph: onnx.GraphProto,
        where: str,
    ) -> Iterator[Finding]:
        later = [t for t in missing if t in producer]
        undefined = [t for t in missing if t not in producer]
        if later:
            producers = ", ".join(
                f"'{t}' (from node {node_ref(graph.node[producer[t]], producer[t])} at #{producer[t]})" for t in later
            )
            yield self.finding(
                "OD301",
                "error",
                f"node {ref} (#{index}, {node.op_type}){where} reads {producers} before it is produced",
                nodes=[ref, *later],
                hint=_SORT_HINT,
            )
        if undefined:
            tensors = ", ".join(f"'{t}'" for t in undefined)
            yield self.finding(
                "OD302",
                "error",
                f"node {ref} (#{index}, {node.op_type}){where} reads {tensors}, which no node, graph input "
                "or initializer produces",
                nodes=[ref, *undefined],
                hint="Connect the input to an existing tensor, add the missing graph input/initializer, or use "
                "'' for an omitted optional input.",
            )

    def _producers(self, graph: onnx.GraphProto, where: str) -> Iterator[Finding]:
        inputs = Counter(v.name for v in graph.input)
        inits = Counter(t.name for t in graph.initializer)
        for name, count in inputs.items():
            if count > 1:
                yield self._dup(name, f"graph input '{name}'{where} is declared {count} times")
        for name, count in inits.items():
            if count > 1:
                yield self._dup(name, f"initializer '{name}'{where} is declared {count} times")
        writers: defaultdict[str, list[str]] = defaultdict(list)
        for index, node in enumerate(graph.node):
            for output in node.output:
                if output:
                    writers[output].append(node_ref(node, index))
        for tensor, nodes in writers.items():
            sources = []
            if tensor in inputs:
                sources.append("a graph input")
            if tensor in inits:
                sources.append("an initializer")
            if len(nodes) > 1 or sources:
                what = ", ".join([*sources, *(f"node {n}" for n in nodes)])
                yield self._dup(
                    tensor, f"tensor '{tensor}'{where} has {len(nodes) + len(sources)} producers: {what}", nodes
                )

    def _dup(self, tensor: str, message: str, nodes: Sequence[str] = ()) -> Finding:
        return self.finding(
            "OD303",
            "error",
            message,
            nodes=[tensor, *nodes],
            hint="Rename one of the producers' outputs and update its consumers (ONNX values are SSA).",
        )
