"""_position_mask: the mask from cache_position, and the fill value of the select."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import onnx_ir as ir
import pytest

from onnxdeploy.passes._position_mask import PositionMaskBuilder, lowest_finite


def test_lowest_finite_is_the_dtype_minimum_and_refuses_integers():
    assert float(lowest_finite(ir.DataType.FLOAT16)) == -65504.0
    assert lowest_finite(ir.DataType.FLOAT).dtype == np.float32 and np.isfinite(lowest_finite(ir.DataType.FLOAT))
    with pytest.raises(ValueError, match="not a floating-point type"):
        lowest_finite(ir.DataType.INT64)


def _visible(window: int | None, position: int) -> np.ndarray:
    """The builder's rank-4 mask of a 2-query, 6-slot graph, evaluated by the onnx reference at ``position``."""
    position_input = ir.Value(name="cache_position", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.INT64))
    seed = ir.node("Identity", [position_input], name="seed")
    graph = ir.Graph([position_input], seed.outputs, nodes=[seed], opset_imports={"": 17}, name="g")
    mask = PositionMaskBuilder(graph, position_input, None, B=1, S=2, L=6, prefix="m").visible(window, 4)
    graph.outputs[0] = mask
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=8))
    (out,) = onnx.reference.ReferenceEvaluator(proto).run(None, {"cache_position": np.array([position, position + 1])})
    return out


def test_causal_and_window_masks_see_the_slots_up_to_each_query():
    causal = _visible(None, 2)
    assert causal.shape == (1, 1, 2, 6) and causal.dtype == np.bool_
    assert causal[0, 0].astype(int).tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    window = _visible(2, 2)  # p - j < 2: the slot itself and the one before
    assert window[0, 0].astype(int).tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0]]
    assert not np.array_equal(causal, window)
