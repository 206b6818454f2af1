"""Graph sets (``static_kv {step_lens, max_cache_lens}`` + ``mask_rewrite``) driven by the runner against the
original export.

One set per committed fixture (bfloat16 included: the runner verifies it on its float32 shadow), built once per
session: step lengths 1, 4, 16 and cache lengths 32, 128 (six graphs, one weights file). Two prompts and
remainder policies are chosen so that every graph computes compared positions and the decode crosses bucket
boundaries and the 32 → 128 cache switch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.contract import read_contract, write_contract
from onnxdeploy.graph import tensor_dims
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.mask_rewrite import MaskRewritePass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner import open_decoder, verify
from onnxdeploy.runner.accuracy import DEFAULT_ENTRIES, WEIGHT_ONLY_ENTRIES, evaluate_accuracy, teacher_forced_logits
from onnxdeploy.runner.decoder import make_decoder
from onnxdeploy.runner.graph_set import GraphSetDecoder
from onnxdeploy.runner.session import open_session
from tests.conftest import ALL_FIXTURE_NAMES, BF16_FIXTURE_NAMES, fixture_entry

SET_FIXTURES = [*ALL_FIXTURE_NAMES, *BF16_FIXTURE_NAMES]
STEP_LENS = [1, 4, 16]
CACHE_LENS = [32, 128]
BuiltSet = tuple[str, Path, int]
"""(fixture name, primary graph path, bytes of the unique weights)."""


def _prompt(name: str, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, fixture_entry(name)["config"]["vocab"], size=n).tolist()


def _write_set(name: str, folder: Path, **config) -> tuple[Path, int]:
    """Run static_kv then mask_rewrite on the fixture and write the set like the pipeline does.

    Returns:
        The primary graph's path and the bytes of the unique weights.
    """
    result = StaticKVCachePass(StaticKVConfig(**config))(
        load_model(fixture_entry(name)["model_path"]).model, make_pass_context()
    )
    artifacts = MaskRewritePass()(result.artifacts, make_pass_context()).artifacts
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


@pytest.fixture(scope="session")
def build_set(tmp_path_factory) -> Callable[[str], BuiltSet]:
    """Builds a fixture's set (STEP_LENS × CACHE_LENS, static_kv + mask_rewrite) once per session."""
    built: dict[str, BuiltSet] = {}

    def build(name: str) -> BuiltSet:
        if name not in built:
            folder = tmp_path_factory.mktemp(name) / "out"
            primary, unique = _write_set(name, folder, step_lens=STEP_LENS, max_cache_lens=CACHE_LENS)
            built[name] = (name, primary, unique)
        return built[name]

    return build


@pytest.fixture(params=SET_FIXTURES)
def graph_set(request, build_set) -> BuiltSet:
    return build_set(request.param)


def test_the_set_shares_one_weights_file_and_every_graph_is_static_and_maskless(graph_set) -> None:
    name, primary, unique = graph_set
    expect = fixture_entry(name)["expect"]
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
    vocab = fixture_entry(name)["config"]["vocab"]
    for entry in contract.graph_set:  # every graph opens by path: the verify test below runs all six
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
        # mask_rewrite: no attention_mask, no dynamic dim on the I/O, no mask or shape arithmetic left
        assert own.mask == "cache_position" and own.inputs.attention_mask is None
        assert "attention_mask" not in {i.name for i in header.graph.input}
        dims = {v.name: tensor_dims(v) for v in [*header.graph.input, *header.graph.output]}
        assert all(d is not None and all(isinstance(x, int) for x in d) for d in dims.values()), dims
        assert dims[own.logits] == [1, 1, vocab]
        assert not {"Shape", "Range", "Trilu", "NonZero", "IsNaN"} & {n.op_type for n in header.graph.node}
        assert own.kv_dtype == expect.dtype_name
    if expect.bf16:  # the select's fill is the lowest finite value of the scores' dtype, never -inf
        fills = [
            onnx.numpy_helper.to_array(t)
            for t in onnx.load(str(primary)).graph.initializer
            if t.name.startswith("onnxdeploy/mask_rewrite/lowest")
        ]
        assert fills and all(f.dtype == ml_dtypes.bfloat16 for f in fills), [f.dtype for f in fills]
        assert all(float(f) == float(ml_dtypes.finfo(ml_dtypes.bfloat16).min) for f in fills)


