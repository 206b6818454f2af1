"""The check interface, its context, and the registry of check names used in ``pipeline.yaml``.

A check inspects a model and returns :class:`~onnxdeploy.report.Finding` objects; it never raises for
a problem of the model (docs/ARCHITECTURE.md, "Core interfaces"), so one run reports everything.
"""

from __future__ import annotations

import abc
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import onnx
from pydantic import BaseModel, ConfigDict, Field

from onnxdeploy.errors import ConfigError
from onnxdeploy.report import Finding, Level

__all__ = [
    "CRASH_CODE",
    "CHECK_REGISTRY",
    "Check",
    "CheckContext",
    "check_names",
    "get_check",
    "register_check",
    "run_checks",
]

CRASH_CODE = "OD001"
"""Code of the error finding that stands for a check that crashed (a bug in onnxdeploy, not the model)."""


class CheckContext(BaseModel):
    """Where the model lives and what it is checked for.

    Attributes:
        model_path: the ``.onnx`` file the model was loaded from or will be saved to; external data
            locations are resolved against its folder unless ``base_dir`` is given.
        base_dir: the folder external-data ``location`` entries are relative to (overrides the
            folder of ``model_path``).
        target: a target id from ``matrices/`` (e.g. ``ort-cpu``) for target-specific checks.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path | None = Field(default=None, description="The model file (external data is beside it).")
    base_dir: Path | None = Field(default=None, description="Folder external-data locations are relative to.")
    target: str | None = Field(default=None, description="Target id from matrices/, e.g. 'ort-cpu'.")

    @property
    def data_dir(self) -> Path | None:
        """The folder to resolve external data against: ``base_dir``, else ``model_path``'s folder."""
        if self.base_dir is not None:
            return self.base_dir
        if self.model_path is not None:
            return self.model_path.parent
        return None


class Check(abc.ABC):
    """A named inspection of a model that reports findings instead of raising.

    Subclasses set ``name`` (the registry key), ``description`` and ``codes`` (every code they may
    emit, with a one-line meaning) and implement :meth:`collect`. Callers use :meth:`run`, which
    turns a crash inside :meth:`collect` into a :data:`CRASH_CODE` error finding naming the check,
    keeping the findings yielded before the crash.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    codes: ClassVar[Mapping[str, str]] = {}

    def run(self, model: onnx.ModelProto, context: CheckContext | None = None) -> list[Finding]:
        """Inspect ``model`` and return all findings; never raises for a model problem.

        Args:
            model: the model to inspect; it is not modified.
            context: where the model lives and the target; defaults to an empty context.

        Returns:
            The findings in the order found (empty when the model passes).

        Raises:
            ConfigError: the check is misconfigured (e.g. an unknown target), which is bad input
                rather than a model problem.
        """
        context = context or CheckContext()
        findings: list[Finding] = []
        try:
            for finding in self.collect(model, context):
                findings.append(finding)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a crash must become a finding, not abort the run
            where = traceback.extract_tb(exc.__traceback__)[-1]
            findings.append(
                Finding(
                    code=CRASH_CODE,
                    level="error",
                    check=self.name,
                    message=(
                        f"check '{self.name}' crashed: {type(exc).__name__}: {exc} "
                        f"(at {Path(where.filename).name}:{where.lineno}); its results are incomplete"
                    ),
                    hint="This is a bug in onnxdeploy, not necessarily in the model; please report it "
                    "with the model or a reduced graph.",
                )
            )
        return findings

    @abc.abstractmethod
    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterable[Finding]:
        """Yield the findings for ``model`` (implemented by each check; may be a generator)."""

    def finding(
        self,
        code: str,
        level: Level,
        message: str,
        *,
        nodes: Sequence[str] = (),
        hint: str = "",
        rule: str = "",
        source: str = "",
    ) -> Finding:
        """Build a finding of this check.

        Args:
            code: one of this check's ``codes``.
            level: ``error``, ``warning`` or ``info``.
            message: what is wrong and where.
            nodes: node or tensor names concerned.
            hint: how to fix it.
            rule: the rule broken (target checks: the matrix fact).
            source: where the rule comes from (document, section, version, address, date read).

        Raises:
            ValueError: ``code`` is not declared in ``codes`` (a bug in the check).
        """
        if code not in self.codes:
            raise ValueError(f"check '{self.name}' emitted undeclared code {code}")
        return Finding(
            code=code,
            level=level,
            check=self.name,
            message=message,
            nodes=list(nodes),
            hint=hint,
            rule=rule,
            source=source,
        )


CHECK_REGISTRY: dict[str, type[Check]] = {}
"""Check classes by pipeline name (``checks: [checker, static_shapes, ...]``)."""


def register_check(cls: type[Check]) -> type[Check]:
    """Class decorator adding a :class:`Check` subclass to :data:`CHECK_REGISTRY` under ``cls.name``.

    Raises:
        ValueError: another class is registered under the same name.
    """
    existing = CHECK_REGISTRY.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"check name '{cls.name}' is already registered by {existing.__qualname__}")
    CHECK_REGISTRY[cls.name] = cls
    return cls


def check_names() -> list[str]:
    """Return the registered check names, sorted."""
    return sorted(CHECK_REGISTRY)


def get_check(name: str) -> type[Check]:
    """Return the check class registered as ``name``.

    Raises:
        ConfigError: no check has that name; the message lists the known names.
    """
    try:
        return CHECK_REGISTRY[name]
    except KeyError:
        known = ", ".join(check_names()) or "<none>"
        raise ConfigError(f"unknown check '{name}'; known checks: {known}") from None


def run_checks(model: onnx.ModelProto, names: Iterable[str], context: CheckContext | None = None) -> list[Finding]:
    """Run the named checks in order and return all their findings.

    Every name is resolved before any check runs, so a typo fails fast.

    Raises:
        ConfigError: a name is not registered.
    """
    classes = [get_check(name) for name in names]
    findings: list[Finding] = []
    for cls in classes:
        findings.extend(cls().run(model, context))
    return findings
