"""Target checks: the model against one target's compatibility matrix (``matrices/<target>.yaml``).

Three checks, each finding naming the node or tensor, the rule (the matrix fact) and its source (document,
section, version, address, date read), and a hint naming the pass that fixes it where one does:

- ``target_opset``: opset per domain and IR version within the target's ranges (``OD501``-``OD504``);
- ``target_ops``: every node's op is supported at its schema version, with the entry's dtype, attribute,
  rank and shape-rule constraints (``OD510``-``OD518``);
- ``target_tensors`` (:mod:`onnxdeploy.checks.target_tensors`): dynamic dims where the target requires static
  shapes, zero-size tensors, size limits and initializer dtypes the target does not take (``OD520``-``OD525``).

:func:`predict_supported` answers "would the target take this model?" from the error findings of the three;
the cross-check tests compare it with whether ONNX Runtime / OpenVINO really open the model.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterator

import onnx

from onnxdeploy.checks._graph import group_per_op, iter_graphs, list_names, node_ref, value_type
from onnxdeploy.checks.base import Check, CheckContext, register_check
from onnxdeploy.checks.target_tensors import TargetTensorsCheck, Types, value_types
from onnxdeploy.errors import ConfigError
from onnxdeploy.graph import dtype_name, opset_imports
from onnxdeploy.matrices import Matrix, OpEntry, get_target, schema_version_of
from onnxdeploy.report import Finding

__all__ = ["TARGET_CHECKS", "TargetOpsCheck", "TargetOpsetCheck", "TargetTensorsCheck", "fix_hint", "predict_supported"]

TARGET_CHECKS = ("target_opset", "target_ops", "target_tensors")
"""The checks a pipeline or ``onnxdeploy check`` runs whenever a target is set."""

# Ops the exporters emit for the dynamic cache and its masks, and the pass that removes or replaces them.
# Source: what each pass rewrites (passes/static_kv.py, passes/mask_rewrite.py module docstrings).
_PASS_FIXES: dict[str, str] = {
    "Trilu": "static_kv + mask_rewrite (the causal-mask construction becomes an O(max_cache_len) select)",
    "Range": "static_kv (folds the shape arithmetic once every dim is static) + mask_rewrite (mask ranges)",
    "Shape": "static_kv (the shape arithmetic folds away once every dim is static)",
    "ConstantOfShape": "static_kv (folds to a constant once every dim is static)",
    "Size": "static_kv (folds to a constant once every dim is static)",
    "NonZero": "static_kv (shape arithmetic folds once every dim is static)",
    "IsNaN": "mask_rewrite (removes the exporter's NaN guard on the attention probabilities)",
    "IsInf": "mask_rewrite (the select mask never produces -inf)",
    "Not": "mask_rewrite (replaces the exporter's boolean mask chain)",
    "Or": "mask_rewrite (replaces the exporter's boolean mask chain)",
    "And": "mask_rewrite (replaces the exporter's boolean mask chain)",
    "CumSum": "static_kv (position arithmetic from cache_position) + mask_rewrite",
    "MatMulNBits": "quantize_weights {format: qdq} (standard DequantizeLinear instead of the ORT contrib op)",
}

# Ops an onnxdeploy pass itself writes, and what the user can do about them.
_PASS_MADE: dict[str, str] = {
    "ScatterElements": "static_kv writes the KV cache with ScatterElements by default: set static_kv (or kv_layout) "
    "cache_write: where (Equal/Where, which NPUs lower) or cache_write: host (the host writes the new K/V), or "
    "scatter_nd.",
}


def fix_hint(op: str) -> str:
    """The pass that removes ``op`` from a decoder export, or ``""`` when no onnxdeploy pass does."""
    return _PASS_FIXES.get(op, "")


def _domain(name: str) -> str:
    return name or "ai.onnx"


def _matrix(context: CheckContext) -> Matrix | None:
    return get_target(context.target) if context.target else None


def _used_domains(model: onnx.ModelProto) -> set[str]:
    """The op domains (``ai.onnx`` for the default one) of every node of the graph, its subgraphs and functions."""
    used = {_domain(n.domain) for graph, _ in iter_graphs(model.graph) for n in graph.node}
    for function in model.functions:
        used.add(_domain(function.domain))
        used |= {_domain(n.domain) for n in function.node}
    return used


@register_check
class TargetOpsetCheck(Check):
    """Compare every imported opset domain and the IR version with the target's matrix entry.

    - ``OD501`` error: a domain's opset is outside the target's ``opsets.<domain>`` range (hint: ``pin_opset``);
    - ``OD502`` error: a node uses a domain the target does not list (a domain imported but used by no node,
      in the graph, a subgraph or a local function, is not checked: the runtimes load such models);
    - ``OD503`` error: the IR version is above the target's ``ir_version.max``;
    - ``OD504`` info: no target given, nothing checked.
    """

    name = "target_opset"
    description = "Opset per domain and IR version within the target's matrix entry (matrices/<target>.yaml)."
    codes = {
        "OD501": "error: a domain's opset is outside the target's supported range.",
        "OD502": "error: an opset domain the target does not support.",
        "OD503": "error: the IR version is newer than the target accepts.",
        "OD504": "info: no target given; nothing checked.",
    }

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        """Yield ``OD501``-``OD504`` findings (see the class docstring)."""
        matrix = _matrix(context)
        if matrix is None:
            yield self.finding("OD504", "info", "no target given; opsets not checked against a matrix")
            return
        target = matrix.target
        used = _used_domains(model)
        for domain, version in opset_imports(model).items():
            if domain != "ai.onnx" and domain not in used:
                continue  # imported, no node uses it: ORT and OpenVINO load such a model (issue 16, 11 node tests)
            rng = matrix.opsets.get(domain)
            if rng is None:
                sources = sorted({r.source for r in matrix.opsets.values()})
                yield self.finding(
                    "OD502",
                    "error",
                    f"opset domain '{domain}' (version {version}) is not supported by target {target}",
                    nodes=[domain],
                    hint=f"Remove or replace the {domain} ops; {target} takes the domains {sorted(matrix.opsets)}.",
                    rule=f"{target} supports the opset domains {sorted(matrix.opsets)}",
                    source="; ".join(matrix.source_text(s) for s in sources),
                )
                continue
            if not rng.min <= version <= rng.max:
                pinned = min(max(version, rng.min), rng.max)
                yield self.finding(
                    "OD501",
                    "error",
                    f"{domain} opset {version} is outside {target}'s range {rng.min}..{rng.max}",
                    nodes=[domain],
                    hint=f"Add `pin_opset: {{opset: {pinned}}}` to the passes."
                    if domain == "ai.onnx"
                    else f"Re-export with {domain} opset within {rng.min}..{rng.max}.",
                    rule=f"{domain} opset within {rng.min}..{rng.max}",
                    source=matrix.source_text(rng.source),
                )
        ir = matrix.ir_version
        if ir is not None and not ir.min <= model.ir_version <= ir.max:
            yield self.finding(
                "OD503",
                "error",
                f"IR version {model.ir_version} is outside {target}'s range {ir.min}..{ir.max}",
                hint=f"Save the model with IR version <= {ir.max} (pin_opset to a lower opset lowers it too).",
                rule=f"IR version within {ir.min}..{ir.max}",
                source=matrix.source_text(ir.source),
            )


def _formal_params(entry: OpEntry, node: onnx.NodeProto, opset: int) -> tuple[list[str], list[str]]:
    """The type parameter of each formal input/output: from the entry, else from the op's ONNX schema."""
    if entry.inputs is not None and entry.outputs is not None:
        return entry.inputs, entry.outputs
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return [], []
    return [i.type_str for i in schema.inputs], [o.type_str for o in schema.outputs]


