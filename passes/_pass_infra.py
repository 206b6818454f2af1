"""The pass contract over a run's artifact set (the good parts of onnx_ir's ``passes/_pass_infra.py``).

A pass is a named, configured transformation of an :class:`ArtifactSet` — one or more ``onnx_ir`` graphs
(a decode graph, prefill buckets) whose initializers are the very same tensor objects, so weights stay
shared and memory-mapped — returning :class:`PassResult` ``(artifacts, modified, report)``. Like onnx_ir's
passes it declares whether it edits in place (``in_place``) or returns new graphs, has ``requires`` /
``ensures`` hooks whose failures are typed errors, and :meth:`Pass.__call__` wraps anything unexpected in
:class:`~onnxdeploy.errors.PassError` naming the pass. The input *files* are never modified: external
weights are mapped read-only and outputs are written elsewhere.

A pass that is not in place must not touch the graphs it was given; :meth:`Pass.__call__` checks that
the node objects of the input graphs are unchanged after it ran.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import types
import typing
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from pydantic import BaseModel, ConfigDict

from onnxdeploy.contract import DecodeContract, read_contract
from onnxdeploy.errors import ConfigError, OnnxDeployError, PassError, PostconditionError, PreconditionError
from onnxdeploy.graph import op_histogram
from onnxdeploy.model_io import WeightsPolicy, proto_round_trip
from onnxdeploy.report import PassReport

__all__ = [
    "ORDER_FACTS",
    "Artifact",
    "ArtifactSet",
    "Pass",
    "PassConfig",
    "PassContext",
    "PassResult",
    "PASS_REGISTRY",
    "PipelineSettings",
    "ScratchWriter",
    "get_pass",
    "pass_order_problem",
    "register_pass",
]


class PassConfig(BaseModel):
    """Base of every pass config: typed, described fields; unknown keys and coerced types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


@dataclass
class Artifact:
    """One graph of the run's output.

    Attributes:
        name: its output file name (``model.onnx``; prefill buckets get their own names).
        model: the in-memory graph; its initializers may be shared with the other artifacts.
    """

    name: str
    model: ir.Model


@dataclass
class ArtifactSet:
    """The graphs a run writes, sharing one set of weight tensors, and where the weights go.

    Today's single graph is a set of one. A pass applies to every graph it concerns, and a tensor
    object shared by several graphs is transformed (e.g. quantized) once.

    Attributes:
        artifacts: the graphs, in output order; the first is the primary (decode) graph.
        weights: the writer policy (inline or one shared external data file), set by ``externalize`` and
            ``embed_external_data``.
        input_was_external: the input model kept weights in external data (``auto`` keeps it so).
        notes: things the loader did that the run report should say (e.g. sorted at load).
    """

    artifacts: list[Artifact]
    weights: WeightsPolicy = field(default_factory=WeightsPolicy)
    input_was_external: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def primary(self) -> ir.Model:
        """The first graph (the decode graph)."""
        return self.artifacts[0].model

    def models(self) -> Iterator[ir.Model]:
        """Every graph, in output order."""
        return (a.model for a in self.artifacts)

    def weight_bytes(self) -> int:
        """Bytes of the distinct initializer tensors over all graphs (shared ones counted once)."""
        seen: dict[int, int] = {}
        for model in self.models():
            for value in model.graph.initializers.values():
                if value.const_value is not None:
                    seen[id(value.const_value)] = value.const_value.nbytes
        return sum(seen.values())

    def external(self) -> bool:
        """Whether the writer puts large weights into one external data file.

        ``auto`` with several graphs is external: inline, every graph would carry its own copy of the weights.
        """
        if len(self.artifacts) > 1 and self.weights.mode == "auto":
            return True
        return self.weights.external(self.weight_bytes(), self.input_was_external)

    def with_models(self, models: list[ir.Model]) -> ArtifactSet:
        """A new set with the same names, weights policy and notes, holding ``models`` (one per artifact, in order).

        Raises:
            ValueError: ``models`` does not have one entry per artifact.
        """
        if len(models) != len(self.artifacts):
            raise ValueError(f"expected {len(self.artifacts)} graphs, got {len(models)}")
        return ArtifactSet(
            [Artifact(a.name, m) for a, m in zip(self.artifacts, models, strict=True)],
            weights=self.weights,
            input_was_external=self.input_was_external,
            notes=list(self.notes),
        )

    def contracts(self, pass_name: str) -> Iterator[tuple[Artifact, DecodeContract]]:
        """Every graph with its decode contract, for passes that rewrite static graphs.

        Args:
            pass_name: the pass asking, named in the error.

        Raises:
            PreconditionError: a graph carries no contract (the message says to run ``static_kv`` first).
        """
        for artifact in self.artifacts:
            contract = read_contract(artifact.model, source=artifact.name)
            if contract is None:
                raise PreconditionError(
                    pass_name, f"graph '{artifact.name}' has no decode contract; run static_kv before {pass_name}"
                )
            yield artifact, contract

    def copy_graph(self, model: ir.Model) -> ir.Model:
        """A structural copy of ``model`` whose initializers hold the same tensor objects (no weight copied).

        Args:
            model: one of the set's graphs.

        Returns:
            A new ``ir.Model``; editing its graph leaves ``model`` untouched.
        """
        return proto_round_trip(model, lambda proto: proto, threshold=-1)


