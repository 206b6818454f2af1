"""pin_opset lowering: every fixture reaches 17 (dynamo-23 and GPT-2 included), LLaMA exports reach 11, small
cases (Split, Softmax on a non-last axis, ReduceMean, RotaryEmbedding, RMSNormalization) match on ORT at both
opsets, and an op with no exact lowering is named with the lowest opset it can reach."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy.errors import PassError
from onnxdeploy.model_io import load_model, write_for_ort
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.pin_opset import PinOpsetConfig, PinOpsetPass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import verify
from tests.conftest import PROMPT, REGISTRY, fixture_entry

ALL_FIXTURES = [e["name"] for e in REGISTRY]


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _pin(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    result = PinOpsetPass(PinOpsetConfig(opset=opset))(ir.serde.deserialize_model(model), make_pass_context())
    out = ir.serde.serialize_model(result.artifacts.primary)
    onnx.checker.check_model(out, full_check=True)
    assert {o.domain: o.version for o in out.opset_import}[""] == opset
    return out


def _assert_same_at(text: str, opsets: tuple[int, ...], feeds: dict[str, np.ndarray], atol: float = 0.0) -> None:
    model = onnx.parser.parse_model(text)
    expected = _run(model, feeds)
    for opset in opsets:
        converted = _pin(model, opset)
        for want, got in zip(expected, _run(converted, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"opset {opset}")


RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 4, 6)).astype(np.float32)


def test_split_11_to_18_to_17():
    text = """<ir_version: 7, opset_import: ["" : 11]>
        g (float[2,3,4,6] x) => (float[2,3,4,2] a, float[2,3,4,4] b) { a, b = Split <axis = -1, split = [2, 4]> (x) }"""
    raised = _pin(onnx.parser.parse_model(text), 18)
    assert raised.ir_version == 8
    lowered = _pin(raised, 17)
    want = _run(onnx.parser.parse_model(text), {"x": X})
    for got in (_run(raised, {"x": X}), _run(lowered, {"x": X})):
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b)
    # num_outputs (Split-18 only) becomes equal sizes, and attribute sizes below 13
    text18 = """<ir_version: 8, opset_import: ["" : 18]>
        g (float[2,3,4,6] x) => (float[2,3,4,2] a, float[2,3,4,2] b, float[2,3,4,2] c) {
            a, b, c = Split <axis = 3, num_outputs = 3> (x) }"""
    _assert_same_at(text18, (17, 12), {"x": X})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_non_last_axis_12_and_13(op):
    text13 = f"""<ir_version: 8, opset_import: ["" : 13]>
        g (float[2,3,4,6] x) => (float[2,3,4,6] y) {{ y = {op} <axis = 1> (x) }}"""
    _assert_same_at(text13, (12, 11), {"x": X}, atol=1e-6)
    text12 = f"""<ir_version: 7, opset_import: ["" : 12]>
        g (float[2,3,4,6] x) => (float[2,3,4,6] y) {{ y = {op} <axis = 1> (x) }}"""
    _assert_same_at(text12, (13, 17), {"x": X}, atol=1e-6)


def test_reduce_mean_17_and_18():
    text18 = """<ir_version: 8, opset_import: ["" : 18]>
        g (float[2,3,4,6] x) => (float[2,1,4,1] y, float[2,3,4,6] z) {
            axes = Constant <value = int64[2] {1, -1}> ()
            y = ReduceMean <keepdims = 1> (x, axes)
            z = ReduceMean <noop_with_empty_axes = 1> (x)
        }"""
    _assert_same_at(text18, (17, 11), {"x": X})
    text17 = """<ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3,4,6] x) => (float[2,1,4,1] y) { y = ReduceMean <axes = [1, -1]> (x) }"""
    _assert_same_at(text17, (18, 23), {"x": X})


def test_rotary_embedding_3d_interleaved_partial_and_4d():
    pos = np.array([[3, 4, 5]], dtype=np.int64)
    cos = RNG.standard_normal((16, 2)).astype(np.float32)
    sin = RNG.standard_normal((16, 2)).astype(np.float32)
    x3 = RNG.standard_normal((1, 3, 2 * 6)).astype(np.float32)  # (B, S, H*D), H=2, D=6, rotary dim 4
    text = """<ir_version: 10, opset_import: ["" : 23]>
        g (float[1,3,12] x, float[16,2] cos, float[16,2] sin, int64[1,3] pos) => (float[1,3,12] y) {
            y = RotaryEmbedding <interleaved = 1, num_heads = 2, rotary_embedding_dim = 4> (x, cos, sin, pos) }"""
    _assert_same_at(text, (22, 17, 11), {"x": x3, "cos": cos, "sin": sin, "pos": pos}, atol=1e-6)
    x4 = RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)  # (B, H, S, D): full rotation, no pass-through half
    text4 = """<ir_version: 10, opset_import: ["" : 23]>
        g (float[1,2,3,4] x, float[16,2] cos, float[16,2] sin, int64[1,3] pos) => (float[1,2,3,4] y) {
            y = RotaryEmbedding (x, cos, sin, pos) }"""
    _assert_same_at(text4, (17,), {"x": x4, "cos": cos, "sin": sin, "pos": pos}, atol=1e-6)
    lowered = _pin(onnx.parser.parse_model(text4), 17)
    assert not any(n.op_type == "Concat" and len(n.input) > 2 for n in lowered.graph.node)


def test_rms_and_layer_normalization():
    scale = RNG.standard_normal((6,)).astype(np.float32)
    text = """<ir_version: 10, opset_import: ["" : 23]>
        g (float[2,3,4,6] x, float[6] s) => (float[2,3,4,6] y, float[2,3,4,6] z) {
            y = RMSNormalization <epsilon = 1e-5> (x, s)
            z = LayerNormalization (x, s, s)
        }"""
    _assert_same_at(text, (17, 16, 11), {"x": X, "s": scale}, atol=2e-6)


def test_no_exact_lowering_names_op_node_and_lowest_opset():
    text = """<ir_version: 8, opset_import: ["" : 18]>
        g (float[2,3] x, int64[2,3] i, float[2,3] u) => (float[2,3] y) {
            y = ScatterElements <axis = 1, reduction = "max"> (x, i, u) }"""
    with pytest.raises(PassError) as err:
        PinOpsetPass(PinOpsetConfig(opset=17))(
            ir.serde.deserialize_model(onnx.parser.parse_model(text)), make_pass_context()
        )
    text = str(err.value)
    assert "ScatterElements" in text and "lowest reachable opset: 18" in text


def _static(name: str) -> tuple[dict, ir.Model]:
    entry = fixture_entry(name)
    model = load_model(entry["model_path"]).model
    return entry, StaticKVCachePass(StaticKVConfig(max_cache_len=64))(model, make_pass_context()).artifacts.primary


def _diffs(entry: dict, model: ir.Model, folder) -> tuple[float, float]:
    report = verify(str(entry["model_path"]), str(write_for_ort(model, folder)), prompt=PROMPT, steps=8)
    return max(m.max_abs_logit_diff for m in report.modes.values()), min(
        m.top1_agreement for m in report.modes.values()
    )


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_fixture_reaches_17_after_static_kv(tmp_path, name):
    entry, static = _static(name)
    (tmp_path / "s").mkdir()
    (tmp_path / "p").mkdir()
    base, _ = _diffs(entry, static, tmp_path / "s")
    pinned = PinOpsetPass(PinOpsetConfig(opset=17))(static, make_pass_context()).artifacts.primary
    assert pinned.opset_imports[""] == 17 and pinned.ir_version == 8
    assert not any(n.op_type in ("Attention", "RMSNormalization", "RotaryEmbedding") for n in pinned.graph)
    diff, top1 = _diffs(entry, pinned, tmp_path / "p")
    assert top1 == 1.0 and diff <= base + 1e-6, (diff, base)


@pytest.mark.parametrize("name", ["llama_gqa_optimum", "llama_gqa_torchscript"])
def test_llama_reaches_opset_11_and_ir_7(tmp_path, name):
    entry, static = _static(name)
    pinned = PinOpsetPass(PinOpsetConfig(opset=11))(static, make_pass_context()).artifacts.primary
    assert pinned.opset_imports[""] == 11 and pinned.ir_version == 7
    diff, top1 = _diffs(entry, pinned, tmp_path)
    assert top1 == 1.0 and diff <= 1e-6


def test_pad_18_without_axes_lowers_to_13_and_11():
    _assert_same_at(
        """<ir_version: 8, opset_import: ["" : 18]>
        g (float[2,3,4,6] x) => (float[2,3,4,8] y) {
            pads = Constant <value = int64[8] {0, 0, 0, 0, 0, 0, 0, 2}> ()
            zero = Constant <value = float {0.0}> ()
            y = Pad (x, pads, zero) }""",
        (17, 13, 11),
        {"x": X},
    )


def test_per_axis_dequantize_linear_is_refused_below_13_naming_the_node():
    text = """<ir_version: 8, opset_import: ["" : 13]>
        g (float[2,3] x) => (float[2,3] y) {
            w = Constant <value = int8[3,3] {1, 2, 3, 4, 5, 6, 7, 8, 9}> ()
            s = Constant <value = float[3] {0.5, 0.25, 0.125}> ()
            dq = DequantizeLinear <axis = 1> (w, s)
            y = MatMul (x, dq) }"""
    feeds = {"x": RNG.standard_normal((2, 3)).astype(np.float32)}
    model = onnx.parser.parse_model(text)
    np.testing.assert_array_equal(_run(_pin(model, 17), feeds)[0], _run(model, feeds)[0])
    with pytest.raises(PassError) as err:
        PinOpsetPass(PinOpsetConfig(opset=11))(ir.serde.deserialize_model(model), make_pass_context())
    assert "DequantizeLinear" in str(err.value) and "lowest reachable opset: 13" in str(err.value)


def test_opsets_above_23_up_to_the_newest_onnx_knows_raise_and_lower_back_exactly():
    """ONNX Runtime 1.32 runs up to opset 28; ops whose schema changed at 24-28 (Reshape, Cast, Transpose, Squeeze,
    Unsqueeze, Shape, Pad, Range, ReduceLogSumExp, TopK) give the same numbers after raising and back at 17."""
    newest = onnx.defs.onnx_opset_version()
    text17 = """<ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3,4,6] x) => (float[6,3,8] y, int64[2,3,4,2] i, float[2,1,4,1] r, int64[4] s, float[2,3,4,8] p) {
            t = Transpose <perm = [3, 1, 2, 0]> (x)
            shape = Constant <value = int64[3] {6, 3, -1}> ()
            flat = Reshape (t, shape)
            half = Cast <to = 10> (flat)
            y = Cast <to = 1> (half)
            k = Constant <value = int64[1] {2}> ()
            v, i = TopK <axis = -1> (x, k)
            r = ReduceLogSumExp <axes = [1, 3]> (x)
            s = Shape (x)
            pads = Constant <value = int64[8] {0, 0, 0, 1, 0, 0, 0, 1}> ()
            p = Pad (x, pads)
        }"""
    model = onnx.parser.parse_model(text17)
    want = _run(model, {"x": X})
    for opset in (24, newest):
        raised = _pin(model, opset)
        for name, graph in ((f"{opset}", raised), (f"{opset} -> 17", _pin(raised, 17))):
            for out, a, b in zip("yirsp", want, _run(graph, {"x": X}), strict=True):
                # ORT's ReduceLogSumExp-28 kernel rounds the last bit unlike -18's; the rest is bit-exact
                np.testing.assert_allclose(b, a, rtol=0, atol=5e-7 if out == "r" else 0, err_msg=f"{name}: {out}")


def test_an_opset_outside_11_to_the_newest_is_refused_naming_the_range():
    newest = onnx.defs.onnx_opset_version()
    for opset in (10, newest + 1):
        with pytest.raises(ValueError, match=rf"opset {opset} is outside the supported range 11\.\.{newest}"):
            PinOpsetConfig(opset=opset)


@pytest.mark.parametrize("upper", [1, 0])
def test_trilu_14_lowers_to_range_where_at_13_and_11(upper):
    """Trilu (first at 14) → Range/Where: the kept triangle for k below, on and above the diagonal, on a non-square
    batched input holding -inf and NaN (kept where the triangle keeps them), and on a bool mask."""
    x = RNG.standard_normal((2, 4, 6)).astype(np.float32)
    x[0, 1, 0], x[1, 0, 5], x[1, 3, 2] = -np.inf, np.nan, np.inf
    mask = RNG.standard_normal((4, 6)) > 0
    text = f"""<ir_version: 8, opset_import: ["" : 14]>
        g (float[2,4,6] x, int64 k, bool[4,6] m) => (float[2,4,6] y, float[2,4,6] d, bool[4,6] b) {{
            y = Trilu <upper = {upper}> (x, k)
            d = Trilu <upper = {upper}> (x)
            b = Trilu <upper = {upper}> (m, k)
        }}"""
    model = onnx.parser.parse_model(text)
    for k in (-2, 0, 3):
        feeds = {"x": x, "k": np.array(k, np.int64), "m": mask}
        want = _run(model, feeds)
        for opset in (13, 11):
            lowered = _pin(model, opset)
            assert not any(n.op_type == "Trilu" for n in lowered.graph.node)
            for name, a, b in zip("ydb", want, _run(lowered, feeds), strict=True):
                np.testing.assert_array_equal(b, a, err_msg=f"k={k} opset {opset}: {name}")


def test_cast_like_lowers_to_cast_at_14_and_11():
    """CastLike (first at 15) → Cast to the dtype of its second input: float16 (rounding), int32 (truncation), bool."""
    x = (RNG.standard_normal((3, 5)) * 70000).astype(np.float32)
    x[0, 0], x[1, 1], x[2, 2] = 0.0, -0.75, 1e-8
    text = """<ir_version: 8, opset_import: ["" : 15]>
        g (float[3,5] x, float16[1] h, int32[1] i, bool[1] t) => (float16[3,5] a, int32[3,5] b, bool[3,5] c) {
            a = CastLike (x, h)
            b = CastLike (x, i)
            c = CastLike (x, t)
        }"""
    model = onnx.parser.parse_model(text)
    feeds = {"x": x, "h": np.zeros(1, np.float16), "i": np.zeros(1, np.int32), "t": np.zeros(1, bool)}
    want = _run(model, feeds)
    for opset in (14, 11):
        lowered = _pin(model, opset)
        assert [n.op_type for n in lowered.graph.node] == ["Cast"] * 3
        for name, a, b in zip("abc", want, _run(lowered, feeds), strict=True):
            assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
            np.testing.assert_array_equal(b, a, err_msg=f"opset {opset}: {name}")


def test_shape_15_start_end_and_unnamed_nodes_of_one_op_lower_without_name_clashes():
    """Shape-15 ``start``/``end`` → Shape + Slice at 14; two unnamed Softmax-13 on a non-last axis → transposes at
    12: what each lowering adds is named after the node's output, so nothing is defined twice."""
    text15 = """<ir_version: 8, opset_import: ["" : 15]>
        g (float[2,3,4,6] x) => (int64[2] a, int64[1] b, float[2,3,4,6] y, float[2,3,4,6] z) {
            a = Shape <start = 1, end = 3> (x)
            b = Shape <start = -1> (x)
            y = Softmax <axis = 1> (x)
            z = Softmax <axis = 1> (x)
        }"""
    _assert_same_at(text15, (14, 12), {"x": X}, atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "scales", "target"),
    [("float16", "14336, 13312, 12288", 17), ("bfloat16", "16128, 16000, 15872", 13)],  # 0.5, 0.25, 0.125 as bits
)
def test_float16_or_bfloat16_dequantize_linear_is_refused_below_19_naming_the_node(dtype, scales, target):
    """DequantizeLinear takes float16/bfloat16 scales from opset 19 on (x_scale is tensor(float) in -10/-13)."""
    text = f"""<ir_version: 9, opset_import: ["" : 19]>
        g ({dtype}[2,3] x) => ({dtype}[2,3] y) {{
            w = Constant <value = int8[3,3] {{1, 2, 3, 4, 5, 6, 7, 8, 9}}> ()
            s = Constant <value = {dtype}[3] {{{scales}}}> ()
            dq = DequantizeLinear <axis = 1> (w, s)
            y = MatMul (x, dq) }}"""
    model = ir.serde.deserialize_model(onnx.parser.parse_model(text))
    next(n for n in model.graph if n.op_type == "DequantizeLinear").name = "w_DequantizeLinear"
    with pytest.raises(PassError) as err:
        PinOpsetPass(PinOpsetConfig(opset=target))(model, make_pass_context())
    text = str(err.value)
    assert "'w_DequantizeLinear'" in text and f"tensor({dtype})" in text and "lowest reachable opset: 19" in text
