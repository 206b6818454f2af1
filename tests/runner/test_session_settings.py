"""Session options follow the graph: prepacking for quantized MatMul weights, off for float ones (issue 15).

Small graphs built with onnx.helper run on real ORT sessions: a ``MatMulNBits``, a ``DequantizeLinear`` feeding a
``MatMul`` (fused by ORT), a ``DequantizeLinear`` feeding only a ``Gather``, and a float ``MatMul``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.errors import ConfigError
from onnxdeploy.runner.session import (
    ACCURACY_LEVEL_KEY,
    PREPACKING_KEY,
    GraphWeights,
    graph_weights,
    open_session,
    session_settings,
)

K, N = 64, 32
RNG = np.random.default_rng(0)
CODES = RNG.integers(0, 16, size=(N, K)).astype(np.uint8)  # 4-bit codes, zero point 8
SCALES = (RNG.random(N) * 0.1 + 0.01).astype(np.float32)  # one block of K per output channel
X = RNG.standard_normal((1, K)).astype(np.float32)
WEIGHT = ((CODES.astype(np.float32) - 8) * SCALES[:, None]).T  # (K, N) dequantized
MS_OPSET = helper.make_opsetid("com.microsoft", 1)


def _save(path: Path, nodes, initializers, opset: int = 21, extra=()) -> Path:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra], ir_version=10)
    onnx.save(model, str(path))
    return path


def matmulnbits(path: Path, accuracy_level: int | None = None) -> Path:
    """y = x @ W through com.microsoft::MatMulNBits (4 bits, one block of K per column, zero point 8)."""
    packed = (CODES[:, 0::2] | (CODES[:, 1::2] << 4)).reshape(N, 1, K // 2)
    attrs = {"K": K, "N": N, "bits": 4, "block_size": K}
    if accuracy_level is not None:
        attrs["accuracy_level"] = accuracy_level
    node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", **attrs)
    inits = [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(SCALES, "s")]
    return _save(path, [node], inits, extra=[MS_OPSET])


def dequantized(path: Path, *, into: str = "MatMul") -> Path:
    """DequantizeLinear of a blocked uint4 (K, N) weight into a MatMul (or, ``into="Gather"``, only a Gather)."""
    q = helper.make_tensor("q", TensorProto.UINT4, [K, N], CODES.T.flatten().tolist())
    scale = numpy_helper.from_array(SCALES[None, :].copy(), "scale")  # (1, N): one block of K
    zero = helper.make_tensor("zp", TensorProto.UINT4, [1, N], [8] * N)
    dq = helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["w"], axis=0, block_size=K)
    if into == "MatMul":
        return _save(path, [dq, helper.make_node("MatMul", ["x", "w"], ["y"])], [q, scale, zero])
    ids = numpy_helper.from_array(np.array([1, 2], np.int64), "ids")
    nodes = [dq, helper.make_node("Gather", ["w", "ids"], ["rows"]), helper.make_node("MatMul", ["x", "f"], ["y"])]
    return _save(path, nodes, [q, scale, zero, ids, numpy_helper.from_array(WEIGHT, "f")])


def float_matmul(path: Path) -> Path:
    return _save(path, [helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(WEIGHT, "w")], 17)


def entry(session, key: str) -> str:
    return session.session.get_session_options().get_session_config_entry(key)


def test_float_weights_open_without_prepacking(tmp_path: Path) -> None:
    with open_session(float_matmul(tmp_path / "f.onnx")) as s:
        assert entry(s, PREPACKING_KEY) == "1"
        assert s.settings is not None and s.settings.weights == "float" and not s.settings.prepacking
        assert s.settings.accuracy_level == [] and "float" in s.settings.reason
        np.testing.assert_allclose(s.session.run(None, {"x": X})[0], X @ WEIGHT, rtol=1e-5, atol=1e-5)


def test_matmulnbits_opens_with_prepacking_at_its_own_accuracy_level(tmp_path: Path) -> None:
    with open_session(matmulnbits(tmp_path / "q.onnx")) as s:
        assert entry(s, PREPACKING_KEY) == "0"
        assert s.settings is not None and s.settings.weights == "quantized" and s.settings.prepacking
        assert s.settings.accuracy_level == [0] and s.scratch is None  # unset attribute: no copy needed
        np.testing.assert_allclose(s.session.run(None, {"x": X})[0], X @ WEIGHT, rtol=1e-4, atol=1e-4)


def test_the_accuracy_level_key_reaches_matmulnbits_nodes_through_a_scratch_copy(tmp_path: Path) -> None:
    path = matmulnbits(tmp_path / "q.onnx", accuracy_level=4)
    with open_session(path, config_entries={ACCURACY_LEVEL_KEY: "0"}) as s:
        assert s.settings is not None and s.settings.accuracy_level == [0]
        assert s.scratch is not None
        (copy,) = s.scratch.glob("*.onnx")
        node = onnx.load(str(copy), load_external_data=False).graph.node[0]
        assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "accuracy_level")) == 0
        fp32 = s.session.run(None, {"x": X})[0]
        np.testing.assert_allclose(fp32, X @ WEIGHT, rtol=1e-4, atol=1e-4)
        scratch = s.scratch
    assert not scratch.exists()
    assert graph_weights(onnx.load(str(path))).matmulnbits == (4,)  # the input is left alone
    with open_session(path) as own:
        assert own.settings is not None and own.settings.accuracy_level == [4]
        int8 = own.session.run(None, {"x": X})[0]  # int8 activations: close, not equal
        np.testing.assert_allclose(int8, X @ WEIGHT, rtol=0, atol=0.05 * np.abs(X @ WEIGHT).max())


def test_dequantize_into_matmul_is_quantized_at_orts_fused_level(tmp_path: Path) -> None:
    path = dequantized(tmp_path / "dq.onnx")
    with open_session(path) as s:
        assert entry(s, PREPACKING_KEY) == "0"
        assert s.settings is not None and s.settings.accuracy_level == [4]  # ORT's default for the fusion
    with open_session(path, config_entries={ACCURACY_LEVEL_KEY: "0"}) as s:
        assert s.settings is not None and s.settings.accuracy_level == [0]
        np.testing.assert_allclose(s.session.run(None, {"x": X})[0], X @ WEIGHT, rtol=1e-4, atol=1e-4)


def test_a_dequantized_embedding_alone_leaves_float_matmuls_unpacked(tmp_path: Path) -> None:
    weights = graph_weights(onnx.load(str(dequantized(tmp_path / "g.onnx", into="Gather"))))
    assert not weights.quantized and weights.float_matmul_bytes == WEIGHT.nbytes
    with open_session(tmp_path / "g.onnx") as s:
        assert entry(s, PREPACKING_KEY) == "1"


def test_an_explicit_prepacking_entry_wins_over_the_rule(tmp_path: Path) -> None:
    with open_session(matmulnbits(tmp_path / "q.onnx"), config_entries={PREPACKING_KEY: "1"}) as s:
        assert entry(s, PREPACKING_KEY) == "1"
        assert s.settings is not None and not s.settings.prepacking and PREPACKING_KEY in s.settings.reason
    with open_session(float_matmul(tmp_path / "f.onnx"), config_entries={PREPACKING_KEY: "0"}) as s:
        assert entry(s, PREPACKING_KEY) == "0" and s.settings is not None and s.settings.prepacking


def test_a_quantized_graph_says_which_float_matmul_weights_are_prepacked_too() -> None:
    settings = session_settings(GraphWeights(matmulnbits=(0,), float_matmul_bytes=4_000_000))
    assert settings.prepacking and "4.0 MB of float MatMul weights are prepacked too" in settings.reason


@pytest.mark.parametrize("value", ["5", "fp32", ""])
def test_an_accuracy_level_outside_0_to_4_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=ACCURACY_LEVEL_KEY):
        open_session(matmulnbits(tmp_path / "q.onnx"), config_entries={ACCURACY_LEVEL_KEY: value})