@dataclass
class PipelineSettings:
    """What a pass may validate its config against before anything runs (the config's non-pass sections).

    Attributes:
        verify_positions: ``len(prompt) + steps`` the runner will decode, or None without verification.
        verify_prompt_len: the prompt's length in tokens (None without verification).
        source: the pipeline file, for messages.
        calibration_tokens: tokens the ``calibration`` section provides at most (None without one).
    """

    verify_positions: int | None = None
    verify_prompt_len: int | None = None
    source: str = "pipeline"
    calibration_tokens: int | None = None


@dataclass
class PassContext:
    """What a pass needs that is not in the graph.

    Attributes:
        model_path: the input ``.onnx`` file (its folder holds the input's external data).
        target: a target id of ``matrices/`` or None.
        calibration: calibration prompts (token id lists) for passes that collect activations.
        session_factory: opens an ONNX Runtime session on a model path; the runner's own
            (:func:`onnxdeploy.runner.session.open_session`), so passes and verification share options.
        scratch_dir: a folder for probe models; removed by whoever made it.
        passes_run: names of the passes that already ran, for error messages.
    """

    model_path: Path | None = None
    target: str | None = None
    calibration: list[list[int]] = field(default_factory=list)
    session_factory: Callable[..., Any] | None = None
    scratch_dir: Path | None = None
    passes_run: list[str] = field(default_factory=list)

    def scratch(self) -> Path:
        """A scratch folder for probe models (made on first use, in the system temp folder if unset)."""
        if self.scratch_dir is None:
            self.scratch_dir = Path(tempfile.mkdtemp(prefix="onnxdeploy-scratch-"))
            # a folder this context made is removed with it (or at exit), whoever forgets to
            weakref.finalize(self, shutil.rmtree, self.scratch_dir, True)
        return self.scratch_dir


