"""Helpers for the check tests: parse ONNX text with a standard header and pick findings."""

from __future__ import annotations

import onnx
from onnx import parser

from onnxdeploy.report import Finding

STATIC_MODEL = """
g (float[2,4] x) => (float[2,3] y)
<float[4,3] w = {1.,2.,3.,4.,5.,6.,7.,8.,9.,10.,11.,12.}>
{
    [mm] t = MatMul(x, w)
    [relu] y = Relu(t)
}
"""


def parse(text: str, *, opset: int = 17, extra_opsets: str = "") -> onnx.ModelProto:
    """Parse a graph in ONNX text syntax under ``<ir_version: 8, opset_import: ["": opset, ...]>``."""
    header = f'<ir_version: 8, opset_import: ["" : {opset}{extra_opsets}]>\n'
    return parser.parse_model(header + text)


def by_code(findings: list[Finding], code: str) -> list[Finding]:
    return [f for f in findings if f.code == code]


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]
