"""pin_opset on a CI-sized subset of ONNX's node tests: no wrong, invalid or unexplained output, no crash.

Target opsets {11, 13, 17, 19, 21, newest}; each op is converted only to the targets where its schema version
changes (from one target of the list to the next), with at most :data:`PER_OP` of its tests, chosen by name
order (deterministic). Every (test, target) must end correct, refused in user terms (node, op, opset pair,
reason), or valid ONNX that ORT has no kernel for; and wherever onnx's own converter is correct, pin_opset is.
The whole suite at every opset is ``benchmarks/conformance.py``.
"""

from __future__ import annotations

import functools

import onnx
import pytest

from tests.conformance import harness
from tests.conformance.node_cases import NodeCase, load_node_cases

TARGETS = tuple(sorted({11, 13, 17, 19, 21, onnx.defs.onnx_opset_version()}))
PER_OP = 2
"""Tests per op and target: the suite holds up to ~40 tests of one op (Attention); two keep CI to minutes."""

ACCEPTED = ("correct", "refused", "ort_no_kernel")


def _version(op: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op, opset, "").since_version
    except onnx.defs.SchemaError:
        return None


def _changing_targets(op: str) -> set[int]:
    """The targets of :data:`TARGETS` where ``op``'s version differs from its version at the previous target."""
    found, previous = set(), object()
    for target in TARGETS:
        version = _version(op, target)
        if version != previous:
            found.add(target)
        previous = version
    return found


@functools.cache
def _selection() -> dict[int, list[NodeCase]]:
    """Per target: the baseline tests of the subset (see the module docstring)."""
    by_op: dict[str, list[NodeCase]] = {}
    for case in load_node_cases():
        # "_expanded": the function-body twin of a test (same op coverage)
        if case.opset is not None and not case.name.endswith("_expanded"):
            by_op.setdefault(case.op_type, []).append(case)
    chosen: dict[int, list[NodeCase]] = {t: [] for t in TARGETS}
    for op, cases in sorted(by_op.items()):
        for target in sorted(_changing_targets(op)):
            picked = [c for c in cases if c.opset != target and harness.in_baseline(c)][:PER_OP]
            chosen[target] += picked
    return chosen


@pytest.mark.parametrize("target", TARGETS)
def test_pin_opset_on_node_tests(target):
    problems = []
    for case in _selection()[target]:
        pin = harness.outcome(case, target)
        if pin.status not in ACCEPTED:
            problems.append(f"{case.name} (opset {case.opset}) -> {target}: {pin.status}: {pin.detail}")
        elif pin.status != "correct" and harness.outcome(case, target, "onnx").status == "correct":
            problems.append(
                f"{case.name} (opset {case.opset}) -> {target}: onnx's converter is correct, "
                f"pin_opset {pin.status}: {pin.detail}"
            )
    assert not problems, f"{len(problems)} of {len(_selection()[target])}:\n" + "\n".join(problems)
