"""The passes' one way to run ONNX Runtime: a probe model written to scratch, opened through the context.

A pass that must *run* a graph to decide a rewrite (``static_kv`` finding the exporter's query positions,
``mask_rewrite`` reading the exporter's mask, ``quantize_weights`` collecting calibration statistics) builds a
probe here and opens it with the :class:`~onnxdeploy.passes._context.PassContext`'s ``session_factory`` (the
runner's sessions, injected by the pipeline): one set of session options for every probe and every
verification, prepacking off so mapped weights stay mapped. The probe is a structural copy (``clone``: no
weight copied) pruned to what computes the values asked for, written with
:func:`onnxdeploy.model_io.write_for_ort` (input weights hard-linked, never copied); a bfloat16 probe runs as its
float32 shadow (ORT's CPU EP has no bfloat16 kernels). Session and folder are released on exit.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator

import onnx_ir as ir

from onnxdeploy import model_io
from onnxdeploy.contract import DecodeContract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import float32_shadow_graph
from onnxdeploy.passes._context import CalibrationDecoder, PassContext, ProbeSession
from onnxdeploy.passes._edit import clone, remove_dead_nodes

__all__ = ["calibration_decoder", "open_probe", "pruned_copy"]


def pruned_copy(
    model: ir.Model, outputs: list[str], *, keep_outputs: bool = False, keep_inputs: bool = False, shadow: bool = True
) -> ir.Model:
    """A copy of ``model`` whose graph outputs are ``outputs``, pruned to what computes them.

    Args:
        model: the graph (unchanged; the copy shares its tensors).
        outputs: names of values to make outputs (any value of the main graph).
        keep_outputs: keep the graph's own outputs too (and every input), appending ``outputs``: a decode loop
            then still drives it through its contract or the exporter convention.
        keep_inputs: keep every graph input, read or not (the caller feeds them all by name).
        shadow: make a bfloat16 copy its float32 shadow (:func:`onnxdeploy.graph.float32_shadow_graph`).

    Returns:
        The probe model; graph inputs nothing reads are dropped unless ``keep_outputs`` or ``keep_inputs``.

    Raises:
        KeyError: a name of ``outputs`` is no value of the graph.
    """
    probe = clone(model)
    values = ir.convenience.create_value_mapping(probe.graph)
    if not keep_outputs:
        probe.graph.outputs.clear()
    for name in outputs:
        probe.graph.outputs.append(values[name])
    if not keep_outputs:
        remove_dead_nodes(probe)
    if not (keep_outputs or keep_inputs):
        used = {id(v) for node in probe.graph for v in node.inputs if v is not None}
        used |= {id(v) for v in probe.graph.outputs}
        for value in list(probe.graph.inputs):
            if id(value) not in used:
                probe.graph.inputs.remove(value)
    if shadow:
        float32_shadow_graph(probe)
    return probe


@contextlib.contextmanager
def open_probe(probe: ir.Model, context: PassContext, *, who: str, what: str = "probe") -> Iterator[ProbeSession]:
    """Write ``probe`` to a scratch folder and open it with ``context.session_factory``; close and remove on exit.

    Args:
        probe: the model to run (e.g. from :func:`pruned_copy`).
        context: the pass context (its scratch folder and session factory).
        who: the pass named in errors.
        what: what the probe is, for the error ("the original model", "the mask probe").

    Yields:
        The open session (``.session`` is the ``onnxruntime.InferenceSession``).

    Raises:
        PreconditionError: ONNX Runtime cannot load the probe (names ``who`` and ``what``).
    """
    folder = tempfile.mkdtemp(prefix=f"{who}-probe-", dir=context.scratch())
    opened: ProbeSession | None = None
    try:
        path = model_io.write_for_ort(probe, folder)
        try:
            opened = context.session_factory(path)
        except Exception as exc:  # ORT raises several unrelated exception types
            raise PreconditionError(who, f"ONNX Runtime cannot load {what}: {exc}") from exc
        yield opened
    finally:
        if opened is not None:
            opened.close()
        shutil.rmtree(folder, ignore_errors=True)


def calibration_decoder(
    context: PassContext, session: ProbeSession, contract: DecodeContract | None, *, who: str
) -> CalibrationDecoder:
    """The context's decode loop over ``session`` (its contract, or the exporter convention without one).

    Raises:
        PreconditionError: the context supplies no decoder factory (calibration needs the runner's decode loop).
    """
    if context.decoder_factory is None:
        raise PreconditionError(
            who, "calibration needs a decode loop, and the pass context has none (build it with make_pass_context)"
        )
    return context.decoder_factory(session, contract)
