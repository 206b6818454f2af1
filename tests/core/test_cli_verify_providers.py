"""``onnxdeploy verify --providers/--strict-providers``: a requested EP that fell back fails only when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onnxdeploy.cli import app
from tests.runner.tiny_decoder import save_tiny_decoder

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return save_tiny_decoder(root / "exporter.onnx"), save_tiny_decoder(root / "full_buffer.onnx", "full_buffer")


@pytest.mark.parametrize(("strict", "exit_code"), [(False, 0), (True, 1)])
def test_a_provider_fallback_fails_only_with_strict_providers(tiny, strict: bool, exit_code: int) -> None:
    original, candidate = tiny
    args = ["verify", str(original), str(candidate), "--prompt", "1,2,3", "--steps", "3", "--json"]
    args += ["--providers", "CUDAExecutionProvider,CPUExecutionProvider"] + (["--strict-providers"] if strict else [])
    result = runner.invoke(app, args)
    assert result.exit_code == exit_code, result.output
    report = json.loads(result.stdout)
    assert report["providers"] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert report["strict_providers"] is strict
    assert any("CUDAExecutionProvider" in line for line in report["provider_fallbacks"])
    assert all(mode["passed"] for mode in report["modes"].values())  # the numbers agree; only the EP failed
    assert bool(report["failures"]) is strict and report["passed"] is not strict


def test_an_empty_providers_list_exits_2(tiny) -> None:
    original, candidate = tiny
    result = runner.invoke(app, ["verify", str(original), str(candidate), "--providers", " , "])
    assert result.exit_code == 2, result.output
    assert "--providers" in result.output


def test_pipeline_verify_strict_providers_fails_the_run(tiny, tmp_path: Path) -> None:
    original, _ = tiny
    pipeline = tmp_path / "p.yaml"
    verify = {"prompt": [1, 2, 3], "steps": 2, "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
    pipeline.write_text(
        json.dumps(
            {
                "model": str(original),
                "output_dir": str(tmp_path / "out"),
                "verify": {**verify, "strict_providers": True},
            }
        )
    )
    result = runner.invoke(app, ["run", str(pipeline), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["status"] == "failed"
    assert any("strict_providers" in line and "CUDAExecutionProvider" in line for line in report["failures"])
