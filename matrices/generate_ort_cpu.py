"""Regenerate ``matrices/ort-cpu.yaml`` from the installed ONNX Runtime's own kernel registry.

Run ``python -m onnxdeploy.matrices.generate_ort_cpu [--output PATH]`` after upgrading onnxruntime. What it
reads, all from the installed wheel:

- ``onnxruntime.capi.onnxruntime_pybind11_state.get_all_opkernel_def()``: every registered kernel (op, domain,
  schema version range, type constraints, provider); the CPU wheel registers CPUExecutionProvider kernels only;
- ``get_all_operator_schema()``: ORT's own op schemas (every version), for each kernel's formal inputs/outputs
  and their type parameters, and the highest opset per domain ORT knows;
- probes: a one-node model per IR version opened in a session, so the IR range is what this ORT accepts; a
  float16 and a bfloat16 ``MatMul`` (no CPU kernel takes either) opened with graph optimizations off, so
  ``emulated_types`` lists the type ORT casts to float around such a node (``InsertCastTransformer``: float16).

Each kernel is recorded with the schema versions ORT really matches it at. ORT's
``KernelRegistry::VerifyKernelDef`` (onnxruntime/core/framework/kernel_registry.cc, main at 05f47fa0) takes a
kernel registered for ``since..until`` when the node's schema ``since_version`` lies in that range, but a kernel
registered open-ended (``since`` only, ``version_range`` end ``INT_MAX``) *only* when the node's schema version
equals ``since`` ("we will temporary require kernel definition to have the same since version as schema
definition"). So an open-ended ``DequantizeLinear`` kernel since 25 is written ``since: 25, until: 25``: at opset
28 the node's schema version is 28 and ORT refuses it ("Could not find an implementation for
DequantizeLinear(28)", probed on 1.32).

ONNX ops with no kernel at a schema version but an ONNX function body there (``onnx.defs`` ``has_function`` or
``has_context_dependent_function``) are inlined by ORT at load (``Node::CanBeInlined``; e.g. ``ReduceLogSum-28``);
they are listed with ``via: function`` and the types of their schema (the body's own ops decide in the end).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections import defaultdict
from pathlib import Path

import onnx
import onnxruntime as ort
import yaml
from onnx import TensorProto, helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from onnxdeploy.matrices._ort_probes import opset_reach, probe_attributes, probe_zero_points
from onnxdeploy.matrices._probe_models import PLANS, SequentialProber, probe_model, probe_op
from onnxdeploy.matrices.schema import Matrix

__all__ = ["build_matrix", "main", "probe_max_ir_version", "probe_type_emulation"]

_OPEN_ENDED = 2**31 - 1
"""ORT's ``version_range`` end for a kernel that covers every later version."""

_PROVIDER = "CPUExecutionProvider"
_OPSET_MIN = 7
"""ORT's stated floor: 'ONNX Runtime only *guarantees* support for models stamped with opset version 7 or above'
(the warning ``model.cc`` prints for lower opsets; docs/Versioning.md, 'Backwards compatibility')."""


def _domain(name: str) -> str:
    return name or "ai.onnx"


def _tensor_type(type_str: str) -> str:
    """``tensor(float)`` -> ``float``; other type strings (``seq(tensor(float))``) unchanged."""
    return type_str[len("tensor(") : -1] if type_str.startswith("tensor(") and type_str.endswith(")") else type_str


def _opens(model: onnx.ModelProto, *, optimize: bool = True) -> bool:
    """Whether ORT's CPU EP creates a session for ``model`` (quietly; graph optimizations off with ``optimize=False``).

    Any refusal counts as "not accepted": ORT raises several unrelated exception types for it.
    """
    return _open_error(model, optimize=optimize) is None


def _open_error(model: onnx.ModelProto | None, *, optimize: bool = True) -> str | None:
    """ORT's message refusing ``model`` (None: the session opened); ``"no model"`` for a probe not built."""
    if model is None:
        return "no model"
    options = ort.SessionOptions()
    options.log_severity_level = 4
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=[_PROVIDER])
    except Exception as exc:  # noqa: BLE001 - any refusal means "not accepted"
        return str(exc) or exc.__class__.__name__
    return None


def _runs(model: onnx.ModelProto, feeds: dict) -> bool:
    """Whether ORT's CPU EP opens ``model`` and runs it once on ``feeds`` (any error: False)."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=[_PROVIDER]).run(None, feeds)
    except Exception:  # noqa: BLE001 - any refusal or run error
        return False
    return True


_NO_KERNEL = "Could not find an implementation"
"""ORT's refusal of a node it has no kernel for and cannot inline (inference_session / graph partitioner)."""


