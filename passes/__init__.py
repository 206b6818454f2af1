"""Passes: graph rewrites over a run's artifact set, each returning a ``PassResult``.

Every pass module registers its class with :func:`~onnxdeploy.passes._pass_infra.register_pass`; the
registry maps the name used in ``pipeline.yaml`` to the class, and ``onnxdeploy passes`` lists them with
their config fields. Importing this package imports every pass module, so the registry is complete.
"""

from __future__ import annotations

from onnxdeploy.passes import (  # noqa: F401  (modules register their passes)
    external_data,
    fuse_matmuls,
    grouped_attention,
    kv_layout,
    mask_rewrite,
    pin_opset,
    quantize_weights,
    static_kv,
)
from onnxdeploy.passes._pass_infra import (
    PASS_REGISTRY,
    Artifact,
    ArtifactSet,
    Pass,
    PassConfig,
    PassContext,
    PassResult,
    PipelineSettings,
    get_pass,
    register_pass,
)

PASSES = PASS_REGISTRY
"""Alias of :data:`~onnxdeploy.passes._pass_infra.PASS_REGISTRY` (name in ``pipeline.yaml`` -> class)."""

__all__ = [
    "PASSES",
    "PASS_REGISTRY",
    "Artifact",
    "ArtifactSet",
    "Pass",
    "PassConfig",
    "PassContext",
    "PassResult",
    "PipelineSettings",
    "get_pass",
    "register_pass",
]
