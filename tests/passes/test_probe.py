"""The passes' probe service (passes/_probe.py): pruned copies, sessions through the context, and refusals."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnxdeploy.errors import PreconditionError
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import _probe

TEXT = """
<ir_version: 9, opset_import: ["" : 17]>
g (float[2, 3] x, int64[2] n) => (float[2, 3] y, int64[2] m) <float[3] bias = {1, 2, 3}> {
    a = Add (x, bias)
    y = Relu (a)
    one = Constant <value_ints = [1, 1]> ()
    m = Add (n, one)
}
"""


def _model() -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(TEXT))


def test_pruned_copy_keeps_what_computes_the_outputs_and_shares_tensors():
    model = _model()
    probe = _probe.pruned_copy(model, ["a"])
    assert [o.name for o in probe.graph.outputs] == ["a"]
    assert [n.op_type for n in probe.graph] == ["Add"] and [v.name for v in probe.graph.inputs] == ["x"]
    assert probe.graph.initializers["bias"].const_value is model.graph.initializers["bias"].const_value
    assert len(model.graph) == 4 and [o.name for o in model.graph.outputs] == ["y", "m"]  # the input is unchanged
    kept = _probe.pruned_copy(model, ["a"], keep_inputs=True)
    assert [v.name for v in kept.graph.inputs] == ["x", "n"]
    extra = _probe.pruned_copy(model, ["a"], keep_outputs=True)
    assert [o.name for o in extra.graph.outputs] == ["y", "m", "a"] and len(extra.graph) == 4
    with pytest.raises(KeyError):
        _probe.pruned_copy(model, ["no_such_value"])


def test_open_probe_runs_through_the_context_and_removes_its_folder(tmp_path):
    opened = []
    context = make_pass_context(scratch_dir=tmp_path)
    factory = context.session_factory

    def counting(path):
        opened.append(path)
        return factory(path)

    context.session_factory = counting
    with _probe.open_probe(_probe.pruned_copy(_model(), ["m"]), context, who="test") as session:
        (m,) = session.session.run(["m"], {"n": np.array([3, 4], np.int64)})
    np.testing.assert_array_equal(m, [4, 5])
    assert len(opened) == 1 and list(tmp_path.iterdir()) == []


def test_open_probe_names_the_pass_when_ort_refuses(tmp_path):
    context = make_pass_context(scratch_dir=tmp_path)

    def refusing(path):
        raise RuntimeError("no kernel")

    context.session_factory = refusing
    with pytest.raises(PreconditionError, match=r"static_kv.*ONNX Runtime cannot load the mask probe: no kernel"):
        with _probe.open_probe(_model(), context, who="static_kv", what="the mask probe"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_calibration_needs_the_contexts_decode_loop(tmp_path):
    context = make_pass_context(scratch_dir=tmp_path)
    context.decoder_factory = None
    with pytest.raises(PreconditionError, match="calibration needs a decode loop"):
        _probe.calibration_decoder(context, object(), None, who="quantize_weights")  # type: ignore[arg-type]
