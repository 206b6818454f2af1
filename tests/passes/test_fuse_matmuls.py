"""fuse_matmuls: q/k/v and gate/up become one MatMul + Split per layer, a graph set shares the fused weights, and
the decode is the same on ORT; tied weights, excluded nodes and pre-13 opsets are handled."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy import model_io
from onnxdeploy.contract import read_contract
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.fuse_matmuls import FuseMatMulsConfig, FuseMatMulsPass, fusable_groups, nbits_groups
from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig, QuantizeWeightsPass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import verify
from tests.conftest import fixture_entry

PROMPT = [1, 17, 42, 99, 7, 3, 5, 8]


def _matmul_count(model: ir.Model) -> int:
    return sum(1 for n in model.graph if n.op_type == "MatMul")


@pytest.mark.parametrize("name", ["llama_gqa_optimum", "llama_gqa_dynamo"])
def test_fuse_matmuls_on_a_graph_set_shares_the_fused_weights_and_decodes_the_same(tmp_path, name):
    entry = fixture_entry(name)
    layers = entry["config"]["layers"]
    model = model_io.load_model(entry["model_path"]).model
    static = StaticKVCachePass(StaticKVConfig(step_lens=[1, 4], max_cache_lens=[32]))(
        model, make_pass_context()
    ).artifacts
    context = make_pass_context()  # its scratch folder holds the fused weights until they are written
    result = FuseMatMulsPass()(static, context)
    fused = result.artifacts

    assert result.modified and result.report.warnings == []
    for before, after in zip(static.models(), fused.models(), strict=True):
        assert _matmul_count(before) - _matmul_count(after) == 3 * layers  # q,k,v -> 1 and gate,up -> 1
        assert (
            sum(1 for n in after.graph if n.op_type == "Split") - sum(1 for n in before.graph if n.op_type == "Split")
            == 2 * layers
        )
        assert fusable_groups(after.graph, []) == []
        assert read_contract(after) == read_contract(before)
        assert [v.name for v in after.graph.outputs] == [v.name for v in before.graph.outputs]
    # the decode graph and the prefill graph hold the very same fused tensors: written once
    ids = [
        {id(n.inputs[1].const_value) for n in m.graph if n.op_type == "MatMul" and "+" in (n.name or "")}
        for m in fused.models()
    ]
    assert len(ids[0]) == 2 * layers and ids[0] == ids[1]
    assert fused.weight_bytes() == pytest.approx(static.weight_bytes(), rel=0.01)

    out = tmp_path / "set"
    out.mkdir()
    graphs = [(a.name, a.model) for a in fused.artifacts]
    paths = model_io.stage_artifacts(graphs, out, external=True, data_name="model.onnx.data").commit()
    data = out / "model.onnx.data"
    assert data.stat().st_size <= 1.05 * fused.weight_bytes()
    res = verify(str(entry["model_path"]), str(out / "model.onnx"), prompt=PROMPT, steps=24, max_abs_logit_diff=1e-5)
    assert res.passed, [m.failures for m in res.modes.values()]
    assert sorted(res.graphs) == sorted(p.name for p in paths if p.suffix == ".onnx")
    for mode in res.modes.values():
        assert mode.top1_agreement == 1.0
        assert mode.positions == len(PROMPT) // 4 + 24  # two 4-token chunks (last-token logits each), then 24 steps
        assert mode.max_abs_logit_diff <= 1e-5


def _shared_input_graph(opset: int, *, tied: bool = False) -> onnx.ModelProto:
    """x (2, 8) @ {a (8, 3), b (8, 5), c (8, 4)}; with ``tied``, ``b`` is also added to a graph input."""
    rng = np.random.default_rng(0)
    widths = {"a": 3, "b": 5, "c": 4}
    inits = [numpy_helper.from_array(rng.standard_normal((8, n)).astype(np.float32), w) for w, n in widths.items()]
    nodes = [helper.make_node("MatMul", ["x", w], [f"y_{w}"], name=f"/layer/{w}_proj/MatMul") for w in "abc"]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])]
    outputs = [helper.make_tensor_value_info(f"y_{w}", TensorProto.FLOAT, [2, n]) for w, n in widths.items()]
    if tied:
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [8, 5]))
        nodes.append(helper.make_node("Add", ["b", "z"], ["tied"], name="/tied/Add"))
        outputs.append(helper.make_tensor_value_info("tied", TensorProto.FLOAT, [8, 5]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize(
    ("opset", "tied", "exclude", "fused_names"),
    [
        (17, False, [], ["/layer/a_proj+b_proj+c_proj/MatMul"]),
        (11, False, [], ["/layer/a_proj+b_proj+c_proj/MatMul"]),  # Split-11 takes the sizes as an attribute
        (17, True, [], ["/layer/a_proj+c_proj/MatMul"]),  # b is read elsewhere: fusing would duplicate it
        (17, False, ["*/c_proj/*"], ["/layer/a_proj+b_proj/MatMul"]),
    ],
)
def test_fuse_matmuls_small_cases(opset, tied, exclude, fused_names):
    proto = _shared_input_graph(opset, tied=tied)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)}
    if tied:
        feeds["z"] = np.ones((8, 5), np.float32)
    result = FuseMatMulsPass(FuseMatMulsConfig(exclude=exclude))(ir.serde.deserialize_model(proto), make_pass_context())
    model = result.artifacts.primary
    assert [n.name for n in model.graph if n.op_type == "MatMul" and n.name.count("+")] == fused_names
    split = next(n for n in model.graph if n.op_type == "Split")
    assert ("split" in split.attributes) == (opset < 13)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    for want, got in zip(_run(proto, feeds), _run(out, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_fuse_matmuls_leaves_a_graph_without_groups_alone():
    proto = _shared_input_graph(17)
    for i, node in enumerate(proto.graph.node[1:], start=2):  # every MatMul reads its own input
        node.input[0] = f"x{i}"
        proto.graph.input.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2, 8]))
    result = FuseMatMulsPass()(ir.serde.deserialize_model(proto), make_pass_context())
    assert not result.modified
    assert result.report.changes == [
        "no MatMuls sharing an input with their own constant float weights (or MatMulNBits of one format)"
    ]


def test_fuse_matmuls_reports_what_it_leaves_apart():
    """A tied weight, a quantized MatMul and an exclude pattern that matches nothing are each said, not silent."""
    proto = _shared_input_graph(17, tied=True)
    q = numpy_helper.from_array(np.ones((8, 6), np.int8), "q")
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "scale")
    proto.graph.initializer.extend([q, scale])
    proto.graph.node.extend(
        [
            helper.make_node("DequantizeLinear", ["q", "scale"], ["dq"], name="/layer/d_proj/DequantizeLinear"),
            helper.make_node("MatMul", ["x", "dq"], ["y_d"], name="/layer/d_proj/MatMul"),
        ]
    )
    proto.graph.output.append(helper.make_tensor_value_info("y_d", TensorProto.FLOAT, [2, 6]))
    result = FuseMatMulsPass(FuseMatMulsConfig(exclude=["*/mpl/*"]))(
        ir.serde.deserialize_model(proto), make_pass_context()
    )
    assert "left apart: 1 MatMul(s) whose weight is read elsewhere too (tied), e.g. /layer/b_proj/MatMul" in (
        result.report.changes
    )
    assert result.report.warnings == [
        "1 MatMul(s) already quantized (e.g. /layer/d_proj/MatMul) are not fused (a DequantizeLinear weight, or no "
        "MatMulNBits sibling of the same bits/block_size): run fuse_matmuls before quantize_weights to fuse them in "
        "float",
        "exclude pattern '*/mpl/*' matched no node",
    ]


def test_fused_weights_stay_readable_while_a_probe_session_links_them(tmp_path):
    """quantize_weights' calibration probe hard-links the scratch data file (write_for_ort); reading a fused
    weight afterwards must not trip onnx_ir's hard-link check (it did: 'has multiple hard links')."""
    model = model_io.load_model(fixture_entry("llama_gqa_optimum")["model_path"]).model
    context = make_pass_context(scratch_dir=tmp_path / "scratch")
    fused = FuseMatMulsPass()(model, context).artifacts.primary
    (tmp_path / "probe").mkdir()
    probe = model_io.write_for_ort(fused, tmp_path / "probe")
    ort.InferenceSession(str(probe), providers=["CPUExecutionProvider"])
    weights = [n.inputs[1].const_value for n in fused.graph if n.op_type == "MatMul" and "+" in (n.name or "")]
    assert weights and all(w.numpy().size for w in weights)


