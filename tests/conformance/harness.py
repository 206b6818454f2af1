"""Conformance harness: ONNX's node tests through ``pin_opset`` (and onnx's own converter), judged on ORT CPU.

For one :class:`~tests.conformance.node_cases.NodeCase` and one target opset, :func:`convert_with_pin_opset`
runs the real pass entry point (``PinOpsetPass(...)(model, make_pass_context())``) and
:func:`convert_with_onnx` runs ``onnx.version_converter.convert_version``; :func:`judge` then classifies what
came out (:data:`STATUSES`): the written model goes through onnx's checker with full shape inference
(``onnx.checker.check_model(full_check=True)``), an ONNX Runtime CPU session, and every data set of the test,
compared with the expected outputs at the test's own ``rtol``/``atol`` as onnx's backend runner compares them
(``onnx.backend.test.runner.Runner.assert_similar_outputs``, onnx 1.23.2).

A test belongs to the *baseline* (:func:`in_baseline`) when ORT runs it correctly at its own opset; only
baseline tests are judged at other opsets. Used by ``tests/conformance/test_pin_opset_conformance.py`` and
``benchmarks/conformance.py``.
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import version_converter
from onnx.backend.test.runner import Runner

from onnxdeploy.errors import OnnxDeployError, PassError
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.pin_opset import PinOpsetConfig, PinOpsetPass
from tests.conformance.node_cases import NodeCase

__all__ = [
    "STATUSES",
    "Outcome",
    "convert_with_onnx",
    "convert_with_pin_opset",
    "in_baseline",
    "judge",
    "outcome",
    "ort_registers",
    "user_terms_refusal",
]

STATUSES = (
    "correct",  # every data set matches the expected outputs
    "wrong",  # ORT ran it and an output differs beyond rtol/atol
    "invalid",  # written, but fails onnx's checker or full shape inference
    "ort_no_kernel",  # valid ONNX, ORT has no CPU kernel for an op at its version/types
    "ort_refuses",  # valid per onnx's checker, ORT's session creation refuses it otherwise
    "ort_fails",  # the session opened, a run raised
    "refused",  # the converter refused, naming node, op, opset pair and reason
    "refused_internal",  # refused with a message in internal terms
    "crash",  # an unexpected exception (a bug)
)
"""What a (test, target opset) can come to, best first."""

_INTERNAL = re.compile(
    r"topologically sorted|function body could not be built|opset 0\b|Traceback|KeyError|AssertionError|"
    r"IndexError|AttributeError|TypeError|NoneType|onnxdeploy\.held|version_converter says"
)
_PAIR = re.compile(r"opset \d+ to \d+")
_NODE = re.compile(r"\bnode\b")


@dataclass(frozen=True)
class Outcome:
    """The class of one conversion (:data:`STATUSES`) and what explains it (error text, first differing output)."""

    status: str
    detail: str = ""


def user_terms_refusal(message: str) -> bool:
    """Whether a refusal names the node, the op's opset pair and a reason, without internal vocabulary."""
    return bool(_PAIR.search(message) and _NODE.search(message)) and not _INTERNAL.search(message)


@functools.cache
def _cpu_kernels() -> dict[tuple[str, str], list[tuple[int, int]]]:
    """ORT's CPU kernel registry: ``(domain, op) -> [(first, last) opset]`` (``get_all_opkernel_def``)."""
    from onnxruntime.capi import _pybind_state as C  # noqa: PLC0415

    table: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for k in C.get_all_opkernel_def():
        if k.provider == "CPUExecutionProvider":
            domain = "" if k.domain in ("", "ai.onnx") else k.domain
            table.setdefault((domain, k.op_name), []).append(tuple(k.version_range))
    return table


def ort_registers(model: onnx.ModelProto) -> list[str]:
    """The default-domain ops of ``model`` ORT's CPU EP registers no kernel for at their version (``Op-since``).

    ``Constant`` (ORT folds it into an initializer) and ops with an ONNX function body (ORT inlines the body
    where it has no kernel) need no kernel and are not listed.
    """
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    missing = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            continue
        since = schema.since_version
        if node.op_type == "Constant" or schema.has_function or schema.has_context_dependent_function:
            continue
        ranges = _cpu_kernels().get(("", node.op_type), [])
        if not any(lo <= since <= hi for lo, hi in ranges):
            missing.append(f"{node.op_type}-{since}")
    return missing