def _session_opens(opset: int, ir_version: int, *, constant: bool = False) -> bool:
    """Whether ORT opens a one-node model (Identity, or Constant) at ``ai.onnx`` ``opset`` and IR ``ir_version``."""
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    if constant:
        value = helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])
        graph = helper.make_graph([helper.make_node("Constant", [], ["y"], value=value)], "probe", [], [y])
    else:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return _opens(model)


def probe_min_opset() -> int:
    """The lowest ``ai.onnx`` opset at which ORT opens a one-node Identity model.

    Below its stated floor of 7 ORT warns "may run depending upon legacy support" and still loads the kernels
    it has.
    """
    for opset in range(1, _OPSET_MIN + 1):
        if _session_opens(opset, 8):
            return opset
    return _OPSET_MIN


def probe_max_ir_version(opset: int = 18) -> int:
    """Return the highest IR version the installed ORT opens (probing upward from IR 8)."""
    best = 0
    for ir_version in range(8, onnx.IR_VERSION + 4):
        if not _session_opens(opset, ir_version):
            break
        best = ir_version
    return best


_INSERT_CAST = (
    "https://github.com/microsoft/onnxruntime/blob/05f47fa0aa39c517a7071462444d6649a9ef171d/"
    "onnxruntime/core/optimizer/insert_cast_transformer.cc"
)
_EMULATION_PROBE_OP = "MatMul"
"""An op with float CPU kernels and neither a float16 nor a bfloat16 one (checked against the registry)."""


def probe_type_emulation() -> dict[str, dict]:
    """The element types ORT's CPU EP runs through float on ops with no kernel for them, as ``emulated_types``.

    ORT's ``InsertCastTransformer`` (onnxruntime/core/optimizer/insert_cast_transformer.cc, ``NeedInsertCast``:
    a float16 input of a node no EP took) inserts Casts to float around such a node after partitioning, at every
    optimization level (``inference_session.cc``, ``TransformGraph``); bfloat16 gets no such Casts. Probed here:
    a one-node ``MatMul`` in each type is opened with graph optimizations off.

    Raises:
        RuntimeError: the registry now has a float16 or bfloat16 ``MatMul`` CPU kernel (pick another probe op).
    """
    registered = {
        _tensor_type(t)
        for k in ort_state.get_all_opkernel_def()
        if k.provider == _PROVIDER and k.op_name == _EMULATION_PROBE_OP and not k.domain
        for allowed in k.type_constraints.values()
        for t in allowed
    }
    found = {}
    for name, elem in (("float16", TensorProto.FLOAT16), ("bfloat16", TensorProto.BFLOAT16)):
        if name in registered:
            raise RuntimeError(f"ORT now has a {name} {_EMULATION_PROBE_OP} CPU kernel: choose another probe op")
        a, b, c = (helper.make_tensor_value_info(n, elem, [2, 2]) for n in "abc")
        node = helper.make_node(_EMULATION_PROBE_OP, ["a", "b"], ["c"])
        model = helper.make_model(
            helper.make_graph([node], "probe", [a, b], [c]), opset_imports=[helper.make_opsetid("", 17)]
        )
        model.ir_version = 8
        if not _opens(model, optimize=False):  # "Could not find an implementation": not emulated
            continue
        found[name] = {
            "computes_in": "float",
            "how": "ORT inserts Casts and computes in float32 (emulated)",
            "source": "ort-insert-cast",
        }
    return found


def _schema_io(domain: str, op: str, since: int) -> tuple[list[str], list[str]] | None:
    """Formal inputs/outputs (type parameter or fixed type each) of ORT's schema of ``op`` at ``since``."""
    for schema in _schemas().get((domain, op), []):
        if schema.since_version == since:
            return [_tensor_type(i.typeStr) for i in schema.inputs], [_tensor_type(o.typeStr) for o in schema.outputs]
    return None


_SCHEMA_CACHE: dict[tuple[str, str], list] = {}


def _schemas() -> dict[tuple[str, str], list]:
    if not _SCHEMA_CACHE:
        for schema in ort_state.get_all_operator_schema():
            _SCHEMA_CACHE.setdefault((_domain(schema.domain), schema.name), []).append(schema)
    return _SCHEMA_CACHE


def _max_opsets() -> dict[str, int]:
    """Highest op schema version per domain in ORT's own registry (= the highest opset it knows)."""
    best: dict[str, int] = defaultdict(int)
    for (domain, _), schemas in _schemas().items():
        best[domain] = max(best[domain], *(s.since_version for s in schemas))
    return dict(best)


