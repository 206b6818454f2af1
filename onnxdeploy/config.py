"""The pipeline file (``pipeline.yaml``): schema, loading and error messages naming the key.

Relative paths (``model``, ``output_dir``) are resolved against the folder of the pipeline file, so a
pipeline runs the same from any working directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from onnxdeploy.cache_config import CacheConfig
from onnxdeploy.errors import ConfigError
from onnxdeploy.passes import get_pass, pass_config_model
from onnxdeploy.settings import PipelineSettings, SettingsConflict

if TYPE_CHECKING:  # the pass modules (onnx, onnx_ir) are imported once the file validated: refusals come fast
    from onnxdeploy.passes import Pass

__all__ = [
    "AccuracyConfig",
    "CalibrationConfig",
    "VerifyConfig",
    "ReportConfig",
    "SdkConfig",
    "SdkQuantization",
    "PassSpec",
    "PipelineConfig",
    "RuntimeSpec",
    "check_pass_settings",
    "default_checks",
    "load_pipeline",
    "format_validation_error",
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


RuntimeName = Literal["onnxruntime", "openvino", "rknn-sim"]


class RuntimeSpec(BaseModel):
    """One ``verify.runtimes`` entry in its mapping form, with the bounds that runtime is held to.

    An fp16 runtime cannot meet an fp32 tolerance (RKNN-Toolkit2's fp16 simulator: 0.042 in max-abs logit with
    100% top-1, issue 19), so an unset bound comes from the precision the runtime computes in
    (:func:`onnxdeploy.runner.thresholds.runtime_thresholds`: f32 OpenVINO takes the ``verify`` section's; fp16
    rknn-sim mean cosine >= 0.9999 and top-1 >= 99%; a w8a8 build the held-out accuracy). The plain string form
    (``rknn-sim``) sets none of its own.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    name: RuntimeName = Field(description="The runtime (onnxruntime, openvino, rknn-sim).")
    max_abs_logit_diff: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Largest allowed max-abs logit difference on this runtime against the original on ORT; "
        "null: the runtime's precision defaults (fp32: verify.max_abs_logit_diff; fp16 builds: none).",
    )
    max_rel_logit_diff: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Largest allowed per-position max|diff| / max|reference logit|; null: precision defaults.",
    )
    min_cosine_similarity: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="Smallest allowed mean cosine similarity; null: precision defaults (fp16 builds: 0.9999).",
    )
    min_top1_agreement: float | None = Field(
        None, ge=0, le=1, description="Smallest allowed top-1 agreement; null: precision defaults (fp16: 0.99)."
    )

    def bounds(self) -> dict[str, float | None]:
        """The bounds this entry sets itself (None: the runtime's precision defaults decide)."""
        return {
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "max_rel_logit_diff": self.max_rel_logit_diff,
            "min_cosine_similarity": self.min_cosine_similarity,
            "min_top1_agreement": self.min_top1_agreement,
        }


