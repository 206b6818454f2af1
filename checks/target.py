"""``target_opset``: the model's opsets and IR version are within what the target's matrix entry accepts.

Source: the target's data file in ``matrices/`` (each entry names its document, version and address).
Operator-level support (ops and their constraints per target) comes with the full matrix checks.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from onnxdeploy.checks.base import Check, CheckContext, register_check
from onnxdeploy.matrices import get_target
from onnxdeploy.report import Finding

__all__ = ["TargetOpsetCheck"]


@register_check
class TargetOpsetCheck(Check):
    """Compare every imported opset domain and the IR version with the target's matrix entry.

    - ``OD501`` error: a domain's opset is outside the target's ``opsets.<domain>`` range;
    - ``OD502`` error: the model imports a domain the target does not list;
    - ``OD503`` error: the IR version is above the target's ``ir_version.max``;
    - ``OD504`` info: no target given, nothing checked.
    """

    name = "target_opset"
    description = "Opset per domain and IR version within the target's matrix entry (matrices/<target>.yaml)."
    codes = {
        "OD501": "error: a domain's opset is outside the target's supported range.",
        "OD502": "error: an opset domain the target does not support.",
        "OD503": "error: the IR version is newer than the target accepts.",
        "OD504": "info: no target given; nothing checked.",
    }

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        """Yield ``OD501``-``OD504`` findings (see the class docstring)."""
        if not context.target:
            yield self.finding("OD504", "info", "no target given; opsets not checked against a matrix")
            return
        entry = get_target(context.target)
        sources = "; ".join(f"{s['doc']} ({s['version']})" for s in entry.get("sources", []))
        ranges = entry.get("opsets", {})
        for imp in model.opset_import:
            domain = imp.domain or "ai.onnx"
            if domain not in ranges:
                yield self.finding(
                    "OD502",
                    "error",
                    f"opset domain '{domain}' (version {imp.version}) is not supported by target {context.target}",
                    nodes=[domain],
                    hint=f"Remove or replace the {domain} ops; supported domains: {sorted(ranges)}. Source: {sources}",
                )
                continue
            lo, hi = ranges[domain].get("min", 1), ranges[domain].get("max", imp.version)
            if not lo <= imp.version <= hi:
                yield self.finding(
                    "OD501",
                    "error",
                    f"{domain} opset {imp.version} is outside {context.target}'s range {lo}..{hi}",
                    nodes=[domain],
                    hint=f"Add `pin_opset: {{opset: {min(max(imp.version, lo), hi)}}}` to the passes. "
                    f"Source: {sources}",
                )
        ir_max = entry.get("ir_version", {}).get("max")
        if ir_max is not None and model.ir_version > ir_max:
            yield self.finding(
                "OD503",
                "error",
                f"IR version {model.ir_version} is above {context.target}'s maximum {ir_max}",
                hint=f"Lower the opset (pin_opset) so the model can be saved with IR version <= {ir_max}. "
                f"Source: {sources}",
            )
