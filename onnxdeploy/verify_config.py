"""The pipeline file's ``verify`` and ``calibration`` sections: how the runner compares the models, on which tokens.

Re-exported by :mod:`onnxdeploy.config` (``from onnxdeploy.config import VerifyConfig`` keeps working).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from onnxdeploy.batching_trace import PoissonTrace, TraceRequest, TraceSpec
from onnxdeploy.config_errors import did_you_mean

__all__ = [
    "AccuracyConfig",
    "BatchingConfig",
    "CalibrationConfig",
    "PoissonTrace",
    "RuntimeName",
    "RuntimeSpec",
    "TraceRequest",
    "TraceSpec",
    "VerifyConfig",
]


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
    batching: BatchingConfig | None = Field(
        None,
        description="Continuous batching: serve a deterministic arrival trace on the candidate (a static_kv "
        "{row_positions: true} set) and compare each request with its own batch-1 decode of the original.",
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

        known = onnxruntime.get_all_providers()
        unknown = [name for name in v if name not in known]
        if unknown:
            hint = did_you_mean(unknown[0], known)
            raise ValueError(f"unknown execution provider(s) {unknown}; ONNX Runtime knows {known}{hint}")
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


class BatchingConfig(TraceSpec):
    """The ``verify.batching`` section: a trace served by continuous batching on the candidate, each request checked.

    The trace is a file (``trace``, relative to the pipeline file) or given inline (``requests`` or ``poisson``,
    the file's keys): exactly one. The candidate must be a ``static_kv {row_positions: true}`` set with batch-1
    prefill buckets (``prefill_batch: 1``, a step length > 1); every request must fit ``max_cache_len``.
    """

    trace: Path | None = Field(
        None,
        strict=False,
        description="A trace file (YAML: requests or poisson, as inline), relative to the pipeline file.",
    )
    policy: Literal["continuous", "static"] = Field(
        "continuous",
        description="continuous: a freed row is refilled at once; static: a batch of B runs until its longest ends.",
    )
    max_abs_logit_diff: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Largest allowed max-abs logit difference per request; null: verify.max_abs_logit_diff.",
    )

    @model_validator(mode="after")
    def _one_trace(self) -> BatchingConfig:
        if (self.trace is None) == (not self.trace_given()):
            raise ValueError("give exactly one of trace (a file), requests (listed) and poisson (drawn)")
        if self.trace is not None and {"vocab", "seed"} & self.model_fields_set:
            raise ValueError("vocab and seed belong in the trace file when trace is given")
        return self


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
