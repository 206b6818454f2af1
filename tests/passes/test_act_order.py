"""Act-order folds: into the producers' output channels where the activation is theirs alone, else a Gather."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.passes._act_order import apply_fold, plan_folds
from onnxdeploy.passes._edit import names_in_use
from onnxdeploy.passes._quant_targets import Target, find_targets
from onnxdeploy.report import PassReport

RNG = np.random.default_rng(0)
HIDDEN, FF = 8, 16


def _mlp(extra_reader: bool = False) -> ir.Model:
    """gate/up (8 -> 16), ``a = Sigmoid(gate) * up + b``, down (16 -> 8); optionally ``a`` is an output too."""
    inits = [
        numpy_helper.from_array(RNG.standard_normal((HIDDEN, FF)).astype(np.float32), "w_gate"),
        numpy_helper.from_array(RNG.standard_normal((HIDDEN, FF)).astype(np.float32), "w_up"),
        numpy_helper.from_array(RNG.standard_normal((FF, HIDDEN)).astype(np.float32), "w_down"),
        numpy_helper.from_array(np.arange(FF, dtype=np.float32), "b"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w_gate"], ["gate"], name="gate_proj"),
        helper.make_node("MatMul", ["x", "w_up"], ["up"], name="up_proj"),
        helper.make_node("Sigmoid", ["gate"], ["s"], name="act"),
        helper.make_node("Mul", ["s", "up"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "b"], ["a"], name="bias"),
        helper.make_node("MatMul", ["a", "w_down"], ["y"], name="down_proj"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, HIDDEN])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, FF]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, HIDDEN])], outputs, initializer=inits
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _groups(model: ir.Model) -> tuple[dict[int, list[Target]], dict[int, Target]]:
    targets, _ = find_targets(model, exclude=[], lm_head=True, embedding=False)
    by_activation: dict[int, list[Target]] = {}
    for t in targets:
        by_activation.setdefault(id(t.activation), []).append(t)
    return by_activation, {id(t.node): t for t in targets}


def _stats(model: ir.Model) -> dict[str, np.ndarray]:
    return {"x": RNG.random(HIDDEN) + 0.1, "a": RNG.random(FF) + 0.1}


def test_the_mlp_activation_folds_into_gate_and_up_and_its_bias_becomes_a_new_permuted_initializer() -> None:
    model = _mlp()
    by_activation, by_node = _groups(model)
    report = PassReport(name="quantize_weights")
    folds = plan_folds(model, "model.onnx", by_activation, by_node, _stats(model), report)
    down = next(f for f in folds if f.activation.name == "a")
    assert {p.node.name for p in down.producers} == {"gate_proj", "up_proj"}
    assert {n.name for n in down.region} == {"bias", "mul", "act"}
    assert [(n.name, i) for n, i in down.bias_constants] == [("bias", 1)]
    rows = {r["activation"]: r for r in report.details["act_order"]}
    assert rows["a"]["fold"] == "producers" and rows["x"]["fold"] == "gather"
    bias = model.graph.initializers["b"].const_value
    before = bias.numpy().copy()
    apply_fold(model.graph, down, by_activation[id(down.activation)], names_in_use(model.graph))
    add = next(n for n in model.graph if n.name == "bias")
    np.testing.assert_array_equal(add.inputs[1].const_value.numpy(), before[down.perm])
    assert add.inputs[1].name == "b_act_order"
    np.testing.assert_array_equal(bias.numpy(), before)  # the input's tensor is never written


def test_an_activation_read_outside_its_region_is_permuted_by_a_gather() -> None:
    model = _mlp(extra_reader=True)
    by_activation, by_node = _groups(model)
    folds = plan_folds(model, "model.onnx", by_activation, by_node, _stats(model), PassReport(name="q"))
    down = next(f for f in folds if f.activation.name == "a")
    assert down.producers == [] and down.how == "by a Gather on the activation"
    apply_fold(model.graph, down, by_activation[id(down.activation)], names_in_use(model.graph))
    gather = next(n for n in model.graph if n.op_type == "Gather")
    assert gather.name == "act_order_Gather" and gather.attributes.get_int("axis") == -1
    np.testing.assert_array_equal(gather.inputs[1].const_value.numpy(), down.perm)
    reader = next(n for n in model.graph if n.name == "down_proj")
    assert reader.inputs[0] is gather.outputs[0] and gather.outputs[0].name == "a_act_order"
