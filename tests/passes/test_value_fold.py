"""o_proj's act-order folded into V's output channels within each head (``passes/_value_fold.py``), on small graphs.

A GQA attention block (4 query heads, 2 KV heads, head dim 8, no cache): the fold is found by data flow, and
permuting V's weight columns and o_proj's weight rows as it says leaves the output equal (ORT, fp32 noise);
where V's channels leave the graph, are combined with a computed value, or reach o_proj across heads, there
is no fold and the reason says why.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.model_io import write_for_ort
from onnxdeploy.passes._value_fold import PROBES, ValueFold, concrete_dims, plan_value_fold
from onnxdeploy.passes._weight_quant import act_order_permutation
from onnxdeploy.runner.session import open_session

B, S, E, H, HKV, D = 1, 5, 16, 4, 2, 8
RNG = np.random.default_rng(0)


def _attention(variant: str = "plain") -> tuple[ir.Model, dict[str, np.ndarray]]:
    """x (B, S, E) -> GQA attention (V with a bias, heads repeated by Unsqueeze/Expand/Reshape) -> o_proj -> y."""
    weights = {
        "wq": RNG.standard_normal((E, H * D)),
        "wk": RNG.standard_normal((E, HKV * D)),
        "wv": RNG.standard_normal((E, HKV * D)),
        "bv": RNG.standard_normal(HKV * D),
        "wo": RNG.standard_normal((H * D, E)),
        "wg": RNG.standard_normal((E, HKV * D)),
    }
    weights = {k: v.astype(np.float32) for k, v in weights.items() if k != "wg" or variant == "computed"}
    ints = {
        "q_shape": [B, S, H, D],
        "kv_shape": [B, S, HKV, D],
        "axis2": [2],
        "rep_shape": [B, HKV, H // HKV, S, D],
        "heads_shape": [B, H, S, D],
        "out_shape": [B, S, H * D],
    }
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    inits += [numpy_helper.from_array(np.array(v, dtype=np.int64), k) for k, v in ints.items()]
    last = (0, 2, 3, 1) if variant == "across_heads" else (0, 2, 1, 3)
    v_in = "v_gated" if variant == "computed" else "v_biased"
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k_proj"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="v_proj"),
        helper.make_node("Add", ["v", "bv"], ["v_biased"], name="v_bias"),
        *(
            [
                helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
                helper.make_node("Mul", ["v_biased", "g"], ["v_gated"], name="v_gate"),
            ]
            if variant == "computed"
            else []
        ),
        helper.make_node("Reshape", ["q", "q_shape"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["k", "kv_shape"], ["k4"]),
        helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", [v_in, "kv_shape"], ["v4"]),
        helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
        *(
            helper.make_node(op, [src, arg], [dst])
            for op, src, arg, dst in (
                ("Unsqueeze", "kt", "axis2", "kt5"),
                ("Expand", "kt5", "rep_shape_k", "kt_rep"),
                ("Unsqueeze", "vh", "axis2", "vh5"),
                ("Expand", "vh5", "rep_shape", "vh_rep"),
            )
        ),
        helper.make_node("Reshape", ["kt_rep", "heads_shape_k"], ["k_heads"]),
        helper.make_node("Reshape", ["vh_rep", "heads_shape"], ["v_heads"]),
        helper.make_node("MatMul", ["qh", "k_heads"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v_heads"], ["ctx"], name="attention"),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=list(last)),
        helper.make_node("Reshape", ["ctx_t", "out_shape"], ["attn"]),
        helper.make_node("MatMul", ["attn", "wo"], ["y"], name="o_proj"),
    ]
    inits += [
        numpy_helper.from_array(np.array([B, HKV, H // HKV, D, S], dtype=np.int64), "rep_shape_k"),
        numpy_helper.from_array(np.array([B, H, D, S], dtype=np.int64), "heads_shape_k"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, E])]
    if variant == "cache":
        outputs.append(helper.make_tensor_value_info("vh", TensorProto.FLOAT, [B, HKV, S, D]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, E])], outputs, inits
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto), weights


def _plan(model: ir.Model) -> ValueFold | str | None:
    nodes = {n.name: n for n in model.graph}
    projections = {id(nodes[name]) for name in ("q_proj", "k_proj", "v_proj", "gate") if name in nodes}
    o_proj = nodes["o_proj"]
    return plan_value_fold(
        o_proj.inputs[0], {id(o_proj)}, lambda n: id(n) in projections, lambda i: concrete_dims(model, PROBES[i])
    )


def _run(model: ir.Model, x: np.ndarray, folder: Path) -> np.ndarray:
    folder.mkdir()
    with open_session(write_for_ort(model, folder)) as session:
        assert session.session is not None
        return session.session.run(["y"], {"x": x})[0]


def test_gqa_attention_folds_into_v_within_each_kv_head_exactly(tmp_path: Path) -> None:
    model, weights = _attention()
    fold = _plan(model)
    assert isinstance(fold, ValueFold), fold
    assert fold.producer.name == "v_proj" and fold.head_dim == D and fold.n_kv == HKV
    assert fold.kv_of_head.tolist() == [0, 0, 1, 1]  # query heads 0, 1 read KV head 0 (repeat_kv's order)
    assert [(node.name, index) for node, index in fold.constants] == [("v_bias", 1)]
    importance = RNG.random(H * D)
    v_perm, o_perm = fold.permutations(importance, act_order_permutation)
    # One order per KV head, shared by the query heads reading it: within-head blocks only.
    assert sorted(v_perm.tolist()) == list(range(HKV * D)) and (v_perm // D == np.arange(HKV * D) // D).all()
    assert (o_perm.reshape(H, D) - np.arange(H)[:, None] * D == np.repeat(v_perm.reshape(HKV, D) % D, 2, 0)).all()
    x = RNG.standard_normal((B, S, E)).astype(np.float32)
    expected = _run(model, x, tmp_path / "float")
    inits = model.graph.initializers
    for name, array in (
        ("wv", weights["wv"][:, v_perm]),
        ("bv", weights["bv"][v_perm]),
        ("wo", weights["wo"][o_perm, :]),
    ):
        inits[name].const_value = ir.Tensor(np.ascontiguousarray(array), name=name)
    folded = _run(model, x, tmp_path / "folded")
    np.testing.assert_allclose(folded, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("cache", "V's channels reach graph output 'vh' (the KV cache)"),
        ("computed", "V's channels pass through Mul 'v_gate'"),
        ("across_heads", "o_proj's channels are not whole heads of V's channels"),
    ],
)
def test_no_fold_where_v_leaves_the_graph_mixes_or_crosses_heads(variant: str, reason: str) -> None:
    model, _ = _attention(variant)
    assert _plan(model) == reason
