"""``cache_policy: {sinks, recent}``: decoding past ``max_cache_len`` exactly as the original fed the kept tokens.

The static graph (``static_kv {cache_policy}`` + ``mask_rewrite``: the mask from ``slot_positions``) is driven by
the sinks + recent host over 4× ``max_cache_len`` positions and compared with the original export whose past is cut
to the same positions before every call, fed the true position ids (runner/cache_policy.py). The policy's cost
against the full context is measured on the trained fixture's held-out text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.mask_rewrite import MaskRewritePass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner.cache_policy import compare_with_cut_past, policy_quality
from onnxdeploy.runner.exporter_decoder import ExporterDecoder
from onnxdeploy.runner.session import open_session
from tests.conftest import fixture_entry

M = 32
POLICY_FIXTURES = [
    "llama_gqa_optimum",
    "llama_gqa_torchscript",
    "gpt2_optimum",
    "llama_gqa_dynamo",
    "llama_bytes_torchscript",
]
"""Fixtures with ``position_ids`` and no sliding window (the original's window mask counts cut-past indices)."""


def _write(name: str, folder: Path, policy: dict, **static) -> Path:
    config = StaticKVConfig(cache_policy=policy, **static)
    artifacts = StaticKVCachePass(config)(load_model(fixture_entry(name)["model_path"]).model, make_pass_context())
    artifacts = MaskRewritePass()(artifacts.artifacts, make_pass_context()).artifacts
    folder.mkdir(parents=True)
    stage_artifacts(
        [(a.name, a.model) for a in artifacts.artifacts], folder, external=True, data_name="model.onnx.data"
    ).commit()
    return folder / "model.onnx"


@pytest.mark.parametrize("name", POLICY_FIXTURES)
def test_sinks_and_recent_match_the_cut_past_original_over_4x_the_cache(name: str, tmp_path: Path) -> None:
    model = _write(name, tmp_path / "out", {"sinks": 4, "recent": 20}, max_cache_len=M)
    contract = read_contract(onnx.load(str(model), load_external_data=False))
    assert contract is not None and contract.contract_version == 5 and contract.mask == "slot_positions"
    assert contract.cache_policy is not None and contract.inputs.slot_positions == "slot_positions"
    tokens = np.random.default_rng(0).integers(1, fixture_entry(name)["config"]["vocab"], size=4 * M).tolist()
    result = compare_with_cut_past(fixture_entry(name)["model_path"], model, tokens)
    assert result.past_cache_positions == 3 * M
    assert result.top1_agreement == 1.0
    assert result.max_abs_logit_diff <= (2e-5 if name == "llama_bytes_torchscript" else 1e-5)  # trained logits ~20


def test_the_policy_is_not_the_full_context_and_its_cost_is_measured(tmp_path: Path) -> None:
    name = "llama_bytes_torchscript"
    model = _write(name, tmp_path / "out", {"sinks": 4, "recent": 20}, max_cache_len=M)
    text = list((Path(fixture_entry(name)["model_path"]).parent / "eval.txt").read_bytes()[: 4 * M])
    quality = policy_quality(fixture_entry(name)["model_path"], model, text)
    assert quality.evicting_positions == 3 * M
    assert 0.0 < quality.mean_kl < 0.1 and 0.8 < quality.top1_agreement < 1.0
    with ExporterDecoder(open_session(fixture_entry(name)["model_path"])) as full:
        full_logits = np.stack([x for x, _ in full.feed(text)])
    cut = compare_with_cut_past(fixture_entry(name)["model_path"], model, text)
    assert cut.max_abs_logit_diff < 1e-4 < float(np.abs(full_logits[M:]).max())  # a different reference


def _pipeline(tmp_path: Path, name: str, static: dict, steps: int = 4) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(fixture_entry(name)["model_path"]),
                "output_dir": str(tmp_path / "out"),
                "passes": [{"static_kv": static}, {"mask_rewrite": {}}],
                "verify": {"prompt": [1, 2, 3], "steps": steps},
            }
        )
    )
    return path


def test_sinks_plus_recent_above_the_cache_exits_2_before_any_pass(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "llama_gqa_optimum", {"max_cache_len": 16, "cache_policy": {"sinks": 4, "recent": 13}})
    with pytest.raises(ConfigError, match="sinks 4 \\+ recent 13 > max_cache_len 16"):
        load_pipeline(path)


def test_an_export_without_position_ids_is_refused_naming_the_input(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "llama_gqa_genai", {"max_cache_len": 16, "cache_policy": {"sinks": 2, "recent": 8}})
    with pytest.raises(ConfigError, match="no 'position_ids' input") as err:
        run_pipeline(load_pipeline(path))
    assert err.value.exit_code == 2 and not (tmp_path / "out").exists()


def test_verify_decodes_a_policy_graph_set_past_the_cache_against_the_cut_past_original(tmp_path: Path) -> None:
    """The pipeline's verify: within the cache the set as any; past it, the host against the cut-past original."""
    name = "llama_gqa_optimum"
    static = {"step_lens": [1, 4], "max_cache_lens": [16, 32], "cache_policy": {"sinks": 4, "recent": 12}}
    outcome = run_pipeline(load_pipeline(_pipeline(tmp_path, name, static, steps=4 * 32 - 3)))
    assert outcome.exit_code == 0, outcome.report.failures
    modes = outcome.report.verify.modes  # type: ignore[union-attr]
    assert {m.positions for m in modes.values()} == {4 * 32}
    assert all(m.top1_agreement == 1.0 and m.max_abs_logit_diff <= 1e-5 for m in modes.values())


@pytest.mark.parametrize("verify", [None, {"prompt": [1, 2, 3], "steps": 4}, {"prompt": [1, 2, 3], "steps": 40}])
def test_a_policy_without_a_later_mask_rewrite_exits_2_before_any_pass(tmp_path: Path, verify: dict | None) -> None:
    """A fresh user's case: without mask_rewrite the graph masks by the exporter's attention_mask, never by the
    slot_positions the contract's host feeds; the run passed (no verify, or within the cache) or failed late."""
    path = _pipeline(tmp_path, "llama_gqa_optimum", {"max_cache_len": 16, "cache_policy": {"sinks": 2, "recent": 8}})
    config = yaml.safe_load(path.read_text())
    config["passes"], config["verify"] = config["passes"][:1], verify
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"key 'passes\[0\]\.static_kv': needs a later mask_rewrite pass") as err:
        load_pipeline(path)
    assert "cache_policy" in str(err.value) and err.value.exit_code == 2 and not (tmp_path / "out").exists()
