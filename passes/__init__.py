"""Passes: graph rewrites over a run's artifact set, each returning a ``PassResult``.

Every pass module registers its class with :func:`~onnxdeploy.passes._pass_infra.register_pass`; the
registry maps the name used in ``pipeline.yaml`` to the class, and ``onnxdeploy passes`` lists them with
their config fields. Pass modules are imported when first needed (some pull in heavy tools, e.g. onnxsim):
:func:`get_pass` imports the module named like the pass (else every module), and reading :data:`PASSES` /
``PASS_REGISTRY`` imports every pass module of this package, so the registry read that way is complete.
"""

from __future__ import annotations

import importlib
import pkgutil

from onnxdeploy.artifacts import Artifact, ArtifactSet
from onnxdeploy.passes import _pass_infra
from onnxdeploy.passes._context import PassContext, TargetDefaults
from onnxdeploy.passes._order import ORDER_FACTS, OrderFact, pass_order_problem
from onnxdeploy.passes._pass_infra import Pass, PassConfig, PassResult, register_pass
from onnxdeploy.settings import PipelineSettings

__all__ = [
    "ORDER_FACTS",
    "PASSES",
    "PASS_REGISTRY",
    "Artifact",
    "ArtifactSet",
    "OrderFact",
    "Pass",
    "PassConfig",
    "PassContext",
    "PassResult",
    "PipelineSettings",
    "TargetDefaults",
    "get_pass",
    "load_passes",
    "pass_modules",
    "pass_order_problem",
    "register_pass",
]


def pass_modules() -> list[str]:
    """The pass modules of this package: every module whose name does not start with ``_``."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load_passes() -> dict[str, type[Pass]]:
    """Import every pass module (each registers its passes) and return the complete registry (name -> class)."""
    for module in pass_modules():
        importlib.import_module(f"{__name__}.{module}")
    return _pass_infra.PASS_REGISTRY


def get_pass(name: str) -> type[Pass]:
    """Return the pass class registered as ``name``, importing only its module when it is named like the pass.

    Raises:
        ConfigError: no pass has that name (the message lists the known ones).
    """
    if name not in _pass_infra.PASS_REGISTRY:
        if name in pass_modules():
            importlib.import_module(f"{__name__}.{name}")
        if name not in _pass_infra.PASS_REGISTRY:
            load_passes()
    return _pass_infra.get_pass(name)


def __getattr__(attr: str) -> object:
    """``PASSES`` and ``PASS_REGISTRY``: the complete registry (every pass module imported on first access)."""
    if attr in ("PASSES", "PASS_REGISTRY"):
        return load_passes()
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