class ScratchWriter:
    """Writes the new weight tensors a pass makes to one scratch data file and maps them back.

    A pass that computes new weights (quantized, concatenated) over a model of any size must not hold them
    all in memory until the run's writer stages the output: each tensor is appended here as soon as it is
    made (64-byte aligned) and replaced by an :class:`onnx_ir.ExternalTensor` over the file, memory-mapped
    when read. The folder belongs to the pass context's scratch folder, removed with it.

    Args:
        folder: the folder to hold ``weights.bin`` (created).
        inline_bytes: tensors up to this many bytes stay in memory (small scales, zero points).
    """

    def __init__(self, folder: Path, inline_bytes: int = 1024):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "weights.bin"
        self.inline_bytes = inline_bytes
        self.offset = 0
        self.path.write_bytes(b"")

    def tensor(self, array: np.ndarray, dtype: ir.DataType, name: str) -> ir.TensorProtocol:
        """A tensor of ``array`` stored as ``dtype`` (INT4/UINT4 packed two a byte), on disk when large.

        Args:
            array: the values, any shape; converted by :class:`onnx_ir.Tensor` to ``dtype``.
            dtype: the ONNX element type to store.
            name: the tensor's name.

        Returns:
            An in-memory tensor up to ``inline_bytes``, else an external tensor over the scratch file.

        Raises:
            OSError: the scratch file cannot be written (disk full).
        """
        memory = ir.Tensor(array, dtype=dtype, name=name)
        if memory.nbytes <= self.inline_bytes:
            return memory
        data = memory.tobytes()
        start = -(-self.offset // 64) * 64
        with open(self.path, "r+b") as fh:
            fh.seek(start)
            fh.write(data)
        self.offset = start + len(data)
        # An absolute location and no base_dir, as model_io.load_model gives the input's weights: the file is
        # ours, and onnx_ir's containment checks (base_dir set) refuse a data file with a second hard link,
        # which write_for_ort makes while a probe session maps it.
        return ir.ExternalTensor(
            str(self.path.resolve()),
            start,
            len(data),
            dtype,
            shape=ir.Shape(array.shape),
            name=name,
            base_dir="",
        )


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) artifact set, whether anything changed, and the report."""

    artifacts: ArtifactSet
    modified: bool
    report: PassReport


def _snapshot(artifacts: ArtifactSet) -> list[tuple[int, ...]]:
    return [tuple(id(node) for node in model.graph) for model in artifacts.models()]


ORDER_FACTS: dict[str, str] = {
    "contract": "the decode contract static_kv writes",
    "bhsd_cache": "a BHSD cache (B, H_kv, L, D)",
}
"""What a pass may need of the graph it is given and another pass makes or changes, for the up-front order check
(:func:`pass_order_problem`): fact -> how a message names it."""


class Pass:
    """A graph rewrite over an :class:`ArtifactSet`. Subclasses set the class attributes and implement :meth:`call`.

    Class attributes:
        name: the registry key used in ``pipeline.yaml``.
        summary: one line for ``onnxdeploy passes``.
        config_model: the pydantic config class (unknown keys are errors).
        in_place: True when the pass edits the graphs it is given; False when it returns new ones.
        needs: facts of :data:`ORDER_FACTS` the pass's input must have (``requires`` checks them on the graph).
        provides: facts its output has whatever its input was (``static_kv``: the contract, a BHSD cache).
        keeps_opset: the output has the input's ``ai.onnx`` opset (False: unknown, see :meth:`output_opset`).

    Args:
        config: the validated config (an instance of ``config_model``).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    config_model: ClassVar[type[PassConfig]] = PassConfig
    in_place: ClassVar[bool] = True
    needs: ClassVar[frozenset[str]] = frozenset()
    provides: ClassVar[frozenset[str]] = frozenset()
    keeps_opset: ClassVar[bool] = False

    def __init__(self, config: PassConfig | None = None):
        self.config = config if config is not None else self.config_model()

    def removes(self) -> frozenset[str]:
        """Facts of :data:`ORDER_FACTS` the output no longer has, with this config (``kv_layout``: a BHSD cache)."""
        return frozenset()

    def output_opset(self, opset: int | None) -> int | None:
        """The output's ``ai.onnx`` opset given the input's (None: unknown); ``pin_opset`` sets its own."""
        return opset if self.keeps_opset else None

    def min_opset(self, model: ir.Model | None) -> tuple[int, str] | None:
        """The lowest ``ai.onnx`` opset the input may have and why (the ops the pass writes), else None.

        Args:
            model: the run's input graph when known (a requirement may depend on it), else None.
        """
        return None

    def check_settings(self, settings: PipelineSettings) -> None:
        """Validate the config against the rest of the pipeline before anything runs.

        Raises:
            ConfigError: the combination cannot work (names the pipeline key).
        """

    def check_model(self, model: ir.Model, settings: PipelineSettings) -> None:
        """Validate the config against the input model's graph (no weights read) before the first pass.

        Raises:
            OnnxDeployError: the run would fail later (e.g. cache buffers larger than the memory available).
        """

    def requires(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Check preconditions; raise :class:`~onnxdeploy.errors.PreconditionError` naming what is missing."""

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Transform the set; return ``(artifacts, modified)``. Changes, dims fixed and warnings go into ``report``."""
        raise NotImplementedError

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Check postconditions; raise :class:`~onnxdeploy.errors.PostconditionError` naming what is wrong."""

    def __call__(self, artifacts: ArtifactSet | ir.Model, context: PassContext | None = None) -> PassResult:
        """Run ``requires``, ``call`` and ``ensures``, filling the report's sizes, op diff and wall time.

        Args:
            artifacts: the set (a bare ``ir.Model`` is taken as a set of one named ``model.onnx``).
            context: the pass context (a default one when omitted).

        Returns:
            The result; ``result.artifacts`` is the set to hand to the next pass.

        Raises:
            PreconditionError: ``requires`` failed.
            PostconditionError: ``ensures`` failed, or a pass declared not in place edited its input.
            PassError: anything else went wrong inside the pass (names the pass and the passes already run).
        """
        if isinstance(artifacts, ir.Model):
            artifacts = ArtifactSet([Artifact("model.onnx", artifacts)])
        context = context or PassContext()
        start = time.perf_counter()
        first = artifacts.primary
        report = PassReport(
            name=self.name,
            config=self.config.model_dump(mode="json"),
            nodes_before=sum(len(m.graph) for m in artifacts.models()),
            initializers_before=len(first.graph.initializers),
            initializer_bytes_before=artifacts.weight_bytes(),
            op_histogram_before=op_histogram(first),
        )
        before = None if self.in_place else _snapshot(artifacts)
        try:
            self.requires(artifacts, context)
            out, modified = self.call(artifacts, context, report)
            self.ensures(out, context)
        except PassError as exc:
            if context.passes_run and "passes already run" not in exc.detail:
                exc.args = (f"{exc.args[0]} (passes already run: {', '.join(context.passes_run)})",)
            raise
        except OnnxDeployError:
            raise
        except Exception as exc:  # a bug or an unforeseen graph: name the pass, keep the cause
            ran = f" (passes already run: {', '.join(context.passes_run)})" if context.passes_run else ""
            raise PassError(self.name, f"{type(exc).__name__}: {exc}{ran}") from exc
        if before is not None and _snapshot(artifacts) != before:
            raise PostconditionError(self.name, "the pass is declared not in place but edited the graphs it was given")
        hist_after = op_histogram(out.primary)
        keys = set(report.op_histogram_before) | set(hist_after)
        diff = {k: hist_after.get(k, 0) - report.op_histogram_before.get(k, 0) for k in sorted(keys)}
        report.modified = modified
        report.nodes_after = sum(len(m.graph) for m in out.models())
        report.initializers_after = len(out.primary.graph.initializers)
        report.initializer_bytes_after = out.weight_bytes()
        report.op_histogram_after = hist_after
        report.ops_added = {k: v for k, v in diff.items() if v > 0}
        report.ops_removed = {k: -v for k, v in diff.items() if v < 0}
        report.wall_time_s = round(time.perf_counter() - start, 4)
        context.passes_run.append(self.name)
        return PassResult(artifacts=out, modified=modified, report=report)

    @classmethod
    def describe_config(cls) -> list[dict[str, Any]]:
        """List the config fields: name, type, default and description (for ``onnxdeploy passes``)."""
        rows = []
        for fname, fld in cls.config_model.model_fields.items():
            ann = fld.annotation
            members = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
            if any(typing.get_origin(m) is typing.Literal for m in members):  # Literal[...] or Literal[...] | None
                type_name = " | ".join(
                    str(a) if typing.get_origin(m) is typing.Literal else "None" if a is type(None) else a.__name__
                    for m in members
                    for a in (typing.get_args(m) if typing.get_origin(m) is typing.Literal else (m,))
                )
            else:
                type_name = getattr(ann, "__name__", str(ann)).replace("typing.", "")
            rows.append(
                {
                    "name": fname,
                    "type": type_name,
                    "default": None if fld.is_required() else fld.get_default(call_default_factory=True),
                    "required": fld.is_required(),
                    "description": fld.description or "",
                }
            )
        return rows


def pass_order_problem(passes: Sequence[Pass], model: ir.Model | None = None) -> tuple[int, str] | None:
    """The first pass the pipeline's order keeps from running, before any runs: ``(index, reason and fix)``.

    Read off the passes' declarations (:attr:`Pass.needs`, :attr:`Pass.provides`, :meth:`Pass.removes`,
    :meth:`Pass.min_opset`, :meth:`Pass.output_opset`), never off the graph's data, so it only refuses what the
    pass's own ``requires`` would refuse later:

    - a fact the pass needs was removed by an earlier pass (``grouped_attention`` after ``kv_layout`` to BHDS_K);
    - no earlier pass provides a fact the pass needs and a later one does (``grouped_attention`` before
      ``static_kv``: a later ``static_kv`` means the input has no contract yet);
    - the ``ai.onnx`` opset the pass gets is known (the input's, or one ``pin_opset`` set, carried by passes that
      keep it) and below the pass's minimum (``mask_rewrite`` after ``pin_opset: {opset: 11}``).

    Args:
        passes: the pipeline's passes, in order.
        model: the input graph (its opset, and what a pass's minimum opset depends on), or None.

    Returns:
        None when no order problem is known; else the index into ``passes`` and one line naming the fix.
    """
    known: dict[str, tuple[int, bool]] = {}  # fact -> (index of the last pass that made or removed it, present)
    if model is not None:  # what the input graph already has (index -1): its contract and cache layout
        contract = read_contract(model)
        known["contract"] = (-1, contract is not None)
        if contract is not None:
            plain = contract.kv_layout == "BHSD" and contract.head_dim_padded == contract.head_dim
            known["bhsd_cache"] = (-1, plain)
    opset = None if model is None else model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    opset_from: int | None = None  # index of the pass that set the opset; None: the input's
    for i, p in enumerate(passes):
        for fact in [f for f in ORDER_FACTS if f in p.needs]:
            last = known.get(fact)
            if last is not None and not last[1] and last[0] < 0:
                later = next((j for j in range(i + 1, len(passes)) if fact in passes[j].provides), None)
                where = (
                    f"move {p.name} after passes[{later}].{passes[later].name}"
                    if later is not None
                    else ("add static_kv before it" if fact == "contract" else f"run {p.name} on a graph that has it")
                )
                return i, f"needs {ORDER_FACTS[fact]}, which the input model does not have; {where}"
            if last is not None and not last[1]:
                j = last[0]
                fix = (
                    f"one {p.name} pass does it: keep only the one with the config you need"
                    if passes[j].name == p.name
                    else f"move {p.name} before {passes[j].name}"
                )
                return i, (
                    f"needs {ORDER_FACTS[fact]}, which the earlier passes[{j}].{passes[j].name} does not leave; {fix}"
                )
            later = next((j for j in range(i + 1, len(passes)) if fact in passes[j].provides), None)
            if last is None and later is not None:
                return i, (
                    f"needs {ORDER_FACTS[fact]}, which only the later passes[{later}].{passes[later].name} makes; "
                    f"move {p.name} after {passes[later].name}"
                )
        need = p.min_opset(model)
        if need is not None and opset is not None and opset < need[0]:
            if opset_from is None:
                return i, (
                    f"needs ai.onnx opset >= {need[0]} ({need[1]}); the input model has opset {opset}: add "
                    f"pin_opset: {{opset: {need[0]}}} before {p.name}"
                )
            j = opset_from
            return i, (
                f"needs ai.onnx opset >= {need[0]} ({need[1]}), but passes[{j}].{passes[j].name} sets opset {opset}: "
                f"pin opset {need[0]} or higher, or move {passes[j].name} after {p.name}"
            )
        for fact in p.provides:
            known[fact] = (i, True)
        for fact in p.removes():
            known[fact] = (i, False)
        if not p.keeps_opset:
            out = p.output_opset(opset)
            if out != opset:  # a pass that keeps the opset it was given (with this config) is not named
                opset, opset_from = out, i
    return None


PASS_REGISTRY: dict[str, type[Pass]] = {}
"""Pass classes by the name used in ``pipeline.yaml``; filled by :func:`register_pass`."""


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator adding a :class:`Pass` subclass to :data:`PASS_REGISTRY` under ``cls.name``.

    Raises:
        ValueError: the name is empty or already registered by another class.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if PASS_REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"pass name '{cls.name}' is registered twice")
    PASS_REGISTRY[cls.name] = cls
    return cls


def get_pass(name: str) -> type[Pass]:
    """Return the pass class registered as ``name``.

    Raises:
        ConfigError: no pass has that name (the message lists the known ones).
    """
    try:
        return PASS_REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown pass '{name}'; known passes: {', '.join(sorted(PASS_REGISTRY))}") from None
