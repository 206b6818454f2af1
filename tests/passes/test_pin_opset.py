"""pin_opset: LLaMA exports lower to 17 and decode identically; weights are shared, inputs untouched."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from onnxdeploy.graph import opset_imports
from onnxdeploy.model_io import load_model, stand_in_proto, write_for_ort
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.pin_opset import PinOpsetConfig, PinOpsetPass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import verify
from tests.conftest import FIXTURE_NAMES, PROMPT, fixture_entry


@pytest.mark.parametrize("name", [n for n in FIXTURE_NAMES if n.startswith("llama_gqa")])
def test_pin_opset_17_on_llama_verifies_identical(tmp_path, name):
    entry = fixture_entry(name)
    model = load_model(entry["model_path"]).model
    static = StaticKVCachePass(StaticKVConfig(max_cache_len=64))(model, make_pass_context()).artifacts.primary
    result = PinOpsetPass(PinOpsetConfig(opset=17))(static, make_pass_context())
    pinned = result.artifacts.primary
    assert opset_imports(pinned)["ai.onnx"] == 17
    onnx.checker.check_model(stand_in_proto(pinned, as_inputs=True), full_check=True)

    # the weights were never copied: the pinned graph holds the very tensor objects static_kv held
    def weights(m):
        return {id(v.const_value) for v in m.graph.initializers.values() if v.const_value.nbytes > 1024}

    assert weights(pinned) and weights(pinned) == weights(static)
    path = write_for_ort(pinned, tmp_path)
    report = verify(str(entry["model_path"]), str(path), prompt=PROMPT, steps=32)
    assert report.passed
    assert all(m.max_abs_logit_diff <= 1e-4 and m.top1_agreement == 1.0 for m in report.modes.values())


def test_pin_opset_same_opset_is_a_no_op():
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y) { y = Relu (x) }
        """
    )
    ir_model = ir.serde.deserialize_model(model)
    before = ir.serde.serialize_model(ir_model).SerializeToString()
    result = PinOpsetPass(PinOpsetConfig(opset=17))(ir_model, make_pass_context())
    assert not result.modified
    assert result.artifacts.primary is ir_model
    assert ir.serde.serialize_model(result.artifacts.primary).SerializeToString() == before


def test_lowering_reduce_mean_18_drops_the_attribute_opset_17_lacks():
    import numpy as np
    import onnxruntime as ort

    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[2, 3] x) => (float[2, 1] y) {
            axes = Constant <value = int64[1] {-1}> ()
            y = ReduceMean <keepdims = 1, noop_with_empty_axes = 0> (x, axes)
        }
        """
    )
    result = PinOpsetPass(PinOpsetConfig(opset=17))(ir.serde.deserialize_model(model), make_pass_context())
    lowered = ir.serde.serialize_model(result.artifacts.primary)
    onnx.checker.check_model(lowered, full_check=True)
    (reduce,) = [n for n in lowered.graph.node if n.op_type == "ReduceMean"]
    assert [a.name for a in reduce.attribute] == ["axes", "keepdims"] or {a.name for a in reduce.attribute} == {
        "axes",
        "keepdims",
    }
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    after = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(before[0], after[0])


def test_pin_opset_leaves_the_graph_it_was_given_untouched():
    model = load_model(fixture_entry("llama_gqa_optimum")["model_path"]).model
    before = ir.serde.serialize_model(model).SerializeToString()
    result = PinOpsetPass(PinOpsetConfig(opset=17))(model, make_pass_context())
    assert result.modified and result.artifacts.primary is not model
    assert ir.serde.serialize_model(model).SerializeToString() == before