class VerifyConfig(BaseModel):
    """The ``verify`` section: how the runner compares the transformed model with the original."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: list[int] = Field(default=[1, 17, 42, 99, 7, 3], min_length=1, description="Prompt token ids.")
    prompt_text: str | None = Field(
        None,
        min_length=1,
        description="The prompt as text instead of ids, encoded by the tokenizer (verify.tokenizer); needs the "
        "text extra. Not together with prompt.",
    )
    chat_template: StrictBool = Field(
        False,
        description="Render prompt_text as one user message through the tokenizer folder's chat template (with the "
        "assistant's turn opened) before encoding it; needs jinja2 (the text extra).",
    )
    tokenizer: Path | None = Field(
        None,
        strict=False,
        description="A tokenizer.json, or the folder holding one (relative to the pipeline file); default: the "
        "model's folder. Encodes prompt_text and accuracy.text_file and decodes the generations in the reports.",
    )
    steps: int = Field(32, ge=0, description="Greedy tokens generated (and fed) after the prompt.")
    modes: list[Literal["teacher_forced", "free_running"]] = Field(
        default=["teacher_forced", "free_running"], min_length=1, description="Decode modes to compare."
    )
    max_abs_logit_diff: float = Field(
        1e-4, ge=0, allow_inf_nan=False, description="Largest allowed max-abs logit difference."
    )
    min_top1_agreement: float = Field(1.0, ge=0, le=1, description="Smallest allowed top-1 agreement rate.")
    max_rel_logit_diff: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Largest allowed per-position max|diff| / max|reference logit| (dimensionless; null: not "
        "checked), per mode and per graph of a set.",
    )
    min_cosine_similarity: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="Smallest allowed mean cosine similarity of the logits (null: not checked), per mode and per "
        "graph of a set; e.g. 0.9999 for an fp16 KV cache.",
    )
    providers: list[str] = Field(
        default=["CPUExecutionProvider"], min_length=1, description="ONNX Runtime execution providers, in order."
    )
    runtimes: list[RuntimeSpec] = Field(
        default_factory=lambda: [RuntimeSpec(name="onnxruntime")],
        min_length=1,
        description="Runtimes the candidate is also decoded on; each is compared with the original on ONNX Runtime "
        "(openvino: CPU, INFERENCE_PRECISION_HINT f32; needs the openvino extra. rknn-sim: RKNN-Toolkit2 2.5.0's "
        "simulator, each graph built for rk3588 as the sdk section says (fp16 or w8a8); needs `onnxdeploy sdk "
        "install rknn`). Graph sets and step_len > 1 graphs are driven as on ONNX Runtime. An entry is a name or "
        "{name, max_abs_logit_diff, max_rel_logit_diff, min_cosine_similarity, min_top1_agreement} with that "
        "runtime's own bounds (unset: its precision's defaults, README 'Thresholds for reduced precision').",
    )
    strict_providers: StrictBool = Field(
        False, description="Fail (exit 1) when a requested provider is not active (ONNX Runtime fell back to CPU)."
    )
    accuracy: AccuracyConfig | None = Field(
        None, description="Teacher-forced KL, top-1 and perplexity on held-out tokens (for quantized candidates)."
    )
    remainder: Literal["padded", "buckets"] = Field(
        "padded",
        description="Graph sets: how the prompt tokens left after the largest bucket are fed: one padded chunk of "
        "the smallest bucket that holds them, or smaller buckets.",
    )

    @field_validator("prompt")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("providers")
    @classmethod
    def _known_providers(cls, v: list[str]) -> list[str]:
        import onnxruntime  # noqa: PLC0415  (only when a verify section names providers)

        unknown = [name for name in v if name not in onnxruntime.get_all_providers()]
        if unknown:
            raise ValueError(
                f"unknown execution provider(s) {unknown}; ONNX Runtime knows {onnxruntime.get_all_providers()}"
            )
        return v

    @field_validator("modes", "providers")
    @classmethod
    def _no_repeats(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"each entry may appear once, got {v}")
        return v

    @field_validator("runtimes", mode="before")
    @classmethod
    def _runtime_names(cls, v: Any) -> Any:
        """A plain name is the mapping form without a tolerance of its own (``openvino`` = ``{name: openvino}``)."""
        return [{"name": r} if isinstance(r, str) else r for r in v] if isinstance(v, list) else v

    @field_validator("runtimes")
    @classmethod
    def _runtime_once(cls, v: list[RuntimeSpec]) -> list[RuntimeSpec]:
        names = [r.name for r in v]
        if len(set(names)) != len(names):
            raise ValueError(f"each runtime may appear once, got {names}")
        return v

    def runtime_specs(self) -> list[RuntimeSpec]:
        """Every ``runtimes`` entry as a :class:`RuntimeSpec` with its tolerance resolved.

        Returns:
            One spec per entry, in order; ``max_abs_logit_diff`` is the entry's own, else the section's.
        """
        return [
            s
            if s.max_abs_logit_diff is not None
            else s.model_copy(update={"max_abs_logit_diff": self.max_abs_logit_diff})
            for s in self.runtimes
        ]


class CalibrationConfig(BaseModel):
    """The ``calibration`` section: token ids passes collect activations on (``quantize_weights``' act-order, GPTQ)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    token_ids_file: Path = Field(
        strict=False,
        description="Token ids (.npy int array, .json list or list of lists, or whitespace-separated ints); "
        "relative to the pipeline file.",
    )
    max_tokens: int = Field(2048, ge=1, description="Tokens used at most, from the start of the file.")