def as_value(x: object) -> object:
    """A data-set entry as ORT takes and returns it: TensorProto and numpy scalars become arrays, lists recurse."""
    if isinstance(x, onnx.TensorProto):
        return onnx.numpy_helper.to_array(x)
    if isinstance(x, np.generic):
        return np.asarray(x)
    if isinstance(x, (list, tuple)):
        return [as_value(v) for v in x]
    return x


def _feeds(model: onnx.ModelProto, inputs: list) -> dict:
    inits = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    return {n: as_value(v) for n, v in zip(names, inputs, strict=False)}


def judge(model: onnx.ModelProto, case: NodeCase) -> Outcome:
    """Classify a converted model of ``case``: checker, ORT session, then every data set against its outputs."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # ValidationError, InferenceError
        return Outcome("invalid", str(exc).strip().splitlines()[0][:300])
    try:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises Fail / InvalidGraph / NotImplemented
        text = str(exc).strip().splitlines()[0][:300]
        missing = sorted(set(ort_registers(model)))
        lacks = "NOT_IMPLEMENTED" in text or "Could not find an implementation" in text
        why = (f"no kernel: {missing}; " if missing else "") + text
        return Outcome("ort_no_kernel" if lacks else "ort_refuses", why)
    for i, (inputs, expected) in enumerate(case.data_sets):
        try:
            got = session.run(None, _feeds(model, inputs))
        except Exception as exc:  # ORT raises RuntimeException / Fail / InvalidArgument
            return Outcome("ort_fails", f"data set {i}: {str(exc).strip().splitlines()[0][:300]}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Runner.assert_similar_outputs([as_value(e) for e in expected], got, case.rtol, case.atol)
        except Exception as exc:  # AssertionError, TypeError
            return Outcome("wrong", f"data set {i}: {' '.join(str(exc).split())[:300]}")
    return Outcome("correct")


_BASELINE_CASES: dict[str, bool] = {}


def in_baseline(case: NodeCase) -> bool:
    """Whether ORT CPU runs ``case`` correctly at its own opset (memoised per test name)."""
    if case.name not in _BASELINE_CASES:
        _BASELINE_CASES[case.name] = judge(case.model, case).status == "correct"
    return _BASELINE_CASES[case.name]


def convert_with_pin_opset(case: NodeCase, target: int, **config: object) -> tuple[onnx.ModelProto | None, Outcome]:
    """Run ``pin_opset`` (its real entry point) on ``case`` to ``target``: the written model, or a refusal/crash.

    Returns ``(model, Outcome("written"))`` on success; ``(None, Outcome("refused"|"refused_internal"|"crash"))``
    otherwise. A crash is an exception the pass wrapped (not one of onnxdeploy's typed errors it raised itself).
    """
    try:
        result = PinOpsetPass(PinOpsetConfig(opset=target, **config))(
            ir.serde.deserialize_model(case.model), make_pass_context()
        )
        return ir.serde.serialize_model(result.artifacts.primary), Outcome("written")
    except PassError as exc:
        cause = exc.__cause__
        wrapped = (
            cause is not None
            and not isinstance(cause, OnnxDeployError)
            and exc.detail.startswith(f"{type(cause).__name__}:")
        )
        if wrapped:
            return None, Outcome("crash", exc.detail[:300])
        status = "refused" if user_terms_refusal(exc.detail) else "refused_internal"
        return None, Outcome(status, exc.detail[:400])
    except Exception as exc:  # noqa: BLE001  (anything else is a crash to count)
        return None, Outcome("crash", f"{type(exc).__name__}: {exc}"[:300])


def convert_with_onnx(case: NodeCase, target: int) -> tuple[onnx.ModelProto | None, Outcome]:
    """Run ``onnx.version_converter.convert_version`` on ``case`` to ``target`` (the baseline converter)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return version_converter.convert_version(case.model, target), Outcome("written")
    except Exception as exc:  # noqa: BLE001  (the converter raises RuntimeError/ValueError/InferenceError)
        return None, Outcome("refused", " ".join(str(exc).split())[:300])


def outcome(case: NodeCase, target: int, converter: str = "pin_opset", **config: object) -> Outcome:
    """Convert ``case`` to ``target`` with ``converter`` (``pin_opset``, with ``config``, or ``onnx``); judge it."""
    if converter == "pin_opset":
        model, result = convert_with_pin_opset(case, target, **config)
    else:
        model, result = convert_with_onnx(case, target)
    if model is None:
        return result
    return judge(model, case)
