"""``onnxdeploy check``: run the checks on one model file, optionally against a target's matrix.

The checks read the file's header (graph and inline tensors; external weights are not read). Which checks run
when none are named: the static-decoder set when the model carries a decode contract, the general set when it
does not (:func:`onnxdeploy.config.default_checks`), plus the target checks when a target is given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from onnxdeploy.checks import CheckContext, get_check
from onnxdeploy.checks.target import TARGET_CHECKS
from onnxdeploy.config import default_checks
from onnxdeploy.contract import read_contract
from onnxdeploy.matrices import get_target
from onnxdeploy.model_io import read_model_header
from onnxdeploy.report import CheckReport

__all__ = ["check_model_file"]


def check_model_file(
    path: str | Path, *, target: str | None = None, checks: Sequence[str] | None = None
) -> CheckReport:
    """Check one model file and return the report (status ``failed`` when any finding is an error).

    Args:
        path: the ``.onnx`` file.
        target: a target id of ``matrices/`` (adds ``target_opset``, ``target_ops``, ``target_tensors``).
        checks: check names to run instead of the defaults.

    Returns:
        The :class:`~onnxdeploy.report.CheckReport`.

    Raises:
        ModelLoadError: the file or its external data is refused (:func:`onnxdeploy.model_io.read_model_header`).
        ConfigError: an unknown target or check name (the message lists the known ones).
    """
    matrix = get_target(target) if target else None
    names = [get_check(n).name for n in checks] if checks is not None else None
    header = read_model_header(path)
    if names is None:
        names = default_checks(read_contract(header, source=str(path)) is not None)
    if target:
        names += [n for n in TARGET_CHECKS if n not in names]
    context = CheckContext(model_path=Path(path), target=target)
    findings = [f for name in names for f in get_check(name)().run(header, context)]
    levels = Counter(f.level for f in findings)
    return CheckReport(
        status="failed" if levels["error"] else "passed",
        model=str(path),
        target=target,
        target_version=matrix.product_version if matrix else None,
        checks_run=names,
        summary={level: levels[level] for level in ("error", "warning", "info")},
        findings=findings,
    )
