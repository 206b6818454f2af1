"""``pin_opset``'s proof: the input and the converted graph run on the same random feeds, outputs compared.

A conversion that writes a model proves it on ONNX Runtime CPU through the toolkit's probe service
(:func:`onnxdeploy.passes._probe.open_probe`: the runner's sessions, one intra-op thread): every graph input
gets a random feed drawn from a fixed seed (floats standard normal, integers in ``[0, 3)``, bools uniform;
a symbolic dim is 2), both graphs run, and every output must match: same shape; floats within
:data:`TOLERANCE` (``rtol=1e-3, atol=1e-4`` for float32), NaN equal to NaN; other dtypes exactly. A
mismatch, or a converted graph that fails where the input ran, is a refusal
(:class:`~onnxdeploy.errors.PassError`); what cannot be run (an input dtype ORT cannot feed, feeds the input
itself rejects, a kernel ORT lacks) is reported as not proven, with the reason.

Skipped for decoders (a graph input named ``past_key_values.*`` or a decode contract in its metadata: the
pipeline's ``verify`` decodes those) and for graphs whose weights exceed :data:`PROVE_MAX_BYTES`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxdeploy.errors import PassError, PreconditionError
from onnxdeploy.graph import numpy_dtype_of
from onnxdeploy.passes._catalog import PROVE_MAX_BYTES
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._opset_schemas import node_label
from onnxdeploy.passes._probe import open_probe

__all__ = ["PROVE_MAX_BYTES", "TOLERANCE", "Proof", "prove_conversion", "why_not_proven"]

TOLERANCE = {"float16": (1e-2, 1e-2), "float32": (1e-3, 1e-4), "float64": (1e-6, 1e-9)}
"""``(rtol, atol)`` per float dtype. Exact rewrites may reorder float ops (Softmax on a moved axis) and a
function body (``Attention``'s, onnx's own definition) is not ORT's fused kernel: the same order of error as
onnx's backend tests allow (``rtol=1e-3``), far below what a misplaced or dropped operand gives."""

_WHO = "pin_opset"


@dataclass(frozen=True)
class Proof:
    """What the proof found: ``proven`` and a line for the report (the reason when not proven)."""

    proven: bool
    line: str


def why_not_proven(model: ir.Model) -> str | None:
    """Why ``model`` is not proven by default (a decoder, or weights above :data:`PROVE_MAX_BYTES`), else None."""
    names = [v.name or "" for v in model.graph.inputs]
    if any(n.startswith("past_key_values.") for n in names) or "onnxdeploy.contract" in model.metadata_props:
        return "a decoder (verify decodes it)"
    weights = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if weights > PROVE_MAX_BYTES:
        return f"weights of {weights / 2**20:.0f} MiB exceed the proof's bound of {PROVE_MAX_BYTES // 2**20} MiB"
    return None


def _feeds(model: ir.Model) -> dict[str, np.ndarray] | str:
    """Random feeds for every graph input that is no initializer, else why none can be drawn."""
    rng = np.random.default_rng(0)
    feeds = {}
    for value in model.graph.inputs:
        if value.name in model.graph.initializers:
            continue
        if not isinstance(value.type, ir.TensorType) or value.dtype is None or value.shape is None:
            return f"input '{value.name}' is not a tensor of known type and rank"
        try:
            dtype = np.dtype(numpy_dtype_of(value.dtype))
        except Exception:  # noqa: BLE001  (a dtype numpy has no form for)
            return f"input '{value.name}' is {value.dtype.name}, which numpy cannot draw"
        dims = [d if isinstance(d, int) else 2 for d in value.shape]
        if dtype.kind == "f" and dtype.itemsize >= 2 and dtype.name in ("float16", "float32", "float64"):
            feeds[value.name] = rng.standard_normal(dims).astype(dtype)
        elif dtype.kind in "iu":
            feeds[value.name] = rng.integers(0, 3, dims).astype(dtype)
        elif dtype.kind == "b":
            feeds[value.name] = rng.random(dims) < 0.5
        else:
            return f"input '{value.name}' is {value.dtype.name}, which the proof does not draw"
    return feeds


