import onnx
from onnx import TensorProto, helper

from onnxdeploy.checks import TopoOrderCheck
from tests.checks.checks_testutil import STATIC_MODEL, by_code, codes, errors, parse


def run(model: onnx.ModelProto):
    return TopoOrderCheck().run(model)


def _model(nodes, inputs=("x",), outputs=("y",), initializers=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in outputs],
        list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sorted_model_has_no_findings():
    assert run(parse(STATIC_MODEL)) == []


def test_optional_empty_input_is_fine():
    model = parse('g (float[4] x) => (float[2] y) { [clip] y = Clip(x, "", "") }')
    # Clip's output shape is wrong on purpose: only ordering matters to this check.
    assert run(model) == []


def test_unsorted_node_names_node_and_tensor():
    model = parse(
        """
        g (float[2] x) => (float[2] y) {
            [late] y = Relu(t)
            [early] t = Relu(x)
        }
        """
    )
    findings = run(model)
    assert codes(findings) == ["OD301"]
    assert findings[0].level == "error"
    assert findings[0].nodes == ["late", "t"]
    assert "'t'" in findings[0].message and "early" in findings[0].message


def test_undefined_input_and_output_are_reported():
    model = _model([helper.make_node("Add", ["x", "ghost"], ["y"], name="add")], outputs=("y", "nowhere"))
    findings = run(model)
    assert codes(findings) == ["OD302", "OD302"]
    assert findings[0].nodes == ["add", "ghost"]
    assert findings[1].nodes == ["nowhere"] and "graph output" in findings[1].message


def test_duplicate_producers_are_errors():
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["t"], name="a"),
            helper.make_node("Neg", ["x"], ["t"], name="b"),
            helper.make_node("Relu", ["t"], ["x"], name="c"),
            helper.make_node("Identity", ["t"], ["y"], name="d"),
        ]
    )
    findings = by_code(run(model), "OD303")
    assert len(findings) == 2
    by_tensor = {f.nodes[0]: f for f in findings}
    assert by_tensor["t"].nodes == ["t", "a", "b"]
    assert by_tensor["x"].nodes == ["x", "c"] and "graph input" in by_tensor["x"].message
    assert all(f.level == "error" for f in findings)


def test_duplicate_initializers_are_errors():
    w = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    model = _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[w, w])
    assert [f.nodes for f in by_code(run(model), "OD303")] == [["w"]]


def test_empty_and_duplicate_node_names_are_warnings():
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("Relu", ["a"], ["b"], name="same"),
            helper.make_node("Relu", ["b"], ["y"], name="same"),
        ]
    )
    findings = run(model)
    assert codes(findings) == ["OD304", "OD305"]
    assert all(f.level == "warning" for f in findings)
    assert findings[0].nodes == ["<Relu #0>"]
    assert findings[1].nodes == ["same"] and "2 nodes" in findings[1].message


def test_subgraph_may_read_outer_names_defined_earlier():
    model = parse(
        """
        g (bool c, float[2] x) => (float[2] y) {
            [pre] t = Relu(x)
            [iff] y = If(c) <
                then_branch = g1 () => (float[2] a) { [t1] a = Relu(t) },
                else_branch = g2 () => (float[2] b) { [e1] b = Neg(x) }
            >
        }
        """
    )
    assert run(model) == []


def test_subgraph_reading_outer_name_defined_later_is_reported():
    model = parse(
        """
        g (bool c, float[2] x) => (float[2] y, float[2] t) {
            [iff] y = If(c) <
                then_branch = g1 () => (float[2] a) { [t1] a = Relu(t) },
                else_branch = g2 () => (float[2] b) { [e1] b = Neg(x) }
            >
            [post] t = Relu(x)
        }
        """
    )
    findings = run(model)
    assert codes(findings) == ["OD302"]  # the branch cannot see 't': it is defined after the If
    assert findings[0].nodes == ["t1", "t"] and "iff/then_branch" in findings[0].message


def test_many_offending_nodes_are_capped():
    nodes = [helper.make_node("Relu", [f"t{i + 1}"], [f"t{i}"], name=f"n{i}") for i in range(30)]
    nodes.append(helper.make_node("Relu", ["x"], ["t30"], name="n30"))
    nodes.append(helper.make_node("Identity", ["t0"], ["y"], name="out"))
    findings = run(_model(nodes))
    ood = by_code(findings, "OD301")
    assert len(ood) == TopoOrderCheck.max_reported + 1
    assert "10 more node(s)" in ood[-1].message
    assert errors(findings) == ood
