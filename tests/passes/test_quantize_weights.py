"""``quantize_weights`` on small inline graphs: what it emits and that ORT computes exactly the dequantized weight.

Every case runs the quantized graph on ONNX Runtime with ``session.qdq_matmulnbits_accuracy_level=0`` (the
DQ+MatMul fusion in fp32, as the runner's weight-only figures) and compares with numpy on the weight that
:mod:`onnxdeploy.passes._weight_quant` dequantizes: equal up to fp32 rounding, while the float weight is not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.model_io import write_for_ort
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import PipelineSettings
from onnxdeploy.passes._quant_tensors import int8_nbits_block
from onnxdeploy.passes._weight_quant import pack_matmulnbits, quantize_rtn, quantize_rtn_stored
from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig, QuantizeWeightsPass
from onnxdeploy.runner.accuracy import WEIGHT_ONLY_ENTRIES
from onnxdeploy.runner.session import open_session

RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits, opset: int = 17, ir_version: int = 8) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _run(model: ir.Model, feeds: dict[str, np.ndarray], folder: Path) -> np.ndarray:
    path = write_for_ort(model, folder)
    with open_session(path, config_entries=WEIGHT_ONLY_ENTRIES) as session:
        assert session.session is not None
        return session.session.run(None, feeds)[0]


def _quantize(model: ir.Model, tmp_path: Path, **config) -> tuple[ir.Model, object]:
    result = QuantizeWeightsPass(QuantizeWeightsConfig(**config))(model, make_pass_context(scratch_dir=tmp_path / "s"))
    return result.artifacts.primary, result.report


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _dequantized(w_nk: np.ndarray, bits: int, block_size: int, symmetric: bool = True, nbits: bool = False):
    k = w_nk.shape[1]
    block = block_size if bits == 4 else (int8_nbits_block(k, asymmetric=not symmetric) if nbits else k)
    return quantize_rtn(w_nk, bits=bits, block_size=block, symmetric=symmetric).dequantize()


@pytest.mark.parametrize("fmt", ["qdq", "matmulnbits"])
def test_tied_embedding_and_lm_head_share_one_quantized_weight(fmt: str, tmp_path: Path) -> None:
    vocab, hidden = 64, 32
    table = RNG.standard_normal((vocab, hidden)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["h"], name="embed"),
        helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0], name="tie"),
        helper.make_node("MatMul", ["h", "table_t"], ["logits"], name="lm_head"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 5, vocab])],
        [numpy_helper.from_array(table, "table")],
    )
    quantized, _ = _quantize(model, tmp_path, bits=4, block_size=16, format=fmt, embedding=True)
    assert _ops(quantized).count("DequantizeLinear") == 1 and "MatMulNBits" not in _ops(quantized)
    assert "table" not in quantized.graph.initializers  # the float table is gone: stored once, quantized
    ids = np.array([[3, 9, 0, 63, 17]], dtype=np.int64)
    deq = _dequantized(table, 4, 16)
    got = _run(quantized, {"ids": ids}, tmp_path)
    np.testing.assert_allclose(got, deq[ids] @ deq.T, rtol=1e-5, atol=1e-4)
    assert np.abs(got - table[ids] @ table.T).max() > 1e-2


@pytest.mark.parametrize("fmt", ["qdq", "matmulnbits"])
@pytest.mark.parametrize("bits", [8, 4])
def test_gemm_trans_b_with_bias(fmt: str, bits: int, tmp_path: Path) -> None:
    n, k = 24, 64
    w = RNG.standard_normal((n, k)).astype(np.float32)  # (N, K): transB=1
    bias = RNG.standard_normal(n).astype(np.float32)
    model = _model(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1, name="fc")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")],
        opset=21,
        ir_version=10,
    )
    quantized, report = _quantize(model, tmp_path, bits=bits, block_size=32, format=fmt)
    assert ("MatMulNBits" in _ops(quantized)) == (fmt == "matmulnbits")
    x = RNG.standard_normal((3, k)).astype(np.float32)
    want = x @ _dequantized(w, bits, 32, nbits=fmt == "matmulnbits").T + bias
    np.testing.assert_allclose(_run(quantized, {"x": x}, tmp_path), want, rtol=1e-5, atol=1e-4)
    assert report.details["layers"][0]["n"] == n and report.details["layers"][0]["k"] == k


@pytest.mark.parametrize("fmt", ["qdq", "matmulnbits"])
def test_fp16_weight_through_a_cast_is_quantized_from_its_fp16_values(fmt: str, tmp_path: Path) -> None:
    k, n = 48, 16
    w16 = RNG.standard_normal((k, n)).astype(np.float16)
    model = _model(
        [
            helper.make_node("Cast", ["w16"], ["w32"], to=TensorProto.FLOAT, name="cast"),
            helper.make_node("MatMul", ["x", "w32"], ["y"], name="mm"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])],
        [numpy_helper.from_array(w16, "w16")],
        opset=21,
        ir_version=10,
    )
    quantized, _ = _quantize(model, tmp_path, bits=4, block_size=16, format=fmt)
    assert "Cast" not in _ops(quantized) and "w16" not in quantized.graph.initializers
    x = RNG.standard_normal((2, k)).astype(np.float32)
    want = x @ _dequantized(w16.astype(np.float32).T, 4, 16).T
    np.testing.assert_allclose(_run(quantized, {"x": x}, tmp_path), want, rtol=1e-5, atol=1e-4)


def test_int8_qdq_of_an_fp16_weight_raises_opset_17_to_19_for_its_fp16_scales(tmp_path: Path) -> None:
    k, n = 48, 16
    w16 = RNG.standard_normal((k, n)).astype(np.float16)

    def fp16_matmul() -> ir.Model:
        return _model(
            [helper.make_node("MatMul", ["x", "w16"], ["y"], name="mm")],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, n])],
            [numpy_helper.from_array(w16, "w16")],
        )

    with pytest.raises(ConfigError, match="DequantizeLinear with float16/bfloat16 scales needs ai.onnx opset >= 19"):
        QuantizeWeightsPass(QuantizeWeightsConfig(bits=8, format="qdq", raise_opset=False)).check_model(
            fp16_matmul(), PipelineSettings()
        )
    quantized, report = _quantize(fp16_matmul(), tmp_path, bits=8, format="qdq")
    assert quantized.opset_imports[""] == 19 and "raised to ai.onnx opset 19" in report.changes
    x = RNG.standard_normal((2, k)).astype(np.float16)
    want = x.astype(np.float32) @ _dequantized(w16.astype(np.float32).T, 8, k).T
    np.testing.assert_allclose(_run(quantized, {"x": x}, tmp_path).astype(np.float32), want, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize(("fmt", "symmetric"), [("qdq", True), ("matmulnbits", True), ("matmulnbits", False)])
def test_k_not_a_multiple_of_the_block(fmt: str, symmetric: bool, tmp_path: Path) -> None:
    k, n = 40, 16  # two blocks of 32, the second partial (padded in MatMulNBits)
    w = RNG.standard_normal((k, n)).astype(np.float32)
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])],
        [numpy_helper.from_array(w, "w")],
        opset=21,
        ir_version=10,
    )
    quantized, _ = _quantize(model, tmp_path, bits=4, block_size=32, format=fmt, symmetric=symmetric)
    if fmt == "matmulnbits":
        (node,) = [n for n in quantized.graph if n.op_type == "MatMulNBits"]
        assert node.attributes.get_int("K") == 40 and node.attributes.get_int("block_size") == 32
        assert quantized.graph.initializers[str(node.inputs[1].name)].const_value.shape == (n, 2, 16)
    x = RNG.standard_normal((2, k)).astype(np.float32)
    want = x @ _dequantized(w.T, 4, 32, symmetric).T
    np.testing.assert_allclose(_run(quantized, {"x": x}, tmp_path), want, rtol=1e-5, atol=1e-4)


def _opset17_model() -> ir.Model:
    w = RNG.standard_normal((32, 8)).astype(np.float32)
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(w, "w")],
        opset=17,
    )


def test_qdq_int4_on_opset_17_raises_the_opset_to_21_and_ir_to_10(tmp_path: Path) -> None:
    quantized, report = _quantize(_opset17_model(), tmp_path, bits=4, block_size=16)
    assert quantized.opset_imports[""] == 21 and quantized.ir_version >= 10
    (dq,) = [n for n in quantized.graph if n.op_type == "DequantizeLinear"]
    assert dq.attributes.get_int("block_size") == 16
    assert any("raised to ai.onnx opset 21" in c for c in report.changes)
    x = RNG.standard_normal((1, 32)).astype(np.float32)
    assert _run(quantized, {"x": x}, tmp_path).shape == (1, 8)


def test_qdq_int4_on_opset_17_is_refused_with_the_reason_when_raising_is_off(tmp_path: Path) -> None:
    model = _opset17_model()
    quantize = QuantizeWeightsPass(QuantizeWeightsConfig(bits=4, block_size=16, raise_opset=False))
    with pytest.raises(ConfigError, match="opset >= 21 and IR >= 10; the model has opset 17"):
        quantize.check_model(model, PipelineSettings())
    with pytest.raises(PreconditionError, match="opset >= 21"):
        quantize(model, make_pass_context(scratch_dir=tmp_path))
    assert "DequantizeLinear" not in _ops(model)
    # INT8 per channel needs only opset 13: no raise, no block_size.
    quantized, _ = _quantize(model, tmp_path, bits=8, raise_opset=False)
    (dq,) = [n for n in quantized.graph if n.op_type == "DequantizeLinear"]
    assert quantized.opset_imports[""] == 17 and "block_size" not in dq.attributes


def test_exclusions_and_lm_head_switch(tmp_path: Path) -> None:
    w1 = RNG.standard_normal((16, 16)).astype(np.float32)
    w2 = RNG.standard_normal((16, 32)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="block/proj"),
        helper.make_node("MatMul", ["h", "w2"], ["logits"], name="lm_head"),
    ]

    def build() -> ir.Model:
        return _model(
            nodes,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 32])],
            [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
        )

    quantized, report = _quantize(build(), tmp_path, bits=8, format="matmulnbits", lm_head=False)
    assert [n.name for n in quantized.graph if n.op_type == "MatMul"] == ["lm_head"]
    assert any("LM head" in w for w in report.warnings)
    quantized, report = _quantize(build(), tmp_path, bits=8, format="matmulnbits", exclude=["block/*", "nothing*"])
    assert [n.name for n in quantized.graph if n.op_type == "MatMul"] == ["block/proj"]
    assert any("'nothing*' matched no" in w for w in report.warnings)


def test_check_settings_needs_calibration_for_act_order_and_gptq() -> None:
    for config in (dict(act_order=True), dict(method="gptq")):
        with pytest.raises(ConfigError, match="needs calibration data"):
            QuantizeWeightsPass(QuantizeWeightsConfig(**config)).check_settings(PipelineSettings())
        QuantizeWeightsPass(QuantizeWeightsConfig(**config)).check_settings(PipelineSettings(calibration_tokens=64))


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_matmulnbits_takes_the_block_storing_the_fewest_bytes(symmetric: bool, tmp_path: Path) -> None:
    """K = 96: one power-of-two block (128) would pad a third; blocks of 32 store the fewest bits and run."""
    k, n = 96, 24
    w = RNG.standard_normal((k, n)).astype(np.float32)
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
        [numpy_helper.from_array(w, "w")],
    )
    quantized, _ = _quantize(model, tmp_path, bits=8, format="matmulnbits", symmetric=symmetric)
    (node,) = [nd for nd in quantized.graph if nd.op_type == "MatMulNBits"]
    assert node.attributes.get_int("block_size") == 32 == int8_nbits_block(k, asymmetric=not symmetric)
    assert int8_nbits_block(576) == 64 and int8_nbits_block(1536) == 512 and int8_nbits_block(128) == 128
    x = RNG.standard_normal((3, k)).astype(np.float32)
    want = x @ _dequantized(w.T, 8, 0, symmetric, nbits=True).T
    np.testing.assert_allclose(_run(quantized, {"x": x}, tmp_path), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matmulnbits_tensors_are_bit_identical_to_onnxruntimes_quantizer(bits: int, symmetric: bool) -> None:
    """Our RTN tensors equal those of ORT's ``MatMulNBitsQuantizer`` (its MLAS kernels), K padded to the block."""
    from onnxruntime.capi import _pybind_state as ort_c

    k, n, block = 80, 20, 32  # K = 2.5 blocks
    w = RNG.standard_normal((k, n)).astype(np.float32)
    blocks = -(-k // block)
    packed = np.zeros((n, blocks, block * bits // 8), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=np.float32)
    zp = np.zeros((n, -(-blocks * bits // 8)), dtype=np.uint8)
    getattr(ort_c, f"quantize_matmul_{bits}bits")(packed, w, scales, zp, block, n, k, symmetric)
    ours_b, ours_s, ours_zp = pack_matmulnbits(quantize_rtn(w.T, bits=bits, block_size=block, symmetric=symmetric))
    assert ours_b.shape == packed.shape
    real = k * bits // 8  # bytes of the real K (the padding is never read: the op takes K)
    np.testing.assert_array_equal(ours_b.reshape(n, -1)[:, :real], packed.reshape(n, -1)[:, :real])
    np.testing.assert_array_equal(ours_s, scales.reshape(-1))
    if symmetric:
        assert ours_zp is None
    else:
        np.testing.assert_array_equal(ours_zp, zp)
    # The pass's path for MatMul weights quantizes the stored (K, N) layout straight into the same tensors, and
    # into the (K, N) DequantizeLinear ones; the per-weight error is the same as well.
    reference = quantize_rtn(w.T, bits=bits, block_size=block, symmetric=symmetric, error_weights=np.array([]))
    stored = quantize_rtn_stored(
        w, bits=bits, block_size=block, symmetric=symmetric, form="nbits", error_weights=np.array([])
    )
    np.testing.assert_array_equal(stored.values, ours_b)
    np.testing.assert_array_equal(stored.scale, ours_s)
    assert (stored.zero_point is None) == symmetric and (symmetric or np.array_equal(stored.zero_point, ours_zp))
    assert stored.error == pytest.approx(reference.error, rel=1e-5)
    kn = quantize_rtn_stored(w, bits=bits, block_size=block, symmetric=symmetric, form="kn")
    np.testing.assert_array_equal(kn.values, reference.q.T)
    np.testing.assert_array_equal(kn.scale, reference.scale.T)
    assert kn.error is None and (symmetric or np.array_equal(kn.zero_point, reference.zero_point.T))