def _bind(formal: list[str], actual: list[str]) -> Iterator[tuple[str, str]]:
    """Pair each actual tensor name with its formal's type parameter (the last formal repeats: variadic)."""
    for index, name in enumerate(actual):
        if name and formal:
            yield formal[min(index, len(formal) - 1)], name


def _violations(
    entry: OpEntry, node: onnx.NodeProto, opset: int, types: Types, read_as: dict[str, str] | None = None
) -> list[tuple[str, str]]:
    """``(code, reason)`` for each constraint of ``entry`` the node breaks (empty: the entry takes the node).

    ``read_as`` maps element types to the one the target computes in instead (``Matrix.emulated_types``).
    """
    read_as = read_as or {}

    def dtype_of(tensor: str) -> str:
        name = dtype_name(types.elem[tensor])
        return read_as.get(name, name)

    problems: list[tuple[str, str]] = []
    if entry.types:
        ins, outs = _formal_params(entry, node, opset)
        for param, tensor in (*_bind(ins, list(node.input)), *_bind(outs, list(node.output))):
            allowed = entry.types.get(param)
            if allowed is None or tensor not in types.elem:
                continue
            dtype = dtype_of(tensor)
            if dtype not in allowed:
                problems.append(("OD512", f"'{tensor}' ({param}) is {dtype}; {param} allows {', '.join(allowed)}"))
    if entry.dtypes:
        for tensor in (*node.input, *node.output):
            if tensor and tensor in types.elem and dtype_of(tensor) not in entry.dtypes:
                problems.append(("OD512", f"'{tensor}' is {dtype_of(tensor)}; allowed: {', '.join(entry.dtypes)}"))
    if entry.attributes:
        for name, value in _attribute_values(node, opset, entry.attributes).items():
            if value not in entry.attributes[name]:
                problems.append(("OD513", f"attribute {name}={value!r}; allowed: {entry.attributes[name]}"))
    if "block_size_divides_axis" in entry.rules:
        problems += _partial_block(node, types)
    if "per_tensor_zero_points" in entry.rules:
        problems += _per_channel_zero_points(node, opset, types)
    if "constant_inputs" in entry.rules:
        for tensor in node.input[1:]:
            if tensor and tensor not in types.constants:
                problems.append(("OD518", f"'{tensor}' is not a constant (the target takes this input as one only)"))
    if entry.max_rank is not None:
        for tensor in (*node.input, *node.output):
            shape = types.dims.get(tensor)
            if tensor and shape is not None and len(shape) > entry.max_rank:
                problems.append(("OD514", f"'{tensor}' has rank {len(shape)} > {entry.max_rank}"))
    return problems


