"""``static_shapes``: after shape inference, every tensor has a fully static shape.

Source: ``onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)`` and the ONNX IR
spec, "Tensor shapes" (a dim is a ``dim_value``, a ``dim_param`` symbol, or unknown; a missing ``shape``
means unknown rank). Edge compilers need every dim fixed; ``static_kv`` and onnxsim get it there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import onnx

from onnxdeploy.checks._graph import infer, iter_graphs, list_names, node_ref, value_type
from onnxdeploy.checks.base import Check, CheckContext, register_check
from onnxdeploy.graph import format_dims
from onnxdeploy.report import Finding

__all__ = ["StaticShapesCheck"]

# onnx shape inference names dims it cannot resolve "unk__0", "unk__1", ...
_INFERENCE_SYMBOL = re.compile(r"unk__\d+")

_FIX_DIMS_HINT = (
    "Fix the dim: run static_kv {batch, step_len, max_cache_len} for decoder I/O, or set input shapes "
    "(onnxsim --overwrite-input-shape, onnx.tools.update_model_dims) and fold the shape arithmetic."
)


@register_check
class StaticShapesCheck(Check):
    """Report every tensor whose shape is not fully static after shape inference.

    What is checked, on the model after ``infer_shapes(strict_mode=False, data_prop=True)`` (run on a
    weight-less copy, so models above 2 GiB work):

    - every graph input, graph output and ``value_info`` entry (subgraphs included) has a tensor type
      with a known rank (``OD201``), no ``dim_param`` symbol (``OD202``) and no unknown dim (``OD203``);
      one finding per tensor naming each dynamic axis and its symbol;
    - sequence/map/optional values, which have no static tensor shape (``OD204``, warning);
    - node outputs that inference could not type at all (no ``value_info`` afterwards; ``OD205``,
      warning) — usually custom-domain ops without a shape function;
    - ``Shape``, ``Range`` and ``Trilu`` nodes left in the graph (``OD206``, warning): legal on static
      tensors, but a sign the shape arithmetic was not folded;
    - inference that cannot run at all (``OD207``); the declared types are then checked instead.
    """

    name = "static_shapes"
    description = "Shape inference leaves no unknown rank, symbolic or unknown dim; no dynamic shape ops left."
    codes = {
        "OD201": "error: a tensor has no shape (type missing, not a tensor, or unknown rank).",
        "OD202": "error: a tensor has a symbolic dim (dim_param).",
        "OD203": "error: a tensor has an unknown dim (neither dim_value nor dim_param).",
        "OD204": "warning: a value is a sequence/map/optional, which has no static tensor shape.",
        "OD205": "warning: shape inference could not type a node output (no value_info).",
        "OD206": "warning: dynamic shape arithmetic left (Shape/Range/Trilu nodes).",
        "OD207": "error: shape inference failed; declared shapes were checked instead.",
    }

    shape_ops: tuple[str, ...] = ("Shape", "Range", "Trilu")
    """Op types whose presence means shape arithmetic was left unfolded (default domain only)."""

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        """Yield ``OD201``-``OD207`` findings for ``model`` (see the class docstring)."""
        try:
            inferred = infer(model)
        except Exception as exc:  # noqa: BLE001 - an inference failure is a model problem
            yield self.finding(
                "OD207",
                "error",
                f"shape inference (strict_mode=False, data_prop=True) failed: {type(exc).__name__}: {exc}",
                hint="Run the checker check for details; fix the node it names, then re-run.",
            )
            inferred = model
        for graph, scope in iter_graphs(inferred.graph):
            yield from self._graph_findings(graph, scope)
        yield from self._shape_op_findings(model)

    def _graph_findings(self, graph: onnx.GraphProto, scope: str) -> Iterator[Finding]:
        where = f" in subgraph '{scope.rstrip('/')}'" if scope else ""
        seen: set[str] = set()
        for role, values in (
            ("graph input", graph.input),
            ("graph output", graph.output),
            ("value_info", graph.value_info),
        ):
            for value in values:
                if value.name in seen:
                    continue
                seen.add(value.name)
                finding = self._value_finding(value, f"{role} '{value.name}'{where}")
                if finding is not None:
                    yield finding
        typed = seen | {t.name for t in graph.initializer} | {s.values.name for s in graph.sparse_initializer}
        for index, node in enumerate(graph.node):
            for output in node.output:
                if output and output not in typed:
                    typed.add(output)
                    yield self.finding(
                        "OD205",
                        "warning",
                        f"tensor '{output}'{where}, output {list(node.output).index(output)} of node "
                        f"{node_ref(node, index)} ({node.domain or 'ai.onnx'}::{node.op_type}), "
                        "has no type or shape after shape inference",
                        nodes=[output, node_ref(node, index)],
                        hint="Give the op a shape-inference function or a value_info with a static shape "
                        "(custom ops), or replace it with standard ops.",
                    )

    def _value_finding(self, value: onnx.ValueInfoProto, label: str) -> Finding | None:
        vtype = value_type(value.type)
        if vtype.kind in ("sequence", "map", "optional"):
            return self.finding(
                "OD204",
                "warning",
                f"{label} is a {vtype.kind}, which has no static tensor shape",
                nodes=[value.name],
                hint="Edge compilers take tensors only: unroll or remove the sequence/optional ops.",
            )
        if vtype.kind == "missing":
            return self.finding("OD201", "error", f"{label} has no type", nodes=[value.name], hint=_FIX_DIMS_HINT)
        if vtype.dims is None:
            return self.finding(
                "OD201",
                "error",
                f"{label} has no shape (rank unknown)",
                nodes=[value.name],
                hint=_FIX_DIMS_HINT,
            )
        symbolic = [(axis, d) for axis, d in enumerate(vtype.dims) if isinstance(d, str)]
        unknown = [axis for axis, d in enumerate(vtype.dims) if d is None or (isinstance(d, int) and d < 0)]
        if not symbolic and not unknown:
            return None
        parts = [
            f"axis {axis} is symbolic '{symbol}'"
            + (" (a placeholder made by shape inference)" if _INFERENCE_SYMBOL.fullmatch(symbol) else "")
            for axis, symbol in symbolic
        ]
        parts += [f"axis {axis} is unknown" for axis in unknown]
        code = "OD202" if symbolic else "OD203"
        return self.finding(
            code,
            "error",
            f"{label} has a dynamic shape {format_dims(vtype.dims)}: " + ", ".join(parts),
            nodes=[value.name],
            hint=_FIX_DIMS_HINT,
        )

    def _shape_op_findings(self, model: onnx.ModelProto) -> Iterator[Finding]:
        found: dict[str, list[str]] = {op: [] for op in self.shape_ops}
        for graph, _ in iter_graphs(model.graph):
            for index, node in enumerate(graph.node):
                if node.domain in ("", "ai.onnx") and node.op_type in found:
                    found[node.op_type].append(node_ref(node, index))
        for op, nodes in found.items():
            if nodes:
                listed = list_names(nodes)
                yield self.finding(
                    "OD206",
                    "warning",
                    f"{len(nodes)} {op} node(s) left: dynamic shape arithmetic was not folded ({listed})",
                    nodes=nodes,
                    hint="Fold it once every input shape is static: onnxsim (onnxsim.simplify) or constant folding.",
                )
