"""What a pass may validate its config against before anything runs: the config's non-pass sections."""

from __future__ import annotations

from dataclasses import dataclass

from onnxdeploy.errors import ConfigError

__all__ = ["PipelineSettings", "SettingsConflict"]


@dataclass
class PipelineSettings:
    """What a pass may validate its config against before anything runs (the config's non-pass sections).

    Attributes:
        verify_positions: ``len(prompt) + steps`` the runner will decode, or None without verification.
        verify_prompt_len: the prompt's length in tokens (None without verification).
        source: the pipeline file, for messages.
        calibration_tokens: tokens the ``calibration`` section provides at most (None without one).
        verify_runtimes: the ``verify.runtimes`` names in order (``onnxruntime``, ``openvino``, ``rknn-sim``);
            empty without verification.
        accuracy_tokens: held-out tokens ``verify.accuracy`` decodes as one teacher-forced sequence through the
            candidate (known once its file is read; None before, or without the section).
        prompt_key: the key the prompt's ids come from: ``verify.prompt``, or ``verify.prompt_text`` (encoded by
            the tokenizer), for messages that ask to shorten it.
        target: the pipeline's ``target`` id, or None.
        target_context_bytes: the largest weight bytes one graph may hold on the target (its matrix's
            ``context_bytes`` limit, e.g. ort-qnn's HTP context), or None (no target, or no such limit sourced).
        target_context_source: where that limit is stated (``matrices/<target>.yaml`` and the limit's source), for
            messages; empty without one.
        passes: the pipeline's pass names in order (a pass checks what runs before it, e.g. ``split`` whether a
            ``quantize_weights`` changes the weight bytes first).
    """

    verify_positions: int | None = None
    verify_prompt_len: int | None = None
    source: str = "pipeline"
    calibration_tokens: int | None = None
    verify_runtimes: tuple[str, ...] = ()
    accuracy_tokens: int | None = None
    prompt_key: str = "verify.prompt"
    target: str | None = None
    target_context_bytes: int | None = None
    target_context_source: str = ""
    passes: tuple[str, ...] = ()


class SettingsConflict(ConfigError):
    """A pass's ``check_settings`` refusal that belongs to another section's key (e.g. ``verify.runtimes[1]``).

    The pipeline loader reports it as ``<file>: key '<key>': <message>`` instead of under the pass's own key,
    with ``{pass_key}`` in the message replaced by the pass's key (``passes[2].static_kv``).

    Args:
        key: the dotted key of the section that cannot run with the pass.
        message: why, ``{pass_key}`` standing for the pass's key.
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"key '{key}': {self.located('this pass')}")

    def located(self, pass_key: str) -> str:
        """The message with ``{pass_key}`` replaced by ``pass_key``."""
        return self.message.replace("{pass_key}", pass_key)