def _per_channel_zero_points(node: onnx.NodeProto, opset: int, types: Types) -> list[tuple[str, str]]:
    """``OD518`` for each input whose formal name ends in ``zero_point`` and holds more than one element."""
    try:
        formals = [f.name for f in onnx.defs.get_schema(node.op_type, opset, node.domain).inputs]
    except onnx.defs.SchemaError:
        return []
    problems = []
    for formal, tensor in zip(formals, node.input, strict=False):
        dims = types.dims.get(tensor) if tensor else None
        if formal.endswith("zero_point") and dims and all(isinstance(d, int) for d in dims) and math.prod(dims) > 1:
            problems.append(
                ("OD518", f"'{tensor}' ({formal}) has {math.prod(dims)} elements; only per-tensor is taken")
            )
    return problems


def _attribute_values(node: onnx.NodeProto, opset: int, names) -> dict[str, object]:
    """The node's values of the attributes ``names``: set on the node, else the op schema's default (if any)."""
    values: dict[str, object] = {}
    for attr in node.attribute:
        if attr.name in names:
            value = onnx.helper.get_attribute_value(attr)
            values[attr.name] = value.decode() if isinstance(value, bytes) else value
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return values
    for name in names:
        default = schema.attributes.get(name)
        if name not in values and default is not None and default.default_value.type != 0:
            value = onnx.helper.get_attribute_value(default.default_value)
            values[name] = value.decode() if isinstance(value, bytes) else value
    return values


