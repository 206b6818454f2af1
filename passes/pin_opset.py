"""``pin_opset``: convert ``ai.onnx`` to a target opset and the IR version with it (raised or lowered).

The target is 11 up to the newest opset the installed onnx knows (28 with onnx 1.23.2; ONNX Runtime 1.32 runs
28), checked when the config is read.

Uses ``onnx.version_converter.convert_version`` (onnx docs, "Version Converter") on a weightless copy, with
what onnx 1.23 lacks done on onnx_ir around it: ops that do not exist at the target but have an ONNX function
definition (``LayerNormalization`` below 17; ``RMSNormalization``, ``RotaryEmbedding``, ``Attention`` below
23; ``LessOrEqual`` below 16) are expanded into their function body first
(:mod:`onnxdeploy.passes._opset_functions`); nodes the converter has no adapter for (``Split``-18, ``Pow``-15,
``Shape``-15, ``Identity``-16, the -14 arithmetic ops, ``CastLike``, ``Trilu``, Reduce* ``axes``, any
version that only added types) or a wrong one for (``Softmax``-13 → 12 on a non-last axis) are held out of
it and rewritten exactly afterwards (:mod:`onnxdeploy.passes._opset_adapters`); empty tensors the bodies
leave are folded away. The IR version becomes the lowest the result needs (opset 17 → IR 8, 11 → IR 7).
Other domains (``com.microsoft``, …) are kept and listed in the report; default-domain ops onnx has no
schema for (ORT's ``SimplifiedLayerNormalization``) are kept as they are. Where no exact lowering exists
the error names op, node and lowest reachable opset.
"""

from __future__ import annotations

import re

import onnx
import onnx_ir as ir
from onnx import version_converter

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.errors import PassError
from onnxdeploy.graph import default_opset
from onnxdeploy.model_io import proto_round_trip, stand_in_proto
from onnxdeploy.passes._catalog import PinOpsetConfig
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import clone, fold_constants, infer_shapes
from onnxdeploy.passes._opset_adapters import hold_nodes, name_created_nodes, refuse_unraisable, restore_held
from onnxdeploy.passes._opset_functions import expand_function_ops, fold_empty_tensors, function_ops_to_expand
from onnxdeploy.passes._opset_proof import prove_conversion, why_not_proven
from onnxdeploy.passes._opset_schemas import DEFAULT_DOMAINS, node_label, schema_at, since_version
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.report import PassReport

__all__ = ["PinOpsetConfig", "PinOpsetPass"]


def _ops_needing_adapter(model: ir.Model, current: int, target: int) -> list[tuple[str, int]]:
    """Ops of the default domain whose schema changes between ``current`` and ``target``: (op, since_version)."""
    lo, hi = sorted((current, target))
    found = {}
    for node in model.graph:
        if node.domain not in DEFAULT_DOMAINS or node.op_type in found:
            continue
        since = since_version(node.op_type, current)
        if since is None:
            continue
        if target < current and since > target:
            found[node.op_type] = since
        elif target > current:
            newer = since_version(node.op_type, hi)
            if newer is not None and newer > lo and newer != since:
                found[node.op_type] = since
    return sorted(found.items())


