"""The float32 shadow of separately loaded bfloat16 graphs keeps each graph's own weights."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnxdeploy.graph import float32_shadow_graph


def _graph(seed: int) -> ir.Model:
    """A one-node bfloat16 model ``y = x + w`` with an in-memory initializer ``w`` (4,) of values ``seed + i``."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.BFLOAT16), shape=ir.Shape([4]))
    array = (np.arange(4, dtype=np.float32) + seed).astype(ml_dtypes.bfloat16)
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.BFLOAT16), shape=ir.Shape([4]))
    w.const_value = ir.tensor(array, name="w")
    node = ir.node("Add", [x, w])
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def test_in_memory_weights_of_separately_loaded_graphs_never_share_a_conversion() -> None:
    # A shared memo keyed by id() handed a graph the converted copy of a freed tensor whose id it reused:
    # created and freed in turn, CPython reuses those ids within a few rounds.
    memo: dict[object, ir.Tensor] = {}
    for seed in range(64):
        model = _graph(seed)
        assert float32_shadow_graph(model, memo)
        w = model.graph.initializers["w"].const_value
        assert w is not None and w.dtype == ir.DataType.FLOAT
        np.testing.assert_array_equal(w.numpy(), np.arange(4, dtype=np.float32) + seed)
        del model, w
