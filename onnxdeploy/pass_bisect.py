"""Which pass broke it, and where: a short decode after each pass, and the first diverging node of a pass.

``verify_each_pass`` (pipeline key) decodes a few positions of every pass's output against the original
(:func:`verify_pass_output`; a graph set is written whole and driven as the runner drives a set); the first
pass over the thresholds is named (:class:`EachPassVerifier`). ``bisect`` (pipeline key and
``onnxdeploy run --bisect``) then compares that pass's input and output graph node by node
(:func:`first_divergent_node`; of a set, the primary graphs): both graphs get every node output as an extra
graph output (on copies that share the weights, written with :func:`onnxdeploy.model_io.write_for_ort`), both
are decoded over the same tokens, and each intermediate of the pass's input is mapped to one of its output — by
name where both graphs have a value of that name and shape, else by data flow and value: a value of the same
dtype and shape holding the same numbers. The first node, in the input graph's order, whose output maps to a
value holding other numbers, or to none while every input of the node maps, is the first diverging node.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.contract import read_contract
from onnxdeploy.model_io import proto_round_trip, stage_artifacts, write_for_ort
from onnxdeploy.report import NodeDivergence, PassVerifyRecord
from onnxdeploy.runner import ContractDecoder, Decoder, make_decoder, open_session, verify
from onnxdeploy.runner.graph_set import Remainder

if TYPE_CHECKING:
    from onnxdeploy.config import VerifyConfig

__all__ = ["EACH_PASS_STEPS", "EachPassVerifier", "first_divergent_node", "verify_pass_output", "write_set_for_ort"]

EACH_PASS_STEPS = 4
"""Generated positions decoded after each pass by ``verify_each_pass`` (after the verify prompt)."""


def write_set_for_ort(artifacts: ArtifactSet, folder: str | Path) -> Path:
    """Write every graph of ``artifacts`` side by side under ``folder``, for ONNX Runtime to open by path.

    The file names a contract's ``graph_set`` lists then resolve beside the primary. A lone graph is written by
    :func:`onnxdeploy.model_io.write_for_ort` (the input data files it maps are hard-linked, not copied); a set
    as the run writes it, by :func:`onnxdeploy.model_io.stage_artifacts` with one external data file, so a
    weight the graphs share is written once (per-graph ``write_for_ort`` would copy it for every graph).

    Args:
        artifacts: the graph set (or a single graph), primary first.
        folder: an existing scratch folder the caller removes later.

    Returns:
        The path of the primary's ``.onnx``.
    """
    primary = artifacts.artifacts[0]
    if len(artifacts.artifacts) == 1:
        return write_for_ort(primary.model, folder, primary.name)
    staged = stage_artifacts(
        [(a.name, a.model) for a in artifacts.artifacts], Path(folder), external=True, data_name="weights.data"
    )
    return staged.path(primary.name)


def verify_pass_output(
    original: str | Path,
    artifacts: ArtifactSet,
    pass_name: str,
    *,
    prompt: Sequence[int],
    steps: int,
    max_abs_logit_diff: float,
    min_top1_agreement: float,
    remainder: Remainder = "padded",
) -> PassVerifyRecord:
    """Decode ``prompt`` + ``steps`` teacher-forced positions of a pass's output against the original.

    Args:
        original: the input model file (exporter convention or contract).
        artifacts: the pass's output, every graph of it (a graph set is driven as a set: prompt through the
            buckets, cache-length switches); written to a scratch folder for ORT.
        pass_name: for the record.
        prompt: token ids.
        steps: generated positions after the prompt.
        max_abs_logit_diff: largest allowed |logit difference|.
        min_top1_agreement: smallest allowed fraction of positions with the same argmax.
        remainder: a graph set's remainder policy, ``padded`` or ``buckets`` (``verify.remainder``).

    Returns:
        The record; ``diverged`` is True when a threshold is broken.

    Raises:
        DecodeRunError / ContractError: the output cannot be decoded (as :func:`onnxdeploy.runner.verify`).
    """
    with tempfile.TemporaryDirectory(prefix="onnxdeploy-each-pass-") as folder:
        path = write_set_for_ort(artifacts, folder)
        report = verify(
            str(original),
            str(path),
            prompt=list(prompt),
            steps=steps,
            modes=("teacher_forced",),
            max_abs_logit_diff=max_abs_logit_diff,
            min_top1_agreement=min_top1_agreement,
            remainder=remainder,
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


class EachPassVerifier:
    """``verify_each_pass`` / ``bisect``: a short decode after each pass, the first diverging pass and node.

    Args:
        original: the input model file.
        verify: the pipeline's ``verify`` section (prompt, thresholds, remainder); None verifies nothing.
        enabled: ``verify_each_pass``.
        bisect: ``bisect``: compare the first diverging pass's input and output node by node.
    """

    def __init__(self, original: Path, verify: VerifyConfig | None, *, enabled: bool, bisect: bool) -> None:
        self.original = original
        self.verify = verify if enabled else None
        self.bisect = bisect
        self.records: list[PassVerifyRecord] = []
        self.first_pass: str | None = None
        self.node: NodeDivergence | None = None
        self.note: str | None = None

    def wants_input(self) -> bool:
        """Whether the next pass's input must be kept (bisect, nothing diverged yet)."""
        return self.bisect and self.first_pass is None

    def after(self, name: str, before: ir.Model | None, after: ArtifactSet, say: Callable[[str], None]) -> None:
        """Decode the pass's output set; on the first divergence (with bisect) compare its primary node by node.

        Args:
            name: the pass.
            before: the primary graph the pass was given (kept when :meth:`wants_input`), else None.
            after: the artifact set it returned.
            say: progress lines.
        """
        v = self.verify
        if v is None:
            return
        say(f"verify after pass {name}")
        record = verify_pass_output(
            self.original,
            after,
            name,
            prompt=list(v.prompt),
            steps=min(v.steps, EACH_PASS_STEPS),
            max_abs_logit_diff=v.max_abs_logit_diff,
            min_top1_agreement=v.min_top1_agreement,
            remainder=v.remainder,
        )
        self.records.append(record)
        if not record.diverged or self.first_pass is not None:
            return
        self.first_pass = name
        if self.bisect and before is not None:
            self._bisect(name, before, after, list(v.prompt), say)

    def _bisect(
        self, name: str, before: ir.Model, after: ArtifactSet, prompt: list[int], say: Callable[[str], None]
    ) -> None:
        """Find the first node of the pass's input primary whose output its output primary does not reproduce."""
        if _io_names(before) != _io_names(after.primary):
            self.note = f"bisect: pass {name} changes the graph's inputs/outputs; its nodes were not compared"
            return
        say(f"bisect: comparing the input and output of pass {name} node by node")
        found = first_divergent_node(before, after.primary, prompt)
        self.node = found.model_copy(update={"pass_name": name}) if found is not None else None
        if found is None and len(after.artifacts) > 1:
            self.note = (
                f"bisect: the primary graph {after.artifacts[0].name} reproduces pass {name}'s input; the "
                "divergence is in another graph of the set"
            )

    def failures(self) -> list[str]:
        """Lines for ``report.failures``: the first diverging pass, and its first diverging node if found."""
        if self.first_pass is None:
            return []
        line = f"verify_each_pass: pass {self.first_pass} is the first whose output diverges from the original"
        if self.node is not None:
            line += f"; first diverging node: {self.node.op_type} '{self.node.node}' (output {self.node.output})"
        elif self.note:
            line += f"; {self.note}"
        return [line]


def _io_names(model: ir.Model) -> tuple[list[str], list[str]]:
    return [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]


def _open_alone(path: Path) -> Decoder:
    """A decode loop over the graph at ``path`` only: a step-1 graph of a set is driven alone (no sibling read)."""
    session = open_session(path)
    try:
        contract = read_contract(session.model, source=str(path))
        if contract is not None and contract.step_len == 1:
            return ContractDecoder(session, contract)
        return make_decoder(session)
    except BaseException:
        session.close()
        raise


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
    with _open_alone(path) as decoder:
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