def _partial_block(node: onnx.NodeProto, types: Types) -> list[tuple[str, str]]:
    """``OD518`` when a blocked DequantizeLinear's input dim on ``axis`` is not a multiple of ``block_size``.

    ONNX allows a partial last block (Operators.md, DequantizeLinear-21: the scale's dim on ``axis`` is
    ``ceil(D / block_size)``); a target whose entry carries ``block_size_divides_axis`` refuses it.
    """
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    block, axis = int(attrs.get("block_size", 0)), int(attrs.get("axis", 1))
    dims = types.dims.get(node.input[0]) if node.input else None
    if block <= 0 or not dims or not -len(dims) <= axis < len(dims):
        return []
    dim = dims[axis]
    if not isinstance(dim, int) or dim % block == 0:
        return []
    return [
        (
            "OD518",
            f"'{node.input[0]}' has {dim} on axis {axis}, not a multiple of block_size {block} (a partial last block "
            f"of {dim % block})",
        )
    ]


def _emulated_type(
    matrix: Matrix, entries: list[OpEntry], node: onnx.NodeProto, opset: int, types: Types
) -> str | None:
    """The emulated element type that lets an entry take the node, else None.

    A type of ``matrix.emulated_types`` the node has a tensor of, read as the type the target computes it in.
    """
    present = {dtype_name(types.elem[t]) for t in (*node.input, *node.output) if t in types.elem}
    for dtype in sorted(set(matrix.emulated_types) & present):
        read_as = {dtype: matrix.emulated_types[dtype].computes_in}
        if any(not _violations(entry, node, opset, types, read_as) for entry in entries):
            return dtype
    return None


_BATCH_ONE = re.compile(r"batch ?size: ?1", re.IGNORECASE)
"""A constraint in words about the batch only (rknn-rk3588's 'batchsize: 1' on Softmax, Slice, Tile, ...)."""


def _static_batch_one(model: onnx.ModelProto) -> bool:
    """Whether the graph's batch dim is static 1: dim 0 of every fed input of rank >= 2 is 1.

    ``input_ids`` ``(B, S)``, ``attention_mask`` ``(B, L)``, ``past_key_values.{i}.key`` ``(B, H, L, D)`` and a
    part's hidden state ``(B, S, hidden)`` all lead with the batch; rank-1 inputs (``cache_position``) do not.
    """
    fed = {t.name for t in model.graph.initializer}
    dims = [value_type(v.type).dims for v in model.graph.input if v.name not in fed]
    leading = [d[0] for d in dims if d is not None and len(d) >= 2]
    return bool(leading) and all(d == 1 for d in leading)


def _pin_hint(matrix: Matrix, domain: str, op: str, opset: int) -> str:
    """``pin_opset: {opset: N}`` for the nearest opset in the target's range where an entry covers ``op``."""
    rng = matrix.opsets.get(domain)
    if rng is None or domain != "ai.onnx":
        return ""
    for candidate in sorted(range(rng.min, rng.max + 1), key=lambda v: (abs(v - opset), -v)):
        version = schema_version_of(domain, op, candidate)
        if version is not None and matrix.ops_for(domain, op, version):
            return f"`pin_opset: {{opset: {candidate}}}` ({op} is supported at schema version {version})"
    return ""