class AccuracyConfig(BaseModel):
    """The ``verify.accuracy`` section: teacher-forced accuracy of the candidate on held-out tokens (quantized models).

    Both models are fed the same tokens; per position the runner compares the next-token distributions
    (KL divergence original -> candidate, top-1 agreement) and both models' perplexity of the text.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    token_ids_file: Path | None = Field(
        None, strict=False, description="Held-out token ids (formats as calibration); relative to the pipeline."
    )
    text_file: Path | None = Field(
        None,
        strict=False,
        description="Held-out UTF-8 text instead of ids, encoded by verify.tokenizer (the text extra); relative to "
        "the pipeline. Exactly one of token_ids_file and text_file.",
    )
    max_tokens: int = Field(129, ge=2, description="Tokens fed at most (positions compared: one fewer).")
    max_mean_kl: float | None = Field(None, ge=0, description="Largest allowed mean KL(original || candidate), nats.")
    min_top1_agreement: float | None = Field(None, ge=0, le=1, description="Smallest allowed top-1 agreement.")
    max_ppl_ratio: float | None = Field(None, ge=1, description="Largest allowed perplexity candidate / original.")

    @model_validator(mode="after")
    def _one_source(self) -> AccuracyConfig:
        if (self.token_ids_file is None) == (self.text_file is None):
            raise ValueError("give exactly one of token_ids_file (ids) and text_file (text)")
        return self

    @property
    def source_key(self) -> str:
        """``verify.accuracy.token_ids_file`` or ``verify.accuracy.text_file``: the key the tokens come from."""
        return "verify.accuracy." + ("text_file" if self.text_file is not None else "token_ids_file")


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
        )

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


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """Render pydantic errors as ``key.path: message`` lines."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        key = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"key '{key}': {msg}")
    return "; ".join(lines)


def _parse_passes(raw: Any, where: str) -> list[PassSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: key 'passes' must be a list of '- name: {{config}}' entries")
    specs = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            name, cfg = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            name, cfg = next(iter(entry.items()))
        else:
            raise ConfigError(f"{where}: key 'passes[{i}]' must map one pass name to its config, got {entry!r}")
        try:
            config_model = pass_config_model(str(name))  # the catalogue's: no pass module imported yet
        except ConfigError as exc:
            raise ConfigError(f"{where}: key 'passes[{i}]': {exc}") from None
        if cfg is None:
            cfg = {}
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where}: key 'passes[{i}].{name}' must be a mapping of config keys")
        try:
            config = config_model.model_validate(cfg)
        except ValidationError as exc:
            raise ConfigError(f"{where}: {format_validation_error(exc, f'passes[{i}].{name}.')}") from None
        specs.append(PassSpec(name=str(name), config=config))
    return specs


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses duplicate mapping keys instead of keeping the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)  # resolve YAML merge keys (<<: *anchor) first
    keys = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in keys:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key}'", key_node.start_mark)
        keys.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _check_pass_settings(cfg: PipelineConfig, where: str) -> None:
    """Let each pass refuse, before any work, a combination with the rest of the pipeline it cannot run.

    First the order of the passes (:func:`~onnxdeploy.passes.pass_order_problem`, without the graph: the
    pipeline re-checks it with the input graph before the first pass), then each pass's ``check_settings``
    (:func:`check_pass_settings`).
    """
    from onnxdeploy.passes import pass_order_problem  # noqa: PLC0415  (imports onnx_ir: the file validated)

    problem = pass_order_problem([spec.build() for spec in cfg.passes])
    if problem is not None:
        i, reason = problem
        raise ConfigError(f"{where}: key 'passes[{i}].{cfg.passes[i].name}': {reason}")
    check_pass_settings(cfg, where, cfg.settings())


def check_pass_settings(cfg: PipelineConfig, where: str, settings: PipelineSettings) -> None:
    """Each pass's ``check_settings`` on ``settings``: at config load, and again once the token files are read.

    Raises:
        ConfigError: under ``passes[i].<name>``, or under the other section's key for a
            :class:`~onnxdeploy.settings.SettingsConflict` (e.g. ``verify.runtimes[1]``).
    """
    for i, spec in enumerate(cfg.passes):
        try:
            spec.build().check_settings(settings)
        except SettingsConflict as exc:
            raise ConfigError(f"{where}: key '{exc.key}': {exc.located(f'passes[{i}].{spec.name}')}") from None
        except ConfigError as exc:
            raise ConfigError(f"{where}: key 'passes[{i}].{spec.name}': {exc}") from None


