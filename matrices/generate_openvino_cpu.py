"""Regenerate ``matrices/openvino.yaml`` by probing the installed OpenVINO's CPU plugin, one small model at a time.

Run ``python -m onnxdeploy.matrices.generate_openvino_cpu [--output PATH]`` after upgrading openvino (a few
minutes on one core). What it probes, every model compiled with ``openvino.Core().compile_model(model, "CPU")``
(the ONNX frontend reads it, the CPU plugin compiles it):

- the ``ai.onnx`` opset range and IR range: a one-node ``Identity`` model per opset / IR version;
- per op schema of ``ai.onnx``, ``ai.onnx.ml`` and ``ai.onnx.preview.training`` (``onnx.defs``, every schema
  version up to the newest opset), a one-node model at the opset that introduced that schema version: its
  required inputs as graph inputs, required attributes at plain defaults, shapes from a few plans (every input
  ``(2, 2, 2, 2)``, rank 2, 3, 1, 0, the first input rank 4 and the rest rank 1 / scalar, ..., and last the inputs
  after the first as constants of zeros, as exporters write axes, shapes and pads: an op that compiles only
  so gets the rule ``constant_inputs``, as Unsqueeze-13+ with its ``axes``). The first plan that
  compiles with the op's default element types (float where allowed) is then compiled once per element-type
  class of each type parameter (float, double, float16, bfloat16, 8/16/32/64-bit ints, bool, string, float8,
  int4, int2, float4, complex: one allowed member stands for the class), the other parameters held at their
  default, then bound to the same type where they allow it: the entry lists the types that compiled. A schema
  version no plan compiles takes the frontend's table (``supported_ops.md``, ``via: listed``, no types): listed
  there, supported (but not an op of sequence values: the CPU plugin compiles none); else left out
  (``ops_complete: true``: unsupported);
- blocked ``DequantizeLinear`` (opset 21+) weights with a partial last block (``K % block_size != 0``) against
  whole blocks: when only whole blocks compile, the entry carries the rule ``block_size_divides_axis``;
- ``Resize`` (11+), which the generic probe cannot build (it needs ``scales`` or ``sizes``): a linear resize by
  constant scales per ``coordinate_transformation_mode``; the entry lists the modes that compiled.

Ops a one-node probe cannot build (control flow with a subgraph attribute: ``If``, ``Loop``, ``Scan``,
``SequenceMap``; sparse and type-proto attributes) keep the entries of OpenVINO's own table (the frontend's
``supported_ops.md``), as do the ``com.microsoft`` and ``org.openvinotoolkit`` domains; the NPU plugin's facts
live in ``openvino-npu.yaml`` (hand-sourced).

Each probe model is compiled in a worker process (a probe that crashes the plugin costs that probe only); the
probes of one op are merged into one model and compiled together, halved where that fails. ``--reuse PATH``
keeps the probed entries of an earlier file of the same openvino and probes only the schema versions it lacks
(after the probe plans change). The plans, element-type classes and the search are shared with the ORT
generator's function probes (:mod:`onnxdeploy.matrices._probe_models`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import sys
from pathlib import Path

import onnx
import yaml
from onnx import TensorProto, helper

from onnxdeploy.matrices._probe_models import merged, probe_op
from onnxdeploy.matrices.generate_ort_cpu import _dump
from onnxdeploy.matrices.schema import Matrix

__all__ = ["build_matrix", "main"]

_DOMAINS = ("", "ai.onnx.ml", "ai.onnx.preview.training")
_SUBGRAPH_OPS = {"If", "Loop", "Scan", "SequenceMap"}
_DOC_TARGET = "openvino-npu"
"""The hand-sourced matrix holding OpenVINO's frontend table (``supported_ops.md``), read for what is not probed."""


def _compiles(data: bytes) -> bool:
    """Whether OpenVINO's CPU plugin compiles the serialized model (runs in a worker process)."""
    import openvino as ov

    core = _CORE.get("core")
    if core is None:
        core = _CORE["core"] = ov.Core()
    try:
        core.compile_model(core.read_model(data, b""), "CPU")
    except Exception:  # noqa: BLE001 - any refusal is "does not compile"
        return False
    return True


