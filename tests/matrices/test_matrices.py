"""The matrix files: schema, sources, the generated ORT CPU entry, lookup, and the ``matrix`` CLI."""

from __future__ import annotations

import json

import onnxruntime
import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from onnxdeploy.errors import ConfigError
from onnxdeploy.matrices import generate_ort_mobile, get_target, list_targets, lookup, transcribe_ort_cuda
from onnxdeploy.matrices.generate_ort_cpu import build_matrix
from onnxdeploy.matrices.schema import Matrix


@pytest.mark.parametrize("target", list_targets())
def test_every_matrix_validates_and_every_fact_cites_a_read_source(target):
    matrix = get_target(target)
    assert matrix.target == target
    cited = {e.source for e in matrix.ops} | {r.source for r in matrix.opsets.values()}
    cited |= {d.source for d in matrix.dtypes.values()} | {lim.source for lim in matrix.limits}
    assert cited <= set(matrix.sources), cited - set(matrix.sources)
    for source in matrix.sources.values():
        assert source.doc and source.section and source.version and source.address and source.read
    assert matrix.ops, "a matrix with no sourced op says nothing"


def test_schema_refuses_an_entry_whose_source_is_not_listed():
    data = yaml.safe_load(yaml.safe_dump(get_target("rknn-rk3588").model_dump(mode="json")))
    data["ops"][0]["source"] = "nowhere"
    with pytest.raises(ValueError, match="unknown source id"):
        Matrix.model_validate(data)
    data["ops"][0]["source"] = data["ops"][1]["source"]
    data["ops"][0]["until"] = 0
    with pytest.raises(ValueError):
        Matrix.model_validate(data)


def test_ort_cpu_is_generated_from_the_installed_onnxruntime():
    committed = get_target("ort-cpu")
    assert committed.generated is not None
    assert committed.generated.versions["onnxruntime"] == onnxruntime.__version__, (
        "regenerate: python -m onnxdeploy.matrices.generate_ort_cpu"
    )
    fresh = Matrix.model_validate(build_matrix(committed.generated.on))
    assert fresh.ops == committed.ops and fresh.opsets == committed.opsets and fresh.ir_version == committed.ir_version
    # probed: ORT casts a float16 node without a float16 kernel to float; a bfloat16 one fails to load
    assert fresh.emulated_types == committed.emulated_types and list(committed.emulated_types) == ["float16"]
    # What issue 8 asks of the generated entry: opset 23 / IR 11 models are inside its ranges.
    assert committed.opsets["ai.onnx"].max >= 23 and committed.ir_version.max >= 11


def test_ort_cpu_records_the_schema_versions_ort_matches_each_kernel_at():
    """An open-ended kernel is matched only at its since version (KernelRegistry::VerifyKernelDef)."""
    matrix = get_target("ort-cpu")
    assert all(e.until is not None for e in matrix.ops)
    dq = {(e.since, e.until, e.via) for e in matrix.ops_for("ai.onnx", "DequantizeLinear")}
    assert (25, 25, "kernel") in dq and not matrix.ops_for("ai.onnx", "DequantizeLinear", 28)
    (reduce_log_sum,) = matrix.ops_for("ai.onnx", "ReduceLogSum", 28)
    assert reduce_log_sum.via == "function" and reduce_log_sum.source == "ort-function-probe"
    assert matrix.opsets["ai.onnx"].min == 1


def test_openvino_cpu_is_generated_by_probing_the_installed_openvino_and_npu_stays_hand_sourced():
    cpu, npu = get_target("openvino"), get_target("openvino-npu")
    assert cpu.generated is not None and cpu.generated.by == "python -m onnxdeploy.matrices.generate_openvino_cpu"
    ov = pytest.importorskip("openvino", reason="optional extra: pip install -e '.[openvino]'")
    assert cpu.generated.versions["openvino"] == ov.__version__, (
        "regenerate: python -m onnxdeploy.matrices.generate_openvino_cpu"
    )
    assert cpu.opsets["ai.onnx"].max >= 28 and {e.source for e in cpu.ops} <= {"ov-probe", "ov-onnx-fe"}
    (blocked,) = [e for e in cpu.ops_for("ai.onnx", "DequantizeLinear", 21)]
    assert blocked.rules == ["block_size_divides_axis"] and "int4" in blocked.types["T1"]
    assert npu.generated is None and {e.source for e in npu.ops} == {"ov-onnx-fe"}
    assert npu.opsets["ai.onnx"].max == 23 and npu.sources["ov-onnx-fe"].address.startswith("https://github.com/")


