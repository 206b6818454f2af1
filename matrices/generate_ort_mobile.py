"""Regenerate ``matrices/ort-coreml.yaml`` and ``matrices/ort-nnapi.yaml`` from the installed onnxruntime wheel.

Run ``python -m onnxdeploy.matrices.generate_ort_mobile [--output-dir DIR]`` after upgrading onnxruntime. The
wheel ships the support tables of its CoreML and NNAPI execution providers, which ORT's own mobile usability
checker reads (``onnxruntime/tools/mobile_helpers/``):

- ``coreml_supported_mlprogram_ops.md``: ops the CoreML EP converts to an ML Program (CoreML 5+, the format
  the EP uses with ``ModelFormat=MLProgram``), with a note per op;
- ``nnapi_supported_ops.md``: ops the NNAPI EP converts, with a note per op;
- ``usability_checker.py``: ``check_shapes`` states that NNAPI does not support dynamically sized values and
  that CoreML does, at a cost in performance.

Both tables carry the comment "Keep in sync with doco generated from /docs/execution-providers/<EP>.md on the
gh_pages branch", i.e. they are the EP documentation's "Supported ops" table of this ORT version. The opset
range and IR range are those of the ONNX Runtime that hosts the EP (the model must load in ORT first): the
installed wheel's schema registry and the IR probe of :mod:`onnxdeploy.matrices.generate_ort_cpu`.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from importlib import resources
from pathlib import Path

import onnx
import onnxruntime as ort

from onnxdeploy.matrices.generate_ort_cpu import _OPSET_MIN, _dump, _max_opsets, probe_max_ir_version
from onnxdeploy.matrices.schema import Matrix

__all__ = ["CONSTANT_ENTRY", "ORT_GRAPH_SOURCE", "TARGETS", "build_matrix", "main", "parse_support_table"]

_ROW = re.compile(r"^\|\s*(ai\.onnx|com\.microsoft)[:.](\w+)\s*\|(.*)\|\s*$")
"""A table row ``|ai.onnx:Op|note|`` (the tables also spell the separator with a dot, e.g. ``ai.onnx.ReduceSum``)."""

TARGETS: dict[str, dict] = {
    "ort-coreml": {
        "file": "coreml_supported_mlprogram_ops.md",
        "name": "ONNX Runtime, CoreML execution provider (ML Program)",
        "ep": "CoreMLExecutionProvider",
        "doc_page": "docs/execution-providers/CoreML-ExecutionProvider.md (gh-pages)",
        "description": "ONNX Runtime's CoreMLExecutionProvider with ModelFormat=MLProgram: the ops listed here are "
        "converted to a CoreML ML Program (run on the Apple Neural Engine, GPU or CPU as CoreML decides); every "
        "other node stays on ORT's CPU EP unless CPU fallback is disabled.",
        "static_shapes": "preferred",
        "static_note": "check_shapes: 'NNAPI does not support dynamically sized values. CoreML does, but it will "
        "most likely cost performance.'",
        "dtypes": {
            "fp16": {
                "supported": "partial",
                "note": "ML Program computes in fp16 or fp32; the table's notes name "
                "per-op limits (e.g. Pow: both inputs fp32; Where: X/Y float or float16).",
            },
        },
    },
    "ort-nnapi": {
        "file": "nnapi_supported_ops.md",
        "name": "ONNX Runtime, NNAPI execution provider (Android)",
        "ep": "NnapiExecutionProvider",
        "doc_page": "docs/execution-providers/NNAPI-ExecutionProvider.md (gh-pages)",
        "description": "ONNX Runtime's NnapiExecutionProvider on Android: the ops listed here are handed to the "
        "Android Neural Networks API (NPU/DSP/GPU drivers); every other node stays on ORT's CPU EP unless CPU "
        "fallback is disabled. NNAPI needs fixed shapes.",
        "static_shapes": "required",
        "static_note": "check_shapes: 'NNAPI does not support dynamically sized values.'",
        "dtypes": {
            "int8": {
                "supported": "partial",
                "note": "QDQ and QLinear* ops (DequantizeLinear, QuantizeLinear, "
                "QLinearConv, QLinearMatMul, com.microsoft QLinearAdd/AveragePool/Sigmoid) with constant "
                "scales and zero points.",
            },
        },
    },
}


CONSTANT_ENTRY: dict = {"op": "Constant", "domain": "ai.onnx", "since": 1, "via": "graph", "source": "ort-graph"}
"""ORT's graph loader turns Constant nodes into initializers before any EP takes nodes, so every ORT EP takes them."""

ORT_GRAPH_SOURCE: dict = {
    "doc": "ONNX Runtime graph loader (Constant nodes become initializers before EP partitioning)",
    "section": "session probe: a model of Constant nodes opens although the CPU EP registers no Constant kernel",
    "version": f"onnxruntime {ort.__version__}",
    "address": "onnxdeploy.matrices.generate_ort_cpu._graph_entries (the probe behind ort-cpu's Constant entries)",
}
"""Source of :data:`CONSTANT_ENTRY` (add ``read``)."""


def _helpers_dir() -> Path:
    return Path(str(resources.files("onnxruntime") / "tools" / "mobile_helpers"))


def _canonical_op(op: str) -> tuple[str, str]:
    """ONNX's spelling of ``op`` (the tables write ``Argmax``) and a note when it differs ('' otherwise)."""
    names = {s.name for s in onnx.defs.get_all_schemas_with_history()}
    if op in names:
        return op, ""
    matches = [n for n in names if n.lower() == op.lower()]
    if len(matches) == 1:
        return matches[0], f"the table spells it '{op}'"
    return op, ""


