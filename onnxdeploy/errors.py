"""Typed errors of onnxdeploy and the exit status each one maps to.

Exit status (README, "Exit codes"): 0 all good, 1 a check or the verification failed,
2 bad input or configuration. Every error here is a *bad input* error (exit 2); a model that
loads but fails a check or verification is reported through findings and verification results,
never through an exception.
"""

from __future__ import annotations

__all__ = [
    "OnnxDeployError",
    "ConfigError",
    "ModelLoadError",
    "DuplicateTensorError",
    "PassError",
    "PreconditionError",
    "PostconditionError",
    "UnsupportedGraphError",
    "CacheOverflowError",
    "DecodeRunError",
    "OutputError",
    "ContractError",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_BAD_INPUT",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class OnnxDeployError(Exception):
    """Base class of every error onnxdeploy raises for bad input; maps to exit status 2."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(OnnxDeployError):
    """The pipeline file or a pass/verify config is invalid (names the file and the key)."""


class ModelLoadError(OnnxDeployError):
    """A model file is missing, unreadable or not a valid ONNX protobuf (names the path)."""


class DuplicateTensorError(ModelLoadError):
    """A graph defines a tensor twice (not SSA): no pass can load it; a checks-only run reports it as findings."""


class ContractError(OnnxDeployError):
    """A decode contract in ``metadata_props`` is missing, malformed or disagrees with the graph."""


class PassError(OnnxDeployError):
    """A pass could not transform the model; the message names the pass and the node or tensor.

    Args:
        pass_name: registry name of the failing pass (e.g. ``static_kv``).
        message: what went wrong, naming the node/tensor/op.
    """

    def __init__(self, pass_name: str, message: str):
        self.pass_name = pass_name
        self.detail = message
        super().__init__(f"pass '{pass_name}': {message}")


class PreconditionError(PassError):
    """The model does not meet what a pass requires (e.g. no KV cache found for ``static_kv``)."""


class PostconditionError(PassError):
    """A pass produced a model that breaks what it promises (e.g. a dynamic dim left)."""


class UnsupportedGraphError(PassError):
    """A pass met a graph pattern it does not recognise and refuses to guess."""


class CacheOverflowError(OnnxDeployError):
    """A decode step would write past ``max_cache_len``; raised before ``session.run``.

    Args:
        position: the cache slot the step would write (0-based token position).
        max_cache_len: the number of slots of the fixed cache buffer.
    """

    def __init__(self, position: int, max_cache_len: int):
        self.position = position
        self.max_cache_len = max_cache_len
        super().__init__(
            f"decode step at position {position} would write past max_cache_len={max_cache_len} "
            f"(slots 0..{max_cache_len - 1}); raise max_cache_len or decode fewer steps"
        )


class DecodeRunError(OnnxDeployError):
    """ONNX Runtime failed inside ``session.run`` while decoding (names the model and the position)."""


class OutputError(OnnxDeployError):
    """An output cannot be written (names the path): not a folder, not writable, disk full, or the input."""
