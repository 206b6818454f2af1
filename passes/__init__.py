"""Passes: graph rewrites, each a :class:`~onnxdeploy.passes.base.Pass` returning a ``PassResult``.

The registry maps the name used in ``pipeline.yaml`` to the pass class; ``onnxdeploy passes`` lists
them with their config fields.
"""

from __future__ import annotations

from onnxdeploy.errors import ConfigError
from onnxdeploy.passes.base import Pass, PassConfig, PassResult
from onnxdeploy.passes.pin_opset import PinOpsetPass
from onnxdeploy.passes.static_kv import StaticKVCachePass

__all__ = ["PASSES", "Pass", "PassConfig", "PassResult", "get_pass"]

PASSES: dict[str, type[Pass]] = {cls.name: cls for cls in (StaticKVCachePass, PinOpsetPass)}


def get_pass(name: str) -> type[Pass]:
    """Return the pass class registered as ``name``.

    Raises:
        ConfigError: no pass has that name (the message lists the known ones).
    """
    try:
        return PASSES[name]
    except KeyError:
        raise ConfigError(f"unknown pass '{name}'; known passes: {', '.join(sorted(PASSES))}") from None