@register_check
class TargetOpsCheck(Check):
    """Every node's op is supported by the target at the op's schema version, within the entry's constraints.

    The schema version is the ``since_version`` of the op's ONNX definition that the model's opset selects
    (``onnx.defs.get_schema``), as ONNX Runtime registers kernels. One finding per node, the nodes of one op type
    that share a message, fix, rule and source merged into one naming them all (``checks._graph.group_per_op``):

    - ``OD510`` error: the op (at this schema version) is not in a complete operator list, or its domain is
      not supported; the hint names the pass that removes the op, or the ``pin_opset`` that reaches a
      supported version;
    - ``OD511`` warning: the target's sourced list is partial and does not name the op (unknown, not no);
    - ``OD512`` error: an input/output dtype outside the entry's type constraint (e.g. ``Add`` on uint16
      at opset 13 on ORT CPU);
    - ``OD513`` error: an attribute value the entry does not accept;
    - ``OD514`` error: a tensor rank above the entry's ``max_rank``;
    - ``OD515`` warning: the op is accepted but has no accelerator lowering (runs on the host CPU);
    - ``OD516`` info: per op type, constraints stated in words by the source, with the nodes they concern (a
      ``batchsize: 1`` constraint is left out when every fed input's batch dim, dim 0 of rank >= 2, is static 1);
    - ``OD517`` warning: per op type and element type, nodes no entry takes in that type but one takes once the
      type is read as the one the target computes in instead (``Matrix.emulated_types``: ORT's CPU EP casts a
      float16 node without a float16 kernel to float32); other targets keep ``OD512``;
    - ``OD518`` error: a named rule of the entry broken (``block_size_divides_axis``: a blocked DequantizeLinear
      whose weight dim on ``axis`` is not a multiple of ``block_size``, which OpenVINO's CPU plugin refuses;
      ``constant_inputs``: an input after the first that is not a constant, as OpenVINO compiles Unsqueeze-13;
      ``per_tensor_zero_points``: a zero point of more than one element, which ORT's CPU ConvInteger fails on).

    An entry with ``opset_max`` below the model's opset of the op's domain does not take the node (ORT expands a
    function body at the model's opset; Swish-24 is refused at opset 25 and later).
    """

    name = "target_ops"
    description = "Each node's op, schema version, dtypes, attributes and rank against the target's operator list."
    codes = {
        "OD510": "error: an op the target does not support (at this schema version).",
        "OD511": "warning: an op the target's partial list does not name (support unknown).",
        "OD512": "error: a dtype outside the target's type constraint for the op.",
        "OD513": "error: an attribute value the target does not accept for the op.",
        "OD514": "error: a tensor rank above the target's limit for the op.",
        "OD515": "warning: the op runs on the host CPU (no accelerator lowering).",
        "OD516": "info: constraints stated in words for an op (not machine-checked).",
        "OD517": "warning: no kernel for the op in this dtype; the target converts it and computes in another.",
        "OD518": "error: a rule of the target's entry broken (a partial quantization block; a non-constant input).",
    }

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        """Yield ``OD510``-``OD516`` findings (see the class docstring); nothing without a target."""
        matrix = _matrix(context)
        if matrix is None:
            return
        opsets = opset_imports(model)
        _, types = value_types(model)
        worded: dict[tuple[str, str], list[str]] = defaultdict(list)
        worded_entry: dict[tuple[str, str], list[str]] = {}
        emulated: dict[tuple[str, str], list[str]] = defaultdict(list)
        per_node: list[Finding] = []
        batch_one = _static_batch_one(model)
        for graph, scope in iter_graphs(model.graph):
            for index, node in enumerate(graph.node):
                ref = f"{scope}{node_ref(node, index)}"
                finding, entry = self._node(matrix, node, ref, opsets, types, emulated)
                if finding is not None:
                    per_node.append(finding)
                words = [c for c in entry.constraints if not (batch_one and _BATCH_ONE.fullmatch(c))] if entry else []
                if entry is not None and words:
                    worded[(node.op_type, entry.source)].append(ref)
                    worded_entry[(node.op_type, entry.source)] = words
        yield from group_per_op(per_node)  # OD510 & co: one per op type and message, not one per node
        for (op, source), refs in worded.items():
            words = worded_entry[(op, source)]
            listed = list_names(refs)
            yield self.finding(
                "OD516",
                "info",
                f"{len(refs)} {op} node(s) must meet constraints {matrix.target} states in words: "
                f"{'; '.join(words)} ({listed})",
                nodes=refs,
                rule=f"{op}: {'; '.join(words)}",
                source=matrix.source_text(source),
            )
        for (op, dtype), refs in emulated.items():
            how = matrix.emulated_types[dtype]
            listed = list_names(refs)
            yield self.finding(
                "OD517",
                "warning",
                f"{len(refs)} {op} node(s) have no {dtype} kernel on {matrix.target}: {how.how} ({listed})",
                nodes=refs,
                hint=f"Runs as it is; a model in {how.computes_in} avoids the conversions on {matrix.target}.",
                rule=f"{dtype} on an op without a {dtype} kernel runs as {how.computes_in}",
                source=matrix.source_text(how.source),
            )

    def _node(
        self,
        matrix: Matrix,
        node: onnx.NodeProto,
        ref: str,
        opsets: dict[str, int],
        types: Types,
        emulated: dict[tuple[str, str], list[str]],
    ) -> tuple[Finding | None, OpEntry | None]:
        """The node's finding (None when taken) and the entry that takes it.

        A node no entry takes as it is, but one takes with an element type of ``Matrix.emulated_types`` read as the
        type the target computes in, gets no finding of its own: its ref goes to ``emulated[(op, dtype)]``.
        """
        domain = _domain(node.domain)
        opset = opsets.get(domain)
        label = f"node {ref} ({domain}::{node.op_type})" if domain != "ai.onnx" else f"node {ref} ({node.op_type})"
        if matrix.opsets.get(domain) is None or opset is None:
            return self._unsupported_domain(matrix, node, ref, label, domain), None
        version = schema_version_of(domain, node.op_type, opset)
        if version is None and domain == "ai.onnx":
            version = opset  # an op onnx does not know at this opset: the checker reports it; match by opset
        entries = matrix.ops_for(domain, node.op_type, version if version is not None else opset)
        entries = [e for e in entries if e.opset_max is None or opset <= e.opset_max]
        if not entries:
            return self._missing(matrix, node, ref, label, domain, opset, version), None
        best: list[tuple[str, str]] | None = None
        for entry in entries:
            problems = _violations(entry, node, opset, types)
            if not problems:
                return (
                    self._on_host(matrix, node, ref, label, entry) if entry.placement == "cpu_fallback" else None
                ), entry
            if best is None or len(problems) < len(best):
                best, chosen = problems, entry
        assert best is not None
        dtype = _emulated_type(matrix, entries, node, opset, types)
        if dtype is not None:
            emulated[(node.op_type, dtype)].append(ref)
            return None, None
        return self._violated(matrix, node, ref, f"{label} at schema version {version}", best, chosen), None

    def _unsupported_domain(self, matrix: Matrix, node: onnx.NodeProto, ref: str, label: str, domain: str) -> Finding:
        """``OD510`` for a node whose domain the target does not take (or the model does not import)."""
        sources = sorted({r.source for r in matrix.opsets.values()})
        return self.finding(
            "OD510",
            "error",
            f"{label}: domain {domain} is not supported by {matrix.target}",
            nodes=[ref],
            hint=fix_hint(node.op_type) or f"Replace the {domain} op with standard ONNX ops.",
            rule=f"{matrix.target} supports the op domains {sorted(matrix.opsets)}",
            source="; ".join(matrix.source_text(s) for s in sources),
        )

    def _on_host(self, matrix: Matrix, node: onnx.NodeProto, ref: str, label: str, entry: OpEntry) -> Finding:
        """``OD515`` for a node the target takes on its host CPU only (``placement: cpu_fallback``)."""
        return self.finding(
            "OD515",
            "warning",
            f"{label} has no accelerator lowering on {matrix.target}: it runs on the host CPU",
            nodes=[ref],
            hint=fix_hint(node.op_type),
            rule=f"{node.op_type}: placement cpu_fallback",
            source=matrix.source_text(entry.source),
        )

    def _violated(
        self,
        matrix: Matrix,
        node: onnx.NodeProto,
        ref: str,
        where: str,
        problems: list[tuple[str, str]],
        entry: OpEntry,
    ) -> Finding:
        """``OD512``-``OD514`` for the constraints of ``entry`` (the closest entry) the node breaks."""
        span = f"{entry.since}..{entry.until or '∞'}"
        return self.finding(
            problems[0][0],
            "error",
            f"{where}: " + "; ".join(reason for _, reason in problems),
            nodes=[ref],
            hint=(
                "Choose a quantize_weights block_size that divides the weight's K, or pad K to a multiple of it."
                if problems[0][0] == "OD518" and "block_size_divides_axis" in entry.rules
                else "Make the input a constant (an initializer) in the export."
                if problems[0][0] == "OD518" and "constant_inputs" in entry.rules
                else "Quantize that input per tensor (one zero point)."
                if problems[0][0] == "OD518"
                else fix_hint(node.op_type) or "Insert Casts to a supported dtype, or change the exporter's dtype."
            ),
            rule=f"{node.op_type} (schema versions {span}) constraints: "
            + ", ".join(f"{p}: {'|'.join(v)}" for p, v in (entry.types or {}).items())
            + (f" dtypes {entry.dtypes}" if entry.dtypes else "")
            + (f" attributes {entry.attributes}" if entry.attributes else "")
            + (f" max_rank {entry.max_rank}" if entry.max_rank is not None else "")
            + (f" rules {entry.rules}" if entry.rules else ""),
            source=matrix.source_text(entry.source),
        )

    def _missing(
        self, matrix: Matrix, node: onnx.NodeProto, ref: str, label: str, domain: str, opset: int, version: int | None
    ) -> Finding:
        target = matrix.target
        at = f" at schema version {version} ({domain} opset {opset})" if version is not None else ""
        others = matrix.ops_for(domain, node.op_type)
        hints = [h for h in (fix_hint(node.op_type), _pin_hint(matrix, domain, node.op_type, opset)) if h]
        listing = Counter(e.source for e in matrix.ops if e.domain == domain).most_common(1)  # the op list's source
        sources = sorted({e.source for e in others} or {s for s, _ in listing})
        if others:
            spans = ", ".join(
                f"{e.since}..{e.until or '∞'}" + (f" at {domain} opset <= {e.opset_max}" if e.opset_max else "")
                for e in others
            )
            rule = f"{node.op_type} supported for schema versions {spans}"
        else:
            rule = f"{node.op_type} is not in {target}'s operator list"
        if matrix.ops_complete or others:
            return self.finding(
                "OD510",
                "error",
                f"{label} is not supported by {target}{at}",
                nodes=[ref],
                hint=" or ".join(hints)
                or _PASS_MADE.get(
                    node.op_type, f"No onnxdeploy pass removes {node.op_type}; replace it in the export."
                ),
                rule=rule,
                source="; ".join(matrix.source_text(s) for s in sources),
            )
        return self.finding(
            "OD511",
            "warning",
            f"{label}: {target}'s sourced operator list is partial and does not name {node.op_type}{at}",
            nodes=[ref],
            hint=" or ".join(hints) or "Compile on the device to know; see the matrix file's gaps.",
            rule=f"{node.op_type} not in the sourced (partial) list",
            source="; ".join(matrix.source_text(s) for s in sources),
        )


def predict_supported(model: onnx.ModelProto, target: str) -> tuple[bool, list[Finding]]:
    """Predict from the matrix alone whether ``target`` takes ``model``.

    Args:
        model: the model (a header without weights is enough).
        target: a target id of ``matrices/``.

    Returns:
        ``(accepted, errors)``: accepted when the target checks give no error finding; the errors otherwise.

    Raises:
        ConfigError: unknown target.
    """
    if not target:
        raise ConfigError("predict_supported needs a target")
    context = CheckContext(target=target)
    errors = [
        f
        for cls in (TargetOpsetCheck, TargetOpsCheck, TargetTensorsCheck)
        for f in cls().run(model, context)
        if f.level == "error" and f.code not in ("OD520", "OD521")
    ]
    return not errors, errors
