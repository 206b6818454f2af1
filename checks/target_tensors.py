"""Target check of tensors: shapes, sizes and initializer dtypes against a target's matrix (``OD520``-``OD525``).

Split from :mod:`onnxdeploy.checks.target` (which keeps the opset and op checks and ``predict_supported``); the
value types both read (:func:`value_types`, after shape inference) live here.
"""

from __future__ import annotations

import fnmatch
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import onnx
import onnx_ir as ir
from onnx import TensorProto

from onnxdeploy.checks._graph import infer, iter_graphs, list_names, value_type
from onnxdeploy.checks.base import Check, CheckContext, register_check
from onnxdeploy.graph import format_dims
from onnxdeploy.matrices import Matrix, get_target
from onnxdeploy.matrices.schema import Limit
from onnxdeploy.report import Finding

__all__ = ["TargetTensorsCheck", "Types", "value_types"]


def _matrix(context: CheckContext) -> Matrix | None:
    return get_target(context.target) if context.target else None


@dataclass
class Types:
    """Element types and shapes of every value of a graph and its subgraphs, after shape inference."""

    elem: dict[str, int]
    dims: dict[str, tuple[int | str | None, ...] | None]
    constants: frozenset[str] = frozenset()
    """Names of initializers (not also graph inputs) and Constant nodes' outputs: values known when loading."""


def value_types(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Types]:
    """The model after shape inference (the model itself when inference fails) and its values' types and dims."""
    try:
        inferred = infer(model)
    except Exception:  # noqa: BLE001 - types then come from the declared values only
        inferred = model
    elem: dict[str, int] = {}
    dims: dict[str, tuple[int | str | None, ...] | None] = {}
    constants: set[str] = set()
    for graph, _ in iter_graphs(inferred.graph):
        fed = {v.name for v in graph.input}
        constants |= {t.name for t in graph.initializer if t.name not in fed}
        constants |= {
            o for n in graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx") for o in n.output
        }
        for value in (*graph.input, *graph.output, *graph.value_info):
            vt = value_type(value.type)
            if vt.elem_type:
                elem[value.name] = vt.elem_type
                dims[value.name] = vt.dims
        for tensor in graph.initializer:
            elem[tensor.name] = tensor.data_type
            dims[tensor.name] = tuple(tensor.dims)
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for attr in node.attribute:
                    if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                        elem[node.output[0]] = attr.t.data_type
                        dims[node.output[0]] = tuple(attr.t.dims)
    return inferred, Types(elem, dims, frozenset(constants))


def _limit_scope(limit: Limit, model: onnx.ModelProto, types: Types) -> list[str] | None:
    """The tensors ``limit`` is checked on (its ``applies_to``), or None when it is scoped in words only.

    No ``applies_to``: every tensor. ``ops``: the inputs and outputs of nodes of those op types (subgraphs
    included); ``tensors``: names matching those fnmatch patterns; both: either.
    """
    if not limit.ops and not limit.tensors:
        return None if limit.applies_to else list(types.dims)
    names: set[str] = set()
    if limit.ops:
        for graph, _ in iter_graphs(model.graph):
            for node in graph.node:
                if node.op_type in limit.ops:
                    names.update(n for n in (*node.input, *node.output) if n)
    names.update(n for n in types.dims if any(fnmatch.fnmatchcase(n, p) for p in limit.tensors))
    return [n for n in types.dims if n in names]


_QUANT_DTYPES: dict[int, str] = {
    TensorProto.INT4: "int4",
    TensorProto.UINT4: "uint4",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
    TensorProto.FLOAT16: "fp16",
    TensorProto.BFLOAT16: "bf16",
}


def _nbytes(elem_type: int, dims: tuple[int, ...]) -> int:
    """A tensor's bytes, sub-byte types packed (onnx_ir's ``DataType.bitwidth``: int4 is 4 bits, float4 4)."""
    try:
        bits = ir.DataType(elem_type).bitwidth
    except (ValueError, TypeError):  # no fixed width (STRING) or a type onnx_ir does not know: a byte each
        bits = 8
    return math.ceil(math.prod(dims) * bits / 8)


