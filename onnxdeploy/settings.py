"""What a pass may validate its config against before anything runs: the config's non-pass sections."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineSettings"]


@dataclass
class PipelineSettings:
    """What a pass may validate its config against before anything runs (the config's non-pass sections).

    Attributes:
        verify_positions: ``len(prompt) + steps`` the runner will decode, or None without verification.
        verify_prompt_len: the prompt's length in tokens (None without verification).
        source: the pipeline file, for messages.
        calibration_tokens: tokens the ``calibration`` section provides at most (None without one).
    """

    verify_positions: int | None = None
    verify_prompt_len: int | None = None
    source: str = "pipeline"
    calibration_tokens: int | None = None
