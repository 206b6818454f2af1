"""``static_kv {window_cache: true}``: ring buffers of ``W + max(step_lens) − 1`` slots for windowed layers.

The Mistral fixture (every layer a sliding window of 8) is decoded through rings over more than 3× the window,
alone and as a graph set (buckets and two cache lengths: the rings never move), in every layout, against the
original export; the buffers the contract declares are the ring's length, not ``max_cache_len``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.kv_layout import KVLayoutConfig, KVLayoutPass
from onnxdeploy.passes.mask_rewrite import MaskRewritePass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import verify
from tests.conftest import fixture_entry

NAME = "mistral_sw_optimum"
WINDOW = 8


def _build(name: str = NAME, **static) -> ArtifactSet:
    """``static_kv {window_cache: true, **static}`` then ``mask_rewrite`` on the registry's fixture ``name``."""
    artifacts = StaticKVCachePass(StaticKVConfig(window_cache=True, **static))(
        load_model(fixture_entry(name)["model_path"]).model, make_pass_context()
    ).artifacts
    return MaskRewritePass()(artifacts, make_pass_context()).artifacts


def _stage(artifacts: ArtifactSet, folder: Path, layout: str | None = None, cache_write: str | None = None) -> Path:
    """``kv_layout`` (when ``layout``) on a copy, then the set written to ``folder``; the primary graph's path."""
    if layout is not None:
        config = KVLayoutConfig(layout=layout, cache_write=cache_write)
        artifacts = KVLayoutPass(config)(artifacts, make_pass_context()).artifacts
    folder.mkdir(parents=True)
    stage_artifacts(
        [(a.name, a.model) for a in artifacts.artifacts], folder, external=True, data_name="model.onnx.data"
    ).commit()
    return folder / "model.onnx"


def _write(folder: Path, layout: str | None = None, name: str = NAME, **static) -> Path:
    return _stage(_build(name, **static), folder, layout)


def _check(model: Path, steps: int) -> None:
    prompt = np.random.default_rng(0).integers(1, 512, size=11).tolist()
    report = verify(fixture_entry(NAME)["model_path"], model, prompt=prompt, steps=steps, max_abs_logit_diff=1e-5)
    assert report.passed, report.failures
    assert all(m.top1_agreement == 1.0 for m in report.modes.values())


@pytest.mark.parametrize("cache_write", ["scatter_elements", "where"])
def test_a_ring_of_the_window_decodes_as_the_export_over_many_windows(cache_write: str, tmp_path: Path) -> None:
    model = _write(tmp_path / "out", max_cache_len=64, cache_write=cache_write)
    contract = read_contract(onnx.load(str(model), load_external_data=False))
    assert contract is not None and contract.contract_version == 5 and contract.max_cache_len == 64
    assert {(e.cache_len, e.slot_mapping) for e in contract.cache} == {(WINDOW, "ring")}
    assert {s[2] for s in contract.pair_input_shapes()} == {WINDOW}  # (B, H, 8, D), not 64 slots
    _check(model, steps=50)  # 61 positions: more than 7 windows


@pytest.mark.parametrize("layout", [None, "BSH2D", "BHDS_K"])
def test_a_ring_graph_set_is_driven_through_its_buckets_in_every_layout(layout: str | None, tmp_path: Path) -> None:
    model = _write(tmp_path / "out", layout, step_lens=[1, 4], max_cache_lens=[32, 64])
    contract = read_contract(onnx.load(str(model), load_external_data=False))
    assert contract is not None and {e.cache_len for e in contract.cache} == {WINDOW + 4 - 1}
    _check(model, steps=50)


def test_a_model_without_a_window_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PreconditionError, match="windows are \\[None, None\\]"):
        _write(tmp_path / "out", name="llama_gqa_optimum", max_cache_len=32)


def test_a_window_not_smaller_than_the_cache_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not smaller than max_cache_len 8"):
        _write(tmp_path / "out", max_cache_len=8)
    with pytest.raises(ValueError, match="window_cache needs cache_update full_buffer"):
        StaticKVConfig(window_cache=True, max_cache_len=32, cache_update="new_token_only")


MIXED = "gemma3_mixed_optimum"
"""Random-init Gemma-3-style text decoder: 5 layers with window 16, then 1 global (fixtures/registry.json)."""

_SET = {"step_lens": [1, 4], "max_cache_lens": [64, 128]}  # a prefill bucket and a cache-length switch at 64


def _mixed_report(model: Path, layout: str | None, ring: int, name: str = MIXED) -> None:
    """Every graph of the set: 5 rings of ``ring`` slots (one shape for the whole set) and the global layer at the
    graph's max_cache_len, in ``layout``; then the set decodes as the export, exact, over 71 positions (> 4 windows)."""
    ring_shapes = set()
    for graph in sorted(model.parent.glob("*.onnx")):
        contract = read_contract(onnx.load(str(graph), load_external_data=False))
        assert contract is not None and contract.kv_layout == (layout or "BHSD")
        assert [(e.cache_len, e.slot_mapping) for e in contract.cache] == [(ring, "ring")] * 5 + [(None, "position")]
        shapes, axes = contract.pair_input_shapes(), contract.pair_sequence_axes()
        per = len(shapes) // 6  # buffers per layer: 1 packed (BSH2D), else K and V
        assert [s[a] for s, a in zip(shapes, axes, strict=True)] == [ring] * 5 * per + [contract.max_cache_len] * per
        ring_shapes.add(tuple(shapes[: 5 * per]))
    assert len(ring_shapes) == 1  # a host never re-slots a ring when it switches graphs
    prompt = np.random.default_rng(0).integers(1, 512, size=11).tolist()
    report = verify(fixture_entry(name)["model_path"], model, prompt=prompt, steps=60, max_abs_logit_diff=1e-5)
    assert report.passed, report.failures
    assert all(m.top1_agreement == 1.0 for m in report.modes.values())


@pytest.mark.parametrize("name", [MIXED, "gemma3_mixed_torchscript"])  # both exporters
def test_mixed_layers_ring_caches_are_0_27x_and_decode_as_the_export(name: str, tmp_path: Path) -> None:
    """scatter_elements, one graph at max_cache_len 128 = 8x the window: (5 x 16 + 128) / (6 x 128) = 0.27."""
    model = _write(tmp_path / "out", name=name, max_cache_len=128)
    contract = read_contract(onnx.load(str(model), load_external_data=False))
    assert contract is not None
    shapes = contract.pair_input_shapes()
    assert sum(math.prod(s) for s in shapes) / (len(shapes) * math.prod(shapes[-1])) <= 0.3
    _mixed_report(model, None, 16, name)


@pytest.fixture(scope="module")
def mixed_set() -> ArtifactSet:
    """The mixed fixture as a BHSD graph set (``_SET``) written by ``where`` (static_kv's select write on rings)."""
    return _build(MIXED, cache_write="where", **_SET)


@pytest.mark.parametrize(
    ("layout", "cache_write"), [(None, None), ("BSH2D", None), ("BHDS_K", "scatter_nd")]
)  # every layout; kv_layout keeps the set's where or writes scatter_nd in BHDS_K
def test_mixed_layer_ring_graph_sets_decode_as_the_export_in_every_layout(
    mixed_set: ArtifactSet, layout: str | None, cache_write: str | None, tmp_path: Path
) -> None:
    _mixed_report(_stage(mixed_set, tmp_path / "out", layout, cache_write), layout, 16 + 4 - 1)
