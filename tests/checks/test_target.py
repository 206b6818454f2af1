"""Target checks: per-node findings with rule, source and fixing pass; predictions cross-checked on real runtimes."""

from __future__ import annotations

import json

import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from onnxdeploy.checks import CheckContext
from onnxdeploy.checks.target import TargetOpsCheck, TargetTensorsCheck, predict_supported
from onnxdeploy.checks.target_tensors import _nbytes
from onnxdeploy.checks.topo_order import TopoOrderCheck
from onnxdeploy.cli import app
from onnxdeploy.config import load_pipeline
from onnxdeploy.matrices import Matrix, get_target
from onnxdeploy.pipeline import run_pipeline
from tests.checks.checks_testutil import by_code, parse
from tests.conftest import FIXTURE_NAMES, fixture_entry


def _ort_opens(model: onnx.ModelProto | str) -> bool:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    source = model if isinstance(model, str) else model.SerializeToString()
    try:
        onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any refusal is "does not open"
        return False
    return True


def _add(dtype: int, opset: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", dtype, [2])
    y = helper.make_tensor_value_info("y", dtype, [2])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"], name="add")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_ort_cpu_matrix_predicts_session_creation_for_every_fixture(name):
    path = str(fixture_entry(name)["model_path"])
    predicted, errors = predict_supported(onnx.load(path, load_external_data=False), "ort-cpu")
    assert predicted == _ort_opens(path), [e.message for e in errors]


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (_add(TensorProto.UINT16, 13), False),  # Add-13 has no uint16 CPU kernel
        (_add(TensorProto.UINT16, 14), True),  # Add-14 does (ORT 1.32 registry)
        (_add(TensorProto.FLOAT, 29), False),  # above the installed ORT's opset range
        (_add(TensorProto.FLOAT, 23), True),
    ],
    ids=["add-uint16-opset13", "add-uint16-opset14", "opset29", "opset23"],
)
def test_ort_cpu_matrix_predicts_small_cases(model, expected):
    predicted, errors = predict_supported(model, "ort-cpu")
    assert _ort_opens(model) == expected
    assert predicted == expected, [e.message for e in errors]


@pytest.mark.parametrize("name", ["llama_gqa_fp16", "llama_gqa_bf16"])
def test_ort_cpu_matrix_predicts_session_creation_for_16_bit_float_fixtures(name):
    """float16 nodes without a CPU kernel run through ORT's inserted Casts (a warning); bfloat16 ones do not."""
    model = onnx.load(str(fixture_entry(name)["model_path"]), load_external_data=False)
    predicted, errors = predict_supported(model, "ort-cpu")
    assert predicted == _ort_opens(str(fixture_entry(name)["model_path"])), [e.message for e in errors][:3]
    emulated = by_code(TargetOpsCheck().run(model, CheckContext(target="ort-cpu")), "OD517")
    if name == "llama_gqa_fp16":
        matmul = next(f for f in emulated if " MatMul node(s)" in f.message)
        assert matmul.level == "warning" and "no float16 kernel" in matmul.message, matmul.message
        assert "computes in float32 (emulated)" in matmul.message and "insert_cast_transformer.cc" in matmul.source
    else:
        assert emulated == []


def test_float16_emulation_comes_from_the_matrix_not_the_target_name(monkeypatch):
    """The same ort-cpu matrix without ``emulated_types`` reports the float16 nodes as OD512 errors."""
    model = onnx.load(str(fixture_entry("llama_gqa_fp16")["model_path"]), load_external_data=False)
    strict = Matrix.model_validate({**get_target("ort-cpu").model_dump(mode="json"), "emulated_types": {}})
    monkeypatch.setattr("onnxdeploy.checks.target.get_target", lambda _name: strict)
    findings = TargetOpsCheck().run(model, CheckContext(target="ort-cpu"))
    assert by_code(findings, "OD517") == [] and len(by_code(findings, "OD512")) == 46


def test_dtype_finding_names_node_rule_and_registry_source():
    findings = TargetOpsCheck().run(_add(TensorProto.UINT16, 13), CheckContext(target="ort-cpu"))
    (finding,) = by_code(findings, "OD512")
    assert finding.nodes == ["add"] and "uint16" in finding.message
    assert "T: double|float|int32|int64|uint32|uint64" in finding.rule
    assert "get_all_opkernel_def" in finding.source and onnxruntime.__version__ in finding.source


