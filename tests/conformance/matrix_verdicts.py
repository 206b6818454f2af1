"""What the runtimes really do with a node-test model, beside what a target's matrix predicts.

Shared by the cross-check test (``tests/conformance/test_matrix_crosscheck.py``, a sample) and
``benchmarks/matrix_check.py`` (the whole suite). Verdicts:

- :func:`ort_verdict`: ``works`` (ORT's CPU EP opens the model, runs every data set and matches onnx's
  expected outputs within the case's ``rtol``/``atol``, the comparison onnx's backend runner makes),
  ``refused`` (session creation fails), ``fails`` (a run raises), ``different`` (outputs differ),
  ``imprecise`` (outputs differ at onnx's per-element tolerance but every difference is within ``rtol`` of the
  output's largest magnitude: float32/float16 rounding of a sum, as ORT's FFT gives on DFT/STFT, where onnx's
  ``atol`` of 1e-7 on outputs of magnitude ~500 is below float32's resolution; see :func:`within_scale`), or
  ``untested`` (after the session opened: a data set holds a packed sub-byte tensor, int4/uint4/int2/uint2/
  float4, which ORT's Python API cannot feed or return as numpy);
- :func:`openvino_verdict`: ``compiles`` or ``refused`` (``openvino.Core().read_model`` + ``compile_model``
  on ``CPU`` raises);
- :func:`predicted`: the target checks' answer (``checks.target.predict_supported``).

Sessions run one intra-op thread with spinning off (the machine is shared).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import onnxruntime as ort

from onnxdeploy.checks.target import predict_supported
from tests.conformance.node_cases import NodeCase

__all__ = ["as_value", "openvino_verdict", "ort_verdict", "outputs_match", "predicted", "within_scale"]


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def as_value(value):
    """A data-set value as ORT takes and returns it: TensorProto and numpy scalars as arrays, lists element-wise."""
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    if isinstance(value, list):
        return [as_value(v) for v in value]
    if isinstance(value, np.generic):
        return np.asarray(value)
    return value


_SUB_BYTE = {"int4", "uint4", "int2", "uint2", "float4_e2m1fn"}
"""ml_dtypes names of packed sub-byte types: ORT's Python API cannot take or give them unpacked."""


_ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"}
"""ml_dtypes names ORT's Python API takes only as OrtValues of their ONNX type and returns as unsigned ints."""


def _untestable(values) -> bool:
    """Whether a data set holds a sub-byte tensor ORT's Python API cannot feed or return (``_SUB_BYTE``)."""
    return any(
        _untestable(v) if isinstance(v, list) else (isinstance(v, np.ndarray) and v.dtype.name in _SUB_BYTE)
        for v in values
    )


def _feed(value, elem_type: int):
    """An ORT feed: an ml_dtypes array (bfloat16, float8) as an OrtValue of its ONNX type, the rest as it is."""
    if isinstance(value, np.ndarray) and value.dtype.name in _ML_DTYPES:
        raw = value.view(np.uint8 if value.dtype.itemsize == 1 else np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, elem_type)
    return value


def _as_expected(expected, actual):
    """ORT returns bfloat16/float8 outputs as unsigned ints of their bytes: view them as the expected type."""
    if isinstance(expected, np.ndarray) and isinstance(actual, np.ndarray) and expected.dtype.name in _ML_DTYPES:
        if actual.dtype.kind == "u" and actual.dtype.itemsize == expected.dtype.itemsize:
            return actual.view(expected.dtype)
    return actual


