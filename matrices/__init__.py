"""Compatibility matrices: one YAML data file per target (``matrices/<target>.yaml``).

Each file states the target's opset range per domain, IR version and, for every entry, its source
(document, version, address, date read). This issue ships the loader and the ``ort-cpu`` entry; the
operator-level support check comes with the matrix checks.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from onnxdeploy.errors import ConfigError

__all__ = ["list_targets", "get_target"]


def list_targets() -> list[str]:
    """Return the ids of every target with a data file, sorted."""
    files = resources.files(__name__).iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


def get_target(name: str) -> dict[str, Any]:
    """Load the matrix entry of target ``name``.

    Returns:
        The parsed YAML mapping (keys: ``target``, ``description``, ``opsets``, ``sources``, …).

    Raises:
        ConfigError: no data file for ``name`` (the message lists the known targets).
    """
    if name not in list_targets():
        raise ConfigError(f"unknown target '{name}'; known targets: {', '.join(list_targets()) or 'none'}")
    text = resources.files(__name__).joinpath(f"{name}.yaml").read_text()
    return yaml.safe_load(text)
