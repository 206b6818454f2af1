"""A deterministic arrival trace for continuous batching: requests listed one by one, or drawn (Poisson arrivals).

The schema of a trace file (:func:`onnxdeploy.runner.batching_verify.read_trace`) and of ``verify.batching``'s inline
trace (:class:`onnxdeploy.verify_config.BatchingConfig`, which re-exports these); pydantic only, so the runner and
the config both read it (README, "Continuous batching").
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["PoissonTrace", "TraceRequest", "TraceSpec"]


class TraceRequest(BaseModel):
    """One request of an arrival trace: a prompt (ids, or a length drawn from the trace's seed), its new tokens."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: list[int] | None = Field(None, min_length=1, description="Prompt token ids (or prompt_len).")
    prompt_len: int | None = Field(
        None, ge=1, description="Prompt length; the ids are drawn uniform in 1..vocab-1 from the trace's seed."
    )
    max_new_tokens: int = Field(ge=1, description="Greedy tokens generated, the first from the prefill's logits.")
    arrival: int = Field(0, ge=0, description="Decode step of the host at which the request enters the queue.")
    stop_token: int | None = Field(None, ge=0, description="Generation ends once this token is produced (kept).")

    @model_validator(mode="after")
    def _one_prompt(self) -> TraceRequest:
        if (self.prompt is None) == (self.prompt_len is None):
            raise ValueError("give exactly one of prompt (token ids) and prompt_len")
        if self.prompt is not None and any(t < 0 for t in self.prompt):
            raise ValueError("token ids must be >= 0")
        return self


class PoissonTrace(BaseModel):
    """A drawn trace (:func:`onnxdeploy.runner.batching.poisson_trace`): uniform lengths, Poisson arrivals."""

    model_config = ConfigDict(extra="forbid", strict=True)

    count: int = Field(ge=1, description="Requests.")
    prompt_lens: tuple[int, int] = Field(description="[lowest, highest] prompt length (inclusive).")
    new_tokens: tuple[int, int] = Field(description="[lowest, highest] max_new_tokens (inclusive).")
    mean_gap: float = Field(ge=0, strict=False, allow_inf_nan=False, description="Mean decode steps between arrivals.")
    seed: int = Field(0, description="numpy default_rng seed.")
    vocab: int | None = Field(None, ge=2, description="Prompt ids drawn in 1..vocab-1; default: the model's.")

    @field_validator("prompt_lens", "new_tokens", mode="before")
    @classmethod
    def _pair(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _ranges(self) -> PoissonTrace:
        for key in ("prompt_lens", "new_tokens"):
            low, high = getattr(self, key)
            if not 1 <= low <= high:
                raise ValueError(f"{key} must be [lowest, highest] with 1 <= lowest <= highest, got [{low}, {high}]")
        return self


class TraceSpec(BaseModel):
    """A deterministic arrival trace: ``requests`` listed one by one, or drawn by ``poisson`` (exactly one).

    The format of a trace file (:func:`onnxdeploy.runner.batching_verify.read_trace`) and of ``verify.batching``'s
    inline trace; arrivals are counted in decode steps of the host (README, "Continuous batching").
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    requests: list[TraceRequest] | None = Field(None, min_length=1, description="The requests, listed.")
    poisson: PoissonTrace | None = Field(None, description="The requests, drawn (instead of requests).")
    vocab: int | None = Field(
        None, ge=2, description="requests: prompt_len ids are drawn in 1..vocab-1; default: the model's vocabulary."
    )
    seed: int = Field(0, description="requests: the numpy default_rng seed prompt_len ids are drawn from.")

    def trace_given(self) -> bool:
        """Whether this mapping lists or draws requests itself (else a ``trace`` file must)."""
        return self.requests is not None or self.poisson is not None

    @model_validator(mode="after")
    def _not_both(self) -> TraceSpec:
        if self.requests is not None and self.poisson is not None:
            raise ValueError("give requests (listed) or poisson (drawn), not both")
        return self