def outputs_match(expected, actual, rtol: float, atol: float) -> bool:
    """Whether ``actual`` matches ``expected`` as onnx's backend runner compares them.

    Arrays: same dtype (strings/objects compared exactly), ``np.testing.assert_allclose(rtol, atol)`` with NaNs
    equal; sequences (lists) element by element; ``None`` (an empty optional) only matches ``None``.
    Source: ``onnx/backend/test/runner/__init__.py`` ``assert_similar_outputs`` (onnx 1.23.2).
    """
    if expected is None or actual is None:
        return expected is None and actual is None
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return False
        return all(outputs_match(e, a, rtol, atol) for e, a in zip(expected, actual, strict=True))
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.dtype == object or expected.dtype.kind in "SU":
        return expected.shape == actual.shape and bool(np.all(expected.astype(str) == actual.astype(str)))
    if expected.dtype != actual.dtype or expected.shape != actual.shape:
        return False
    if expected.dtype.kind in "fcV":  # V: ml_dtypes (bfloat16, float8, int4)
        try:
            np.testing.assert_allclose(
                actual.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True
            )
        except AssertionError:
            return False
        return True
    try:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)
    except (AssertionError, TypeError):
        return bool(np.array_equal(actual, expected))
    return True


def within_scale(expected, actual, rtol: float) -> bool:
    """Whether float outputs of the same dtype and shape differ by at most ``rtol`` times ``max |expected|``.

    The relative tolerance applied to the output's scale instead of to each element: what float rounding of a
    sum of many terms gives (an element that should be 0 comes out ~1e-6 of the scale). NaN/inf positions must
    match exactly; sequences element by element.
    """
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(within_scale(e, a, rtol) for e, a in zip(expected, actual, strict=True))
        )
    if expected is None or actual is None:
        return False
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.dtype != actual.dtype or expected.shape != actual.shape or expected.dtype.kind not in "fV":
        return False
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    finite = np.isfinite(e)
    if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(e[~finite], a[~finite], equal_nan=True):
        return False
    if not finite.any():
        return True
    return bool(np.max(np.abs(e[finite] - a[finite])) <= rtol * np.max(np.abs(e[finite])))


def ort_verdict(case: NodeCase) -> str:
    """``works`` / ``imprecise`` / ``refused`` / ``fails`` / ``different`` / ``untested`` for ``case`` on ORT's CPU EP.

    See the module docstring; ``imprecise`` only when no data set is ``different``.
    """
    try:
        session = ort.InferenceSession(case.model.SerializeToString(), _options(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any refusal counts
        return "refused"
    inputs = [i.name for i in session.get_inputs()]
    declared = [(i.name, i.type.tensor_type.elem_type) for i in case.model.graph.input]
    verdict = "works"
    for feeds, expected in case.data_sets:
        values, expected = [as_value(v) for v in feeds], [as_value(e) for e in expected]
        if _untestable(values) or _untestable(expected):
            return "untested"
        feed = {name: _feed(v, elem) for (name, elem), v in zip(declared, values, strict=False) if name in inputs}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = session.run(None, feed)
        except Exception as exc:  # noqa: BLE001 - any run error counts
            # a bfloat16 output ran but ORT's Python API cannot hand it over as numpy
            return "untested" if "No corresponding Numpy type" in str(exc) else "fails"
        if len(got) != len(expected):
            return "different"
        pairs = [(e, _as_expected(e, a)) for e, a in zip(expected, got, strict=True)]
        off = [(e, a) for e, a in pairs if not outputs_match(e, a, case.rtol, case.atol)]
        if off and all(within_scale(e, a, case.rtol) for e, a in off):
            verdict = "imprecise"
        elif off:
            return "different"
    return verdict


@functools.cache
def _core():
    import openvino as ov

    return ov.Core()


def openvino_verdict(model: onnx.ModelProto) -> str:
    """``compiles`` or ``refused``: ``openvino.Core().compile_model(model, "CPU")`` on the model's bytes."""
    core = _core()
    try:
        core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU")
    except Exception:  # noqa: BLE001 - any refusal counts
        return "refused"
    return "compiles"


def predicted(model: onnx.ModelProto, target: str) -> bool:
    """Whether the target checks predict ``target`` takes ``model`` (``checks.target.predict_supported``)."""
    return predict_supported(model, target)[0]
