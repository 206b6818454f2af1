"""What a pass gets that is not in the graph: the :class:`PassContext` and the services the pipeline injects.

A pass never imports the runner or the matrices. What it needs of them arrives here, typed, from whoever runs
the pass (the pipeline, through :func:`onnxdeploy.pass_context.make_pass_context`; tests the same way):

- ``session_factory`` opens an ONNX Runtime session on a model path (the runner's ``open_session``: the
  verification's own session options, prepacking off so external weights stay mapped);
- ``decoder_factory`` wraps such a session in a decode loop (the runner's ``ContractDecoder`` for a graph
  with a decode contract, else its ``ExporterDecoder``), for passes that collect calibration statistics;
- ``target_defaults`` are the settings the target's matrix implies (``static_kv``'s ``cache_write``).

:meth:`PassContext.provenance` states what the context supplied, so the pass cache key names it: a change of a
target file's defaults or of the runner's decode code cannot serve a stale cached pass output.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx

from onnxdeploy.contract import DecodeContract

__all__ = [
    "CalibrationDecoder",
    "DecoderFactory",
    "PassContext",
    "ProbeSession",
    "SessionFactory",
    "TargetDefaults",
]


class ProbeSession(Protocol):
    """An open ONNX Runtime session on a model file (the runner's ``ModelSession`` satisfies it).

    Attributes:
        session: the ``onnxruntime.InferenceSession``.
        model: the model's header proto (graph and metadata; large initializers without data).
    """

    session: Any
    model: onnx.ModelProto

    def close(self) -> None:
        """Release the session and any scratch copy it made."""


class SessionFactory(Protocol):
    """Opens a :class:`ProbeSession` on a model path.

    Raises:
        OnnxDeployError: the model cannot be loaded (its message names the path).
    """

    def __call__(self, path: str | Path) -> ProbeSession:
        """Open ``path``."""


class CalibrationDecoder(Protocol):
    """A decode loop that also returns extra graph outputs (the runner's decoders satisfy it).

    Attributes:
        extra_outputs: names of further graph outputs to fetch at every call.
        extra_results: one dict per call since :meth:`reset`, output name -> array (e.g. ``(B, S, K)`` float).
    """

    extra_outputs: list[str]
    extra_results: list[dict[str, np.ndarray]]

    def reset(self) -> None:
        """Start a new sequence (empty cache, position 0)."""

    def feed(self, tokens: list[int]) -> Any:
        """Feed token ids at the next positions; returns the logits."""


class DecoderFactory(Protocol):
    """Wraps an open session in a :class:`CalibrationDecoder`: contract loop with a contract, else the exporter's."""

    def __call__(self, session: ProbeSession, contract: DecodeContract | None) -> CalibrationDecoder:
        """The decoder for ``session``."""


@dataclass(frozen=True)
class TargetDefaults:
    """Pass settings a target implies when the pipeline does not choose (its matrix file's ``defaults``).

    Attributes:
        target: the target id (``rknn-rk3588``).
        cache_write: ``static_kv``/``kv_layout`` ``cache_write`` for this target, or None (scatter_elements).
        source: where the defaults were read (the matrix file), for messages.
        context_bytes: the largest weight bytes one graph may hold (the matrix's ``context_bytes`` limit), which
            ``split {parts: auto}`` fits each part to; None when the matrix states none.
        context_source: the limit's source (document, section, version, address, date read), for the report.
    """

    target: str
    cache_write: str | None = None
    source: str = ""
    context_bytes: int | None = None
    context_source: str = ""


@dataclass
class PassContext:
    """What a pass needs that is not in the graph.

    Attributes:
        session_factory: opens ORT sessions for probes (required; see the module docstring).
        model_path: the input ``.onnx`` file (its folder holds the input's external data).
        target: a target id of ``matrices/`` or None.
        target_defaults: the target's default pass settings, or None (no target, or none it implies).
        calibration: calibration prompts (token id lists) for passes that collect activations.
        decoder_factory: wraps a session in a decode loop for calibration, or None (calibration refused).
        decoder_source: what identifies the decode loop's code (a sha256 of the runner's source), for the pass
            cache key; None when ``decoder_factory`` is None.
        scratch_dir: a folder for probe models; made on first use and removed with the context if unset.
        passes_run: names of the passes that already ran, for error messages.
    """

    session_factory: SessionFactory
    model_path: Path | None = None
    target: str | None = None
    target_defaults: TargetDefaults | None = None
    calibration: list[list[int]] = field(default_factory=list)
    decoder_factory: DecoderFactory | None = None
    decoder_source: str | None = None
    scratch_dir: Path | None = None
    passes_run: list[str] = field(default_factory=list)

    def scratch(self) -> Path:
        """A scratch folder for probe models (made on first use, in the system temp folder if unset)."""
        if self.scratch_dir is not None:
            self.scratch_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.scratch_dir = Path(tempfile.mkdtemp(prefix="onnxdeploy-scratch-"))
            # a folder this context made is removed with it (or at exit), whoever forgets to
            weakref.finalize(self, shutil.rmtree, self.scratch_dir, True)
        return self.scratch_dir

    def provenance(self) -> dict[str, Any]:
        """What the context supplies to passes beyond the graph and the config, for the pass cache key.

        Returns:
            JSON-ready: the target, its defaults, and what identifies the calibration decode loop.
        """
        defaults = self.target_defaults
        return {
            "target": self.target,
            "target_defaults": None
            if defaults is None
            else {
                "target": defaults.target,
                "cache_write": defaults.cache_write,
                "context_bytes": defaults.context_bytes,
            },
            "decoder_source": self.decoder_source,
        }