# (prompt length, steps, remainder policy) -> graphs that compute compared positions; together they cover all six.
# 22 = 16 + 4 + 1 + 1 in the 32 cache, then 12 steps from position 22 cross into the 128 one; 50 = 16 + 16 (32
# cache) + 16 + a 4-bucket padded from 2 real tokens (128 cache).
RUNS = [
    (22, 12, "buckets", {"model.s16.c32.onnx", "model.s4.c32.onnx", "model.s1.c32.onnx", "model.onnx"}),
    (50, 4, "padded", {"model.s16.c32.onnx", "model.s16.c128.onnx", "model.s4.c128.onnx", "model.onnx"}),
]


def test_every_graph_of_the_set_matches_the_original_across_buckets_and_cache_switches(graph_set) -> None:
    name, primary, _ = graph_set
    expect = fixture_entry(name)["expect"]
    tolerance = expect.tol(1e-4)
    # a bfloat16 pair runs as float32 shadows: whatever bfloat16 allows, the rewrite itself must be float32-exact
    measured = 1e-4 if expect.bf16 else tolerance
    seen: set[str] = set()
    for prompt_len, steps, remainder, graphs in RUNS:
        prompt = _prompt(name, prompt_len)
        report = verify(
            fixture_entry(name)["model_path"],
            primary,
            prompt=prompt,
            steps=steps,
            remainder=remainder,
            max_abs_logit_diff=tolerance,
        )
        assert report.passed, (report.failures, [m.failures for m in report.modes.values()])
        assert len(report.graphs) == 6
        assert report.numerics is not None  # fp16/bf16 on the CPU EP: emulated, never native
        assert (report.numerics.compute_dtype, report.numerics.execution) == (
            expect.dtype_name,
            "emulated" if expect.fp16 or expect.bf16 else "native",
        )
        for mode in report.modes.values():
            assert mode.top1_agreement == 1.0 and mode.max_abs_logit_diff <= measured, mode.failures
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


def test_plans_take_the_largest_bucket_then_pad_or_split_and_never_shrink_the_cache(build_set) -> None:
    _, primary, _ = build_set("llama_gqa_optimum")  # plans depend on the set's lengths only
    with open_decoder(primary, remainder="padded") as padded, open_decoder(primary, remainder="buckets") as buckets:
        assert isinstance(padded, GraphSetDecoder) and isinstance(buckets, GraphSetDecoder)
        assert padded.plan(41) == [(16, 32, 16), (16, 32, 16), (16, 128, 9)]
        assert buckets.plan(41) == [(16, 32, 16), (16, 32, 16), (4, 128, 4), (4, 128, 4), (1, 128, 1)]
        assert padded.plan(6) == [(16, 32, 6)]
        assert buckets.plan(6) == [(4, 32, 4), (1, 32, 1), (1, 32, 1)]
        # a padded chunk's slots must fit: 16 slots from position 20 need the 128 cache
        assert padded.plan(5, position=20) == [(16, 128, 5)]
        assert padded.plan(1, position=127) == [(1, 128, 1)]


# every prompt position's logits: the plain LM head (optimum) and genai's (after its fused norm, cache in the op)
@pytest.mark.parametrize("name", ["llama_gqa_optimum", "llama_gqa_genai"])
def test_prefill_logits_all_compares_every_prompt_position(tmp_path: Path, name: str) -> None:
    primary, _ = _write_set(name, tmp_path / "out", step_lens=[1, 4], max_cache_lens=[16, 64], prefill_logits="all")
    tolerance = fixture_entry(name)["expect"].tol(1e-4)
    report = verify(
        fixture_entry(name)["model_path"],
        primary,
        prompt=_prompt(name, 14),
        steps=10,
        remainder="padded",
        max_abs_logit_diff=tolerance,
    )
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
        "verify": {"prompt": _prompt(name, 11), "steps": 30},
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


# -- graph-set bugs of issue 14: accuracy, session options, graphs verification did not drive ----------------------

