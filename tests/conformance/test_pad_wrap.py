"""Pad-19+ ``mode='wrap'`` lowered below 19: a Gather of ``(j - begin) mod dim`` per padded axis, exact.

ONNX's own ``test_wrap_pad`` (Pad-25, pads fed at run time) converted to 18, 13 and 11 and judged on ORT against
the test's expected output. onnx's converter keeps ``mode='wrap'`` on a Pad-18, which the spec does not define
(Pad-18 takes constant/reflect/edge) and which ORT happens to run; below 18 it refuses.
"""

from __future__ import annotations

import pytest

from tests.conformance import harness
from tests.conformance.node_cases import load_node_cases


@pytest.mark.parametrize("target", [18, 13, 11])
def test_wrap_pad_lowers_exactly(target):
    (case,) = [c for c in load_node_cases() if c.name == "test_wrap_pad"]
    assert case.opset == 25 and harness.in_baseline(case)
    model, written = harness.convert_with_pin_opset(case, target)
    assert model is not None, written.detail
    pads = [n for n in model.graph.node if n.op_type == "Pad"]
    assert not pads and "Mod" in {n.op_type for n in model.graph.node}
    assert harness.judge(model, case).status == "correct"