def test_mobile_and_cuda_matrices_are_what_their_scripts_write():
    for target in generate_ort_mobile.TARGETS:
        committed = get_target(target)
        assert committed.generated.versions["onnxruntime"] == onnxruntime.__version__, (
            "regenerate: python -m onnxdeploy.matrices.generate_ort_mobile"
        )
        fresh = Matrix.model_validate(generate_ort_mobile.build_matrix(target, committed.generated.on))
        assert fresh.ops == committed.ops and fresh.opsets == committed.opsets, target
    cuda = Matrix.model_validate(transcribe_ort_cuda.build_matrix())
    assert cuda.ops == get_target("ort-cuda").ops, "rewrite: python -m onnxdeploy.matrices.transcribe_ort_cuda"


def test_lookup_attention_at_opset_23_answers_per_target():
    answers = {a.target: a for a in lookup("Attention", opset=23)}
    assert set(answers) == set(list_targets()) and len(answers) == 11
    # one entry per kernel registration (T1, T2, U combinations): float and float16
    assert answers["ort-cpu"].verdict == "yes"
    assert {t for e in answers["ort-cpu"].entries for t in e.types["T1"]} == {"float", "float16"}
    assert answers["ort-cuda"].verdict == "yes" and "bfloat16" in answers["ort-cuda"].entries[0].types["T1"]
    assert answers["openvino"].verdict == "yes" and answers["openvino-npu"].verdict == "yes"
    (trt,) = answers["tensorrt"].entries
    assert answers["tensorrt"].verdict == "yes" and any("past_key" in c for c in trt.constraints)
    for target in ("ort-qnn", "ort-coreml", "ort-nnapi"):
        assert answers[target].verdict == "no" and answers[target].reason == "not in the target's operator list"
    for target, span in (("rknn-rk3588", "12..19"), ("ascend-atc", "9..13"), ("horizon-bpu", "10..11")):
        assert answers[target].verdict == "no" and f"outside {span}" in answers[target].reason, target
    assert answers["rknn-rk3588"].max_opset == 19 and answers["tensorrt"].max_opset == 24


def test_lookup_schema_versions_decide_ort_dtypes():
    (v13,) = lookup("Add", opset=13, target="ort-cpu")
    (v14,) = lookup("Add", opset=14, target="ort-cpu")
    assert "uint16" not in v13.entries[0].types["T"] and "uint16" in v14.entries[0].types["T"]
    (trilu,) = lookup("Trilu", opset=19, target="rknn-rk3588")
    assert trilu.verdict == "no" and trilu.reason == "not in the target's operator list"
    with pytest.raises(ConfigError, match="known targets"):
        lookup("Add", target="no-such-target")


def test_matrix_cli_list_show_lookup():
    runner = CliRunner()
    result = runner.invoke(app, ["matrix", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["target"]: r for r in json.loads(result.stdout)}
    assert rows["ort-cpu"]["ai_onnx_opset"][1] >= 23 and rows["rknn-rk3588"]["ai_onnx_opset"] == [12, 19]
    result = runner.invoke(app, ["matrix", "show", "rknn-rk3588"])
    assert result.exit_code == 0 and "gap:" in result.output and "ScatterND" in result.output, result.output
    result = runner.invoke(app, ["matrix", "lookup", "Attention", "--opset", "23", "--json"])
    verdicts = {a["target"]: a["verdict"] for a in json.loads(result.stdout)["answers"]}
    assert verdicts["ort-cpu"] == "yes" and verdicts["rknn-rk3588"] == "no"
    result = runner.invoke(app, ["matrix", "show", "nope"])
    assert result.exit_code == 2 and "known targets" in result.output


def test_lookup_of_an_unknown_op_exits_2_naming_it_with_close_matches():
    with pytest.raises(ConfigError, match=r"unknown op 'ai\.onnx::Atention'.*Attention"):
        lookup("Atention")
    runner = CliRunner()
    result = runner.invoke(app, ["matrix", "lookup", "LayerNorm", "--json"])
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert "'ai.onnx::LayerNorm'" in error and "LayerNormalization" in error, error
    # a custom-domain op some matrix lists is known; one no matrix lists is not
    assert {a.verdict for a in lookup("MatMulNBits", domain="com.microsoft")} >= {"yes", "no"}
    with pytest.raises(ConfigError, match="unknown op 'com.microsoft::MatMulNBit'.*MatMulNBits"):
        lookup("MatMulNBit", domain="com.microsoft")
    # known to ONNX but taken by no target: exit 0, the table says which targets lack it
    result = runner.invoke(app, ["matrix", "lookup", "Trilu", "--target", "rknn-rk3588"])
    assert result.exit_code == 0 and "lack it: rknn-rk3588" in result.output, result.output
