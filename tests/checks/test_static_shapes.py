import onnx
from onnx import TensorProto, helper

import onnxdeploy.checks.static_shapes as static_shapes_module
from onnxdeploy.checks import StaticShapesCheck
from tests.checks.checks_testutil import STATIC_MODEL, by_code, codes, errors, parse


def run(model: onnx.ModelProto):
    return StaticShapesCheck().run(model)


def test_static_model_has_no_findings():
    assert run(parse(STATIC_MODEL)) == []


def test_symbolic_dim_is_reported_per_tensor_with_axis_and_symbol():
    model = parse(
        """
        g (float[batch,4] x, int64[1,seq] ids) => (float[batch,3] y)
        <float[4,3] w = {1.,2.,3.,4.,5.,6.,7.,8.,9.,10.,11.,12.}>
        {
            [mm] t = MatMul(x, w)
            [relu] y = Relu(t)
        }
        """
    )
    findings = run(model)
    assert codes(findings) == ["OD202"] * 4
    assert [f.nodes for f in findings] == [["x"], ["ids"], ["y"], ["t"]]
    assert all(f.level == "error" for f in findings)
    x = findings[0]
    assert "graph input 'x'" in x.message and "axis 0 is symbolic 'batch'" in x.message
    assert "axis 1 is symbolic 'seq'" in findings[1].message
    assert "value_info 't'" in findings[3].message  # an intermediate, typed by inference
    assert "static_kv" in x.hint


def test_unknown_dim_is_reported():
    model = parse("g (float[?,4] x) => (float[?,4] y) { [r] y = Relu(x) }")
    findings = run(model)
    assert codes(findings) == ["OD203", "OD202"]
    assert findings[0].nodes == ["x"] and "axis 0 is unknown" in findings[0].message
    # inference turns the output's unknown dim into a generated symbol
    assert findings[1].nodes == ["y"] and "placeholder made by shape inference" in findings[1].message


def test_symbolic_and_unknown_in_one_tensor_is_one_finding():
    model = parse("g (float[b,?] x) => (float[2] y) { [s] y = ReduceSum <keepdims=0> (x) }", opset=13)
    x = [f for f in run(model) if f.nodes == ["x"]]
    assert codes(x) == ["OD202"]
    assert "axis 0 is symbolic 'b'" in x[0].message and "axis 1 is unknown" in x[0].message


def test_missing_type_and_unknown_rank_are_reported():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)  # no shape: unknown rank
    y = onnx.ValueInfoProto(name="y")  # no type at all
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    findings = by_code(run(model), "OD201")
    assert [f.nodes for f in findings] == [["x"], ["y"]]
    assert "rank unknown" in findings[0].message
    assert all(f.level == "error" for f in findings)


def test_untyped_node_output_is_a_warning_naming_tensor_and_node():
    model = parse(
        """
        g (float[2] x) => (float[2] y) {
            [custom] u = com.example.Mystery(x)
            [relu] y = Relu(x)
        }
        """,
        extra_opsets=', "com.example": 1',
    )
    findings = run(model)
    assert codes(findings) == ["OD205"]
    assert findings[0].level == "warning"
    assert findings[0].nodes == ["u", "custom"]
    assert "com.example::Mystery" in findings[0].message


def test_shape_range_trilu_left_are_warnings_per_op_type():
    model = parse(
        """
        g (float[4,4] x) => (float[4,4] y, int64[2] s, int64[4] r) {
            [shape0] s = Shape(x)
            [tri] y = Trilu(x)
            [range0] r = Range(zero, four, one)
        }
        """,
    )
    for name, value in (("zero", 0), ("four", 4), ("one", 1)):
        model.graph.initializer.append(helper.make_tensor(name, TensorProto.INT64, [], [value]))
    findings = run(model)
    assert codes(findings) == ["OD206"] * 3
    assert all(f.level == "warning" for f in findings)
    assert {tuple(f.nodes) for f in findings} == {("shape0",), ("tri",), ("range0",)}
    assert "Shape" in findings[0].message and "onnxsim" in findings[0].hint
    assert errors(findings) == []


def test_data_propagation_makes_shape_arithmetic_static():
    # Reshape's target comes from Shape(x): only data propagation gives y a static shape.
    model = parse("g (float[2,3] x, float[6] z) => (y) { [s] s = Shape(x)\n [rs] y = Reshape(z, s) }")
    findings = run(model)
    assert codes(findings) == ["OD206"]


def test_sequence_value_is_a_warning():
    model = parse("g (float[2] x) => (seq(float[2]) y) { [sc] y = SequenceConstruct(x, x) }")
    findings = run(model)
    assert codes(findings) == ["OD204"] and findings[0].nodes == ["y"]
    assert findings[0].level == "warning"


def test_subgraph_tensors_are_checked_with_scope():
    model = parse(
        """
        g (bool c, float[N] x) => (float[N] y) {
            [iff] y = If(c) <
                then_branch = g1 () => (float[N] a) { [t1] a = Relu(x) },
                else_branch = g2 () => (float[N] b) { [e1] b = Neg(x) }
            >
        }
        """
    )
    findings = run(model)
    assert [f.nodes[0] for f in findings] == ["x", "y", "a", "b"]
    assert "subgraph 'iff/then_branch'" in findings[2].message


def test_inference_failure_is_reported_and_declared_shapes_are_checked(monkeypatch):
    def broken(model):
        raise RuntimeError("inference exploded")

    monkeypatch.setattr(static_shapes_module, "infer", broken)
    model = parse("g (float[N] x) => (float[N] y) { [r] y = Relu(x) }")
    findings = run(model)
    assert codes(findings) == ["OD207", "OD202", "OD202"]
    assert "inference exploded" in findings[0].message and findings[0].level == "error"