def parse_support_table(text: str, source: str) -> tuple[list[dict], list[str]]:
    """Parse an ORT EP support table (``|domain:Op|Note|`` rows) into op entries.

    Args:
        text: the markdown table.
        source: the source id every entry cites.

    Returns:
        ``(entries, notes)``: one entry per row (``since: 1``, no upper bound: the tables give no versions),
        the row's note split at ``<br/>`` as constraints in words; and notes about spelling corrections.
    """
    entries: list[dict] = []
    notes: list[str] = []
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if not match:
            continue
        domain, raw_op, note = match.groups()
        op, fixed = _canonical_op(raw_op) if domain == "ai.onnx" else (raw_op, "")
        if fixed:
            notes.append(f"{domain}:{op}: {fixed}.")
        entry: dict = {"op": op, "domain": domain, "since": 1, "via": "listed"}
        constraints = [c.strip() for c in note.split("<br/>") if c.strip()]
        if constraints:
            entry["constraints"] = constraints
        entry["source"] = source
        entries.append(entry)
    return sorted(entries, key=lambda e: (e["domain"], e["op"])), notes


def _sources(spec: dict, version: str, read: str) -> dict[str, dict]:
    """The matrix's ``sources``: the EP's table, the usability checker, ORT's graph and host, read on ``read``."""
    return {
        "ep-table": {
            "doc": f"{spec['file']} (the {spec['ep']} 'Supported ops' table, kept in sync with {spec['doc_page']})",
            "section": "table 'Operator | Note'",
            "version": f"onnxruntime {version} (installed wheel)",
            "address": f"onnxruntime/tools/mobile_helpers/{spec['file']}",
            "read": read,
        },
        "ort-usability-checker": {
            "doc": "ONNX Runtime mobile usability checker (usability_checker.py)",
            "section": "check_shapes() docstring",
            "version": f"onnxruntime {version} (installed wheel)",
            "address": "onnxruntime/tools/mobile_helpers/usability_checker.py",
            "read": read,
        },
        "ort-graph": ORT_GRAPH_SOURCE | {"read": read},
        "ort-host": {
            "doc": "The hosting ONNX Runtime's schema registry and IR probe (the model loads in ORT before the "
            "EP takes nodes)",
            "section": "get_all_operator_schema(); onnxdeploy.matrices.generate_ort_cpu.probe_max_ir_version",
            "version": f"onnxruntime {version}",
            "address": "onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema",
            "read": read,
        },
    }


def build_matrix(target: str, today: datetime.date | None = None) -> dict:
    """Build the ``ort-coreml`` or ``ort-nnapi`` matrix as a plain mapping (validated against :class:`Matrix`).

    Raises:
        KeyError: ``target`` is not one of :data:`TARGETS`.
        FileNotFoundError: the installed onnxruntime does not ship the table.
    """
    spec = TARGETS[target]
    today = today or datetime.date.today()
    version = ort.__version__
    helpers = _helpers_dir()
    table = helpers / spec["file"]
    entries, notes = parse_support_table(table.read_text(encoding="utf-8"), "ep-table")
    entries.append(CONSTANT_ENTRY)
    max_opsets = _max_opsets()
    domains = sorted({e["domain"] for e in entries} | {"ai.onnx"})
    data = {
        "schema_version": 1,
        "target": target,
        "name": spec["name"],
        "kind": "execution_provider",
        "description": spec["description"],
        "product_version": f"onnxruntime {version}",
        "execution_provider": spec["ep"],
        "ir_version": {"min": 3, "max": probe_max_ir_version(), "source": "ort-host"},
        "opsets": {
            d: {"min": _OPSET_MIN if d == "ai.onnx" else 1, "max": max_opsets[d], "source": "ort-host"} for d in domains
        },
        "static_shapes": spec["static_shapes"],
        "static_shapes_source": "ort-usability-checker",
        "dtypes": {name: d | {"source": "ep-table"} for name, d in spec["dtypes"].items()},
        "limits": [],
        "ops_complete": True,
        "ops": entries,
        "sources": _sources(spec, version, today.isoformat()),
        "generated": {
            "by": "python -m onnxdeploy.matrices.generate_ort_mobile",
            "on": today.isoformat(),
            "versions": {"onnxruntime": version, "onnx": onnx.__version__},
        },
        "gaps": [
            "The table gives no op versions, dtypes or ranks per op: entries cover every schema version, and the "
            "op builders' own opset and dtype checks (onnxruntime/core/providers/"
            f"{'coreml' if target == 'ort-coreml' else 'nnapi'}/builders/impl/) are not transcribed.",
            "Whether a device's driver (Neural Engine, NNAPI vendor driver) then runs a converted node is decided "
            "on the device; not sourced.",
        ],
        "notes": [
            "An op not listed is not taken by the EP: ORT runs it on the CPU EP (a partitioned graph) unless "
            "session.disable_cpu_ep_fallback=1, when session creation fails.",
            *notes,
        ],
    }
    Matrix.model_validate(data)
    return data


def main(argv: list[str] | None = None) -> int:
    """Write ``ort-coreml.yaml`` and ``ort-nnapi.yaml`` (default: beside this module); print a summary line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent)
    args = parser.parse_args(argv)
    for target in TARGETS:
        data = build_matrix(target)
        header = (
            f"# GENERATED by `python -m onnxdeploy.matrices.generate_ort_mobile` from the installed onnxruntime's\n"
            f"# {TARGETS[target]['file']}; do not edit by hand, regenerate after upgrading onnxruntime.\n"
        )
        path = args.output_dir / f"{target}.yaml"
        path.write_text(header + _dump(data), encoding="utf-8")
        print(f"wrote {path}: onnxruntime {ort.__version__}, {len(data['ops'])} ops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
