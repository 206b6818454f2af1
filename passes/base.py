"""The pass contract: a named, configured, non-mutating ``ModelProto -> PassResult`` transformation.

Modelled on onnx-ir's pass infrastructure (``requires`` / ``call`` / ``ensures`` hooks, typed
pre/postcondition errors) with the report DESIGN.md asks for (``PassReport``).
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import onnx
from pydantic import BaseModel, ConfigDict

from onnxdeploy.errors import OnnxDeployError, PassError, PostconditionError
from onnxdeploy.graph import initializer_bytes, op_histogram
from onnxdeploy.report import PassReport

__all__ = ["PassConfig", "Pass", "PassResult"]


class PassConfig(BaseModel):
    """Base of every pass config: typed, described fields; unknown keys and coerced types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


@dataclass
class PassResult:
    """What a pass returns: the (new) model, whether it changed, and its report."""

    model: onnx.ModelProto
    modified: bool
    report: PassReport


class Pass:
    """A graph rewrite. Subclasses set ``name``, ``config_model`` and implement :meth:`call`.

    ``__call__`` copies the input model (a pass never mutates its input), runs ``requires``,
    ``call`` and ``ensures``, wraps unexpected exceptions in :class:`PassError` naming the pass,
    and fills the size/op/time fields of the report.

    Args:
        config: the validated config (an instance of ``config_model``).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    config_model: ClassVar[type[PassConfig]] = PassConfig

    def __init__(self, config: PassConfig | None = None):
        self.config = config if config is not None else self.config_model()

    def requires(self, model: onnx.ModelProto) -> None:
        """Check preconditions; raise :class:`PreconditionError` naming what is missing."""

    def call(self, model: onnx.ModelProto, report: PassReport) -> tuple[onnx.ModelProto, bool]:
        """Transform ``model`` (a private copy the pass may edit); return ``(model, modified)``.

        Human-readable changes, dims fixed and warnings go into ``report``.
        """
        raise NotImplementedError

    def ensures(self, model: onnx.ModelProto) -> None:
        """Check postconditions; raise :class:`PostconditionError` naming what is wrong."""

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        """Run the pass on a copy of ``model``.

        Raises:
            PreconditionError: ``requires`` failed.
            PostconditionError: ``ensures`` failed.
            PassError: anything else went wrong inside the pass (message names the pass).
        """
        start = time.perf_counter()
        before_bytes = model.SerializeToString()
        work = onnx.ModelProto()
        work.ParseFromString(before_bytes)
        report = PassReport(
            name=self.name,
            config=self.config.model_dump(mode="json"),
            nodes_before=len(model.graph.node),
            initializers_before=len(model.graph.initializer),
            initializer_bytes_before=initializer_bytes(model),
            op_histogram_before=op_histogram(model),
        )
        try:
            self.requires(work)
            out, modified = self.call(work, report)
            self.ensures(out)
        except OnnxDeployError:
            raise
        except Exception as exc:  # a bug or an unforeseen graph: name the pass, keep the cause
            raise PassError(self.name, f"{type(exc).__name__}: {exc}") from exc
        if model.SerializeToString() != before_bytes:  # pragma: no cover - guards pass authors
            raise PostconditionError(self.name, "the pass mutated its input model")
        hist_after = op_histogram(out)
        keys = set(report.op_histogram_before) | set(hist_after)
        diff = {k: hist_after.get(k, 0) - report.op_histogram_before.get(k, 0) for k in sorted(keys)}
        report.modified = modified
        report.nodes_after = len(out.graph.node)
        report.initializers_after = len(out.graph.initializer)
        report.initializer_bytes_after = initializer_bytes(out)
        report.op_histogram_after = hist_after
        report.ops_added = {k: v for k, v in diff.items() if v > 0}
        report.ops_removed = {k: -v for k, v in diff.items() if v < 0}
        report.wall_time_s = round(time.perf_counter() - start, 4)
        return PassResult(model=out, modified=modified, report=report)

    @classmethod
    def describe_config(cls) -> list[dict[str, Any]]:
        """List the config fields: name, type, default and description (for ``onnxdeploy passes``)."""
        rows = []
        for fname, field in cls.config_model.model_fields.items():
            ann = field.annotation
            if typing.get_origin(ann) is typing.Literal:
                type_name = " | ".join(str(a) for a in typing.get_args(ann))
            else:
                type_name = getattr(ann, "__name__", str(ann)).replace("typing.", "")
            rows.append(
                {
                    "name": fname,
                    "type": type_name,
                    "default": None if field.is_required() else field.get_default(call_default_factory=True),
                    "required": field.is_required(),
                    "description": field.description or "",
                }
            )
        return rows