def test_openvino_matrix_predicts_compilation():
    ov = pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    core = ov.Core()

    def compiles(model: onnx.ModelProto | str) -> bool:
        try:
            read = core.read_model(model) if isinstance(model, str) else core.read_model(model.SerializeToString(), b"")
            core.compile_model(read, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        except Exception:  # noqa: BLE001 - any refusal is "does not compile"
            return False
        return True

    for name in FIXTURE_NAMES:
        path = str(fixture_entry(name)["model_path"])
        predicted, errors = predict_supported(onnx.load(path, load_external_data=False), "openvino")
        assert predicted == compiles(path), (name, [e.message for e in errors])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Bernoulli", ["x"], ["y"])], "g", [x], [y])
    bernoulli = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    bernoulli.ir_version = 8
    assert predict_supported(bernoulli, "openvino")[0] is False and compiles(bernoulli) is False


def test_rknn_original_export_lists_dynamic_dims_and_unsupported_ops_node_by_node():
    path = fixture_entry("llama_gqa_optimum")["model_path"]
    model = onnx.load(str(path), load_external_data=False)
    context = CheckContext(target="rknn-rk3588")
    ops = TargetOpsCheck().run(model, context)
    unsupported = sorted((n.rsplit("/", 1)[-1]) for f in by_code(ops, "OD510") for n in f.nodes)
    # Neg: the 2.1.0 table says Not Supported, the 2.5.0 SDK rewrites it to Mul; the entry follows the SDK
    assert unsupported == ["IsNaN", "IsNaN", "Range", "Range_1", "Range_2"]
    # one finding per op type (the ~900-character source and fix once), as OD516 groups its nodes
    assert sorted((f.message.split(" node(s)")[0], len(f.nodes)) for f in by_code(ops, "OD510")) == [
        ("2 IsNaN", 2),
        ("3 Range", 3),
    ]
    (neg,) = get_target("rknn-rk3588").ops_for("ai.onnx", "Neg")
    assert neg.source == "rknn-sdk-build" and [c.source for c in neg.other_sources] == ["rknn-ops"]
    # the export's batch is dynamic: rknn's words 'batchsize: 1' on Softmax/Slice still concern it
    assert any("batchsize: 1" in f.message and "Softmax" in f.message for f in by_code(ops, "OD516"))
    isnan = next(f for f in by_code(ops, "OD510") if "IsNaN" in f.nodes[0])
    assert "are not supported by rknn-rk3588" in isnan.message
    assert "mask_rewrite" in isnan.hint and "RKNNToolKit2_OP_Support-v2.1.0.md" in isnan.source
    tensors = TargetTensorsCheck().run(model, context)
    dynamic = {f.nodes[0] for f in by_code(tensors, "OD520")}
    assert {"input_ids", "past_key_values.0.key", "logits", "present.1.value"} <= dynamic and len(dynamic) == 12
    assert all("static_kv" in f.hint and "CHANGELOG.md" in f.source for f in by_code(tensors, "OD520"))


@pytest.mark.parametrize("cache_write", ["", "scatter_elements"])
def test_rknn_after_static_kv_mask_rewrite_pin_opset_19_leaves_exactly_the_ops_the_table_lacks(tmp_path, cache_write):
    pipeline = tmp_path / "pipeline.yaml"
    write = f", cache_write: {cache_write}" if cache_write else ""
    pipeline.write_text(
        f"model: {fixture_entry('llama_gqa_optimum')['model_path']}\noutput_dir: {tmp_path / 'out'}\n"
        f"target: rknn-rk3588\npasses:\n  - static_kv: {{max_cache_len: 64{write}}}\n  - mask_rewrite: {{}}\n"
        "  - pin_opset: {opset: 19}\nverify: null\n"
    )
    outcome = run_pipeline(load_pipeline(pipeline))
    remaining = sorted(
        (f.code, n.rsplit("/", 2)[-2] + "/" + n.rsplit("/", 1)[-1])
        for f in outcome.report.findings
        if f.level != "info"
        for n in f.nodes
    )
    assert len([f for f in outcome.report.findings if f.code == "OD510"]) == (1 if cache_write else 0)  # grouped
    # the graph's batch is static 1: rknn's 'batchsize: 1' on Softmax/Slice is met, not reported
    assert not any("batchsize" in f.message for f in outcome.report.findings)
    # the target's default cache_write (where) leaves nothing the SDK lacks (Neg is rewritten to Mul by the
    # 2.5.0 SDK); ScatterElements writes have no NPU lowering (tests/core/test_sdk.py checks both against the SDK)
    scatters = [("OD510", f"past_key_values.{i}.{kv}/ScatterElements") for i in (0, 1) for kv in ("key", "value")]
    assert remaining == (scatters if cache_write else []), remaining
    assert outcome.exit_code == (1 if cache_write else 0), outcome.report.failures
    for f in outcome.report.findings:
        if f.level != "info":
            assert f.rule.endswith("is not in rknn-rk3588's operator list")
            assert "RKNNToolKit2_OP_Support-v2.1.0.md" in f.source and "2026" in f.source


def test_names_and_graph_io_findings():
    model = parse(
        """
        g (float[2] x) => (float[2] y, float[2] y, float[2] x)
        {
            y = Relu(x)
        }
        """
    )
    findings = TopoOrderCheck().run(model)
    assert by_code(findings, "OD306")[0].nodes == ["y"]
    assert by_code(findings, "OD307")[0].nodes == ["x"]
    model.graph.initializer.add().CopyFrom(helper.make_tensor("", TensorProto.FLOAT, [1], [1.0]))
    assert "initializer" in by_code(TopoOrderCheck().run(model), "OD308")[0].message


def test_check_cli_json_schema_and_exit_codes(tmp_path):
    runner = CliRunner()
    path = str(fixture_entry("llama_gqa_optimum")["model_path"])
    result = runner.invoke(app, ["check", path, "--json"])
    assert result.exit_code == 0, result.output  # no contract: general checks only, the export passes them
    report = json.loads(result.stdout)
    assert report["checks_run"] == ["checker", "topo_order"] and report["status"] == "passed"
    result = runner.invoke(app, ["check", path, "--target", "rknn-rk3588", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert set(report) == {
        "schema_version",
        "status",
        "model",
        "target",
        "target_version",
        "checks_run",
        "summary",
        "findings",
        "sdk",
    }
    assert report["status"] == "failed" and report["summary"]["error"] == sum(
        f["level"] == "error" for f in report["findings"]
    )
    assert {"code", "level", "check", "message", "nodes", "hint", "rule", "source"} == set(report["findings"][0])
    result = runner.invoke(app, ["check", path, "--target", "nope"])
    assert result.exit_code == 2 and "known targets" in result.output


def test_checks_only_pipeline_checks_what_it_was_given(tmp_path):
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        f"model: {fixture_entry('llama_gqa_optimum')['model_path']}\noutput_dir: {tmp_path / 'out'}\nverify: null\n"
    )
    outcome = run_pipeline(load_pipeline(pipeline))
    assert outcome.exit_code == 0, outcome.report.failures
    assert outcome.report.checks_run == ["checker", "topo_order"]
    assert not [f for f in outcome.report.findings if f.level == "error"]


def test_size_limits_honour_applies_to(monkeypatch):
    """A limit scoped to ops or tensor names is checked on those tensors only; one scoped in words only (no ops or
    tensors to match) is reported as info, not charged to every tensor; an unscoped one applies to all."""
    model = parse(
        """
        g (float[1,300] x, float[1,300] mask_in) => (float[1,300] y, float[1,300] z)
        <float[300,300] w = {0.0}>
        {
            [proj] h = MatMul(x, w)
            [act] y = Relu(h)
            [masked] z = Add(mask_in, x)
        }
        """
    )
    base = get_target("ort-cpu").model_dump(mode="json")

    def flagged(**limit) -> tuple[list[str], list[str]]:
        limit = {"name": "max_tensor_bytes", "value": 1000, "unit": "bytes", "source": "ort-registry", **limit}
        matrix = Matrix.model_validate({**base, "limits": [limit]})
        monkeypatch.setattr("onnxdeploy.checks.target_tensors.get_target", lambda _name: matrix)
        findings = TargetTensorsCheck().run(model, CheckContext(target="ort-cpu"))
        errors = sorted(n for f in by_code(findings, "OD522") for n in f.nodes)
        return errors, [f.message for f in by_code(findings, "OD525")]

    everything = ["h", "mask_in", "w", "x", "y", "z"]
    assert flagged() == (everything, [])
    assert flagged(applies_to="MatMul operands", ops=["MatMul"]) == (["h", "w", "x"], [])
    assert flagged(applies_to="the prefill mask operand", tensors=["mask*"]) == (["mask_in"], [])
    errors, info = flagged(applies_to="the prefill mask operand on the HTP")
    assert errors == [] and len(info) == 1 and "the prefill mask operand on the HTP" in info[0], info


def test_tensor_bytes_pack_sub_byte_types_and_count_a_byte_without_a_width():
    assert _nbytes(TensorProto.FLOAT, (2, 3)) == 24
    assert _nbytes(TensorProto.INT4, (3, 3)) == 5  # 9 nibbles, packed
    assert _nbytes(TensorProto.STRING, (4,)) == 4  # no fixed width: a byte each


def _one_node(op: str, opset: int, inputs, out_type: int, extra_opsets=(), **attrs) -> onnx.ModelProto:
    values = [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
    y = helper.make_tensor_value_info("y", out_type, None)
    node = helper.make_node(op, [n for n, _, _ in inputs], ["y"], name="n0", **attrs)
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in extra_opsets)]
    model = helper.make_model(helper.make_graph([node], "g", values, [y]), opset_imports=imports)
    model.ir_version = 10
    return model


_DQ_INPUTS = [("x", TensorProto.INT8, [4]), ("s", TensorProto.FLOAT, [])]


@pytest.mark.parametrize(
    ("op", "opset", "inputs", "out", "expected"),
    [
        # an open-ended kernel (DequantizeLinear since 25) is matched only at its since version
        ("DequantizeLinear", 25, _DQ_INPUTS, TensorProto.FLOAT, True),
        ("DequantizeLinear", 28, _DQ_INPUTS, TensorProto.FLOAT, False),
        # no kernel at 28, but a function body ORT inlines
        ("ReduceLogSum", 28, [("x", TensorProto.FLOAT, [2, 3])], TensorProto.FLOAT, True),
        ("GlobalLpPool", 22, [("x", TensorProto.FLOAT, [1, 2, 3, 3])], TensorProto.FLOAT, False),
    ],
    ids=["dq-25", "dq-28", "reducelogsum-28", "globallppool-22"],
)
def test_ort_cpu_matrix_knows_which_schema_versions_a_kernel_matches(op, opset, inputs, out, expected):
    model = _one_node(op, opset, inputs, out)
    assert _ort_opens(model) == expected
    predicted, errors = predict_supported(model, "ort-cpu")
    assert predicted == expected, [e.message for e in errors]
    if not expected:
        assert errors[0].code == "OD510" and f"schema version {opset}" in errors[0].message


def test_a_domain_imported_but_used_by_no_node_is_not_flagged():
    model = _one_node("Relu", 21, [("x", TensorProto.FLOAT, [2])], TensorProto.FLOAT, extra_opsets=["com.example"])
    assert _ort_opens(model)
    for target in ("ort-cpu", "openvino"):
        assert predict_supported(model, target) == (True, []), target


def _blocked_int4(rows: int) -> onnx.ModelProto:
    """A MatMul whose (rows, 8) INT4 weight is dequantized in blocks of 32 along K (axis 0), as QDQ emits it."""
    blocks = -(-rows // 32)
    w = helper.make_tensor("w", TensorProto.INT4, [rows, 8], [0] * (rows * 8))
    s = helper.make_tensor("s", TensorProto.FLOAT, [blocks, 8], [1.0] * (blocks * 8))
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], name="dq", axis=0, block_size=32),
        helper.make_node("MatMul", ["a", "wf"], ["y"], name="mm"),
    ]
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, rows])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    graph = helper.make_graph(nodes, "g", [a], [y], initializer=[w, s])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_openvino_flags_an_int4_qdq_weight_with_a_partial_last_block():
    """K % block_size != 0: ONNX allows the partial block, OpenVINO's CPU plugin refuses it (probed rule)."""
    whole, partial = _blocked_int4(64), _blocked_int4(48)
    assert predict_supported(whole, "openvino") == (True, [])
    accepted, errors = predict_supported(partial, "openvino")
    (finding,) = errors
    assert not accepted and finding.code == "OD518" and finding.nodes == ["dq"], finding
    assert "48 on axis 0, not a multiple of block_size 32" in finding.message and "block_size" in finding.hint
    assert "block_size_divides_axis" in finding.rule and "Compile probe" in finding.source
    ov = pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    core = ov.Core()

    def compiles(model):
        try:
            core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU")
        except Exception:  # noqa: BLE001 - any refusal
            return False
        return True

    assert compiles(whole) and not compiles(partial)


def test_an_op_missing_from_ort_qnns_list_cites_the_lists_source_only():
    """The op list is QNN EP's op-builder registry: not the host's opsets, the graph loader or the context limit."""
    model = onnx.load(str(fixture_entry("llama_gqa_genai")["model_path"]), load_external_data=False)
    missing = [
        f
        for f in TargetOpsCheck().run(model, CheckContext(target="ort-qnn"))
        if f.rule.endswith("is not in ort-qnn's operator list")
    ]
    matrix = get_target("ort-qnn")
    assert {f.nodes[0].rsplit("/", 1)[-1] for f in missing} >= {"GroupQueryAttention", "Shape"}
    assert {f.source for f in missing} == {matrix.source_text("qnn-builders")}
