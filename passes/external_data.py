"""``externalize`` and ``embed_external_data``: where the writer puts the weights (one policy, two passes).

Neither pass reads or copies a weight: they set the artifact set's
:class:`~onnxdeploy.model_io.WeightsPolicy`, which the writer applies when it saves the run's graphs
(:func:`onnxdeploy.model_io.stage_artifacts`). External data is always one data file shared by every
graph of the run, referenced by a plain relative ``location`` (no absolute path, no ``..``); models over
the 2 GiB protobuf limit are always written with external data (ONNX docs, "ExternalData.md"; protobuf's
2 GiB message limit).
"""

from __future__ import annotations

import dataclasses

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.errors import PreconditionError
from onnxdeploy.model_io import PROTOBUF_LIMIT_BYTES
from onnxdeploy.passes._catalog import EmbedExternalDataConfig, ExternalizeConfig
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.report import PassReport

__all__ = ["EmbedExternalDataConfig", "EmbedExternalDataPass", "ExternalizeConfig", "ExternalizePass"]


@register_pass
class ExternalizePass(Pass):
    """Write initializers above ``size_threshold`` bytes to one external data file shared by every graph.

    The data file is named after the first graph (``model.onnx.data``) and written fresh (never appended to).
    """

    name = "externalize"
    config_model = ExternalizeConfig
    config: ExternalizeConfig
    keeps_opset = True

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Set the writer policy to external; see the class docstring."""
        threshold = self.config.size_threshold
        artifacts.weights = dataclasses.replace(artifacts.weights, mode="external", size_threshold_bytes=threshold)
        report.changes.append(f"weights above {threshold} bytes will be written to one external data file")
        return artifacts, True


@register_pass
class EmbedExternalDataPass(Pass):
    """Write every weight inline in the ``.onnx`` files (one self-contained file per graph).

    Raises:
        PreconditionError: the weights exceed the 2 GiB protobuf limit (names the size; use ``externalize``).
    """

    name = "embed_external_data"
    config_model = EmbedExternalDataConfig
    config: EmbedExternalDataConfig
    keeps_opset = True

    def requires(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """Refuse weights that cannot fit one protobuf message."""
        total = artifacts.weight_bytes()
        if total > PROTOBUF_LIMIT_BYTES:
            raise PreconditionError(
                self.name,
                f"{total} bytes ({total / 2**30:.2f} GiB) of weights cannot be embedded: a .onnx file is one protobuf "
                f"message, limited to {PROTOBUF_LIMIT_BYTES} bytes (2 GiB); use the externalize pass instead",
            )

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Set the writer policy to inline; see the class docstring."""
        artifacts.weights = dataclasses.replace(artifacts.weights, mode="inline")
        report.changes.append("every weight will be written inline in the .onnx file")
        return artifacts, True
