"""``quantize_weights`` on small inline graphs: ``rules``, weights left in float, bits per weight, scale search.

Every quantized graph runs on ONNX Runtime (weight-only session entries) against numpy on the weight the pass
says it emitted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError

from onnxdeploy.model_io import write_for_ort
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes._quant_search import searched_params
from onnxdeploy.passes._weight_quant import output_error, quantize_rtn
from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig, QuantizeWeightsPass
from onnxdeploy.runner.accuracy import WEIGHT_ONLY_ENTRIES
from onnxdeploy.runner.session import open_session

RNG = np.random.default_rng(7)
K, N, V = 64, 32, 48


WEIGHTS = {
    "w_q": RNG.standard_normal((K, N)),
    "w_down": RNG.standard_normal((N, K)),
    "w_head": RNG.standard_normal((K, V)),
    "w_3d": RNG.standard_normal((2, V, 8)),
}


def _model() -> ir.Model:
    """x (2, K) -> q_proj (K, N) -> down (N, K) -> lm_head (K, V), plus a rank-3 constant MatMul weight."""
    inits = WEIGHTS
    nodes = [
        helper.make_node("MatMul", ["x", "w_q"], ["q"], name="layer/q_proj/MatMul"),
        helper.make_node("MatMul", ["q", "w_down"], ["d"], name="layer/mlp/down_proj/MatMul"),
        helper.make_node("MatMul", ["d", "w_head"], ["logits"], name="lm_head"),
        helper.make_node("MatMul", ["logits", "w_3d"], ["side"], name="batched"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, V]),
            helper.make_tensor_value_info("side", TensorProto.FLOAT, [2, 2, 8]),
        ],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _quantize(tmp_path: Path, **config):
    context = make_pass_context(scratch_dir=tmp_path / "s")
    result = QuantizeWeightsPass(QuantizeWeightsConfig(**config))(_model(), context)
    return result.artifacts.primary, result.report


def _run(model: ir.Model, x: np.ndarray, folder: Path) -> np.ndarray:
    with open_session(write_for_ort(model, folder), config_entries=WEIGHT_ONLY_ENTRIES) as session:
        return session.session.run(["logits"], {"x": x})[0]


def test_rules_set_bits_and_block_size_per_weight_and_the_old_keys_still_apply(tmp_path: Path) -> None:
    rules = [{"kind": "lm_head", "bits": 8}, {"nodes": "*/mlp/down_proj/*", "block_size": 16}]
    quantized, report = _quantize(tmp_path, bits=4, block_size=32, format="matmulnbits", rules=rules)
    nodes = {n.name: n for n in quantized.graph if n.op_type == "MatMulNBits"}
    got = {name: (n.attributes.get_int("bits"), n.attributes.get_int("block_size")) for name, n in nodes.items()}
    assert got == {"layer/q_proj/MatMul_Q4": (4, 32), "layer/mlp/down_proj/MatMul_Q4": (4, 16), "lm_head_Q8": (8, 64)}
    rows = {r["node"]: r for r in report.details["layers"]}
    assert rows["lm_head"]["bits"] == 8 and rows["layer/mlp/down_proj/MatMul"]["block_size"] == 16
    # The output equals numpy on the weights each rule asked for.
    x = RNG.standard_normal((2, K)).astype(np.float32)
    init = {k: v.const_value.numpy() for k, v in _model().graph.initializers.items()}
    want = x
    for name, bits, block in (("w_q", 4, 32), ("w_down", 4, 16), ("w_head", 8, K)):
        want = want @ quantize_rtn(init[name].T, bits=bits, block_size=block, symmetric=True).dequantize().T
    np.testing.assert_allclose(_run(quantized, x, tmp_path), want, rtol=1e-5, atol=1e-4)
    # lm_head: false is the rule {kind: lm_head, bits: float}; a later rule overrides it.
    _, report = _quantize(tmp_path / "b", lm_head=False, rules=[{"nodes": "lm_head", "bits": 8}])
    assert {r["node"] for r in report.details["layers"]} == {
        "layer/q_proj/MatMul",
        "layer/mlp/down_proj/MatMul",
        "lm_head",
    }
    # exclude is a rule placed first: a later rule can give the node bits again.
    _, report = _quantize(tmp_path / "c", exclude=["*q_proj*"], rules=[{"nodes": "layer/*", "bits": 8}])
    assert {r["node"]: r["bits"] for r in report.details["layers"]}["layer/q_proj/MatMul"] == 8


def test_a_rule_needs_a_match_and_a_setting() -> None:
    with pytest.raises(ValidationError, match="needs 'nodes'"):
        QuantizeWeightsConfig(rules=[{"bits": 8}])
    with pytest.raises(ValidationError, match="needs 'bits'"):
        QuantizeWeightsConfig(rules=[{"kind": "lm_head"}])
    with pytest.raises(ValidationError):
        QuantizeWeightsConfig(rules=[{"kind": "lm_head", "bits": 3}])
    # a block size that QDQ INT8 (per output channel) or float would ignore is refused, never silently dropped
    with pytest.raises(ValidationError, match="block_size with bits 8 in format qdq"):
        QuantizeWeightsConfig(rules=[{"nodes": "*v_proj*", "bits": 8, "block_size": 64}])
    with pytest.raises(ValidationError, match="block_size with bits float"):
        QuantizeWeightsConfig(rules=[{"nodes": "*v_proj*", "bits": "float", "block_size": 64}])
    QuantizeWeightsConfig(format="matmulnbits", rules=[{"nodes": "*v_proj*", "bits": 8, "block_size": 64}])  # blocked


def test_every_weight_left_in_float_is_listed_with_its_reason(tmp_path: Path) -> None:
    _, report = _quantize(tmp_path, rules=[{"nodes": "*q_proj*", "bits": "float"}, {"nodes": "nothing*", "bits": 8}])
    left = {row["node"]: row["reason"] for row in report.details["left_in_float"]}
    assert left == {
        "layer/q_proj/MatMul": "rule {nodes: *q_proj*, bits: float}",
        "batched": "constant weight 'w_3d' of rank 3 [2, 48, 8]: only 2-D weights are quantized",
    }
    assert "rule pattern 'nothing*' matched no quantizable node" in report.warnings


@pytest.mark.parametrize(("symmetric", "q_proj", "down"), [(True, 5.0, 5.0), (False, 5.125, 5.25)])
def test_bits_per_weight_counts_values_scales_and_zero_points(symmetric, q_proj, down, tmp_path: Path) -> None:
    _, report = _quantize(tmp_path, bits=4, block_size=32, symmetric=symmetric, format="matmulnbits", lm_head=False)
    # 4 bits a value + a float32 scale per 32 (+ a 4-bit zero point per 32, two a byte per output channel in
    # MatMulNBits: down_proj's K = 32 has one block, so its byte holds one zero point and a pad nibble).
    rows = {r["node"]: r["bits_per_weight"] for r in report.details["layers"]}
    assert rows == {"layer/q_proj/MatMul": pytest.approx(q_proj), "layer/mlp/down_proj/MatMul": pytest.approx(down)}
    total = report.details["bits_per_weight"]
    assert total["weights"] == 2 * K * N and total["scale_dtype"] == ["FLOAT"]
    assert total["bits_per_weight"] == pytest.approx((q_proj + down) / 2)
    assert any(f"{(q_proj + down) / 2:.3f} bits per weight" in c for c in report.changes)


def test_scale_search_never_loses_to_the_mlas_rule_and_runs_exactly(tmp_path: Path) -> None:
    w = RNG.standard_normal((16, 128)).astype(np.float32) * np.linspace(0.2, 2, 128, dtype=np.float32)
    w[0, 5] = 12.0  # an outlier the range rule spends its levels on
    for symmetric in (True, False):
        plain = quantize_rtn(w, bits=4, block_size=32, symmetric=symmetric)
        searched = quantize_rtn(w, bits=4, block_size=32, symmetric=symmetric, search=True)
        e_plain = output_error(w, plain.dequantize(), np.array([]))
        e_search = output_error(w, searched.dequantize(), np.array([]))
        assert e_search < 0.97 * e_plain, (symmetric, e_search, e_plain)
    blocks = w.reshape(-1, 32)
    scale, zero = searched_params(blocks, 4, False)
    assert scale.shape == zero.shape == (blocks.shape[0],) and zero.min() >= 0 and zero.max() <= 15
    quantized, report = _quantize(tmp_path, symmetric=False, scale_search="mse", format="qdq", lm_head=False)
    assert all(
        r["method"] == "rtn mse-search" and r["error"] < r["error_rtn_natural"] for r in report.details["layers"]
    )
    init = {k: v.const_value.numpy() for k, v in _model().graph.initializers.items()}
    x = RNG.standard_normal((2, K)).astype(np.float32)
    want = x
    for name in ("w_q", "w_down"):
        want = want @ quantize_rtn(init[name].T, bits=4, block_size=32, symmetric=False, search=True).dequantize().T
    np.testing.assert_allclose(_run(quantized, x, tmp_path), want @ init["w_head"], rtol=1e-5, atol=1e-4)


def test_qdq_int4_with_a_partial_last_block_is_exact_on_ort_and_named_in_the_report(tmp_path: Path) -> None:
    k = 40  # blocks of 32: the second has 8 channels (DequantizeLinear-21's blocked form: ceil(K / 32) scales)
    w = RNG.standard_normal((k, N)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, N])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = ir.serde.deserialize_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    )
    result = QuantizeWeightsPass(QuantizeWeightsConfig(bits=4, block_size=32))(
        model, make_pass_context(scratch_dir=tmp_path / "s")
    )
    (dq,) = [n for n in result.artifacts.primary.graph if n.op_type == "DequantizeLinear"]
    assert list(dq.inputs[1].shape) == [2, N] and dq.attributes.get_int("block_size") == 32
    (warning,) = [w for w in result.report.warnings if "partial last block" in w]
    assert "OpenVINO" in warning and "mm" in warning
    x = RNG.standard_normal((2, k)).astype(np.float32)
    want = x @ quantize_rtn(w.T, bits=4, block_size=32, symmetric=True).dequantize().T
    np.testing.assert_allclose(_run(result.artifacts.primary, x, tmp_path), want, rtol=1e-5, atol=1e-4)
    # Whole blocks: no warning.
    _, report = _quantize(tmp_path / "b", bits=4, block_size=32, format="qdq")
    assert not any("partial last block" in w for w in report.warnings)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"rules": [{"kind": "lm_head"}]}, r"key 'passes\[0\]\.quantize_weights\.rules\[0\]'.*needs 'bits'"),
        ({"budget": {"max_mean_kl": 0.01}}, "budget needs calibration data"),
        ({"budget": {}}, "budget needs max_mean_kl and/or max_ppl_ratio"),
    ],
)
def test_bad_rules_and_budgets_are_refused_before_any_pass(config: dict, message: str, tmp_path: Path) -> None:
    import yaml

    from onnxdeploy.config import load_pipeline
    from onnxdeploy.errors import ConfigError

    path = tmp_path / "pipeline.yaml"
    model = Path(__file__).resolve().parents[2] / "fixtures" / "llama_bytes" / "torchscript" / "model.onnx"
    pipeline = {"model": str(model), "output_dir": str(tmp_path / "out"), "passes": [{"quantize_weights": config}]}
    path.write_text(yaml.safe_dump(pipeline))
    with pytest.raises(ConfigError, match=message) as info:
        load_pipeline(path)
    assert info.value.exit_code == 2 and not (tmp_path / "out").exists()
