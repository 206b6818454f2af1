"""``checker``: the ONNX checker with full (strict shape/type inference) checking.

Source: ``onnx.checker.check_model(model, full_check=True)`` (onnx/checker.py, onnx/checker/checker.cc),
which validates the model against the ONNX IR spec (IR.md) and each operator schema, then runs strict
shape inference.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import onnx
from onnx.checker import ValidationError
from onnx.shape_inference import InferenceError

from onnxdeploy.checks._graph import (
    iter_tensors,
    serialized_size,
    skeleton,
)
from onnxdeploy.checks.base import Check, CheckContext, register_check
from onnxdeploy.graph import default_opset
from onnxdeploy.model_io import external_location, tensor_nbytes
from onnxdeploy.report import Finding

__all__ = ["CheckerCheck"]

_STUB_FILE = "__onnxdeploy_check__.data"

# (pattern of the checker message, hint); first match wins.
_HINTS: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"No Op registered|No schema registered"),
        "The op is not defined for this domain/opset: pin the opset (pin_opset) or register the custom domain.",
    ),
    (
        re.compile(r"topologically sorted"),
        "Sort the nodes topologically (onnx_ir TopologicalSortPass; onnxdeploy run sorts at load); see topo_order.",
    ),
    (
        re.compile(r"single static assignment|SSA"),
        "Give every tensor a single producer: rename the duplicated output; see the topo_order check.",
    ),
    (
        re.compile(r"is required but missing"),
        "Fill in the required field; graph inputs and outputs need a type (copy the inferred one from "
        "onnx.shape_inference.infer_shapes).",
    ),
    (
        re.compile(r"external|TensorProto|raw_data", re.IGNORECASE),
        "Fix the tensor data: raw_data must match dims x dtype; external data must be a file inside the "
        "model folder (onnx/docs/ExternalData.md).",
    ),
    (
        re.compile(r"Unrecognized attribute|attribute", re.IGNORECASE),
        "Fix the node's attributes to match the operator schema of the imported opset (onnx/docs/Operators.md).",
    ),
    (
        re.compile(r"input size|output size"),
        "Fix the node's input/output count to match the operator schema (onnx/docs/Operators.md).",
    ),
    (
        re.compile(r"existing shape differ|inconsistent|Inferred elem type differs|type", re.IGNORECASE),
        "Declared types/shapes disagree with inference: fix or drop the stale value_info/output shape, "
        "or fix the producing node's inputs.",
    ),
    (
        re.compile(r"ir_version|opset_import|opset", re.IGNORECASE),
        "Set ir_version and opset_import consistently (onnx/docs/IR.md, 'Models' and 'Operator Sets').",
    ),
]
_DEFAULT_HINT = "See the ONNX IR spec (onnx/docs/IR.md) and the operator schema (onnx/docs/Operators.md)."

_INFERENCE_NODE = re.compile(r"\(op_type:(?P<op>[^,)]*)(?:, node name: (?P<name>[^)]*))?\)")
_VALIDATION_NODE = re.compile(r"[Nn]ame: (?P<name>.*?) ?OpType: (?P<op>\S+)")
_TENSOR_NAME = re.compile(r"tensor name: (?P<name>[^)\s]+)|input '(?P<input>[^']+)'|however '(?P<ssa>[^']+)'")


def _hint(message: str) -> str:
    for pattern, hint in _HINTS:
        if pattern.search(message):
            return hint
    return _DEFAULT_HINT


def _concerned(message: str) -> list[str]:
    """Node (or, failing that, tensor) names a checker message mentions, first match of each kind."""
    names: list[str] = []
    for pattern in (_INFERENCE_NODE, _VALIDATION_NODE):
        match = pattern.search(message)
        if match:
            name = (match.group("name") or "").strip()
            names.append(name or f"<unnamed {match.group('op').strip()}>")
            break
    tensor = _TENSOR_NAME.search(message)
    if tensor:
        names.append(next(g for g in tensor.groups() if g))
    return names


def _safe_relative(location: str) -> bool:
    if not location or os.path.isabs(location) or PurePosixPath(location.replace("\\", "/")).is_absolute():
        return False
    normal = os.path.normpath(location.replace("\\", "/"))
    return not (normal == ".." or normal.startswith("../") or normal.startswith(".." + os.sep))


_SET_ASIDE_DOMAIN = "onnxdeploy.not_onnx"


@functools.cache
def _ort_default_domain_ops() -> frozenset[str]:
    """Ops the installed ONNX Runtime registers in the default domain (its schemas, contrib ones included)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c  # noqa: PLC0415

    return frozenset(s.name for s in ort_c.get_all_operator_schema() if s.domain in ("", "ai.onnx"))


def _ort_defines(op_type: str) -> bool:
    return op_type in _ort_default_domain_ops()