def _kernel_entries() -> list[dict]:
    merged: dict[tuple, dict[str, set[str]]] = {}
    for kernel in ort_state.get_all_opkernel_def():
        if kernel.provider != _PROVIDER:
            continue
        since, until = kernel.version_range
        key: tuple = (_domain(kernel.domain), kernel.op_name, since, until)
        if len(kernel.type_constraints) > 1:
            # several type parameters: each registration's combination stays its own entry (OneHot's
            # (indices, depth, values) kernels take some combinations only), as ORT matches one registration
            key += (tuple(sorted((p, tuple(sorted(a))) for p, a in kernel.type_constraints.items())),)
        types = merged.setdefault(key, {})
        for param, allowed in kernel.type_constraints.items():
            types.setdefault(param, set()).update(_tensor_type(t) for t in allowed)
    entries = []
    for (domain, op, since, until, *_), types in sorted(merged.items(), key=lambda kv: str(kv[0])):
        # an open-ended kernel matches only a node whose schema version is exactly `since` (module docstring)
        entry: dict = {"op": op, "domain": domain, "since": since, "until": since if until == _OPEN_ENDED else until}
        entry["via"] = "kernel"
        if types:
            entry["types"] = {p: sorted(v) for p, v in sorted(types.items())}
        io = _schema_io(domain, op, since)
        if io is not None:
            entry["inputs"], entry["outputs"] = io
        entry["source"] = "ort-registry"
        values = probe_attributes(op, since, _opens) if domain == "ai.onnx" else None
        if values is not None:  # attribute values the kernel refuses at session creation (_ort_probes)
            entry["attributes"] = values
            entry = {k: v for k, v in entry.items() if k != "source"} | {"source": "ort-attribute-probe"}
        if domain == "ai.onnx" and probe_zero_points(op, since, _runs):  # a run-time refusal (_ort_probes)
            entry = {k: v for k, v in entry.items() if k != "source"}
            entry |= {"rules": ["per_tensor_zero_points"], "source": "ort-attribute-probe"}
        entries.append(entry)
    return entries


def _function_entries(kernels: list[dict], max_opset: int) -> list[dict]:
    """ai.onnx ops without a CPU kernel at some schema version whose ONNX schema has a function body.

    Only schema versions ORT's own registry holds (ORT inlines a node through the function of the schema it
    resolves the node to), and only the element types a session opens: each candidate is probed with one-node
    models (:func:`onnxdeploy.matrices._probe_models.probe_op`, one per element-type class), since a body can
    need what ORT lacks (``SwiGLU``-28: "Could not find an implementation for Swish(24)"; ``CastLike`` to
    float4e2m1: its ``Cast``), probed on 1.32.
    """
    covered: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for e in kernels:
        if e["domain"] == "ai.onnx":
            covered[e["op"]].append((e["since"], e["until"]))
    known = {(op, s.since_version) for (domain, op), ss in _schemas().items() if domain == "ai.onnx" for s in ss}
    entries = []
    prober = SequentialProber(_opens)
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain != "" or schema.since_version > max_opset or schema.deprecated:
            continue
        if not (schema.has_function or schema.has_context_dependent_function):
            continue
        version = schema.since_version
        if (schema.name, version) not in known:  # ORT inlines only functions of the schemas it has (not Swish-24)
            continue
        if any(lo <= version <= hi for lo, hi in covered[schema.name]):
            continue
        probed = probe_op(schema, prober)
        if probed is None:
            # no probe opened: refused when ORT says it has no implementation, else the probe is at fault
            # (an input it cannot build, a shape it gets wrong) and the schema's types stand, unprobed
            allowed = {tc.type_param_str: list(tc.allowed_type_strs) for tc in schema.type_constraints}
            base = {p: "tensor(float)" if "tensor(float)" in a else a[0] for p, a in allowed.items()}
            errors = [_open_error(probe_model(schema, base, plan)) or "" for plan in PLANS[:3]]
            if any(_NO_KERNEL in e for e in errors):
                continue
            probed = ({p: sorted(map(_tensor_type, a)) for p, a in allowed.items()}, [])
        if not all(probed[0].values()):
            continue
        types = probed[0]
        entry = {"op": schema.name, "domain": "ai.onnx", "since": version, "until": version, "via": "function"}
        if types:
            entry["types"] = types
        entry["inputs"] = [i.type_str for i in schema.inputs]
        entry["outputs"] = [o.type_str for o in schema.outputs]
        reach = opset_reach(schema, types, max_opset, _opens) if all(types.values()) else None
        if reach is not None:  # the body needs, at later opsets, ops ORT lacks there (_ort_probes)
            entry["opset_max"] = reach
        entry["source"] = "ort-function-probe"
        entries.append(entry)
    return entries


