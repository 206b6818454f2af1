"""The pipeline file's schema: the top-level keys, the passes' entries, the ``sdk`` and ``report`` sections.

:mod:`onnxdeploy.config` reads the file into :class:`PipelineConfig` (and re-exports everything here); the
``verify`` and ``calibration`` sections live in :mod:`onnxdeploy.verify_config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from onnxdeploy.cache_config import CacheConfig
from onnxdeploy.errors import ConfigError
from onnxdeploy.passes import get_pass
from onnxdeploy.settings import PipelineSettings
from onnxdeploy.verify_config import CalibrationConfig, VerifyConfig

if TYPE_CHECKING:  # the pass modules (onnx, onnx_ir) are imported once the file validated: refusals come fast
    from onnxdeploy.passes import Pass

__all__ = [
    "DEFAULT_CHECKS",
    "DEFAULT_CHECKS_NO_CONTRACT",
    "PassSpec",
    "PipelineConfig",
    "ReportConfig",
    "SdkConfig",
    "SdkQuantization",
    "default_checks",
]

DEFAULT_CHECKS = ["checker", "static_shapes", "topo_order", "contract"]
"""Default checks of a run whose output carries a decode contract (a static decoder)."""
DEFAULT_CHECKS_NO_CONTRACT = ["checker", "topo_order"]
"""Default checks of a run whose output has no contract (e.g. a checks-only pipeline on an export): the
decoder-only checks (static shapes, contract) would fail on every dynamic tensor of a model nobody asked to
make static. A target adds its own checks either way (``target_opset``, ``target_ops``, ``target_tensors``)."""


def default_checks(has_contract: bool) -> list[str]:
    """The checks a run makes when the pipeline has no ``checks`` key: with or without a decode contract."""
    return list(DEFAULT_CHECKS if has_contract else DEFAULT_CHECKS_NO_CONTRACT)


class SdkQuantization(BaseModel):
    """``sdk.quantization``: the NPU's own integer quantization (RKNN-Toolkit2 ``rknn.config`` + ``rknn.build``).

    RK3588's NPU computes int8 × int8: RKNN-Toolkit2 2.5.0 quantizes weights **and** activations from a
    calibration dataset (``quantized_dtype`` ``w8a8`` or ``w16a16i_dfp`` on rk3588; it refuses ``w8a16`` and
    ``w4a16`` there), which onnxdeploy generates from the pipeline's ``calibration`` token ids through the decode
    contract (the cache inputs filled as in a real decode).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    dtype: Literal["w8a8", "w16a16i_dfp"] = Field("w8a8", description="rknn.config(quantized_dtype=...).")
    algorithm: Literal["normal", "mmse", "kl_divergence", "gdq"] = Field(
        "normal", description="rknn.config(quantized_algorithm=...)."
    )
    float_layers: list[str] = Field(
        default_factory=list,
        description="Hybrid quantization: ONNX node names kept in fp16 (hybrid_quantization_step1/2); [] with "
        "auto_hybrid false: plain quantization.",
    )
    auto_hybrid: StrictBool = Field(
        False,
        description="The SDK keeps in fp16 every layer whose quantized output's cosine to the float one falls below "
        "auto_hybrid_cos (rknn.build(auto_hybrid=True)), chosen from per-layer error on the calibration dataset.",
    )
    auto_hybrid_cos: float = Field(
        0.98, gt=0, le=1, description="rknn.config(auto_hybrid_cos_thresh=...): the per-layer cosine bound."
    )
    hybrid_min_cosine: float | None = Field(
        0.98,
        gt=0,
        le=1,
        description="Hybrid quantization chosen from per-layer error: every SDK tensor whose single-layer cosine "
        "(RKNN accuracy_analysis, quantized vs float) falls below this is kept fp16 with the single-input chain "
        "feeding it and its siblings (default 0.98: the rotary Sin/Cos chain on the fixtures); null: off.",
    )
    hybrid_samples: int = Field(3, ge=1, description="Calibration samples the per-layer analysis runs on.")
    max_samples: int = Field(
        32, ge=1, description="Calibration samples (decode calls) per graph, spread over the calibration tokens."
    )
    max_mean_kl: float | None = Field(
        0.05, ge=0, description="Largest mean KL(original || simulator) on verify.accuracy's held-out tokens, nats."
    )
    min_top1_agreement: float | None = Field(0.95, ge=0, le=1, description="Smallest held-out top-1 agreement.")
    max_ppl_ratio: float | None = Field(None, ge=1, description="Largest held-out perplexity ratio.")


class SdkConfig(BaseModel):
    """The ``sdk`` key: the device SDK build stage (after the checks; ``target: rknn-rk3588`` only).

    ``auto`` (default) builds every graph of the set where the SDK environment exists and adds a note where it does
    not; ``build`` makes a missing environment an error (exit 2 before any pass); ``off`` skips the stage. The
    plain string is the mapping's ``mode``.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["auto", "build", "off"] = Field("auto", description="auto | build | off.")
    quantization: SdkQuantization | None = Field(
        None, description="null: fp16 build (no quantization); else the NPU's own quantization (w8a8)."
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _bare_off(cls, v: Any) -> Any:
        """YAML 1.1 reads ``mode: off`` as false, which means ``off`` (as the plain ``sdk: off`` does)."""
        return "off" if v is False else v


class ReportConfig(BaseModel):
    """How the run's reports are written (``report.json``, ``report.md``, ``report.html``)."""

    model_config = ConfigDict(extra="forbid")

    max_rows: int = Field(
        200,
        ge=1,
        description="Per-position rows listed per verify mode at most (JSON and Markdown); beyond it the rows that "
        "diverge or spike, then the first and last, with the rest summarised in runs. report.html plots every "
        "position.",
    )