SMALL_SET = {"step_lens": [1, 4], "max_cache_lens": [32, 64]}
"""model.onnx (1, 64), model.s1.c32.onnx, model.s4.c32.onnx, model.s4.c64.onnx; buckets return the last logits."""


@pytest.fixture(scope="module")
def small_set(tmp_path_factory) -> Path:
    primary, _ = _write_set("llama_gqa_optimum", tmp_path_factory.mktemp("small") / "out", **SMALL_SET)
    return primary


def test_accuracy_on_a_set_whose_buckets_return_the_last_logits_compares_every_position(small_set: Path) -> None:
    original = fixture_entry("llama_gqa_optimum")["model_path"]
    tokens = _prompt("llama_gqa_optimum", 40)  # crosses the 32-slot cache into the 64 one
    got = teacher_forced_logits(small_set, tokens)
    want = teacher_forced_logits(original, tokens)
    assert got.shape == want.shape == (40, fixture_entry("llama_gqa_optimum")["config"]["vocab"])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    report = evaluate_accuracy(original, small_set, tokens, max_mean_kl=1e-6, min_top1_agreement=1.0)
    assert report.passed, report.failures
    for figures in (report.weight_only, report.default_optimized):
        assert figures.positions == 39 and figures.top1_agreement == 1.0 and figures.mean_kl < 1e-6


def test_every_graph_of_a_set_opens_with_the_session_config_entries_asked_for(small_set: Path) -> None:
    """verify.accuracy's default_optimized (prepacking on) and weight_only (fp32 fusion) differ in every graph."""
    for entries in (WEIGHT_ONLY_ENTRIES, DEFAULT_ENTRIES):
        with make_decoder(open_session(small_set, config_entries=entries)) as decoder:
            assert isinstance(decoder, GraphSetDecoder) and len(decoder.sessions()) == 4
            for session in decoder.sessions():
                options = session.session.get_session_options()
                for name, value in entries.items():
                    assert options.get_session_config_entry(name) == value, (session.path, name)
                assert session.config_entries == entries


def test_verify_drives_every_graph_of_the_set_and_says_which(small_set: Path) -> None:
    # 3 + 3 positions: the modes use the padded 4-bucket and the step-1 graph of the 32 cache only
    report = verify(
        fixture_entry("llama_gqa_optimum")["model_path"], small_set, prompt=_prompt("llama_gqa_optimum", 3), steps=3
    )
    assert report.passed, (report.failures, [m.failures for m in report.modes.values()])
    for mode in report.modes.values():
        assert set(mode.positions_by_graph) == {"model.s4.c32.onnx", "model.s1.c32.onnx"}
    assert set(report.graphs_driven) == set(report.graphs) and len(report.graphs) == 4
    assert all(calls > 0 for calls in report.graphs_driven.values()), report.graphs_driven
    assert set(report.graphs_driven_apart) == {"model.onnx", "model.s4.c64.onnx"}


def test_verify_fails_naming_a_graph_of_the_set_it_could_not_drive(tmp_path: Path) -> None:
    primary, _ = _write_set("llama_gqa_optimum", tmp_path / "out", **SMALL_SET)
    for bucket in ("model.s4.c32.onnx", "model.s4.c64.onnx"):  # buckets that take only whole chunks
        header = onnx.load(str(primary.parent / bucket), load_external_data=False)
        contract = read_contract(header)
        assert contract is not None
        write_contract(header, contract.model_copy(update={"padding": None}))
        onnx.save(header, str(primary.parent / bucket))
    report = verify(
        fixture_entry("llama_gqa_optimum")["model_path"], primary, prompt=_prompt("llama_gqa_optimum", 2), steps=1
    )
    assert not report.passed
    assert all(mode.passed for mode in report.modes.values())  # what was compared matched: the gap fails it
    assert report.graphs_driven["model.s4.c32.onnx"] == report.graphs_driven["model.s4.c64.onnx"] == 0
    missed = [line for line in report.failures if "was not driven" in line]
    assert len(missed) == 2 and "model.s4.c32.onnx" in missed[0] and "model.s4.c64.onnx" in missed[1], missed
    assert report.graphs_driven["model.onnx"] == 1 and report.graphs_driven_apart == ["model.onnx"]
