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
from onnxdeploy.errors import ConfigError
from onnxdeploy.matrices import get_target
from onnxdeploy.model_io import read_model_header
from onnxdeploy.report import CheckReport
from onnxdeploy.sdk import beside_matrix, rknn_build_report

__all__ = ["check_model_file"]


def check_model_file(
    path: str | Path, *, target: str | None = None, checks: Sequence[str] | None = None, sdk: bool = False
) -> CheckReport:
    """Check one model file and return the report (status ``failed`` when any finding is an error).

    Args:
        path: the ``.onnx`` file.
        target: a target id of ``matrices/`` (adds ``target_opset``, ``target_ops``, ``target_tensors``).
        checks: check names to run instead of the defaults.
        sdk: also build the model with the target's SDK (``rknn-rk3588``: RKNN-Toolkit2 2.5.0 in its own
            environment) and report its verdict per node beside the matrix's (``CheckReport.sdk``); a model
            the SDK cannot build fails the report.

    Returns:
        The :class:`~onnxdeploy.report.CheckReport`.

    Raises:
        ModelLoadError: the file or its external data is refused (:func:`onnxdeploy.model_io.read_model_header`).
        ConfigError: an unknown target or check name (the message lists the known ones); ``sdk`` without
            an SDK for the target, or with the SDK environment absent.
    """
    matrix = get_target(target) if target else None
    if sdk and target != "rknn-rk3588":
        raise ConfigError(f"--sdk: no SDK is wired for target '{target}'; only rknn-rk3588 (RKNN-Toolkit2 2.5.0)")
    names = [get_check(n).name for n in checks] if checks is not None else None
    header = read_model_header(path)
    if names is None:
        names = default_checks(read_contract(header, source=str(path)) is not None)
    if target:
        names += [n for n in TARGET_CHECKS if n not in names]
    context = CheckContext(model_path=Path(path), target=target)
    findings = [f for name in names for f in get_check(name)().run(header, context)]
    levels = Counter(f.level for f in findings)
    sdk_json = beside_matrix(rknn_build_report(path), findings) if sdk else None
    return CheckReport(
        status="failed" if levels["error"] or (sdk_json is not None and not sdk_json["built"]) else "passed",
        model=str(path),
        target=target,
        target_version=matrix.product_version if matrix else None,
        checks_run=names,
        summary={level: levels[level] for level in ("error", "warning", "info")},
        findings=findings,
        sdk=sdk_json,
    )