class PassSpec(BaseModel):
    """One entry of ``passes``: the registry name and its validated config."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    config: Any

    def build(self) -> Pass:
        """Instantiate the pass with its config."""
        return get_pass(self.name)(self.config)


class PipelineConfig(BaseModel):
    """The validated pipeline file (README, "The pipeline file")."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: Path = Field(description="Input ONNX model (exporter convention); never modified.")
    output_dir: Path = Field(Path("out"), description="Folder for model.onnx, report.json and report.md.")
    output_name: str = Field("model.onnx", description="File name of the transformed model.")
    target: str | None = Field(None, description="Target id of matrices/ (e.g. ort-cpu); optional.")
    passes: list[PassSpec] = Field(default_factory=list, description="Passes in order: '- name: {config}'.")
    checks: list[str] | None = Field(
        None,
        description="Checks to run; default: checker, static_shapes, topo_order, contract when the output carries a "
        "decode contract, else checker, topo_order (plus the target checks whenever target is set).",
    )
    check_after_each_pass: StrictBool = Field(False, description="Run the ONNX checker after every pass.")
    verify_each_pass: StrictBool = Field(
        False,
        description="Decode a few teacher-forced positions (the verify prompt + up to 4 steps) after every pass and "
        "name the first pass whose output diverges from the original (report: pass_verification).",
    )
    bisect: StrictBool = Field(
        False,
        description="With verify_each_pass (turned on by this key): also name the first node of the diverging pass's "
        "input graph that its output graph does not reproduce (report: first_divergent_node). CLI: run --bisect.",
    )
    verify: VerifyConfig | None = Field(
        default_factory=VerifyConfig, description="Runner settings; null skips verification."
    )
    calibration: CalibrationConfig | None = Field(
        None, description="Calibration token ids for passes that collect activations (quantize_weights)."
    )
    cache: CacheConfig | None = Field(
        default_factory=CacheConfig,
        description="The per-pass cache (dir, full_hash, max_bytes); null turns it off. CLI: --cache-dir, --no-cache.",
    )
    report: ReportConfig = Field(default_factory=ReportConfig, description="Report settings (max_rows).")
    sdk: SdkConfig = Field(
        default_factory=SdkConfig,
        description="Device SDK build stage: auto | build | off, or {mode, quantization} (target rknn-rk3588).",
    )
    source: Path | None = Field(None, description="Set by the loader: the pipeline file this was read from.")

    def settings(self, *, accuracy_tokens: int | None = None) -> PipelineSettings:
        """What a pass may validate its config against (the verify section's sizes, the pipeline file).

        Args:
            accuracy_tokens: the held-out tokens read from ``verify.accuracy.token_ids_file``, once read.
        """
        v = self.verify
        return PipelineSettings(
            verify_positions=None if v is None else len(v.prompt) + v.steps,
            verify_prompt_len=None if v is None else len(v.prompt),
            source=str(self.source) if self.source else "pipeline",
            calibration_tokens=self.calibration.max_tokens if self.calibration is not None else None,
            verify_runtimes=() if v is None else tuple(s.name for s in v.runtime_specs()),
            accuracy_tokens=accuracy_tokens,
            prompt_key="verify.prompt_text" if v is not None and v.prompt_text is not None else "verify.prompt",
            **self._target_settings(),
            passes=tuple(spec.name for spec in self.passes),
        )

    def _target_settings(self) -> dict[str, Any]:
        """The target's id and its ``context_bytes`` limit (``matrices/<target>.yaml``) for the passes' checks."""
        if self.target is None:
            return {}
        from onnxdeploy.pass_context import target_defaults  # noqa: PLC0415  (matrices load lazily)

        try:
            defaults = target_defaults(self.target)
        except ConfigError:  # an unknown target is reported under its own key
            return {"target": self.target}
        assert defaults is not None
        source = f"{defaults.source}: {defaults.context_source}" if defaults.context_bytes is not None else ""
        return {"target": self.target, "target_context_bytes": defaults.context_bytes, "target_context_source": source}

    @model_validator(mode="after")
    def _each_pass_needs_verify(self) -> PipelineConfig:
        if self.bisect:
            self.verify_each_pass = True
        if self.verify_each_pass and self.verify is None:
            raise ValueError("verify_each_pass/bisect need a verify section (its prompt and thresholds)")
        return self

    @field_validator("sdk", mode="before")
    @classmethod
    def _sdk_mode(cls, v: Any) -> Any:
        """``sdk: build`` is ``sdk: {mode: build}``; YAML 1.1 reads a bare ``off`` as false, which means ``off``."""
        if v is False:
            return {"mode": "off"}
        return {"mode": v} if isinstance(v, str) else v

    @field_validator("model", "output_dir", mode="before")
    @classmethod
    def _usable_path(cls, v: object) -> object:
        if isinstance(v, str) and ("\x00" in v or not v.strip()):
            raise ValueError("must be a non-empty path without NUL characters")
        return v

    @field_validator("output_name")
    @classmethod
    def _plain_onnx_name(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("must not contain NUL characters")
        if not v or Path(v).name != v or v in (".", "..") or v == ".onnx":
            raise ValueError("must be a plain file name (no folder part), e.g. model.onnx")
        if not v.endswith(".onnx"):
            raise ValueError("must end in .onnx")
        return v