def _resolve_token_files(cfg: PipelineConfig, base: Path, where: Path) -> PipelineConfig:
    """Resolve the calibration and verify.accuracy ``token_ids_file`` against ``base``; they must exist."""
    update: dict[str, Any] = {}
    sections = (("calibration", cfg.calibration), ("verify.accuracy", cfg.verify.accuracy if cfg.verify else None))
    for key, section in sections:
        if section is None:
            continue
        field = "text_file" if getattr(section, "text_file", None) is not None else "token_ids_file"
        given = getattr(section, field)
        file = given if given.is_absolute() else base / given
        if not file.is_file():
            raise ConfigError(f"{where}: key '{key}.{field}': file not found: {file}")
        resolved = section.model_copy(update={field: file.resolve()})
        if key == "calibration":
            update["calibration"] = resolved
        else:
            assert cfg.verify is not None
            update["verify"] = cfg.verify.model_copy(update={"accuracy": resolved})
    return cfg.model_copy(update=update) if update else cfg


def _resolve_text(cfg: PipelineConfig, base: Path, model: Path, where: Path) -> PipelineConfig:
    """Find the tokenizer (``verify.tokenizer``, else the model's folder) and encode ``verify.prompt_text``.

    ``verify.tokenizer`` becomes the resolved ``tokenizer.json`` when one is found, and ``verify.prompt`` the text's
    ids, so everything after (the passes' ``check_settings``, the prompt's vocabulary check) sees them.

    Raises:
        ConfigError: ``prompt`` and ``prompt_text`` both given; text (``prompt_text``, ``accuracy.text_file``)
            but no tokenizer found, the tokenizers/jinja2 package missing, no chat template declared (each names
            its key).
    """
    from onnxdeploy.text import find_tokenizer, load_codec  # noqa: PLC0415  (tokenizers only when text is given)

    v = cfg.verify
    if v is None:
        return cfg
    if v.prompt_text is not None and "prompt" in v.model_fields_set:
        raise ConfigError(f"{where}: key 'verify.prompt_text': give verify.prompt (token ids) or prompt_text, not both")
    needs = "verify.prompt_text" if v.prompt_text is not None else None
    if needs is None and v.accuracy is not None and v.accuracy.text_file is not None:
        needs = "verify.accuracy.text_file"
    if v.tokenizer is not None:
        given = v.tokenizer.expanduser()
        tokenizer: Path | None = find_tokenizer(
            given if given.is_absolute() else base / given, key=f"{where}: key 'verify.tokenizer'"
        )
    else:
        try:
            tokenizer = find_tokenizer(model.parent, key=f"{where}: key '{needs}'")
        except ConfigError:
            if needs is not None:
                raise
            tokenizer = None  # ids in, and no tokenizer beside the model: the reports show ids only
    if v.tokenizer is not None:  # asked for by name: read it now, so a bad file exits 2 before any pass
        load_codec(tokenizer, key=f"{where}: key 'verify.tokenizer'")
    update: dict[str, Any] = {"tokenizer": tokenizer}
    if v.prompt_text is not None:
        assert tokenizer is not None
        codec = load_codec(tokenizer, key=f"{where}: key 'verify.prompt_text'")
        update["prompt"] = codec.prompt_ids(
            v.prompt_text, chat=v.chat_template, key=f"{where}: key 'verify.prompt_text'"
        )
    elif v.chat_template:
        raise ConfigError(f"{where}: key 'verify.chat_template': applies to verify.prompt_text, which is not given")
    return cfg.model_copy(update={"verify": v.model_copy(update=update)})