def _run(model: ir.Model, feeds: dict, context: PassContext, what: str) -> list | str:
    """Outputs of ``model`` on ``feeds``, or ``"open: <error>"`` / ``"run: <error>"``."""
    try:
        with open_probe(model, context, who=_WHO, what=what) as opened:
            try:
                return opened.session.run(None, feeds)
            except Exception as exc:  # ORT raises several unrelated exception types  # noqa: BLE001
                return f"run: {_first_line(exc)}"
    except PreconditionError as exc:
        return f"open: {exc.detail}"


def _ort_node(text: str) -> str:
    """`` at its <op> node '<name>'`` from an ORT error that names one (session or run), else ``""``."""
    named = re.search(r"Node \(([^)]*)\) Op \(([^)]*)\)|running (\w+) node\. Name:'([^']*)'", text)
    if not named:
        return ""
    name, op = (named[1], named[2]) if named[1] is not None else (named[4], named[3])
    return f" at its {op} node '{name}'"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _differs(a: object, b: object) -> str | None:
    """Why output ``b`` differs from ``a`` (shape, dtype, values; a sequence element by element), else None."""
    if isinstance(a, list) or isinstance(b, list):
        if not (isinstance(a, list) and isinstance(b, list)) or len(a) != len(b):
            return "sequence length or kind differs"
        whys = (_differs(x, y) for x, y in zip(a, b, strict=True))
        return next((f"element {i}: {w}" for i, w in enumerate(whys) if w), None)
    if a is None or b is None:
        return None if a is None and b is None else "optional presence differs"
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {b.shape} {b.dtype} instead of {a.shape} {a.dtype}"
    if a.dtype.kind == "f":
        rtol, atol = TOLERANCE.get(a.dtype.name, TOLERANCE["float16"])
        if np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            return None
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        return f"max |difference| {np.nanmax(diff):.3g}"
    return None if np.array_equal(a, b) else "values differ"


def prove_conversion(before: ir.Model, after: ir.Model, context: PassContext, pair: str) -> Proof:
    """Run ``before`` and ``after`` on the same random feeds; refuse a converted graph that computes otherwise.

    Args:
        before: the pass's input graph.
        after: the converted graph (same inputs and outputs, by position).
        context: the pass context (its session factory: the runner's, CPU, one thread).
        pair: the opset pair for messages (``opset 21 to 17``).

    Returns:
        The proof (``proven`` False, with the reason, when the graphs cannot be run as the proof needs).

    Raises:
        PassError: an output of ``after`` differs beyond :data:`TOLERANCE` (or in shape, dtype or exact
            values for non-floats), or ``after`` fails where ``before`` ran; names the output and the pair.
    """
    feeds = _feeds(before)
    if isinstance(feeds, str):
        return Proof(False, f"not proven on ORT: {feeds}")
    want = _run(before, feeds, context, "the input graph")
    if isinstance(want, str) and want.startswith("open:"):
        return Proof(False, f"not proven on ORT: ONNX Runtime cannot open the input graph ({want})")
    got = _run(after, feeds, context, "the converted graph")
    if isinstance(got, str):
        if "NOT_IMPLEMENTED" in got or "Could not find an implementation" in got:
            return Proof(False, f"not proven on ORT: ONNX Runtime lacks a CPU kernel the valid output needs ({got})")
        if got.startswith("open:") or not isinstance(want, str):  # the input opened (and ran): the output must too
            raise PassError(
                _WHO,
                f"converting {pair}: ONNX Runtime refuses or fails on the converted graph{_ort_node(got)} where "
                f"it takes the input ({got[-300:]}); nothing written",
            )
    if isinstance(want, str):
        return Proof(False, f"not proven on ORT: the input graph does not run on random feeds ({want})")
    assert not isinstance(got, str)
    outputs = list(after.graph.outputs)
    for value, a, b in zip(outputs, want, got, strict=True):
        why = _differs(a, b)
        if why is not None:
            producer = value.producer()
            made_by = f" ({producer.op_type} {node_label(producer)})" if producer is not None else ""
            raise PassError(
                _WHO,
                f"converting {pair}: output '{value.name}'{made_by} of the converted graph differs from the "
                f"input's on the same random feeds ({why}); the conversion is not exact, nothing written",
            )
    return Proof(True, f"proven on ORT CPU: {len(outputs)} output(s) match the input's on random feeds")
