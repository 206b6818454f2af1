"""ONNX Runtime sessions for verification: deterministic options and execution-provider fallback.

ORT silently falls back to ``CPUExecutionProvider`` when a requested execution provider (EP) is not
available; :func:`open_session` compares what was asked with ``session.get_providers()`` and
reports every requested EP that is not active.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from onnxdeploy.errors import ConfigError, ContractError, ModelLoadError

__all__ = ["DEFAULT_PROVIDERS", "ModelSession", "numpy_dtype", "open_session", "session_options"]

DEFAULT_PROVIDERS: tuple[str, ...] = ("CPUExecutionProvider",)

# ORT's type strings for the tensor element types a decoder's inputs and outputs use.
_ORT_TYPES: dict[str, np.dtype] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(bool)": np.dtype(np.bool_),
}


@dataclass(frozen=True)
class ModelSession:
    """An ORT session together with the graph it runs and the EPs it really uses.

    Attributes:
        path: the model file, as given.
        model: the ``ModelProto`` without external weights (graph structure and metadata only).
        session: the ORT inference session.
        providers_requested: EPs asked for, in priority order.
        providers_active: EPs the session reports (``session.get_providers()``).
        fallbacks: one human-readable line per requested EP that is not active.
    """

    path: str
    model: onnx.ModelProto
    session: ort.InferenceSession
    providers_requested: tuple[str, ...]
    providers_active: tuple[str, ...]
    fallbacks: list[str] = field(default_factory=list)

    def input_types(self) -> dict[str, tuple[list[int | str | None], str]]:
        """Return the session inputs (initializers excluded) as ``name -> (shape, ORT type string)``.

        Returns:
            Shapes list static dims as ``int`` and symbolic ones as ``str`` or ``None``.
        """
        return {arg.name: (list(arg.shape), arg.type) for arg in self.session.get_inputs()}

    def output_names(self) -> list[str]:
        """Return the session's output names in graph order."""
        return [arg.name for arg in self.session.get_outputs()]


def numpy_dtype(ort_type: str, *, tensor: str) -> np.dtype:
    """Map an ORT type string such as ``tensor(float16)`` to a numpy dtype.

    Args:
        ort_type: the type string from ``session.get_inputs()[i].type``.
        tensor: the tensor name, for the error message.

    Returns:
        The numpy dtype.

    Raises:
        ContractError: the element type has no numpy equivalent the runner feeds (e.g. bfloat16).
    """
    try:
        return _ORT_TYPES[ort_type]
    except KeyError:
        raise ContractError(f"'{tensor}' has element type {ort_type}, which the runner cannot feed") from None


def session_options() -> ort.SessionOptions:
    """Build the ORT session options used for every verification run.

    One intra-op and one inter-op thread, sequential execution and deterministic compute, so
    two runs of the same model give bit-identical logits and latencies are comparable.

    Returns:
        A fresh ``onnxruntime.SessionOptions``.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.use_deterministic_compute = True
    options.log_severity_level = 3
    return options


def open_session(path: str | Path, *, providers: Sequence[str] = DEFAULT_PROVIDERS) -> ModelSession:
    """Load a model file into an ORT session on the given EP list.

    Args:
        path: the ``.onnx`` file; external data is resolved relative to it by ORT.
        providers: EP names in priority order, e.g. ``("CUDAExecutionProvider", "CPUExecutionProvider")``.

    Returns:
        The session with the graph (weights not loaded) and any EP fallbacks. Only whole-session
        fallbacks are seen; nodes an active EP hands to CPU are not reported.

    Raises:
        ModelLoadError: the file is missing, is not a valid ONNX model, or ORT cannot create a
            session for it; the message names the path.
        ConfigError: a provider name ONNX Runtime does not know (``ort.get_all_providers()``).
    """
    source = str(path)
    if Path(path).is_dir():
        raise ModelLoadError(f"{source}: is a folder, not a model file")
    if not Path(path).is_file():
        raise ModelLoadError(f"{source}: model file not found")
    try:
        model = onnx.load(source, format="protobuf", load_external_data=False)
    except Exception as exc:  # protobuf and onnx raise several unrelated types
        raise ModelLoadError(f"{source}: not a readable ONNX model: {exc}") from exc
    requested = tuple(providers)
    known = ort.get_all_providers()
    unknown = [name for name in requested if name not in known]
    if unknown:
        raise ConfigError(f"unknown execution provider(s) {unknown}; ONNX Runtime knows {known}")
    try:
        with warnings.catch_warnings():
            # ORT warns and falls back when an EP is unavailable; the fallback is reported below.
            warnings.simplefilter("ignore")
            session = ort.InferenceSession(source, sess_options=session_options(), providers=list(requested))
    except Exception as exc:  # ORT raises its own types (Fail, InvalidGraph, ...)
        raise ModelLoadError(f"{source}: ONNX Runtime cannot load the model: {exc}") from exc
    active = tuple(session.get_providers())
    fallbacks = [
        f"{source}: requested {name} is not active; running on {', '.join(active)}"
        for name in requested
        if name not in active
    ]
    return ModelSession(source, model, session, requested, active, fallbacks)
