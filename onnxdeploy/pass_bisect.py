"""Which pass broke it, and where: a short decode after each pass, and the first diverging node of a pass.

``verify_each_pass`` (pipeline key) decodes a few positions of every pass's output against the original
(:func:`verify_pass_output`); the first pass over the thresholds is named. ``bisect`` (pipeline key and
``onnxdeploy run --bisect``) then compares that pass's input and output graph node by node
(:func:`first_divergent_node`): both graphs get every node output as an extra graph output (on copies that
share the weights, written with :func:`onnxdeploy.model_io.write_for_ort`), both are decoded over the same
tokens, and each intermediate of the pass's input is mapped to one of its output — by name where both graphs
have a value of that name and shape, else by data flow and value: a value of the same dtype and shape
holding the same numbers. The first node, in the input graph's order, whose output maps to a value holding
other numbers, or to none while every input of the node maps, is the first diverging node.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxdeploy.model_io import proto_round_trip, write_for_ort
from onnxdeploy.report import NodeDivergence, PassVerifyRecord
from onnxdeploy.runner import open_decoder, verify

__all__ = ["first_divergent_node", "verify_pass_output"]


def verify_pass_output(
    original: str | Path,
    model: ir.Model,
    pass_name: str,
    *,
    prompt: Sequence[int],
    steps: int,
    max_abs_logit_diff: float,
    min_top1_agreement: float,
) -> PassVerifyRecord:
    """Decode ``prompt`` + ``steps`` teacher-forced positions of a pass's output against the original.

    Args:
        original: the input model file (exporter convention or contract).
        model: the pass's output graph (the set's primary); written to a scratch folder for ORT.
        pass_name: for the record.
        prompt: token ids.
        steps: generated positions after the prompt.
        max_abs_logit_diff: largest allowed |logit difference|.
        min_top1_agreement: smallest allowed fraction of positions with the same argmax.

    Returns:
        The record; ``diverged`` is True when a threshold is broken.

    Raises:
        DecodeRunError / ContractError: the output cannot be decoded (as :func:`onnxdeploy.runner.verify`).
    """
    with tempfile.TemporaryDirectory(prefix="onnxdeploy-each-pass-") as folder:
        path = write_for_ort(model, folder)
        report = verify(
            str(original),
            str(path),
            prompt=list(prompt),
            steps=steps,
            modes=("teacher_forced",),
            max_abs_logit_diff=max_abs_logit_diff,
            min_top1_agreement=min_top1_agreement,
        )
    mode = report.modes["teacher_forced"]
    return PassVerifyRecord(
        name=pass_name,
        positions=len(prompt) + steps,
        max_abs_logit_diff=mode.max_abs_logit_diff,
        top1_agreement=mode.top1_agreement,
        first_divergent_step=mode.first_divergent_step,
        diverged=not report.passed,
    )


def _with_intermediates(model: ir.Model) -> tuple[ir.Model, list[str]]:
    """A copy of ``model`` (same weight tensors) whose every typed node output is also a graph output."""
    inferred = proto_round_trip(model, lambda p: onnx.shape_inference.infer_shapes(p, data_prop=True), threshold=-1)
    graph = inferred.graph
    outputs = {v.name for v in graph.outputs}
    names = []
    for node in graph:
        for value in node.outputs:
            if value.name and value.dtype is not None and value.name not in outputs and value.type is not None:
                if value.dtype in (ir.DataType.UNDEFINED, ir.DataType.STRING):
                    continue
                graph.outputs.append(value)
                outputs.add(value.name)
                names.append(value.name)
    return inferred, names


def _intermediates(model: ir.Model, tokens: Sequence[int], folder: Path) -> tuple[ir.Model, list[dict]]:
    """Decode ``tokens`` on ``model`` with every intermediate fetched: one ``name -> array`` per session run."""
    copy, names = _with_intermediates(model)
    path = write_for_ort(copy, folder)
    with open_decoder(path) as decoder:
        decoder.extra_outputs = names
        decoder.feed(list(tokens))
        runs = list(decoder.extra_results)
    return copy, runs


def _same(a: np.ndarray, b: np.ndarray, atol: float) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "biu":
        return bool(np.array_equal(a, b))
    with np.errstate(invalid="ignore"):
        return bool(np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-4, atol=atol, equal_nan=True))


def first_divergent_node(
    before: ir.Model, after: ir.Model, tokens: Sequence[int], *, atol: float = 1e-4
) -> NodeDivergence | None:
    """The first node of ``before`` (a pass's input) whose output ``after`` (its output) does not reproduce.

    Args:
        before: the graph the pass was given.
        after: the graph it returned (the same I/O names: the runner drives both the same way).
        tokens: token ids to decode (a short prompt); intermediates are compared call by call.
        atol: absolute tolerance on top of a 1e-4 relative one.

    Returns:
        The divergence (node and op in ``before``, how its output was mapped, the largest difference, the
        nodes of ``after`` reading the same mapped inputs), or None when every mapped value agrees.
    """
    with tempfile.TemporaryDirectory(prefix="onnxdeploy-bisect-") as scratch:
        (Path(scratch) / "a").mkdir()
        (Path(scratch) / "b").mkdir()
        copy_a, runs_a = _intermediates(before, tokens, Path(scratch) / "a")
        copy_b, runs_b = _intermediates(after, tokens, Path(scratch) / "b")
    for call, (values_a, values_b) in enumerate(zip(runs_a, runs_b, strict=False)):
        found = _first_in_call(copy_a, copy_b, values_a, values_b, atol)
        if found is not None:
            return found.model_copy(update={"call": call})
    return None


def _first_in_call(
    graph_a: ir.Model, graph_b: ir.Model, values_a: dict, values_b: dict, atol: float
) -> NodeDivergence | None:
    by_shape: dict[tuple, list[str]] = {}
    for name, array in values_b.items():
        by_shape.setdefault((array.shape, array.dtype.str), []).append(name)
    mapped: dict[str, str | None] = {}  # before value -> after value (None: no counterpart)
    for value in graph_a.graph.inputs:
        mapped[value.name] = value.name
    for name in graph_a.graph.initializers:
        mapped[name] = name
    producers_b = {v.name: node for node in graph_b.graph for v in node.outputs}
    for node in graph_a.graph:
        inputs_mapped = all(v is None or mapped.get(v.name) is not None for v in node.inputs)
        for value in node.outputs:
            array = values_a.get(value.name)
            if array is None:
                mapped[value.name] = None
                continue
            other = values_b.get(value.name)
            how = "name"
            if other is None or other.shape != array.shape:
                how = "value"
                match = next(
                    (n for n in by_shape.get((array.shape, array.dtype.str), []) if _same(array, values_b[n], atol)),
                    None,
                )
                other = values_b[match] if match is not None else None
                mapped[value.name] = match
            else:
                mapped[value.name] = value.name
            if other is not None and _same(array, other, atol):
                continue
            if other is None and not inputs_mapped:
                continue  # the pass changed what feeds it: the cause is upstream and was reported there, or mapped
            readers = sorted(
                {
                    (n.name or n.op_type)
                    for v in node.inputs
                    if v is not None and mapped.get(v.name)
                    for n in graph_b.graph
                    if any(i is not None and i.name == mapped[v.name] for i in n.inputs)
                }
            )
            counterpart = producers_b.get(value.name) if how == "name" else None
            diff = None if other is None else float(np.max(np.abs(array.astype(np.float64) - other.astype(np.float64))))
            return NodeDivergence(
                node=node.name or f"{node.op_type} #{list(graph_a.graph).index(node)}",
                op_type=node.op_type,
                output=value.name,
                mapped_by=how if other is not None else "none",
                counterpart_node=(counterpart.name if counterpart is not None else None),
                max_abs_diff=diff,
                nodes_in_output_reading_same_inputs=readers[:10],
            )
    return None
