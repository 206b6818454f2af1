"""``static_kv {window_cache: true}`` with a window the cache cannot hold: exit 2 before any pass, nothing written.

The input graph's window constants (the ones ``mask_rewrite`` tries) bound every layer's window from below, so a
ring that is not smaller than the smallest cache even at that bound is refused with the config and the graph alone
(passes/_window_cache.py ``refuse_oversized_window``), before ``static_kv`` builds or probes anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.errors import ConfigError
from onnxdeploy.passes.static_kv import StaticKVCachePass
from onnxdeploy.pipeline import run_pipeline
from tests.conftest import REPO, fixture_entry

MIXED = REPO / "fixtures" / "gemma3_mixed" / "optimum" / "model.onnx"


def _pipeline(tmp_path: Path, model: Path, static: dict) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "output_dir": str(tmp_path / "out"),
                "passes": [{"static_kv": {"window_cache": True, **static}}, {"mask_rewrite": {}}],
                "verify": {"prompt": [1, 2, 3], "steps": 4},
            }
        )
    )
    return path


@pytest.mark.parametrize(
    ("model", "static", "message"),
    [
        (
            Path(fixture_entry("mistral_sw_optimum")["model_path"]),
            {"max_cache_len": 8},
            "key 'passes\\[0\\].static_kv': max_cache_len=8: window_cache: the smallest sliding window in the graph is "
            "8 \\(the mask Softmax '/model/layers.0/self_attn/Softmax' reads\\), so a ring needs at least 8 \\+ "
            "max\\(step_lens\\) 1 - 1 = 8 slots, not smaller than max_cache_len 8",
        ),
        (
            MIXED,
            {"step_lens": [1, 4], "max_cache_lens": [16, 64]},
            "max_cache_lens=\\[16, 64\\]: window_cache: the smallest sliding window in the graph is 16 .* 16 \\+ "
            "max\\(step_lens\\) 4 - 1 = 19 slots, not smaller than max_cache_len 16",
        ),
    ],
)
def test_a_window_larger_than_the_cache_exits_2_before_any_pass(
    model: Path, static: dict, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("static_kv ran")

    monkeypatch.setattr(StaticKVCachePass, "call", ran)
    with pytest.raises(ConfigError, match=message) as err:
        run_pipeline(load_pipeline(_pipeline(tmp_path, model, static)))
    assert err.value.exit_code == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("llama_gqa_optimum", "no attention mask of the graph \\(2 read\\) compares positions with a window constant"),
        ("llama_gqa_dynamo23", "no attention mask of the graph \\(2 read\\)"),  # opset-23 Attention's mask input
        ("llama_gqa_genai", "the cache is held inside com.microsoft::GroupQueryAttention"),
    ],
)
def test_window_cache_on_a_model_without_a_window_exits_2_before_any_pass(
    name: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh user's case: every layer global (or the cache inside an op), the run built and probed a static graph
    before plan_rings refused it; now the input graph's masks decide, naming the pass key and window_cache."""

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("static_kv ran")

    monkeypatch.setattr(StaticKVCachePass, "call", ran)
    path = _pipeline(tmp_path, Path(fixture_entry(name)["model_path"]), {"max_cache_len": 32})
    with pytest.raises(ConfigError, match=f"key 'passes\\[0\\].static_kv': window_cache: true, but {message}") as err:
        run_pipeline(load_pipeline(path))
    assert err.value.exit_code == 2
    assert not (tmp_path / "out").exists()


def test_a_window_the_cache_holds_is_not_refused_before_the_passes(tmp_path: Path) -> None:
    """One slot more than the smallest ring: the check lets it through (the run builds and verifies it)."""
    path = _pipeline(tmp_path, Path(fixture_entry("mistral_sw_optimum")["model_path"]), {"max_cache_len": 9})
    outcome = run_pipeline(load_pipeline(path))
    assert outcome.exit_code == 0, outcome.report.failures
    assert (tmp_path / "out" / "model.onnx").exists()


def test_window_cache_without_a_later_mask_rewrite_exits_2_before_any_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh user's case: without mask_rewrite the exporter's (B, max_cache_len) mask cannot read a ring; the run
    built the graph and then failed on its contract (or, with verify: null, wrote it and exited 1)."""

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("static_kv ran")

    monkeypatch.setattr(StaticKVCachePass, "call", ran)
    path = _pipeline(tmp_path, Path(fixture_entry("mistral_sw_optimum")["model_path"]), {"max_cache_len": 16})
    config = yaml.safe_load(path.read_text())
    config["passes"] = config["passes"][:1]
    config["verify"] = None
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"passes\[0\].*needs a later mask_rewrite pass.*add mask_rewrite after it"):
        run_pipeline(load_pipeline(path))
    assert not (tmp_path / "out").exists()