def _check_sdk(cfg: PipelineConfig, where: Path) -> None:
    """``sdk: build`` needs the SDK environment, and quantization needs ``calibration`` (ConfigError, exit 2)."""
    if cfg.sdk.mode == "off":
        return
    if cfg.sdk.quantization is not None and cfg.calibration is None:
        raise ConfigError(
            f"{where}: key 'sdk.quantization': the {cfg.sdk.quantization.dtype} build needs a calibration dataset, "
            "generated from the 'calibration' section's token ids; add calibration: {token_ids_file: ...}"
        )
    on_sim = cfg.verify is not None and any(r.name == "rknn-sim" for r in cfg.verify.runtimes)
    if cfg.sdk.quantization is not None and on_sim and cfg.verify is not None and cfg.verify.accuracy is None:
        raise ConfigError(
            f"{where}: key 'sdk.quantization': an int8 build on rknn-sim is judged by held-out accuracy (mean KL, "
            "top-1, perplexity); add verify.accuracy: {token_ids_file: ...}"
        )
    if cfg.sdk.mode != "build":
        return
    if cfg.target != "rknn-rk3588":
        raise ConfigError(f"{where}: key 'sdk': no SDK build is wired for target {cfg.target!r}; only rknn-rk3588")
    from onnxdeploy.sdk import rknn_env, rknn_python  # noqa: PLC0415

    if rknn_python() is None:
        raise ConfigError(
            f"{where}: key 'sdk': mode build needs the RKNN-Toolkit2 environment ({rknn_env()}), which is not "
            "installed; run `onnxdeploy sdk install rknn`, or use sdk: auto / off"
        )


def load_pipeline(path: str | Path, *, output_dir: str | Path | None = None) -> PipelineConfig:
    """Read and validate a pipeline file.

    Args:
        path: the YAML file.
        output_dir: overrides the file's ``output_dir`` (relative to the current directory).

    Returns:
        The config with ``model`` and ``output_dir`` resolved to absolute paths.

    Raises:
        ConfigError: the file is missing or not YAML, a key is unknown or invalid (named as a dotted
            path, e.g. ``passes[0].static_kv.max_cache_len``), a key is repeated, a pass or check name
            is unknown, the model file does not exist, or a pass refuses the rest of the pipeline through its
            ``check_settings`` hook (e.g. ``static_kv``: ``len(prompt) + steps > max_cache_len``).
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p} is a folder; expected a pipeline YAML file")
    if not p.is_file():
        raise ConfigError(f"pipeline file not found: {p}")
    try:
        with p.open(encoding="utf-8") as stream:  # a named stream, so YAML errors cite the file
            raw = yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file; expected a pipeline YAML (did you pass the model?)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the pipeline must be a YAML mapping with at least the key 'model'")
    raw = dict(raw)
    if "source" in raw:
        raise ConfigError(f"{p}: key 'source': unknown key")
    passes = _parse_passes(raw.pop("passes", None), str(p))
    try:
        cfg = PipelineConfig.model_validate({**raw, "passes": []})
    except ValidationError as exc:
        raise ConfigError(f"{p}: {format_validation_error(exc)}") from None
    base = p.resolve().parent
    model = cfg.model if cfg.model.is_absolute() else base / cfg.model
    out = Path(output_dir).resolve() if output_dir is not None else cfg.output_dir
    if not out.is_absolute():
        out = base / out
    if not model.exists():
        raise ConfigError(f"{p}: key 'model': model file not found: {model}")
    if not model.is_file():
        raise ConfigError(f"{p}: key 'model': not a file: {model}")
    from onnxdeploy.checks import get_check  # noqa: PLC0415  (checks import config-free modules only)

    for i, name in enumerate(cfg.checks or []):
        try:
            get_check(name)
        except ConfigError as exc:
            raise ConfigError(f"{p}: key 'checks[{i}]': {exc}") from None
    if cfg.target is not None:
        from onnxdeploy.matrices import get_target  # noqa: PLC0415

        try:
            get_target(cfg.target)
        except ConfigError as exc:
            raise ConfigError(f"{p}: key 'target': {exc}") from None
    if cfg.verify is not None:
        from onnxdeploy.runner.runtimes import check_runtimes  # noqa: PLC0415

        try:
            check_runtimes([spec.name for spec in cfg.verify.runtime_specs()])
        except ConfigError as exc:
            raise ConfigError(f"{p}: key 'verify.runtimes': {exc}") from None
    _check_sdk(cfg, p)
    cfg = _resolve_token_files(cfg, base, p)
    cfg = _resolve_text(cfg, base, model, p)
    if cfg.cache is not None and cfg.cache.dir is not None and not cfg.cache.dir.is_absolute():
        cfg = cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"dir": (base / cfg.cache.dir).resolve()})})
    cfg = cfg.model_copy(
        update={"model": Path(os.path.abspath(model)), "output_dir": out.resolve(), "passes": passes, "source": p}
    )
    _check_pass_settings(cfg, str(p))
    return cfg