def _set_aside_unknown_default_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy with default-domain nodes ORT defines but ONNX does not moved to a private domain, and their counts.

    onnxruntime-genai's builder emits ORT contrib ops (``SimplifiedLayerNormalization``, …) in the default
    domain; onnx's checker stops at the first one. Moved to a declared private domain, they are skipped and the
    rest of the graph is still checked; an op neither defines stays and is rejected. The model is not changed.
    """
    version = default_opset(model)
    unknown: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type, "") and _ort_defines(node.op_type):
            unknown[node.op_type] = unknown.get(node.op_type, 0) + 1
    if not unknown or not version:
        return model, {}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in unknown:
            node.domain = _SET_ASIDE_DOMAIN
    copy.opset_import.add(domain=_SET_ASIDE_DOMAIN, version=1)
    return copy, unknown


@register_check
class CheckerCheck(Check):
    """Run ``onnx.checker.check_model(model, full_check=True)`` and report each failure.

    What is checked: the IR rules (ir_version, opset_import, SSA, topological order, names), every
    node against its operator schema, tensor data (``raw_data`` size, external-data location inside
    the model folder and present), then strict shape and type inference (onnx/docs/IR.md,
    onnx/docs/Operators.md, onnx/docs/ExternalData.md). The checker stops at the first structural
    error, so at most one ``OD101`` comes from it; inference errors are split per node (``OD102``).

    Models that cannot be checked in memory (protobuf above 2 GiB, or tensors already stored as
    external data) are checked by path: a weight-less copy is written to a temporary folder, large
    initializers become external-data stubs (their ``raw_data`` size is checked here instead), and
    existing external-data files are stood in for by empty files when they exist in
    ``context.data_dir`` (their presence is what the checker verifies).
    """

    name = "checker"
    description = "onnx.checker.check_model(full_check=True): IR, operator schemas, strict shape inference."
    codes = {
        "OD101": "error: the ONNX checker rejected the model (IR or operator-schema violation).",
        "OD102": "error: strict shape/type inference in the full check failed at a node.",
        "OD103": "warning: external-data files could not be located (no model path/base dir); not verified.",
        "OD104": "info: default-domain ops the ONNX standard does not define (ORT contrib ops) were not checked.",
    }

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        """Yield ``OD101``/``OD102`` for each checker failure and ``OD103`` when external data is unverified."""
        model, contrib = _set_aside_unknown_default_ops(model)
        if contrib:
            yield self.finding(
                "OD104",
                "info",
                f"{sum(contrib.values())} node(s) of ops the ONNX standard does not define sit in the default domain "
                f"({', '.join(f'{op}×{n}' for op, n in sorted(contrib.items()))}; ONNX Runtime contrib ops, e.g. the "
                "onnxruntime-genai builder's): the ONNX checker skipped them; an ONNX Runtime session is their check",
                nodes=sorted(contrib),
                hint="verify (an ORT session) checks these ops; target checks say which targets run them",
            )
        external = [(t.name, external_location(t)) for t in iter_tensors(model.graph)]
        external = [(name, loc) for name, loc in external if loc is not None]
        if not external and serialized_size(model) is not None:
            yield from self._run_checker(model, None, None)
            return
        with tempfile.TemporaryDirectory(prefix="onnxdeploy-check-") as tmp:
            folder = Path(tmp)
            copy, stubbed = skeleton(model, stub_location=_STUB_FILE)
            for tensor in stubbed:
                expected = tensor_nbytes(tensor)
                if expected is not None and expected != len(tensor.raw_data):
                    yield self.finding(
                        "OD101",
                        "error",
                        f"TensorProto (tensor name: {tensor.name}) raw_data size ({len(tensor.raw_data)} bytes) "
                        f"does not match the declared shape and type ({expected} bytes required).",
                        nodes=[tensor.name],
                        hint=_hint("raw_data"),
                    )
            (folder / _STUB_FILE).touch()
            unresolved = self._stage_external(external, folder, context)
            if unresolved:
                yield self.finding(
                    "OD103",
                    "warning",
                    f"{len(unresolved)} tensor(s) use external data but the check context has no model path "
                    "or base dir, so their files were not looked for: " + ", ".join(unresolved[:10]),
                    nodes=unresolved,
                    hint="Pass CheckContext(model_path=...) or base_dir=... so external data can be verified.",
                )
            path = folder / "model.onnx"
            onnx.save_model(copy, path)
            yield from self._run_checker(path, tmp, context.data_dir)

    @staticmethod
    def _stage_external(external: list[tuple[str, str]], folder: Path, context: CheckContext) -> list[str]:
        """Create empty stand-ins in ``folder`` for external files that exist; return names not looked up."""
        data_dir = context.data_dir
        unresolved: list[str] = []
        for name, location in external:
            if not _safe_relative(location):
                continue  # the checker reports absolute or escaping locations itself
            if data_dir is None:
                unresolved.append(name)
            elif not (data_dir / location).is_file():
                continue  # left missing so the checker reports it
            target = folder / location
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        return unresolved

    def _run_checker(self, model: onnx.ModelProto | Path, tmp: str | None, data_dir: Path | None) -> Iterator[Finding]:
        try:
            onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else str(model), full_check=True)
        except InferenceError as exc:
            yield from self._inference_findings(self._clean(str(exc), tmp, data_dir))
        except ValidationError as exc:
            message = " ".join(self._clean(str(exc), tmp, data_dir).split())
            yield self.finding("OD101", "error", message, nodes=_concerned(message), hint=_hint(message))
        except Exception as exc:  # noqa: BLE001 - any checker failure is a model problem
            message = f"{type(exc).__name__}: {self._clean(str(exc), tmp, data_dir)}"
            yield self.finding("OD101", "error", message, nodes=_concerned(message), hint=_hint(message))

    def _inference_findings(self, message: str) -> Iterator[Finding]:
        body = message.split("Inference error(s):", 1)[-1]
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        per_node = [line for line in lines if _INFERENCE_NODE.search(line)]
        for line in per_node or [message.strip()]:
            text = line if line.startswith("[") else f"[ShapeInferenceError] {line}"
            yield self.finding("OD102", "error", text, nodes=_concerned(line), hint=_hint(line))

    @staticmethod
    def _clean(message: str, tmp: str | None, data_dir: Path | None) -> str:
        """Strip the checker's context banner and name the real folder instead of the temporary one."""
        message = message.replace("\n\n==> Context: ", " -- ").strip()
        if tmp:
            message = message.replace(tmp, str(data_dir) if data_dir else "<model folder>")
        return message
