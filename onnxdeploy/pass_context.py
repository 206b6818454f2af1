"""Build the pass context a run's passes get: the runner's sessions and decoders, and the target's defaults.

This is the one place where what the passes need from the runner and the matrices is wired in (the passes
import neither): the pipeline calls :func:`make_pass_context`, and so do tests and benchmarks that run a pass
on its own. :func:`runner_source_digest` names the decode code that produced calibration statistics, so the
pass cache key changes when that code does.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from onnxdeploy.contract import DecodeContract
from onnxdeploy.passes._context import CalibrationDecoder, PassContext, ProbeSession, TargetDefaults

__all__ = ["decoder_for", "make_pass_context", "runner_source_digest", "target_defaults"]


@functools.cache
def runner_source_digest() -> str:
    """sha256 of the runner's source (``runner/*.py``, in path order): what the calibration decode loop runs."""
    from onnxdeploy import runner  # noqa: PLC0415  (the mapped runner/ folder)

    h = hashlib.sha256()
    for path in sorted(Path(runner.__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def target_defaults(target: str | None) -> TargetDefaults | None:
    """The pass settings ``target``'s matrix file implies (``defaults``), or None without a target.

    Source: the target's file in ``matrices/`` (its ``defaults`` section and the note citing why; its
    ``context_bytes`` limit and that limit's source).

    Raises:
        ConfigError: no matrix file has that target id.
    """
    if target is None:
        return None
    from onnxdeploy.matrices import get_target  # noqa: PLC0415  (matrices load lazily: package data)

    matrix = get_target(target)
    context = next((lim for lim in matrix.limits if lim.name == "context_bytes" and lim.unit == "bytes"), None)
    return TargetDefaults(
        target=target,
        cache_write=matrix.defaults.cache_write,
        source=f"matrices/{target}.yaml",
        context_bytes=None if context is None else context.value,
        context_source="" if context is None else matrix.source_text(context.source),
    )


def decoder_for(session: ProbeSession, contract: DecodeContract | None) -> CalibrationDecoder:
    """The runner's decode loop over ``session``: :class:`ContractDecoder` with a contract, else the exporter's."""
    from onnxdeploy.runner import ContractDecoder, ExporterDecoder  # noqa: PLC0415

    return ContractDecoder(session, contract) if contract is not None else ExporterDecoder(session)  # type: ignore[arg-type]


def make_pass_context(
    *,
    model_path: Path | None = None,
    target: str | None = None,
    calibration: list[list[int]] | None = None,
    scratch_dir: Path | None = None,
) -> PassContext:
    """A pass context wired to the runner's ``open_session`` and decoders and to ``target``'s matrix defaults.

    Args:
        model_path: the input ``.onnx`` (its folder holds the input's external data), if any.
        target: a target id of ``matrices/``, or None.
        calibration: calibration token id lists for passes that collect activations.
        scratch_dir: the folder for probe models (made on first use in the system temp folder if None).

    Raises:
        ConfigError: ``target`` names no matrix file.
    """
    from onnxdeploy.runner import open_session  # noqa: PLC0415  (ORT loads only when a pass runs)

    return PassContext(
        session_factory=open_session,
        model_path=model_path,
        target=target,
        target_defaults=target_defaults(target),
        calibration=list(calibration or []),
        decoder_factory=decoder_for,
        decoder_source=runner_source_digest(),
        scratch_dir=scratch_dir,
    )