def _graph_entries(max_opset: int) -> list[dict]:
    """Constant entries: ORT has no Constant kernel; its graph loader turns the node into an initializer.

    One entry per Constant schema version within ORT's opset range that a session opens (probed).
    """
    entries = []
    versions = sorted({onnx.defs.get_schema("Constant", opset).since_version for opset in range(1, max_opset + 1)})
    for version in versions:
        if _session_opens(version, 8, constant=True):
            entries.append(
                {"op": "Constant", "domain": "ai.onnx", "since": version, "until": version, "via": "graph"}
                | {"source": "ort-probe"}
            )
    return entries


_DTYPE_NOTES = (
    ("int4", "QDQ (DequantizeLinear int4, opset 21+) and com.microsoft MatMulNBits kernels"),
    ("int8", "QDQ, QLinear* and MatMulInteger kernels; elementwise math mostly float/int32/int64"),
    ("fp16", "a subset of kernels (see types); ORT casts the rest to float32 (see emulated_types)"),
    ("bf16", "a few kernels (Cast, ...); most math ops have no bfloat16 CPU kernel"),
)
"""What the CPU EP does with each weight dtype (all partly supported), from the kernel registry."""


def _sources(version: str, read: str) -> dict[str, dict]:
    """The matrix's ``sources``: the registries, the session probes and ORT's cast insertion, read on ``read``."""
    registry = "onnxruntime.capi.onnxruntime_pybind11_state"
    return {
        "ort-registry": {
            "doc": "ONNX Runtime kernel and schema registries of the installed wheel",
            "section": "get_all_opkernel_def(), get_all_operator_schema()",
            "version": f"onnxruntime {version}",
            "address": f"{registry}.get_all_opkernel_def / get_all_operator_schema",
            "read": read,
            "note": "A kernel registered open-ended is matched only at its since version "
            "(onnxruntime/core/framework/kernel_registry.cc KernelRegistry::VerifyKernelDef, main at 05f47fa0): "
            "recorded as since..since.",
        },
        "ort-probe": {
            "doc": "Session-creation probe of the installed wheel",
            "section": "one Identity node at ai.onnx 18, IR versions from 8 upward until ORT refuses; one "
            "Constant node per Constant schema version",
            "version": f"onnxruntime {version}",
            "address": "onnxdeploy.matrices.generate_ort_cpu.probe_max_ir_version",
            "read": read,
        },
        "ort-insert-cast": {
            "doc": "onnxruntime/core/optimizer/insert_cast_transformer.cc (InsertCastTransformer), confirmed by a "
            "session probe of the installed wheel",
            "section": "NeedInsertCast / ApplyImpl: a float16 input of a node no execution provider took gets a "
            "Cast to float, the node runs on the CPU EP's float kernel; applied in inference_session.cc "
            "TransformGraph after partitioning, at every optimization level",
            "version": f"onnxruntime main at 05f47fa0; probed on onnxruntime {version}",
            "address": f"{_INSERT_CAST}; onnxdeploy.matrices.generate_ort_cpu.probe_type_emulation",
            "read": read,
        },
        "ort-attribute-probe": {
            "doc": "Session-creation probe of the installed wheel on attribute values a CPU kernel refuses when "
            "it is created",
            "section": "one one-node model per candidate value (onnxdeploy.matrices._ort_probes.ATTRIBUTE_PROBES): "
            "GRU/LSTM/RNN layout (deep_cpu_gru.h, lstm_base.h, rnn.h: 'Batchwise recurrent operations (layout == "
            "1) are not supported'), StringNormalizer case_change_action (string_normalizer.cc constructs the "
            "en_US.UTF-8 locale for LOWER/UPPER); ConvInteger run once with a per-channel w_zero_point "
            "(conv_integer.cc: 'Non per-tensor quantization is not supported now': rule per_tensor_zero_points); "
            "types and versions from the kernel registry",
            "version": f"onnxruntime {version}",
            "address": "onnxdeploy.matrices._ort_probes.probe_attributes",
            "read": read,
            "note": "StringNormalizer's LOWER/UPPER depend on the host's locales: this file records the host it "
            "was generated on.",
        },
        "ort-function-probe": {
            "doc": "Session-creation probe of the installed wheel on ops ORT inlines (ONNX function bodies)",
            "section": "one one-node model per element-type class of each type parameter, at the op's schema "
            "version, for schema versions with a function body and no CPU kernel; then the same model at each "
            "later opset until one is refused (opset_max)",
            "version": f"onnxruntime {version}; onnx {onnx.__version__}",
            "address": "onnxdeploy.matrices.generate_ort_cpu._function_entries",
            "read": read,
        },
        "onnx-functions": {
            "doc": "ONNX operator schemas with a function body (ORT expands them when no kernel matches)",
            "section": "onnx.defs.get_all_schemas_with_history(): has_function / has_context_dependent_function",
            "version": f"onnx {onnx.__version__}",
            "address": "onnx.defs.get_all_schemas_with_history",
            "read": read,
        },
    }


