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

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import onnx_ir as ir

from onnxdeploy.artifacts import Artifact, ArtifactSet
from onnxdeploy.errors import ConfigError, OnnxDeployError, PassError, PostconditionError, PreconditionError
from onnxdeploy.graph import op_histogram
from onnxdeploy.passes._catalog import CATALOG, PassConfig, describe_config
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._order import ORDER_FACTS, OrderFact
from onnxdeploy.report import PassReport
from onnxdeploy.settings import PipelineSettings

__all__ = [
    "Pass",
    "PassConfig",
    "PassResult",
    "PASS_REGISTRY",
    "get_pass",
    "register_pass",
]


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) artifact set, whether anything changed, and the report."""

    artifacts: ArtifactSet
    modified: bool
    report: PassReport


def _snapshot(artifacts: ArtifactSet) -> list[tuple[int, ...]]:
    return [tuple(id(node) for node in model.graph) for model in artifacts.models()]


class Pass:
    """A graph rewrite over an :class:`ArtifactSet`. Subclasses set the class attributes and implement :meth:`call`.

    Class attributes:
        name: the registry key used in ``pipeline.yaml``.
        summary: one line for ``onnxdeploy passes`` (a pass of this package: filled in from its catalogue entry).
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
    needs: ClassVar[frozenset[OrderFact]] = frozenset()
    provides: ClassVar[frozenset[OrderFact]] = frozenset()
    keeps_opset: ClassVar[bool] = False

    def __init__(self, config: PassConfig | None = None):
        self.config = config if config is not None else self.config_model()

    def removes(self) -> frozenset[OrderFact]:
        """Facts of :data:`ORDER_FACTS` the output no longer has, with this config (``kv_layout``: a BHSD cache)."""
        return frozenset()

    def needs_later(self) -> tuple[str, str] | None:
        """A pass that must come after this one with this config, and why: ``(pass name, reason)``; else None.

        The up-front order check (:func:`~onnxdeploy.passes._order.pass_order_problem`) refuses a pipeline without it.
        """
        return None

    def output_opset(self, opset: int | None) -> int | None:
        """The output's ``ai.onnx`` opset given the input's (None: unknown); ``pin_opset`` sets its own."""
        return opset if self.keeps_opset else None

    def min_opset(self, model: ir.Model | None) -> tuple[int, str] | None:
        """The lowest ``ai.onnx`` opset the input may have and why (the ops the pass writes), else None.

        Args:
            model: the run's input graph when known (a requirement may depend on it), else None.
        """
        return None

    def opset_floor(self, model: ir.Model | None) -> tuple[int, str] | None:
        """The lowest ``ai.onnx`` opset the output can be converted to later and why (the ops it writes), else None.

        A later ``pin_opset`` below it is refused before any pass runs (``quantize_weights``' blocked INT4
        ``DequantizeLinear`` exists from opset 21).

        Args:
            model: the run's input graph when known (the floor may depend on its weights' dtype), else None.
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
        """Check preconditions: by default, every graph has each fact of :attr:`needs` (the planner's predicates).

        Passes that need more call ``super().requires`` first.

        Raises:
            PreconditionError: a graph lacks a fact (names the graph and the fact; for the contract: run static_kv).
        """
        for artifact in artifacts.artifacts:
            for fact in [f for f in ORDER_FACTS.values() if f in self.needs]:
                problem = fact.problem(artifact.model, self.name, source=artifact.name)
                if problem is not None:
                    raise PreconditionError(self.name, problem)

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Transform the set; return ``(artifacts, modified)``. Changes, dims fixed and warnings go into ``report``."""
        raise NotImplementedError

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Check postconditions; raise :class:`~onnxdeploy.errors.PostconditionError` naming what is wrong."""

    def __call__(self, artifacts: ArtifactSet | ir.Model, context: PassContext) -> PassResult:
        """Run ``requires``, ``call`` and ``ensures``, filling the report's sizes, op diff and wall time.

        Args:
            artifacts: the set (a bare ``ir.Model`` is taken as a set of one named ``model.onnx``).
            context: what the pass gets beyond the graph (the pipeline's, or
                :func:`onnxdeploy.pass_context.make_pass_context`).

        Returns:
            The result; ``result.artifacts`` is the set to hand to the next pass.

        Raises:
            PreconditionError: ``requires`` failed.
            PostconditionError: ``ensures`` failed, or a pass declared not in place edited its input.
            PassError: anything else went wrong inside the pass (names the pass and the passes already run).
        """
        if isinstance(artifacts, ir.Model):
            artifacts = ArtifactSet([Artifact("model.onnx", artifacts)])
        start = time.perf_counter()
        first = artifacts.primary
        report = PassReport(
            name=self.name,
            config=self.config.model_dump(mode="json"),
            nodes_before=sum(len(m.graph) for m in artifacts.models()),
            graphs_before=len(artifacts.artifacts),
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
        report.graphs_after = len(out.artifacts)
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
        """List the config fields: name, type, default, description (``passes._catalog.describe_config``)."""
        return describe_config(cls.config_model)


PASS_REGISTRY: dict[str, type[Pass]] = {}
"""Pass classes by the name used in ``pipeline.yaml``; filled by :func:`register_pass`."""


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator adding a :class:`Pass` subclass to :data:`PASS_REGISTRY` under ``cls.name``.

    A pass of this package registers against its :data:`~onnxdeploy.passes._catalog.CATALOG` entry: the entry's
    module and config model, and its summary (filled into ``cls.summary``). A pass defined elsewhere (a test's)
    registers with its own ``summary`` and ``config_model``.

    Raises:
        ValueError: the name is empty or already registered by another class; a pass module of this package
            whose pass has no catalogue entry, or differs from it (module, config model, a summary of its own).
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if PASS_REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"pass name '{cls.name}' is registered twice")
    info = CATALOG.get(cls.name)
    if info is None and cls.__module__.startswith(f"{__package__}."):
        raise ValueError(f"pass '{cls.name}' ({cls.__module__}) has no entry in passes/_catalog.py (CATALOG)")
    if info is not None:
        if cls.__module__ != f"{__package__}.{info.module}" or cls.config_model is not info.config_model:
            raise ValueError(
                f"pass '{cls.name}' ({cls.__module__}, {cls.config_model.__name__}) differs from its catalogue "
                f"entry ({__package__}.{info.module}, {info.config_model.__name__})"
            )
        if cls.__dict__.get("summary", info.summary) != info.summary:
            raise ValueError(f"pass '{cls.name}': its summary lives in passes/_catalog.py, not on the class")
        cls.summary = info.summary
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
