"""Which weights ``quantize_weights`` targets: weight chains through Cast/Transpose, the LM head, exclude patterns."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.passes._quant_targets import find_targets, resolve_weight

RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _x(name: str, dims: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def test_a_weight_through_cast_and_transpose_is_read_in_the_consumers_dtype_and_layout() -> None:
    w16 = RNG.standard_normal((8, 4)).astype(np.float16)  # stored (N, K) = (8, 4): the MatMul reads (4, 8)
    model = _model(
        [
            helper.make_node("Cast", ["w16"], ["w32"], to=TensorProto.FLOAT, name="cast"),
            helper.make_node("Transpose", ["w32"], ["wt"], perm=[1, 0], name="t"),
            helper.make_node("MatMul", ["x", "wt"], ["y"], name="mm"),
        ],
        [_x("x", [2, 4])],
        [_x("y", [2, 8])],
        [numpy_helper.from_array(w16, "w16")],
    )
    mm = next(n for n in model.graph if n.op_type == "MatMul")
    weight = resolve_weight(mm.inputs[1])
    assert weight is not None
    assert weight.root.name == "w16" and [n.name for n in weight.chain] == ["cast", "t"]
    assert weight.transposed and weight.dtype == ir.DataType.FLOAT and weight.shape == (4, 8)
    assert weight.tensor.dtype == ir.DataType.FLOAT16
    assert resolve_weight(mm.inputs[0]) is None  # a graph input is no weight


def test_find_targets_skips_what_the_config_leaves_in_float_and_says_why() -> None:
    hidden, vocab = 8, 16
    inits = [
        numpy_helper.from_array(RNG.standard_normal((hidden, hidden)).astype(np.float32), "w_q"),
        numpy_helper.from_array(RNG.standard_normal((hidden, hidden)).astype(np.float32), "w_g"),
        numpy_helper.from_array(RNG.standard_normal((vocab, hidden)).astype(np.float32), "table"),
        numpy_helper.from_array(RNG.standard_normal((hidden, vocab)).astype(np.float32), "w_head"),
    ]
    model = _model(
        [
            helper.make_node("Gather", ["table", "ids"], ["h"], name="embed"),
            helper.make_node("MatMul", ["h", "w_q"], ["q"], name="layer/q_proj"),
            helper.make_node("Gemm", ["q", "w_g"], ["g"], transA=1, name="layer/odd_gemm"),
            helper.make_node("MatMul", ["g", "w_head"], ["logits"], name="lm_head"),
        ],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [8])],
        [_x("logits", [8, vocab])],
        inits,
    )
    targets, skipped = find_targets(model, exclude=["*q_proj", "nothing*"], lm_head=False, embedding=False)
    assert targets == []
    assert skipped == [
        "embed: embedding Gather (embedding: false)",
        "layer/q_proj: excluded by ['*q_proj']",
        "layer/odd_gemm: Gemm with transA/alpha/beta other than 0/1/1 is left in float",
        "lm_head: LM head (lm_head: false)",
        "exclude pattern 'nothing*' matched no quantizable node",
    ]
    targets, _ = find_targets(model, exclude=[], lm_head=True, embedding=True)
    kinds = {t.node.name: (t.kind, t.nk, t.lm_head, t.root_nk) for t in targets}
    assert kinds == {
        "embed": ("gather", True, False, True),
        "layer/q_proj": ("matmul", False, False, False),
        "lm_head": ("matmul", False, True, False),
    }