_CORE: dict = {}


class _Prober:
    """Compiles probe models in one worker process, restarting it when a probe kills it."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=1)

    def compiles(self, model: onnx.ModelProto | None) -> bool:
        if model is None:
            return False
        try:
            return self._pool.submit(_compiles, model.SerializeToString()).result(timeout=120)
        except (concurrent.futures.process.BrokenProcessPool, concurrent.futures.TimeoutError):
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=1)
            return False

    def all_compile(self, models: list[onnx.ModelProto | None]) -> list[bool]:
        """Whether each model compiles: all of them merged into one model first, halves again where that fails.

        The models are one-node probes of the same op (same opset imports); most compile, so a batch costs one
        compile instead of one per model.
        """
        if not models:
            return []
        if len(models) == 1:
            return [self.compiles(models[0])]
        if all(m is not None for m in models) and self.compiles(merged(models)):  # type: ignore[arg-type]
            return [True] * len(models)
        half = len(models) // 2
        return self.all_compile(models[:half]) + self.all_compile(models[half:])

    def close(self) -> None:
        self._pool.shutdown()


def _blocked_dq(prober: _Prober, opset: int, rows: int) -> bool:
    """Whether a blocked int4 DequantizeLinear weight ``(rows, 8)``, block_size 32 on axis 0, compiles into a MatMul."""
    import numpy as np

    w = helper.make_tensor("w", TensorProto.INT4, [rows, 8], np.zeros(rows * 8, np.int8).tolist())
    s = helper.make_tensor("s", TensorProto.FLOAT, [-(-rows // 32), 8], [1.0] * (-(-rows // 32) * 8))
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], axis=0, block_size=32),
        helper.make_node("MatMul", ["a", "wf"], ["y"]),
    ]
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, rows])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    graph = helper.make_graph(nodes, "probe", [a], [y], initializer=[w, s])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return prober.compiles(model)


def _identity(opset: int, ir_version: int = 8) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def _schemas(max_opset: int) -> list[onnx.defs.OpSchema]:
    newest = {d: onnx.defs.onnx_opset_version() if d == "" else 10**6 for d in _DOMAINS}
    newest[""] = max_opset
    return sorted(
        (
            s
            for s in onnx.defs.get_all_schemas_with_history()
            if s.domain in _DOMAINS and s.since_version <= newest[s.domain] and not s.deprecated
        ),
        key=lambda s: (s.domain, s.name, s.since_version),
    )


def _probed_entries(
    prober: _Prober, max_opset: int, say, reuse: list[dict] | None = None, reprobe: frozenset[str] = frozenset()
) -> tuple[list[dict], list[str]]:
    """One entry per op schema version that a probe compiled; the ops no probe could build.

    ``reuse``: probed entries of an earlier run (``--reuse``); schema versions they hold are not probed again,
    but for entries listing a type of ``reprobe`` (``--reprobe-types``, after the type classes change).
    """
    entries, unbuilt, failed = [], [], []
    earlier: dict[tuple[str, str, int], list[dict]] = {}
    again = set()
    for e in reuse or []:
        if e.get("source") == "ov-probe":
            earlier.setdefault((e["domain"], e["op"], e["since"]), []).append(e)
            if reprobe & {t for ts in e.get("types", {}).values() for t in ts}:
                again.add((e["domain"], e["op"], e["since"]))
    earlier = {k: v for k, v in earlier.items() if k not in again}
    schemas = _schemas(max_opset)
    for index, schema in enumerate(schemas):
        if (found := earlier.get((schema.domain or "ai.onnx", schema.name, schema.since_version))) is not None:
            entries += [{k: v for k, v in e.items() if k != "rules" or v != ["block_size_divides_axis"]} for e in found]
            continue
        if schema.name in _SUBGRAPH_OPS or any(
            a.required and a.type in (onnx.defs.OpSchema.AttrType.GRAPH, onnx.defs.OpSchema.AttrType.GRAPHS)
            for a in schema.attributes.values()
        ):
            unbuilt.append(schema.name)
            continue
        plan: list = []
        probed = probe_op(schema, prober, plan)
        if index % 50 == 0:
            say(f"  {index}/{len(schemas)} schemas probed")
        if probed is None:
            failed.append(schema)
            continue
        types, flipped = probed
        domain = schema.domain or "ai.onnx"
        head = {"op": schema.name, "domain": domain, "since": schema.since_version, "until": schema.since_version}
        if _needs_constants(schema, plan[0]):
            head["rules"] = ["constant_inputs"]
        if not types or any(types.values()):
            entries.append(head | {"via": "converter"} | ({"types": types} if types else {}) | {"source": "ov-probe"})
        for param, names, attributes in flipped:
            entries.append(
                head | {"via": "converter", "types": {param: names}, "attributes": attributes, "source": "ov-probe"}
            )
    return entries + _listed(failed), sorted(set(unbuilt))


def _needs_constants(schema: onnx.defs.OpSchema, plan: tuple) -> bool:
    """Whether the op compiled only with its inputs after the first as constants (``constant_inputs``).

    True when the first plan that compiled is a ``const`` plan and none of the plans feeding every input as a
    graph input compiles (the search tries those first: they all failed). An op with one required input has
    nothing to hold constant.
    """
    option = onnx.defs.OpSchema.FormalParameterOption
    required = [f for f in schema.inputs if f.option != option.Optional]
    return plan[0] == "const" and len(required) > 1


def _listed(failed: list[onnx.defs.OpSchema]) -> list[dict]:
    """Entries of the frontend's own table for schema versions no probe could build a compiling model of.

    A probe builds required inputs only, of a few ranks (``Resize`` needs its optional ``scales`` or ``sizes``;
    ``GRU``/``LSTM``/``RNN`` weights of shapes that agree): where none compiles, OpenVINO's table decides
    (source ``ov-onnx-fe``, ``via: listed``, no type constraint), one entry per such schema version.
    """
    from onnxdeploy.matrices import get_target

    doc = get_target(_DOC_TARGET)
    entries = []
    for schema in failed:
        domain = schema.domain or "ai.onnx"
        if (
            domain != "ai.onnx"
            or not doc.ops_for(domain, schema.name, schema.since_version)
            or _takes_sequences(schema)
        ):
            continue
        version = schema.since_version
        entries.append(
            {"op": schema.name, "domain": domain, "since": version, "until": version, "via": "listed"}
            | {"source": "ov-onnx-fe"}
        )
    return entries


def _takes_sequences(schema: onnx.defs.OpSchema) -> bool:
    """Whether a formal input or output of ``schema`` is a sequence or optional value only.

    OpenVINO's CPU plugin refuses every sequence value (a Parameter of dynamic rank, probed on the node tests):
    the frontend's table listing ``SequenceInsert`` does not make it compile, so such ops take no table entry.
    """
    allowed = {tc.type_param_str: list(tc.allowed_type_strs) for tc in schema.type_constraints}
    for formal in (*schema.inputs, *schema.outputs):
        types = allowed.get(formal.type_str, [formal.type_str])
        if types and all(t.startswith(("seq(", "optional(")) for t in types):
            return True
    return False


RESIZE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric")
"""Resize ``coordinate_transformation_mode`` values probed (``tf_crop_and_resize`` too, with its ``roi``)."""


def _resize(opset: int, mode: str) -> onnx.ModelProto:
    """A linear Resize (1, 1, 2, 2) -> (1, 1, 4, 4) by constant scales, with a constant ``roi``."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    roi = helper.make_tensor("roi", TensorProto.FLOAT, [8], [0, 0, 0, 0, 1, 1, 1, 1])
    scales = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])
    node = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], coordinate_transformation_mode=mode, mode="linear")
    graph = helper.make_graph([node], "probe", [x], [y], initializer=[roi, scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def _resize_entries(prober: _Prober, entries: list[dict]) -> None:
    """Resize (11+) gets the ``coordinate_transformation_mode`` values a hand-built probe compiles.

    The generic probe cannot build a Resize (it needs its optional ``scales`` or ``sizes``); this one does, so
    the entry becomes probed (``ov-probe``): OpenVINO 2026.4 refuses ``half_pixel_symmetric`` and
    ``tf_crop_and_resize`` ("transformation mode is not supported").
    """
    for entry in entries:
        if entry["op"] != "Resize" or entry["domain"] != "ai.onnx" or entry["since"] < 11:
            continue
        modes = [*RESIZE_MODES, "tf_crop_and_resize"]
        verdicts = prober.all_compile([_resize(entry["since"], m) for m in modes])
        taken = [m for m, ok in zip(modes, verdicts, strict=True) if ok]
        if taken:
            entry.update(via="converter", attributes={"coordinate_transformation_mode": taken}, source="ov-probe")


def _rules(prober: _Prober, entries: list[dict]) -> None:
    """Add ``block_size_divides_axis`` to blocked DequantizeLinear entries when a partial last block is refused."""
    for entry in entries:
        if entry["op"] != "DequantizeLinear" or entry["domain"] != "ai.onnx" or entry["since"] < 21:
            continue
        if _blocked_dq(prober, entry["since"], 64) and not _blocked_dq(prober, entry["since"], 48):
            entry["rules"] = [*entry.get("rules", []), "block_size_divides_axis"]
            entry["source"] = "ov-probe"


def _doc_entries(unbuilt: list[str]) -> list[dict]:
    """Entries of the frontend's own table for ops a probe cannot build and for the custom domains."""
    from onnxdeploy.matrices import get_target

    doc = get_target(_DOC_TARGET)
    keep = []
    for e in doc.ops:
        if e.domain in ("com.microsoft", "org.openvinotoolkit") or (e.domain == "ai.onnx" and e.op in unbuilt):
            keep.append(e.model_dump(mode="json", exclude_defaults=True) | {"source": "ov-onnx-fe"})
    return keep


def _gaps(entries: list[dict], unbuilt: list[str]) -> list[str]:
    """The matrix's ``gaps``: what the compile probe does not see, and which versions follow the frontend's table."""
    return [
        "Each op is probed at the opset that introduced its schema version, with required inputs only (no "
        "optional input), required attributes at plain values and a few input ranks; an attribute value or "
        "optional input OpenVINO refuses is not seen.",
        "Types are probed per element-type class, one type parameter at a time (the others at their "
        "default), then on every parameter that allows the type; one allowed member stands for its class.",
        f"Not probed (a subgraph attribute), kept from the frontend's table: {', '.join(unbuilt) or 'none'}.",
        "Schema versions no one-node probe compiled (inputs a probe cannot build: Resize's scales, recurrent "
        "weights of agreeing shapes, ...) follow the frontend's table (via: listed, no type constraint): "
        + (", ".join(sorted({f"{e['op']}-{e['since']}" for e in entries if e.get("via") == "listed"})) or "none")
        + ".",
    ]


def build_matrix(
    today: datetime.date | None = None, say=print, reuse: list[dict] | None = None, reprobe: frozenset = frozenset()
) -> dict:
    """Probe the installed OpenVINO and build the ``openvino`` matrix as a plain mapping (validated).

    Raises:
        ImportError: openvino is not installed (``pip install -e '.[openvino]'``).
    """
    import openvino as ov

    from onnxdeploy.matrices import get_target

    today = today or datetime.date.today()
    version = ov.__version__
    prober = _Prober()
    try:
        newest = onnx.defs.onnx_opset_version()
        opsets = [o for o in range(1, newest + 1) if prober.compiles(_identity(o))]
        irs = [v for v in range(3, onnx.IR_VERSION + 1) if prober.compiles(_identity(13, v))]
        say(f"openvino {version}: ai.onnx opsets {opsets[0]}..{opsets[-1]}, IR {irs[0]}..{irs[-1]}")
        entries, unbuilt = _probed_entries(prober, opsets[-1], say, reuse, reprobe)
        _rules(prober, entries)
        _resize_entries(prober, entries)
    finally:
        prober.close()
    doc = get_target(_DOC_TARGET)
    read = today.isoformat()
    data = {
        "schema_version": 1,
        "target": "openvino",
        "name": "OpenVINO, CPU plugin (ONNX frontend)",
        "kind": "runtime",
        "description": "OpenVINO reads ONNX through its ONNX frontend and compiles for the CPU plugin "
        "(openvino.Core().compile_model(model, 'CPU'), as the runner's openvino runtime does). Generated by "
        "probing the installed openvino: an op/type pair listed here compiled as a one-node model.",
        "product_version": f"openvino {version}",
        "ir_version": {"min": irs[0], "max": irs[-1], "source": "ov-probe"},
        "opsets": {
            "ai.onnx": {"min": opsets[0], "max": opsets[-1], "source": "ov-probe"},
            **{d: r.model_dump() for d, r in doc.opsets.items() if d in ("com.microsoft", "org.openvinotoolkit")},
            **{
                d: {"min": 1, "max": max(e["since"] for e in entries if e["domain"] == d), "source": "ov-probe"}
                for d in ("ai.onnx.ml", "ai.onnx.preview.training")
                if any(e["domain"] == d for e in entries)
            },
        },
        "static_shapes": "not_required",
        "static_shapes_source": "ov-probe",
        "limits": [],
        "ops_complete": True,
        "ops": entries + _doc_entries(unbuilt),
        "sources": {
            "ov-probe": {
                "doc": "Compile probe of the installed openvino (CPU plugin)",
                "section": "one-node model per op schema version and element type, compiled on CPU",
                "version": f"openvino {version}",
                "address": "onnxdeploy.matrices.generate_openvino_cpu.build_matrix",
                "read": read,
            },
            "ov-onnx-fe": doc.sources["ov-onnx-fe"].model_dump(mode="json"),
        },
        "generated": {
            "by": "python -m onnxdeploy.matrices.generate_openvino_cpu",
            "on": read,
            "versions": {"openvino": version, "onnx": onnx.__version__},
        },
        "gaps": _gaps(entries, unbuilt),
        "notes": ["The NPU plugin's facts are the target openvino-npu (hand-sourced)."],
    }
    Matrix.model_validate(data)
    return data


def main(argv: list[str] | None = None) -> int:
    """Write the generated matrix (default: ``openvino.yaml`` beside this module) and print a summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("openvino.yaml"))
    parser.add_argument(
        "--reuse",
        type=Path,
        help="an earlier openvino.yaml of the same openvino: its probed entries are kept and only the schema "
        "versions it lacks are probed (after a change of the probe plans)",
    )
    parser.add_argument("--reprobe-types", default="", help="with --reuse: probe again entries listing these types")
    args = parser.parse_args(argv)
    reuse = None
    if args.reuse is not None:
        earlier = yaml.safe_load(args.reuse.read_text(encoding="utf-8"))
        import openvino as ov

        if earlier["generated"]["versions"]["openvino"] != ov.__version__:
            parser.error(f"--reuse {args.reuse} was generated by another openvino")
        reuse = earlier["ops"]
    data = build_matrix(reuse=reuse, reprobe=frozenset(t for t in args.reprobe_types.split(",") if t))
    header = (
        "# GENERATED by `python -m onnxdeploy.matrices.generate_openvino_cpu`: probe models compiled on the\n"
        "# installed openvino's CPU plugin; do not edit by hand, regenerate after upgrading openvino.\n"
    )
    args.output.write_text(header + _dump(data), encoding="utf-8")
    print(f"wrote {args.output}: {data['product_version']}, {len(data['ops'])} op entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