@register_check
class TargetTensorsCheck(Check):
    """Tensors against the target's shape, size and dtype facts.

    - ``OD520`` error (warning when the target only prefers static shapes): a graph input/output with a
      dynamic dim where the target requires static shapes (one finding per tensor, naming each axis);
    - ``OD521`` error: on a compiler target or one that requires static shapes, a zero-size tensor (a dim of
      0) after shape inference or in an initializer; compilers reject them (phi-3's partial-rotary Slice leaves
      such tensors in a static graph); runtimes such as ONNX Runtime run them;
    - ``OD522`` error: a tensor above the target's ``max_tensor_bytes``/``max_operand_bytes`` or a dim above
      ``max_dim``, among the tensors the limit applies to (every tensor, or the inputs/outputs of its ``ops``
      and the names matching its ``tensors`` patterns);
    - ``OD523`` error / warning: initializers in a dtype (int4, int8, fp16, bf16, …) the target does not
      support / supports only partly;
    - ``OD524`` warning: the target requires static shapes and intermediate tensors still have dynamic dims
      (one summary finding);
    - ``OD525`` info: a limit whose ``applies_to`` is words only (no ``ops``/``tensors`` to match): it is
      named, not charged to every tensor;
    - ``OD526`` error: the graph's initializers (shape × dtype, external data not read) above the target's
      ``context_bytes`` (one graph's context on the device, e.g. ort-qnn's 4 GB HTP context); each part of a
      ``split`` model is one graph and is checked on its own.
    """

    name = "target_tensors"
    description = "Dynamic dims, zero-size tensors, size limits and initializer dtypes against the target."
    codes = {
        "OD520": "error: a graph input/output has a dynamic dim; the target requires static shapes.",
        "OD521": "error: a zero-size tensor (a dim of 0).",
        "OD522": "error: a tensor or dim above the target's size limit.",
        "OD523": "error/warning: initializers in a dtype the target does not (fully) support.",
        "OD524": "warning: intermediate tensors with dynamic dims on a target that requires static shapes.",
        "OD525": "info: a size limit scoped in words only (applies_to without ops or tensors): not checked.",
        "OD526": "error: the graph's weights above the target's context_bytes (one context's limit).",
    }

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        """Yield ``OD520``-``OD524`` findings (see the class docstring); nothing without a target."""
        matrix = _matrix(context)
        if matrix is None:
            return
        inferred, types = value_types(model)
        yield from self._dynamic(matrix, inferred)
        if matrix.kind == "compiler" or matrix.static_shapes == "required":
            yield from self._zero_size(inferred, types)
        yield from self._limits(matrix, inferred, types)
        yield from self._dtypes(matrix, model)

    def _dynamic(self, matrix: Matrix, model: onnx.ModelProto) -> Iterator[Finding]:
        if matrix.static_shapes not in ("required", "preferred"):
            return
        level = "error" if matrix.static_shapes == "required" else "warning"
        source = matrix.source_text(matrix.static_shapes_source or "")
        io_names = set()
        for kind, values in (("graph input", model.graph.input), ("graph output", model.graph.output)):
            for value in values:
                io_names.add(value.name)
                vt = value_type(value.type)
                if vt.kind != "tensor" or vt.is_static:
                    continue
                dynamic = (
                    ["rank unknown"]
                    if vt.dims is None
                    else [
                        f"axis {axis} is '{d}'" if isinstance(d, str) else f"axis {axis} is unknown"
                        for axis, d in enumerate(vt.dims)
                        if not isinstance(d, int) or d < 0
                    ]
                )
                yield self.finding(
                    "OD520",
                    level,
                    f"{kind} '{value.name}' has a dynamic shape {format_dims(vt.dims)}: {', '.join(dynamic)}",
                    nodes=[value.name],
                    hint="static_kv {batch, step_len, max_cache_len} fixes every decoder input/output dim.",
                    rule=f"{matrix.target}: static shapes {matrix.static_shapes}",
                    source=source,
                )
        inner = [
            v.name
            for graph, _ in iter_graphs(model.graph)
            for v in graph.value_info
            if v.name not in io_names and value_type(v.type).kind == "tensor" and not value_type(v.type).is_static
        ]
        if inner:
            listed = list_names(inner)
            yield self.finding(
                "OD524",
                "warning",
                f"{len(inner)} intermediate tensor(s) have dynamic dims after shape inference ({listed})",
                nodes=inner,
                hint="static_kv fixes the inputs and folds the shape arithmetic (onnxsim), after which these resolve.",
                rule=f"{matrix.target}: static shapes {matrix.static_shapes}",
                source=source,
            )

    def _zero_size(self, model: onnx.ModelProto, types: Types) -> Iterator[Finding]:
        for name, dims in types.dims.items():
            if dims and any(isinstance(d, int) and d == 0 for d in dims):
                yield self.finding(
                    "OD521",
                    "error",
                    f"tensor '{name}' has zero size {format_dims(dims)}",
                    nodes=[name],
                    hint="Remove the empty branch (e.g. a partial-rotary Slice of width 0 and its Concat) and refold; "
                    "no onnxdeploy pass does this yet.",
                    rule="no tensor has a dim of 0",
                    source="onnxdeploy issue 8 (compilers reject zero-size tensors); no target document states it",
                )

    def _limits(self, matrix: Matrix, model: onnx.ModelProto, types: Types) -> Iterator[Finding]:
        for limit in matrix.limits:
            if limit.name == "context_bytes" and limit.unit == "bytes":
                weights = sum(_nbytes(t.data_type, tuple(t.dims)) for t in model.graph.initializer)
                if weights > limit.value:
                    yield self.finding(
                        "OD526",
                        "error",
                        f"the graph's weights ({weights} bytes) are above {matrix.target}'s context_bytes "
                        f"{limit.value} ({limit.applies_to or 'one context'})",
                        hint="split {parts: auto} cuts the model at layer boundaries into parts whose weights each "
                        "fit (or split {max_part_bytes: N} for headroom)." + (f" {limit.note}" if limit.note else ""),
                        rule=f"{limit.name} <= {limit.value} {limit.unit}",
                        source=matrix.source_text(limit.source),
                    )
                continue
            checked = limit.name in ("max_tensor_bytes", "max_operand_bytes", "max_dim")
            if not checked or (limit.name != "max_dim" and limit.unit != "bytes"):
                continue
            scope = _limit_scope(limit, model, types)
            if scope is None:
                yield self.finding(
                    "OD525",
                    "info",
                    f"{matrix.target}'s {limit.name} {limit.value} {limit.unit} applies to {limit.applies_to}: "
                    "stated in words only, so no tensor was checked against it",
                    rule=f"{limit.name} <= {limit.value} {limit.unit} ({limit.applies_to})",
                    source=matrix.source_text(limit.source),
                )
                continue
            for name in scope:
                dims = types.dims[name]
                if limit.name == "max_dim":
                    if dims and any(isinstance(d, int) and d > limit.value for d in dims):
                        yield self._limit(matrix, limit, name, f"dims {format_dims(dims)}")
                    continue
                if dims is None or not all(isinstance(d, int) and d >= 0 for d in dims):
                    continue
                size = _nbytes(types.elem.get(name, TensorProto.FLOAT), tuple(dims))  # type: ignore[arg-type]
                if size > limit.value:
                    yield self._limit(matrix, limit, name, f"{size} bytes")

    def _limit(self, matrix: Matrix, limit, name: str, what: str) -> Finding:
        return self.finding(
            "OD522",
            "error",
            f"tensor '{name}' ({what}) is above {matrix.target}'s {limit.name} {limit.value} {limit.unit}"
            + (f" ({limit.applies_to})" if limit.applies_to else ""),
            nodes=[name],
            hint="Lower max_cache_len / step_len in static_kv, or split the tensor."
            + (f" {limit.note}" if limit.note else ""),
            rule=f"{limit.name} <= {limit.value} {limit.unit}",
            source=matrix.source_text(limit.source),
        )

    def _dtypes(self, matrix: Matrix, model: onnx.ModelProto) -> Iterator[Finding]:
        found: dict[str, list[str]] = defaultdict(list)
        for graph, _ in iter_graphs(model.graph):
            for tensor in graph.initializer:
                name = _QUANT_DTYPES.get(tensor.data_type)
                if name is not None:
                    found[name].append(tensor.name)
        for dtype, names in found.items():
            support = matrix.dtypes.get(dtype)  # type: ignore[call-overload]
            if support is None or support.supported is True:
                continue
            listed = list_names(names, 5)
            partial = support.supported == "partial"
            yield self.finding(
                "OD523",
                "warning" if partial else "error",
                f"{len(names)} {dtype} initializer(s) ({listed}); {matrix.target} supports {dtype} "
                + ("only partly" if partial else "not at all")
                + (f": {support.note}" if support.note else ""),
                nodes=names,
                hint="quantize_weights {bits, format} chooses the weight dtype and format; "
                "pick one the target lists as supported.",
                rule=f"{dtype}: supported={support.supported}",
                source=matrix.source_text(support.source),
            )
