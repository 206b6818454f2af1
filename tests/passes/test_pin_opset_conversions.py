"""pin_opset: the defects issue 16 found on ONNX's node tests, each on a small model run on ORT CPU, and the proof.

CastLike keeps ``saturate`` and is type-checked; Pad keeps (or spells out) ``axes``; Mod-28 ``fmod=0`` on floats
is lowered exactly; sequence types are checked as sequences; Reshape ``allowzero`` is kept where it exists; a
refusal names the node, the op and the opset pair; the proof refuses a conversion whose output differs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy.errors import PassError
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import _opset_adapters
from onnxdeploy.passes.pin_opset import PinOpsetConfig, PinOpsetPass


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _pin(model: onnx.ModelProto, opset: int, **config: object) -> onnx.ModelProto:
    result = PinOpsetPass(PinOpsetConfig(opset=opset, **config))(ir.serde.deserialize_model(model), make_pass_context())
    out = ir.serde.serialize_model(result.artifacts.primary)
    onnx.checker.check_model(out, full_check=True)
    return out


def _same_at(text: str, targets: tuple[int, ...], feeds: dict) -> None:
    model = onnx.parser.parse_model(text)
    want = _run(model, feeds)
    for target in targets:
        got = _run(_pin(model, target), feeds)
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"opset {target}")


def test_castlike_keeps_saturate_0_for_float8():
    # CastLike-21 -> 19: saturate=0 turns an out-of-range value into inf for float8e5m2 (57344 when saturating)
    text = """<ir_version: 10, opset_import: ["" : 21]>
        g (float[3] x) => (float[3] y) {
            like = Constant <value = float8e5m2[1] {0}> ()
            c = CastLike <saturate = 0> (x, like)
            y = Cast <to = 1> (c)
        }"""
    x = np.array([1e6, -1e6, 1.0], np.float32)
    converted = _pin(onnx.parser.parse_model(text), 19)
    np.testing.assert_array_equal(_run(converted, {"x": x})[0], [np.inf, -np.inf, 1.0])


def test_castlike_to_a_type_the_target_lacks_is_refused_with_op_node_and_pair():
    text = """<ir_version: 10, opset_import: ["" : 21]>
        g (float[3] x, int4[1] like) => (float[3] y) {
            c = CastLike (x, like)
            y = Cast <to = 1> (c)
        }"""
    with pytest.raises(PassError) as err:
        _pin(onnx.parser.parse_model(text), 17)
    message = err.value.detail
    assert "CastLike" in message and "opset 21 to 17" in message and "int4" in message
    assert "lowest reachable opset: 21" in message


PAD = """<ir_version: 10, opset_import: ["" : 21]>
    g (float[2,3,4] x, int64[4] pads) => (float[?,?,?] y) {
        axes = Constant <value = int64[2] {2, 0}> ()
        value = Constant <value = float {5.0}> ()
        y = Pad <mode = "constant"> (x, pads, value, axes)
    }"""


@pytest.mark.parametrize("target", [19, 18, 17, 13, 11])
def test_pad_with_permuted_axes_keeps_its_meaning(target):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    pads = np.array([1, 0, 2, 1], np.int64)  # axis 2: begin 1, end 2; axis 0: begin 0, end 1
    _same_at(PAD, (target,), {"x": x, "pads": pads})


def test_mod_28_fmod_0_on_floats_is_floor_mod_at_13():
    text = """<ir_version: 11, opset_import: ["" : 28]>
        g (float[8] a, float[8] b) => (float[8] y) { y = Mod <fmod = 0> (a, b) }"""
    a = np.array([-4.5, 4.5, -4.5, 4.5, 3.0, -3.0, 0.5, 7.25], np.float32)
    b = np.array([2.0, -2.0, -2.0, 2.0, 3.0, 2.0, np.inf, -np.inf], np.float32)
    converted = _pin(onnx.parser.parse_model(text), 13)
    assert {n.op_type for n in converted.graph.node} >= {"Mod", "Where"}
    got = _run(converted, {"a": a, "b": b})[0]
    np.testing.assert_allclose(got, np.mod(a, b), rtol=0, atol=0)


def test_identity_on_a_sequence_is_refused_below_14_and_kept_above():
    text = """<ir_version: 10, opset_import: ["" : 21]>
        g (seq(float[2]) x) => (seq(float[2]) y) { y = Identity (x) }"""
    with pytest.raises(PassError, match=r"seq\(tensor\(float\)\).*lowest reachable opset: 14"):
        _pin(onnx.parser.parse_model(text), 13)
    converted = _pin(onnx.parser.parse_model(text), 17)
    seq = [np.ones(2, np.float32), np.zeros(2, np.float32)]
    got = _run(converted, {"x": seq})[0]
    np.testing.assert_array_equal(got, seq)


def test_split_to_sequence_converts_to_lower_opsets():
    text = """<ir_version: 10, opset_import: ["" : 24]>
        g (float[6,2] x) => (seq(float[?,2]) y) {
            split = Constant <value = int64[2] {2, 4}> ()
            y = SplitToSequence <axis = 0> (x, split)
        }"""
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    model = onnx.parser.parse_model(text)
    want = _run(model, {"x": x})[0]
    for target in (21, 17, 13, 11):
        got = _run(_pin(model, target), {"x": x})[0]
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_reshape_allowzero_is_kept_where_it_exists():
    text = """<ir_version: 10, opset_import: ["" : 21]>
        g (float[0,3,4] x, int64[3] shape) => (float[?,?,?] y) { y = Reshape <allowzero = 1> (x, shape) }"""
    feeds = {"x": np.zeros((0, 3, 4), np.float32), "shape": np.array([3, 4, 0], np.int64)}
    _same_at(text, (17, 14), feeds)
    with pytest.raises(PassError, match="allowzero=1.*lowest reachable opset: 14"):
        _pin(onnx.parser.parse_model(text), 13)


def test_refusal_names_the_node_the_op_and_the_opset_pair():
    text = """<ir_version: 8, opset_import: ["" : 18]>
        g (float[2,3] x, int64[1] axes) => (float[?,?] y) { y = ReduceMin <keepdims = 1> (x, axes) }"""
    with pytest.raises(PassError) as err:
        _pin(onnx.parser.parse_model(text), 17)
    message = err.value.detail
    assert "ReduceMin node producing 'y'" in message and "opset 18 to 17" in message
    assert "axes 'axes' are not constant" in message


def _wrong_pad(node: ir.Node, current: int, target: int) -> list[ir.Node]:
    """A wrong lowering the checker cannot see (same shapes, other values): the pad mode changed."""
    node.attributes["mode"] = ir.AttrString("mode", "edge")
    return [node]


PAD_ALL_AXES = """<ir_version: 10, opset_import: ["" : 21]>
    g (float[2,3] x) => (float[?,?] y) {
        pads = Constant <value = int64[4] {1, 0, 2, 1}> ()
        axes = Constant <value = int64[2] {1, 0}> ()
        y = Pad <mode = "constant"> (x, pads, , axes)
    }"""


def test_the_proof_refuses_a_conversion_whose_output_differs(monkeypatch):
    monkeypatch.setitem(_opset_adapters.LOWERINGS, "Pad", _wrong_pad)
    differs = r"opset 21 to 19: output 'y' \(Pad node producing 'y'\) of the converted graph differs"
    with pytest.raises(PassError, match=differs):
        _pin(onnx.parser.parse_model(PAD_ALL_AXES), 19)
    # prove: false writes it (the wrong model the issue measured)
    converted = _pin(onnx.parser.parse_model(PAD_ALL_AXES), 19, prove=False)
    (pad,) = [n for n in converted.graph.node if n.op_type == "Pad"]
    assert onnx.helper.get_node_attr_value(pad, "mode") == b"edge"


def test_the_proof_is_reported():
    text = """<ir_version: 8, opset_import: ["" : 18]>
        g (float[2,3] x) => (float[2,1] y) {
            axes = Constant <value = int64[1] {1}> ()
            y = ReduceMean <keepdims = 1> (x, axes)
        }"""
    result = PinOpsetPass(PinOpsetConfig(opset=13))(
        ir.serde.deserialize_model(onnx.parser.parse_model(text)), make_pass_context()
    )
    assert any(line.startswith("proven on ORT CPU: 1 output(s)") for line in result.report.changes)


def test_what_the_proof_cannot_run_is_reported_not_proven():
    # ORT CPU has no int8 Add kernel: neither graph runs, so the conversion is written and said to be unproven
    text = """<ir_version: 8, opset_import: ["" : 13]>
        g (int8[2] a, int8[2] b) => (int8[2] y) { y = Add (a, b) }"""
    result = PinOpsetPass(PinOpsetConfig(opset=14))(
        ir.serde.deserialize_model(onnx.parser.parse_model(text)), make_pass_context()
    )
    assert result.modified
    (line,) = [w for w in result.report.warnings if w.startswith("not proven on ORT")]
    assert "cannot open the input graph" in line
