"""A weight quantized into its stored tensors: the stored-layout fast path writes what the general path writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.artifacts import ScratchWriter
from onnxdeploy.passes._quant_targets import find_targets
from onnxdeploy.passes._quant_tensors import WeightQuantizer
from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig

RNG = np.random.default_rng(0)
K, N = 48, 24


def _target():
    w = RNG.standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(proto)
    targets, _ = find_targets(ir.serde.deserialize_model(proto), exclude=[], lm_head=True, embedding=False)
    return targets[0]


@pytest.mark.parametrize("nbits", [True, False])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_the_stored_layout_path_writes_what_the_identity_permutation_path_writes(
    nbits: bool, bits: int, symmetric: bool, tmp_path: Path
) -> None:
    t = _target()
    cfg = QuantizeWeightsConfig(bits=bits, block_size=16, symmetric=symmetric)
    quantizer = WeightQuantizer(cfg, ScratchWriter(tmp_path / "w", 1024))
    fast = quantizer.quantize(t, None, None, None, nbits=nbits)
    general = quantizer.quantize(t, np.arange(K), None, None, nbits=nbits)  # natural order, the general path
    assert (fast.form, fast.nk, fast.n, fast.k, fast.block_size) == (general.form, general.nk, N, K, general.block_size)
    for a, b in zip(fast.tensors, general.tensors, strict=True):
        assert (a.name, a.dtype, tuple(a.shape)) == (b.name, b.dtype, tuple(b.shape))
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert [len(fast.tensors), fast.tensors[1].dtype] == [2 if symmetric else 3, ir.DataType.FLOAT]
    first, second = quantizer.layers
    assert first["error"] == first["error_rtn_natural"] and first["removed"] == 0.0
    assert second["error"] == pytest.approx(first["error"], rel=1e-6)  # the same RTN, summed in another order
    assert (first["method"], second["method"]) == ("rtn", "rtn act-order")
