"""Passes: graph rewrites over a run's artifact set, each returning a ``PassResult``.

Every pass of this package has an entry in :data:`~onnxdeploy.passes._catalog.CATALOG` (name, module, summary,
config model; pydantic only), and its module registers the class against it with
:func:`~onnxdeploy.passes._pass_infra.register_pass`; the registry maps the name used in ``pipeline.yaml`` to the
class. Importing this package imports neither the pass modules nor onnx: ``onnxdeploy passes`` and the pipeline's
config validation read the catalogue (:func:`pass_config_model`), and the names re-exported from the modules that
need onnx_ir (``Pass``, ``ArtifactSet``, ``PassContext``, ``pass_order_problem`` …) are imported on first access.
:func:`get_pass` imports the one module that implements a pass; reading :data:`PASSES` / ``PASS_REGISTRY``
imports every pass module of this package, so the registry read that way is complete.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import TYPE_CHECKING

from onnxdeploy.errors import ConfigError
from onnxdeploy.passes._catalog import CATALOG, PassConfig, PassInfo, describe_config
from onnxdeploy.settings import PipelineSettings

if TYPE_CHECKING:
    from onnxdeploy.passes._pass_infra import Pass

__all__ = [
    "CATALOG",
    "ORDER_FACTS",
    "PASSES",
    "PASS_REGISTRY",
    "Artifact",
    "ArtifactSet",
    "OrderFact",
    "Pass",
    "PassConfig",
    "PassContext",
    "PassInfo",
    "PassResult",
    "PipelineSettings",
    "TargetDefaults",
    "describe_config",
    "get_pass",
    "load_passes",
    "pass_config_model",
    "pass_modules",
    "pass_order_problem",
    "register_pass",
]

_LAZY = {
    "Artifact": "onnxdeploy.artifacts",
    "ArtifactSet": "onnxdeploy.artifacts",
    "PassContext": "onnxdeploy.passes._context",
    "TargetDefaults": "onnxdeploy.passes._context",
    "ORDER_FACTS": "onnxdeploy.passes._order",
    "OrderFact": "onnxdeploy.passes._order",
    "pass_order_problem": "onnxdeploy.passes._order",
    "Pass": "onnxdeploy.passes._pass_infra",
    "PassResult": "onnxdeploy.passes._pass_infra",
    "register_pass": "onnxdeploy.passes._pass_infra",
}
"""Names re-exported from modules that import onnx_ir: imported on first access (see the module docstring)."""


def pass_modules() -> list[str]:
    """The pass modules of this package: every module whose name does not start with ``_``."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def _registry() -> dict[str, type[Pass]]:
    """The classes registered so far (empty while no module that registers passes was imported)."""
    infra = sys.modules.get(f"{__name__}._pass_infra")
    return infra.PASS_REGISTRY if infra is not None else {}


def load_passes() -> dict[str, type[Pass]]:
    """Import every pass module (each registers its passes) and return the complete registry (name -> class)."""
    for module in pass_modules():
        importlib.import_module(f"{__name__}.{module}")
    return _registry()


def _unknown(name: str) -> ConfigError:
    known = sorted(set(CATALOG) | set(_registry()))
    return ConfigError(f"unknown pass '{name}'; known passes: {', '.join(known)}")


def get_pass(name: str) -> type[Pass]:
    """Return the pass class registered as ``name``, importing only the module its catalogue entry names.

    Raises:
        ConfigError: no pass has that name (the message lists the known ones).
    """
    if name not in _registry() and name in CATALOG:
        importlib.import_module(f"{__name__}.{CATALOG[name].module}")
    if name not in _registry():
        raise _unknown(name)
    return _registry()[name]


def pass_config_model(name: str) -> type[PassConfig]:
    """The config model of the pass ``name`` without importing its module (a registered class's, else the catalogue's).

    Raises:
        ConfigError: no pass has that name (the message lists the known ones).
    """
    registered = _registry().get(name)
    if registered is not None:
        return registered.config_model
    if name in CATALOG:
        return CATALOG[name].config_model
    raise _unknown(name)


def __getattr__(attr: str) -> object:
    """``PASSES`` / ``PASS_REGISTRY`` (the complete registry) and the names of :data:`_LAZY`, on first access."""
    if attr in ("PASSES", "PASS_REGISTRY"):
        return load_passes()
    if attr in _LAZY:
        value = getattr(importlib.import_module(_LAZY[attr]), attr)
        globals()[attr] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
