"""verify_each_pass / bisect: a deliberately wrong pass is named, and so is its first diverging node.

Two test-only passes, registered here: one scales one MatMul weight (names map the nodes), one also splits
that MatMul into two halves joined by a Concat and renames every node and value (only data flow and values
map them). The CLI's --bisect takes the same route.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from onnxdeploy.config import load_pipeline
from onnxdeploy.passes import Pass, PassConfig, register_pass
from onnxdeploy.pipeline import run_pipeline
from tests.conftest import fixture_entry


def _target_matmul(model: ir.Model) -> ir.Node:
    """The first MatMul whose second input is a weight of more than 1 KiB (layer 0's q_proj in these exports)."""
    return next(
        n
        for n in model.graph
        if n.op_type == "MatMul" and n.inputs[1].const_value is not None and n.inputs[1].const_value.nbytes > 1024
    )


@register_pass
class _ScaleOneWeightPass(Pass):
    name = "test_scale_one_weight"
    summary = "test only: scales one MatMul weight by 1.5 (in every graph of a set)"
    config_model = PassConfig

    def call(self, artifacts, context, report):
        for model in artifacts.models():
            weight = _target_matmul(model).inputs[1]
            weight.const_value = ir.tensor(weight.const_value.numpy() * np.float32(1.5), name=weight.name)
        return artifacts, True


@register_pass
class _SplitMatMulPass(Pass):
    name = "test_split_matmul"
    summary = "test only: splits one MatMul in two (one half scaled) and renames every node and value"
    config_model = PassConfig

    def call(self, artifacts, context, report):
        model = artifacts.primary
        graph = model.graph
        node = _target_matmul(model)
        w = node.inputs[1].const_value.numpy()
        half = w.shape[1] // 2
        parts = []
        for i, block in enumerate((w[:, :half], w[:, half:] * np.float32(1.5))):
            value = ir.Value(name=f"split_w{i}", const_value=ir.tensor(np.ascontiguousarray(block), name=f"split_w{i}"))
            value.shape, value.dtype = ir.Shape(block.shape), ir.DataType.FLOAT
            graph.initializers.add(value)
            parts.append(ir.node("MatMul", [node.inputs[0], value]))
        concat = ir.node("Concat", [p.outputs[0] for p in parts], attributes={"axis": -1})
        graph.insert_before(node, [*parts, concat])
        ir.convenience.replace_all_uses_with(node.outputs[0], concat.outputs[0])
        graph.remove(node, safe=True)
        io = {v.name for v in (*graph.inputs, *graph.outputs)}
        for i, n in enumerate(graph):
            n.name = f"renamed_{i}"
            for j, v in enumerate(n.outputs):
                if v.name not in io:
                    v.name = f"renamed_{i}_{j}"
        return artifacts, True


def _pipeline(tmp_path, wrong_pass: str):
    entry = fixture_entry("llama_gqa_optimum")
    (tmp_path / "p.yaml").write_text(
        f"model: {entry['model_path']}\noutput_dir: {tmp_path / 'out'}\n"
        "passes:\n  - static_kv: {max_cache_len: 32}\n"
        f"  - {wrong_pass}: {{}}\n  - pin_opset: {{opset: 17}}\n"
        "verify_each_pass: true\nbisect: true\ncache: null\n"
        "verify: {prompt: [1, 17, 42, 99], steps: 2, modes: [teacher_forced]}\n"
    )
    return tmp_path / "p.yaml"


def _expected_node(entry_name: str) -> str:
    from onnxdeploy.model_io import load_model

    return _target_matmul(load_model(fixture_entry(entry_name)["model_path"]).model).name


@pytest.mark.parametrize(
    ("wrong_pass", "mapped_by"), [("test_scale_one_weight", "name"), ("test_split_matmul", "none")]
)
def test_verify_each_pass_names_the_pass_and_its_first_diverging_node(tmp_path, wrong_pass, mapped_by):
    outcome = run_pipeline(load_pipeline(_pipeline(tmp_path, wrong_pass)))
    report = outcome.report
    assert outcome.exit_code == 1
    assert [r.name for r in report.pass_verification] == ["static_kv", wrong_pass, "pin_opset"]
    assert [r.diverged for r in report.pass_verification] == [False, True, True]
    assert report.pass_verification[0].max_abs_logit_diff <= 1e-4
    assert report.first_divergent_pass == wrong_pass
    node = report.first_divergent_node
    assert node is not None and node.pass_name == wrong_pass
    assert node.op_type == "MatMul" and node.node == _expected_node("llama_gqa_optimum")
    assert node.mapped_by == mapped_by
    if mapped_by == "none":  # the nodes that replaced it read the same (value-mapped) input
        assert node.nodes_in_output_reading_same_inputs
    else:
        assert node.max_abs_diff > 1e-3
    assert any(wrong_pass in line and node.node in line for line in report.failures)


def test_cli_bisect_flag(tmp_path):
    path = _pipeline(tmp_path, "test_scale_one_weight")
    path.write_text(path.read_text().replace("verify_each_pass: true\nbisect: true\n", ""))
    result = CliRunner().invoke(app, ["run", str(path), "--bisect", "--json", "--quiet"])
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["first_divergent_pass"] == "test_scale_one_weight"
    assert report["first_divergent_node"]["op_type"] == "MatMul"


# ------------------------------------------------------------------------------------------------- graph sets

GRAPH_SET = {"static_kv": {"max_cache_lens": [32, 64], "step_lens": [1, 4]}}


def _set_pipeline(tmp_path, passes, **extra) -> Path:
    entry = fixture_entry("llama_gqa_optimum")
    cfg = {
        "model": str(entry["model_path"]),
        "output_dir": str(tmp_path / "out"),
        "passes": passes,
        "cache": None,
        "verify": {"prompt": [1, 17, 42, 99, 7, 3], "steps": 3, "modes": ["teacher_forced"]},
        **extra,
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_cli_bisect_on_a_graph_set_verifies_every_pass_as_a_set(tmp_path):
    path = _set_pipeline(tmp_path, [GRAPH_SET, {"mask_rewrite": {}}, {"pin_opset": {"opset": 17}}])
    result = CliRunner().invoke(app, ["run", str(path), "--bisect", "--json", "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(report["graphs"]) == 4
    records = report["pass_verification"]
    assert [r["name"] for r in records] == ["static_kv", "mask_rewrite", "pin_opset"]
    assert not any(r["diverged"] for r in records) and all(r["positions"] == 9 for r in records)
    assert report["first_divergent_pass"] is None and report["first_divergent_node"] is None


def test_bisect_on_a_graph_set_names_the_diverging_node_of_its_primary(tmp_path):
    path = _set_pipeline(tmp_path, [GRAPH_SET, {"test_scale_one_weight": {}}], verify_each_pass=True, bisect=True)
    outcome = run_pipeline(load_pipeline(path))
    report = outcome.report
    assert outcome.exit_code == 1
    assert [r.diverged for r in report.pass_verification] == [False, True]
    assert report.first_divergent_pass == "test_scale_one_weight"
    node = report.first_divergent_node
    assert node is not None and node.op_type == "MatMul" and node.node == _expected_node("llama_gqa_optimum")


def test_verify_each_pass_on_the_fast_step_example(tmp_path):
    example = Path(__file__).parents[2] / "examples" / "llama_gqa_fast_step.yaml"
    cfg = yaml.safe_load(example.read_text())
    cfg["model"] = str((example.parent / cfg["model"]).resolve())
    cfg.update(output_dir=str(tmp_path / "out"), verify_each_pass=True, cache=None)
    path = tmp_path / "fast_step.yaml"
    path.write_text(yaml.safe_dump(cfg))
    outcome = run_pipeline(load_pipeline(path))
    report = outcome.report
    assert outcome.exit_code == 0, report.failures
    assert [r.name for r in report.pass_verification] == [p.name for p in report.passes]
    assert len(report.pass_verification) == 4 and not any(r.diverged for r in report.pass_verification)
    assert len(report.graphs) == 4  # two step lengths by two cache lengths, one weights file