def build_matrix(today: datetime.date | None = None) -> dict:
    """Build the ``ort-cpu`` matrix as a plain mapping (validated against :class:`Matrix`).

    Returns:
        The mapping that :func:`main` writes as YAML.
    """
    today = today or datetime.date.today()
    version = ort.__version__
    max_opsets = _max_opsets()
    kernels = _kernel_entries()
    functions = _function_entries(kernels, max_opsets["ai.onnx"])
    ir_max = probe_max_ir_version()
    domains = sorted({e["domain"] for e in kernels})
    data = {
        "schema_version": 1,
        "target": "ort-cpu",
        "name": "ONNX Runtime, CPU execution provider",
        "kind": "execution_provider",
        "description": "ONNX Runtime's CPUExecutionProvider (the runner's default). Generated from the installed "
        "wheel's kernel registry: an op/type pair listed here has a CPU kernel.",
        "product_version": f"onnxruntime {version}",
        "execution_provider": _PROVIDER,
        "ir_version": {"min": 3, "max": ir_max, "source": "ort-probe"},
        "opsets": {
            d: {"min": probe_min_opset() if d == "ai.onnx" else 1, "max": max_opsets[d], "source": "ort-registry"}
            for d in domains
            if d in max_opsets
        },
        "static_shapes": "not_required",
        "static_shapes_source": "ort-registry",
        "dtypes": {
            name: {"supported": "partial", "source": "ort-registry", "note": note} for name, note in _DTYPE_NOTES
        },
        "limits": [],
        "ops_complete": True,
        "ops": kernels + functions + _graph_entries(max_opsets["ai.onnx"]),
        "emulated_types": probe_type_emulation(),
        "sources": _sources(version, today.isoformat()),
        "generated": {
            "by": "python -m onnxdeploy.matrices.generate_ort_cpu",
            "on": today.isoformat(),
            "versions": {"onnxruntime": version, "onnx": onnx.__version__},
        },
        "gaps": [
            "Type constraints of an op with one type parameter are merged over ORT's per-type kernel "
            "registrations; an op with several keeps one entry per registration (its exact combinations).",
            "Graph optimizations may fuse ops into com.microsoft kernels; this lists what a session can place on "
            "CPU before optimization, not what runs after it.",
        ],
        "notes": [
            f"ai.onnx opset {_OPSET_MIN} is ORT's stated floor; lower opsets load (with a warning) through the "
            "kernels registered for them, so the range starts at the lowest opset a session opens (probed).",
        ],
    }
    Matrix.model_validate(data)
    return data


class _FlowDumper(yaml.SafeDumper):
    """Writes op entries one per line (flow style below the top level), the rest block style."""


def _dump(data: dict) -> str:
    head = {k: v for k, v in data.items() if k != "ops"}
    text = yaml.dump(head, Dumper=_FlowDumper, sort_keys=False, width=120, allow_unicode=True)
    lines = ["ops:"]
    for entry in data["ops"]:
        lines.append(
            "  - " + yaml.dump(entry, Dumper=_FlowDumper, default_flow_style=True, width=10**6, sort_keys=False).strip()
        )
    return text + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the generated matrix (default: ``ort-cpu.yaml`` beside this module) and print a summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("ort-cpu.yaml"))
    args = parser.parse_args(argv)
    data = build_matrix()
    header = (
        "# GENERATED by `python -m onnxdeploy.matrices.generate_ort_cpu` from the installed onnxruntime's kernel\n"
        "# registry; do not edit by hand, regenerate after upgrading onnxruntime.\n"
    )
    args.output.write_text(header + _dump(data), encoding="utf-8")
    print(
        f"wrote {args.output}: onnxruntime {ort.__version__}, {len(data['ops'])} op entries, "
        f"ai.onnx {data['opsets']['ai.onnx']['min']}..{data['opsets']['ai.onnx']['max']}, "
        f"IR <= {data['ir_version']['max']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