@register_pass
class PinOpsetPass(Pass):
    """Convert the default (``ai.onnx``) domain to ``opset``; other domains are kept as they are.

    Functional (``in_place = False``): the converter runs on a weightless copy of each graph
    (:func:`onnxdeploy.model_io.proto_round_trip`: initializers above 1 KiB are typed stand-ins), and the
    converted graphs hold the same weight tensors, so its cost does not grow with weight bytes.

    Raises:
        PassError: the version converter cannot convert an op, or an op has no exact form at the target (the
            message names the op, the node and the lowest opset it can reach).
    """

    name = "pin_opset"
    config_model = PinOpsetConfig
    config: PinOpsetConfig
    in_place = False

    def output_opset(self, opset: int | None) -> int | None:
        """The configured ``opset``, whatever the input's."""
        return self.config.opset

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Convert every graph of the set, then prove each conversion (``prove``); see the class docstring."""
        converted = [self._convert(model, report) for model in artifacts.models()]
        if not any(changed for _, changed in converted):
            return artifacts, False
        if self.config.prove:
            for before, (after, changed) in zip(artifacts.models(), converted, strict=True):
                if changed:
                    self._prove(before, after, context, report)
        return artifacts.with_models([model for model, _ in converted]), True

    def _prove(self, before: ir.Model, after: ir.Model, context: PassContext, report: PassReport) -> None:
        """Run :func:`~onnxdeploy.passes._opset_proof.prove_conversion` unless the graph is exempt; report it."""
        skip = why_not_proven(before)
        pair = f"ai.onnx opset {default_opset(before)} to {self.config.opset}"
        if skip is not None:
            report.changes.append(f"conversion not proven on ORT: {skip}")
            return
        proof = prove_conversion(before, after, context, pair)
        (report.changes if proof.proven else report.warnings).append(proof.line)

    def _convert(self, model: ir.Model, report: PassReport) -> tuple[ir.Model, bool]:
        """Convert one graph; a refusal from any step is prefixed with the opset pair.

        Raises:
            PassError: a node has no exact form at the target or onnx's converter cannot convert it.
        """
        current = default_opset(model)
        try:
            converted, changed = self._convert_one(model, current, report)
            if changed:
                check_schemas(converted, f"ai.onnx opset {current} to {self.config.opset}")
            return converted, changed
        except PassError as exc:
            if exc.detail.startswith("converting "):
                raise
            pair = f"ai.onnx opset {current} to {self.config.opset}"
            raise PassError(self.name, f"converting {pair}: {exc.detail}") from exc

    def _convert_one(self, model: ir.Model, current: int, report: PassReport) -> tuple[ir.Model, bool]:
        target = self.config.opset
        others = {d: v for d, v in model.opset_imports.items() if d not in DEFAULT_DOMAINS}
        if others:
            report.warnings.append(f"domains kept unconverted: {others}")
        if current == target:
            report.changes.append(f"ai.onnx already at opset {target}")
            return model, False
        refuse_unraisable(model, current, target)
        pending = _ops_needing_adapter(model, current, target)
        work = _expanded_copy(model, current, target, report)
        known = {v.name: (v.dtype, v.shape) for v in _values(work)}
        unnamed = {n.outputs[0].name for n in work.graph if not n.name and n.outputs}  # the input's own
        held = hold_nodes(work, current, target)
        if held:
            report.changes.append("held from onnx's converter: " + ", ".join(f"{op} x{n}" for op, n in held.items()))
        converted = self._run_converter(work, model, current, pending)
        _restore_known_types(converted, known)
        report.changes.append(f"ai.onnx opset {current} -> {target}")
        report.changes += restore_held(converted, current, target)
        converted.opset_imports[""] = target
        _tidy(converted, unnamed, target, report)
        ir_version = required_ir_version(converted)
        if converted.ir_version != ir_version:
            report.changes.append(f"IR version {converted.ir_version} -> {ir_version} (what opset {target} needs)")
            converted.ir_version = ir_version
        if pending:
            report.changes.append("ops converted: " + ", ".join(f"{op}-{since}" for op, since in pending))
        return converted, True

    def _run_converter(self, work: ir.Model, model: ir.Model, current: int, pending: list[tuple[str, int]]) -> ir.Model:
        """Run onnx's version converter on a weightless copy of ``work``; a failure names the op and nodes.

        Raises:
            PassError: the converter failed (names the op it is about, when one can be told, and its nodes in
                ``model``).
        """
        target = self.config.opset
        try:
            return proto_round_trip(work, lambda proto: version_converter.convert_version(proto, target))
        except Exception as exc:  # the converter raises RuntimeError/ValueError/InferenceError
            text = str(exc)
            op = _op_from_message(text, [p[0] for p in pending])
            since = dict(pending).get(op) if op else None
            nodes = [node_label(n) for n in model.graph if op and n.op_type == op]
            where = f"{op}-{since} {nodes[0]}" if op and nodes else (f"{op}-{since}" if op else "a node")
            more = f" (and {len(nodes) - 1} more {op} node(s))" if len(nodes) > 1 else ""
            raise PassError(
                self.name,
                f"converting ai.onnx opset {current} to {target}: {where}{more} has no exact form at opset {target}: "
                f"onnx {onnx.__version__}'s version converter cannot convert it ({_converter_reason(text, exc)})",
            ) from exc

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """The default domain is at the target opset (the schemas were checked as each graph was converted)."""
        for model in artifacts.models():
            if default_opset(model) != self.config.opset:
                raise PassError(self.name, f"ai.onnx opset is {default_opset(model)}, expected {self.config.opset}")


def check_schemas(model: ir.Model, pair: str) -> None:
    """Onnx's checker with full shape inference (``check_model(full_check=True)``) on a weightless copy.

    Default-domain ops onnx has no schema for (ORT's ``SimplifiedLayerNormalization``) are moved to a private
    domain first: the checker does not know them.

    Raises:
        PassError: the converted graph fails the checker (names the pair and the checker's first lines).
    """
    proto = stand_in_proto(model, as_inputs=True)
    foreign = {n.op_type for n in proto.graph.node if n.domain in DEFAULT_DOMAINS and _no_schema(n.op_type)}
    for node in proto.graph.node:
        if node.op_type in foreign and node.domain in DEFAULT_DOMAINS:
            node.domain = "onnxdeploy.foreign"
    if foreign:
        proto.opset_import.append(onnx.helper.make_opsetid("onnxdeploy.foreign", 1))
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # ValidationError, InferenceError (full shape inference)
        raise PassError(
            "pin_opset",
            f"converting {pair}: a node of the converted graph has no valid form at the target (onnx's checker "
            f"with full shape inference: {_first_line(exc)}); nothing written",
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join(text.splitlines()[:2])[:400] if text else type(exc).__name__


def _converter_reason(text: str, exc: BaseException) -> str:
    """The reason of a version-converter error without its C++ file, line and assertion text."""
    last = text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
    return re.sub(r"^.*?(Assertion `.*?` failed: |\.h:\d+: \w+: )", "", last).strip()[:300]


def _no_schema(op: str) -> bool:
    return schema_at(op, onnx.defs.onnx_opset_version()) is None


def _values(model: ir.Model) -> list[ir.Value]:
    graph = model.graph
    return [*graph.inputs, *(v for node in graph for v in node.outputs)]


def _expanded_copy(model: ir.Model, current: int, target: int, report: PassReport) -> ir.Model:
    """A copy of ``model`` (same weights) with its shapes inferred and its function ops expanded for ``target``."""
    work = clone(model)
    infer_shapes(work)
    expand = function_ops_to_expand(work, current, target)
    if expand:
        report.changes += expand_function_ops(work, expand, current, fold_constants)
        infer_shapes(work)
    return work


def _restore_known_types(converted: ir.Model, known: dict[str, tuple]) -> None:
    """Give the converter's values the dtypes and shapes they had before it where it left them unknown."""
    for value in _values(converted):
        dtype, shape = known.get(value.name, (None, None))
        if value.dtype is None and dtype is not None:
            value.dtype = dtype
        if value.shape is None and shape is not None:
            value.shape = shape


def _tidy(converted: ir.Model, unnamed: set[str], target: int, report: PassReport) -> None:
    """After the converter: fold empty tensors, name the nodes it made, drop attributes it left stale."""
    folded = fold_empty_tensors(converted)
    if folded:
        report.changes.append(f"removed {folded} empty tensor(s)/split(s)")
    named = name_created_nodes(converted, unnamed, target)
    if named:
        report.changes.append(
            f"named {len(named)} node(s) onnx's converter made without a name: "
            + ", ".join(named[:5])
            + (" …" if len(named) > 5 else "")
        )
    repaired = _drop_stale_noop_with_empty_axes(converted, target)
    if repaired:
        report.changes.append(
            f"removed noop_with_empty_axes (not in the target schema) from {len(repaired)} Reduce node(s) "
            "the converter lowered: " + ", ".join(repaired[:5]) + (" …" if len(repaired) > 5 else "")
        )


_IR_FOR_DTYPE = {
    **dict.fromkeys(("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ"), 9),
    **dict.fromkeys(("UINT4", "INT4"), 10),
    **dict.fromkeys(("FLOAT4E2M1",), 11),
}
"""Element types newer than IR 8 and the IR version that introduced them (onnx ``docs/IR.md``, "Versioning")."""


def required_ir_version(model: ir.Model) -> int:
    """The lowest IR version that can hold ``model``: what its opset imports and its tensor dtypes need.

    onnx's ``helper.find_min_ir_version_for`` maps opset imports to IR versions (opset 17 -> IR 8,
    21 -> IR 10, 23 -> IR 11); float8 needs IR 9, 4-bit integers IR 10 (onnx ``docs/IR.md``). Never below 7
    (the lowest IR version a current ONNX Runtime loads).
    """
    imports = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    needed = max(7, onnx.helper.find_min_ir_version_for(imports, ignore_unknown=True))
    for value in _values(model) + list(model.graph.initializers.values()):
        if value.dtype is not None:
            needed = max(needed, _IR_FOR_DTYPE.get(value.dtype.name, 0))
    return needed


def _drop_stale_noop_with_empty_axes(model: ir.Model, target: int) -> list[str]:
    """Remove ``noop_with_empty_axes`` from Reduce nodes whose target-opset schema lacks it; return node names.

    onnx's version converter (1.17–1.23) moves ``axes`` from input to attribute when lowering the
    Reduce* ops below opset 18 (ReduceSum below 13) but keeps ``noop_with_empty_axes``, which those
    schemas do not have, so the checker rejects the model. With ``axes`` given, or with the flag at its
    default 0, dropping it keeps the meaning (ONNX Operators.md, ReduceMean-13 vs -18).

    Raises:
        PassError: a node sets ``noop_with_empty_axes=1`` with no ``axes``: reducing nothing cannot be
            expressed in the older schema.
    """
    fixed = []
    for i, node in enumerate(model.graph):
        if node.domain not in DEFAULT_DOMAINS or not node.op_type.startswith("Reduce"):
            continue
        schema = schema_at(node.op_type, target)
        if schema is None or "noop_with_empty_axes" in schema.attributes:
            continue
        flag = node.attributes.get("noop_with_empty_axes")
        if flag is None:
            continue
        axes = node.attributes.get("axes")
        if flag.as_int() == 1 and not (axes is not None and list(axes.as_ints())):
            raise PassError(
                "pin_opset",
                f"{node.op_type} node '{node.name or i}' has noop_with_empty_axes=1 and no axes, which opset "
                f"{target} cannot express",
            )
        node.attributes.pop("noop_with_empty_axes")
        fixed.append(node.name or f"#{i}")
    return fixed


def _op_from_message(text: str, pending: list[str]) -> str | None:
    """Pick the op a version-converter error is about: a pending op named in the message, else the first."""
    for op in pending:
        if re.search(rf"\b{re.escape(op)}\b", text):
            return op
    return pending[0] if len(pending) == 1 else None
