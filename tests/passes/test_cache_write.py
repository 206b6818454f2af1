"""Every cache_write method writes the same buffer, bit for bit, at the slots cache_position names."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy import model_io
from onnxdeploy.passes._cache_write import build_cache_write

L = 6


def _write_graph(method: str, shape: tuple[int, ...], seq_axis: int) -> ir.Model:
    """``updated = write(buffer, update, cache_position)`` as a model of its own."""
    buffer_shape = list(shape)
    buffer_shape[seq_axis] = L
    buffer = ir.Value(name="buffer", shape=ir.Shape(buffer_shape), type=ir.TensorType(ir.DataType.FLOAT))
    update = ir.Value(name="update", shape=ir.Shape(list(shape)), type=ir.TensorType(ir.DataType.FLOAT))
    position = ir.Value(name="cache_position", shape=ir.Shape([shape[seq_axis]]), type=ir.TensorType(ir.DataType.INT64))
    graph = ir.Graph([buffer, update, position], [], nodes=[], opset_imports={"": 17}, name="write")
    nodes, out = build_cache_write(
        graph,
        buffer,
        update,
        position,
        method=method,  # type: ignore[arg-type]
        seq_axis=seq_axis,
        update_shape=shape,
        max_cache_len=L,
        prefix=f"w/{method}",
    )
    graph.extend(nodes)
    graph.outputs.append(out)
    return ir.Model(graph, ir_version=8)


@pytest.mark.parametrize(("shape", "seq_axis"), [((1, 2, 1, 3), 2), ((2, 2, 3, 4), 2), ((1, 3, 4, 2), 3)])
@pytest.mark.parametrize("method", ["scatter_elements", "scatter_nd", "where", "host"])
def test_each_method_writes_the_rows_at_their_slots(tmp_path, method, shape, seq_axis):
    rng = np.random.default_rng(0)
    steps = shape[seq_axis]
    buffer_shape = list(shape)
    buffer_shape[seq_axis] = L
    buffer = rng.standard_normal(buffer_shape).astype(np.float32)
    update = rng.standard_normal(shape).astype(np.float32)
    slots = np.array([4, 1, 2][:steps], np.int64)
    want = buffer.copy()
    index = [slice(None)] * len(shape)
    index[seq_axis] = slots
    want[tuple(index)] = update
    path = model_io.write_for_ort(_write_graph(method, shape, seq_axis), tmp_path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"buffer": buffer, "update": update, "cache_position": slots})
    np.testing.assert_array_equal(got, want)


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown cache_write 'memcpy'"):
        _write_graph("memcpy", (1, 2, 1, 3), 2)