def _nbits_ops(model: ir.Model) -> dict[str, int]:
    """MatMulNBits node name -> bits."""
    return {n.name or "": n.attributes.get_int("bits", 0) for n in model.graph if n.op_type == "MatMulNBits"}


def _ort_outputs(path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.disable_prepacking", "0")  # the runner's choice for MatMulNBits
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_fuse_matmuls_after_quantize_fuses_matmulnbits_of_one_format_and_keeps_the_outputs(tmp_path):
    """quantize_weights with per-projection bits (k/v INT8, the rest INT4) then fuse_matmuls: k+v and gate+up
    become one MatMulNBits each (q stays apart: its format differs), and ORT gives the same outputs."""
    entry = fixture_entry("llama_gqa_optimum")
    layers = entry["config"]["layers"]
    context = make_pass_context()
    static = StaticKVCachePass(StaticKVConfig(step_lens=[1], max_cache_lens=[32]))(
        model_io.load_model(entry["model_path"]).model, context
    ).artifacts
    rules = [{"nodes": "*/k_proj/*", "bits": 8}, {"nodes": "*/v_proj/*", "bits": 8}]
    config = QuantizeWeightsConfig(
        bits=4, block_size=16, format="matmulnbits", symmetric=False, accuracy_level=4, rules=rules
    )
    quantized = QuantizeWeightsPass(config)(static, context).artifacts
    result = FuseMatMulsPass()(quantized, context)
    before, after = _nbits_ops(quantized.primary), _nbits_ops(result.artifacts.primary)

    assert result.modified
    assert len(before) - len(after) == 2 * layers  # per layer k,v -> 1 and gate,up -> 1
    fused = {name: bits for name, bits in after.items() if "+" in name}
    assert sorted(fused.values()) == [4] * layers + [8] * layers
    assert any("k_proj+v_proj" in name for name in fused) and any("gate_proj+up_proj" in name for name in fused)
    assert nbits_groups(result.artifacts.primary.graph, []) == []
    assert read_contract(result.artifacts.primary) == read_contract(quantized.primary)
    assert any("q_proj" in w and "no MatMulNBits sibling" in w for w in result.report.warnings)  # said, not silent
    split_sizes = 2 * layers * 2 * 8  # one int64 (2,) sizes initializer per Split
    assert result.artifacts.weight_bytes() == quantized.weight_bytes() + split_sizes  # the same bytes, concatenated

    paths = {}
    for label, artifacts in (("apart", quantized), ("fused", result.artifacts)):
        (tmp_path / label).mkdir()
        graphs = [(a.name, a.model) for a in artifacts.artifacts]
        model_io.stage_artifacts(graphs, tmp_path / label, external=True, data_name="model.onnx.data").commit()
        paths[label] = tmp_path / label / "model.onnx"
    session = ort.InferenceSession(str(paths["apart"]), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for arg in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in arg.shape]
        if arg.type == "tensor(float)":
            feeds[arg.name] = rng.standard_normal(shape).astype(np.float32)
        else:
            feeds[arg.name] = np.full(shape, 3, np.int64)
    for want, got in zip(_ort_outputs(paths["apart"], feeds), _ort_outputs(paths["fused"], feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # columns computed alike: bit-identical here


def _nbits_graph(blocks: list[int]) -> onnx.ModelProto:
    """x (1, 32) @ one MatMulNBits (4 bits, N 8) per block size, each with its own B/scales/zero points."""
    rng = np.random.default_rng(0)
    nodes, inits, outputs = [], [], []
    for i, block in enumerate(blocks):
        k_blocks = 32 // block
        inits += [
            numpy_helper.from_array(rng.integers(0, 256, (8, k_blocks, block // 2), dtype=np.uint8), f"b{i}"),
            numpy_helper.from_array(rng.random(8 * k_blocks, dtype=np.float32), f"s{i}"),
            numpy_helper.from_array(rng.integers(0, 256, (8 * ((k_blocks + 1) // 2),), dtype=np.uint8), f"z{i}"),
        ]
        nodes.append(
            helper.make_node(
                "MatMulNBits", ["x", f"b{i}", f"s{i}", f"z{i}"], [f"y{i}"], name=f"/layer/p{i}/MatMul_Q4",
                domain="com.microsoft", K=32, N=8, bits=4, block_size=block,
            )
        )  # fmt: skip
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, 8]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])], outputs, inits
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_fuse_matmuls_fuses_matmulnbits_only_within_one_format():
    """Two block-16 siblings fuse; the block-32 one reading the same input stays apart; outputs unchanged."""
    proto = _nbits_graph([16, 32, 16])
    result = FuseMatMulsPass()(ir.serde.deserialize_model(proto), make_pass_context())
    model = result.artifacts.primary
    assert sorted(_nbits_ops(model)) == ["/layer/p0+p2/MatMul_Q4", "/layer/p1/MatMul_Q4"]
    fused = next(n for n in model.graph if n.name == "/layer/p0+p2/MatMul_Q4")
    assert fused.attributes.get_int("N") == 16 and fused.attributes.get_int("block_size") == 16
    out = ir.serde.serialize_model(model)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 32)).astype(np.float32)}
    for want, got in zip(_run(proto, feeds), _run(out, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
