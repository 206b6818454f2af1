"""Graph sets (``static_kv {step_lens, max_cache_lens}``) driven by the runner against the original export.

One set per fixture, written once per module: step lengths 1, 4, 16 and cache lengths 32, 128 (six graphs,
one weights file). Prompts and policies are chosen so that every graph computes compared positions and the
decode crosses bucket boundaries and the 32 → 128 cache switch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.contract import read_contract
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner import open_decoder, verify
from onnxdeploy.runner.graph_set import GraphSetDecoder
from tests.conftest import fixture_entry

SET_FIXTURES = ["llama_gqa_optimum", "llama_gqa_dynamo", "mistral_sw_optimum"]
STEP_LENS = [1, 4, 16]
CACHE_LENS = [32, 128]


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 512, size=n).tolist()


def _write_set(name: str, folder: Path, **config) -> tuple[Path, int]:
    """Run static_kv on the fixture and write the set like the pipeline does; returns the primary and unique bytes."""
    result = StaticKVCachePass(StaticKVConfig(**config))(load_model(fixture_entry(name)["model_path"]).model)
    artifacts = result.artifacts
    folder.mkdir(parents=True)
    staged = stage_artifacts(
        [(a.name, a.model) for a in artifacts.artifacts],
        folder,
        external=artifacts.external(),
        data_name="model.onnx.data",
    )
    staged.commit()
    unique = {
        id(v.const_value): v.const_value.nbytes
        for m in artifacts.models()
        for v in m.graph.initializers.values()
        if v.const_value is not None and v.const_value.nbytes > 1024
    }
    return folder / "model.onnx", sum(unique.values())


@pytest.fixture(scope="module", params=SET_FIXTURES)
def graph_set(request, tmp_path_factory) -> tuple[str, Path, int]:
    folder = tmp_path_factory.mktemp(request.param) / "out"
    primary, unique = _write_set(request.param, folder, step_lens=STEP_LENS, max_cache_lens=CACHE_LENS)
    return request.param, primary, unique


def test_the_set_shares_one_weights_file_and_every_graph_opens_by_path(graph_set) -> None:
    _, primary, unique = graph_set
    files = sorted(p.name for p in primary.parent.iterdir())
    assert files == sorted(
        ["model.onnx", "model.onnx.data"]
        + [f"model.s{s}.c{c}.onnx" for s in STEP_LENS for c in CACHE_LENS if (s, c) != (1, 128)]
    )
    data = primary.parent / "model.onnx.data"
    assert unique <= data.stat().st_size <= unique * 1.05 + 65536  # each weight once (plus alignment)
    contract = read_contract(onnx.load(str(primary), load_external_data=False))
    assert contract is not None and contract.contract_version == 2
    assert [(e.file, e.step_len, e.max_cache_len, e.role) for e in contract.graph_set][0] == (
        "model.onnx",
        1,
        128,
        "decode",
    )
    for entry in contract.graph_set:
        path = primary.parent / entry.file
        header = onnx.load(str(path), load_external_data=False)
        locations = {kv.value for t in header.graph.initializer for kv in t.external_data if kv.key == "location"}
        assert locations == {"model.onnx.data"}, entry.file
        assert path.stat().st_size < data.stat().st_size / 4  # the graph, not a copy of the weights
        own = read_contract(header)
        assert own is not None and own.graph_set == contract.graph_set
        assert (own.step_len, own.max_cache_len) == (entry.step_len, entry.max_cache_len)
        if entry.step_len > 1:
            assert own.prefill_logits == "last" and own.inputs.last_token_index == "last_token_index"
            assert own.padding == "trailing"
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert [o.shape for o in session.get_outputs() if o.name == own.logits] == [[1, 1, 512]]


# (prompt length, steps, remainder policy) -> graphs that compute compared positions; together they cover all six
RUNS = [
    (41, 6, "buckets", {"model.s16.c32.onnx", "model.s4.c128.onnx", "model.onnx"}),
    (41, 6, "padded", {"model.s16.c32.onnx", "model.s16.c128.onnx", "model.onnx"}),
    (22, 20, "buckets", {"model.s16.c32.onnx", "model.s4.c32.onnx", "model.s1.c32.onnx", "model.onnx"}),
]


def test_every_graph_of_the_set_matches_the_original_across_buckets_and_cache_switches(graph_set) -> None:
    name, primary, _ = graph_set
    seen: set[str] = set()
    for prompt_len, steps, remainder, graphs in RUNS:
        prompt = _prompt(prompt_len)
        report = verify(fixture_entry(name)["model_path"], primary, prompt=prompt, steps=steps, remainder=remainder)
        assert report.passed, [m.failures for m in report.modes.values()]
        assert len(report.graphs) == 6
        for mode in report.modes.values():
            assert mode.top1_agreement == 1.0 and mode.max_abs_logit_diff <= 1e-4
            assert set(mode.positions_by_graph) == graphs, (remainder, prompt_len)
            # every generated position is compared; a "last" bucket gives one prompt position per call
            assert [s.position for s in mode.steps if s.phase == "generate"] == list(
                range(prompt_len, prompt_len + steps)
            )
            assert mode.prefill is not None and mode.prefill.tokens == prompt_len
            assert mode.reference_prefill is not None and mode.reference_prefill.calls == 1
            assert mode.latency_ms.calls == steps and mode.reference_latency_ms.calls == steps
            assert all(s.latency_ms_reference is None for s in mode.steps if s.phase == "prompt")
            seen |= set(mode.positions_by_graph)
    assert len(seen) == 6


def test_plans_take_the_largest_bucket_then_pad_or_split_and_never_shrink_the_cache(graph_set) -> None:
    _, primary, _ = graph_set
    with open_decoder(primary, remainder="padded") as padded, open_decoder(primary, remainder="buckets") as buckets:
        assert isinstance(padded, GraphSetDecoder) and isinstance(buckets, GraphSetDecoder)
        assert padded.plan(41) == [(16, 32, 16), (16, 32, 16), (16, 128, 9)]
        assert buckets.plan(41) == [(16, 32, 16), (16, 32, 16), (4, 128, 4), (4, 128, 4), (1, 128, 1)]
        assert padded.plan(6) == [(16, 32, 6)]
        assert buckets.plan(6) == [(4, 32, 4), (1, 32, 1), (1, 32, 1)]
        # a padded chunk's slots must fit: 16 slots from position 20 need the 128 cache
        assert padded.plan(5, position=20) == [(16, 128, 5)]
        assert padded.plan(1, position=127) == [(1, 128, 1)]


def test_prefill_logits_all_compares_every_prompt_position(tmp_path: Path) -> None:
    name = "llama_gqa_optimum"
    primary, _ = _write_set(name, tmp_path / "out", step_lens=[1, 4], max_cache_lens=[16, 64], prefill_logits="all")
    report = verify(fixture_entry(name)["model_path"], primary, prompt=_prompt(14), steps=10, remainder="padded")
    assert report.passed, [m.failures for m in report.modes.values()]
    for mode in report.modes.values():
        assert mode.positions == 14 + 10 and [s.position for s in mode.steps] == list(range(24))
        assert set(mode.positions_by_graph) == {"model.s4.c16.onnx", "model.s1.c16.onnx", "model.onnx"}


def test_a_pipeline_writes_reports_checks_and_verifies_the_set(tmp_path: Path) -> None:
    name = "mistral_sw_optimum"
    pipeline = {
        "model": str(fixture_entry(name)["model_path"]),
        "output_dir": str(tmp_path / "out"),
        "passes": [{"static_kv": {"step_lens": [1, 8], "max_cache_lens": [16, 48]}}],
        "verify": {"prompt": _prompt(11), "steps": 30},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    outcome = run_pipeline(load_pipeline(path))
    assert outcome.exit_code == 0, outcome.report.failures
    report = json.loads(outcome.report_json.read_text())
    assert [(g["file"], g["step_len"], g["max_cache_len"], g["role"]) for g in report["graphs"]] == [
        ("model.onnx", 1, 48, "decode"),
        ("model.s1.c16.onnx", 1, 16, "decode"),
        ("model.s8.c16.onnx", 8, 16, "prefill"),
        ("model.s8.c48.onnx", 8, 48, "prefill"),
    ]
    written = sorted(Path(f).name for f in report["output_files"])
    assert [f for f in written if f.endswith(".data")] == ["model.onnx.data"]
    assert not [f for f in report["findings"] if f["level"] == "error"]
    assert report["verify"]["graphs"] == [g["file"] for g in report["graphs"]]
    # 11 + 30 positions cross the 16-slot cache and pass the fixture's sliding window (8)
    assert set(report["verify"]["modes"]["free_running"]["positions_by_graph"]) == {
        "model.s8.c16.onnx",
        "model.s1.c16.onnx",
        "model.onnx",
    }
