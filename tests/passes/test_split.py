"""``split``: static graphs cut at layer boundaries into parts, decoded as a chain against the original export.

Every committed fixture ONNX Runtime runs is cut into 2 parts after ``static_kv`` + ``mask_rewrite`` and must
decode as the export does (the fixtures have 2 layers; the trained 4-layer one is cut into 2 and 3); a graph set
of split graphs is driven as a set through its buckets and cache lengths; bad configs exit 2 before any pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import yaml
from rich.console import Console

from onnxdeploy.config import load_pipeline
from onnxdeploy.console_report import passes_table
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.mask_rewrite import MaskRewritePass
from onnxdeploy.passes.split import SplitConfig, SplitPass, share_layers
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner import open_decoder, verify
from onnxdeploy.runner.graph_set import GraphSetDecoder
from onnxdeploy.runner.host import StepInputs, allocate_buffers
from onnxdeploy.runner.parts import PartChain
from tests.conftest import ALL_FIXTURE_NAMES, BF16_FIXTURE_NAMES, REPO, fixture_entry, fixture_expectations

SPLIT_FIXTURES = [n for n in [*ALL_FIXTURE_NAMES, *BF16_FIXTURE_NAMES] if n != "llama_gqa_genai"]
"""genai's layers exchange two tensors (SkipSimplifiedLayerNormalization's sum and norm): refused, tested below.
bfloat16 is verified on its float32 shadow (every part shadowed: runner/numerics.py)."""


def _prompt(name: str, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, fixture_entry(name)["config"]["vocab"], size=n).tolist()


def _split(name: str, folder: Path, split: dict, **static) -> tuple[Path, dict]:
    """static_kv + mask_rewrite + split on the fixture, written as the pipeline writes; (primary path, report)."""
    artifacts = StaticKVCachePass(StaticKVConfig(**static))(
        load_model(fixture_entry(name)["model_path"]).model, make_pass_context()
    ).artifacts
    artifacts = MaskRewritePass()(artifacts, make_pass_context()).artifacts
    result = SplitPass(SplitConfig(**split))(artifacts, make_pass_context())
    folder.mkdir(parents=True)
    staged = stage_artifacts(
        [(a.name, a.model) for a in result.artifacts.artifacts], folder, external=True, data_name="model.onnx.data"
    )
    staged.commit()
    return folder / "model.onnx", result.report.details


@pytest.mark.parametrize("name", SPLIT_FIXTURES)
def test_a_model_split_in_two_decodes_as_the_export(name: str, tmp_path: Path) -> None:
    primary, details = _split(name, tmp_path / "out", {"parts": 2}, max_cache_len=24)
    assert sorted(p.name for p in primary.parent.iterdir()) == ["model.onnx", "model.onnx.data", "model.part1.onnx"]
    first = read_contract(onnx.load(str(primary), load_external_data=False))
    last = read_contract(onnx.load(str(primary.with_name("model.part1.onnx")), load_external_data=False))
    assert first is not None and last is not None
    layers = fixture_expectations(name).layers
    cut = first.parts[1].first_layer
    assert first.contract_version == 5 and [(e.file, e.first_layer, e.num_layers) for e in first.parts] == [
        ("model.onnx", 0, cut),
        ("model.part1.onnx", cut, layers - cut),
    ]
    hidden = f"hidden_states.{cut}"
    assert (first.part.hidden_in, first.part.hidden_out, first.logits) == (None, hidden, None)
    assert (last.part.hidden_in, last.part.hidden_out, last.logits) == (hidden, None, "logits")
    assert last.inputs.input_ids is None and [e.layer for e in last.cache] == list(range(cut, layers))
    assert [p["num_layers"] for p in details["parts"]] == [cut, layers - cut]
    if not fixture_expectations(name).bf16:  # ORT's CPU EP has no bfloat16 kernels: verify shadows it
        with open_decoder(primary) as decoder:
            assert isinstance(decoder, PartChain)
    tol = fixture_expectations(name).tol(1e-4)
    original = fixture_entry(name)["model_path"]
    report = verify(original, primary, prompt=_prompt(name, 6), steps=14, max_abs_logit_diff=tol)
    assert report.passed, report.failures
    assert all(m.top1_agreement == 1.0 for m in report.modes.values())


@pytest.mark.parametrize("parts", [2, 3])
def test_the_trained_model_split_in_two_and_three_parts_decodes_as_the_export(parts: int, tmp_path: Path) -> None:
    name = "llama_bytes_torchscript"
    primary, details = _split(name, tmp_path / "out", {"parts": parts}, max_cache_len=48)
    assert len(details["parts"]) == parts
    assert sum(p["num_layers"] for p in details["parts"]) == 4
    assert sorted(p.name for p in primary.parent.glob("*.onnx")) == sorted(
        ["model.onnx", *(f"model.part{i}.onnx" for i in range(1, parts))]
    )
    report = verify(fixture_entry(name)["model_path"], primary, prompt=_prompt(name, 8), steps=30)
    assert report.passed, report.failures
    assert all(m.top1_agreement == 1.0 for m in report.modes.values())  # logits ~20 here: |diff| 1e-5 is rounding


def test_max_part_bytes_takes_the_fewest_parts_that_fit() -> None:
    layers = [{1: 100, 2: 50}, {3: 100}, {4: 100}, {5: 100, 2: 50}]  # tensor 2 read by the first and last layer
    assert share_layers(layers, parts=None, max_bytes=250) == [0, 2]
    assert share_layers(layers, parts=None, max_bytes=150) == [0, 1, 2, 3]
    assert share_layers(layers, parts=2, max_bytes=None) == [0, 2]
    assert share_layers(layers, parts=3, max_bytes=None) in ([0, 1, 3], [0, 2, 3], [0, 1, 2])
    with pytest.raises(ConfigError, match="layer 0's weights alone are 150 bytes"):
        share_layers(layers, parts=None, max_bytes=120)


def test_a_split_graph_set_is_driven_as_a_set(tmp_path: Path) -> None:
    name = "mistral_sw_optimum"  # sliding window 8: the decode passes it and the 16 -> 48 cache switch
    primary, _ = _split(name, tmp_path / "out", {"parts": 2}, step_lens=[1, 4], max_cache_lens=[16, 48])
    assert len(list(primary.parent.glob("*.onnx"))) == 8  # 4 graphs x 2 parts, one weights file
    with open_decoder(primary) as decoder:
        assert isinstance(decoder, GraphSetDecoder)
    report = verify(fixture_entry(name)["model_path"], primary, prompt=_prompt(name, 11), steps=30)
    assert report.passed, report.failures
    assert set(report.graphs_driven) == {"model.onnx", "model.s1.c16.onnx", "model.s4.c16.onnx", "model.s4.c48.onnx"}


def test_a_graph_whose_layers_exchange_two_tensors_is_refused_naming_the_boundary(tmp_path: Path) -> None:
    with pytest.raises(PreconditionError, match="no single tensor separates layer 0 from layer 1"):
        _split("llama_gqa_genai", tmp_path / "out", {"parts": 2}, max_cache_len=16)


def _pipeline(tmp_path: Path, passes: list) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
                "output_dir": str(tmp_path / "out"),
                "passes": passes,
                "verify": {"prompt": [1, 2, 3], "steps": 4},
            }
        )
    )
    return path


def test_more_parts_than_layers_exits_2_before_any_pass(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, [{"static_kv": {"max_cache_len": 16}}, {"split": {"parts": 3}}])
    with pytest.raises(ConfigError, match="parts=3 is more than the model's 2 decoder layers") as err:
        run_pipeline(load_pipeline(path))
    assert err.value.exit_code == 2
    assert not (tmp_path / "out").exists()


def test_a_cache_pass_after_split_is_refused_before_any_pass(tmp_path: Path) -> None:
    passes = [{"static_kv": {"max_cache_len": 16}}, {"split": {"parts": 2}}, {"kv_layout": {"layout": "BSH2D"}}]
    with pytest.raises(ConfigError, match="move kv_layout before split"):
        load_pipeline(_pipeline(tmp_path, passes))
    with pytest.raises(ConfigError, match="exactly one of parts and max_part_bytes"):
        load_pipeline(_pipeline(tmp_path, [{"static_kv": {"max_cache_len": 16}}, {"split": {}}]))


def test_per_part_weights_files_are_written_checked_and_verified(tmp_path: Path) -> None:
    name = "gpt2_optimum"
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(fixture_entry(name)["model_path"]),
                "output_dir": str(tmp_path / "out"),
                "target": "ort-cpu",
                "passes": [
                    {"static_kv": {"step_lens": [1, 4], "max_cache_len": 32}},
                    {"mask_rewrite": {}},
                    {"split": {"parts": 2, "weights": "per_part"}},
                ],
                "verify": {"prompt": _prompt(name, 7), "steps": 20},
            }
        )
    )
    outcome = run_pipeline(load_pipeline(path))
    assert outcome.exit_code == 0, outcome.report.failures
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("*.data")) == ["model.part0.data", "model.part1.data"]
    for graph, data in [("model.onnx", "model.part0.data"), ("model.s4.c32.part1.onnx", "model.part1.data")]:
        header = onnx.load(str(out / graph), load_external_data=False)
        assert {kv.value for t in header.graph.initializer for kv in t.external_data if kv.key == "location"} == {data}
    report = json.loads(outcome.report_json.read_text())
    # per graph: its part, what it outputs (part 0 the hidden state, the last part the logits), its weights file
    assert [(g["file"], g["part"], g["output"], g["weights_file"]) for g in report["graphs"]] == [
        ("model.onnx", 0, "hidden_state", "model.part0.data"),
        ("model.part1.onnx", 1, "logits", "model.part1.data"),
        ("model.s4.c32.onnx", 0, "hidden_state", "model.part0.data"),
        ("model.s4.c32.part1.onnx", 1, "logits", "model.part1.data"),
    ]
    cut = report["graphs"][0]["output_name"]
    assert cut.startswith("hidden_states.") and report["graphs"][1]["output_name"] == "logits"
    md = outcome.report_md.read_text()
    assert "## Graphs (2 weights files)" in md and f"| `model.onnx` | decode | 0 | 1 | 32 | hidden state {cut} |" in md
    assert "| `model.s4.c32.part1.onnx` | prefill | 1 | 4 | 32 | logits (last) | `model.part1.data` |" in md
    html = outcome.report_html.read_text()
    assert "Graphs (2 weights files)" in html and f"hidden state {cut}" in html
    # split's decode-graph diff is what part 1 took, not ops the pass deleted
    split = next(p for p in outcome.report.passes if p.name == "split")
    assert split.ops_removed and "| moved to part 1: " in md and "moved to part 1: " in html
    console = Console(record=True, width=400)
    console.print(passes_table(outcome.report.passes))
    row = next(line for line in console.export_text().splitlines() if line.startswith("│ split"))
    assert "moved to part 1: " in row and "-" not in row.split("moved to part 1: ")[1].split("│")[0]


def test_a_tensor_two_parts_read_is_stored_in_both_part_files(tmp_path: Path) -> None:
    """The writer half of ``weights: per_part``: a tied embedding/LM head is in each file that needs it."""
    primary, _ = _split("llama_gqa_optimum", tmp_path / "a", {"parts": 2}, max_cache_len=16)
    first = load_model(primary).model
    last = load_model(primary.with_name("model.part1.onnx")).model
    tied = first.graph.initializers["model.embed_tokens.weight"]
    last.graph.initializers["model.embed_tokens.weight"] = ir.Value(
        name="model.embed_tokens.weight", shape=tied.shape, type=tied.type, const_value=tied.const_value
    )  # the same tensor object in both graphs, as a tied embedding/LM head is
    out = tmp_path / "b"
    out.mkdir()
    names = {"model.onnx": "model.part0.data", "model.part1.onnx": "model.part1.data"}
    stage_artifacts(
        [("model.onnx", first), ("model.part1.onnx", last)], out, external=True, data_name="x", data_names=names
    ).commit()
    for graph, data in names.items():
        header = onnx.load(str(out / graph), load_external_data=False)
        where = {t.name: kv.value for t in header.graph.initializer for kv in t.external_data if kv.key == "location"}
        assert where["model.embed_tokens.weight"] == data and set(where.values()) == {data}
        assert onnx.load(str(out / graph)).graph.initializer  # every reference resolves in its own file


def test_the_mixed_layer_model_with_ring_caches_split_in_three_decodes_as_the_export(tmp_path: Path) -> None:
    mixed = REPO / "fixtures" / "gemma3_mixed" / "optimum" / "model.onnx"  # 6 layers: 5 local window 16, 1 global
    artifacts = StaticKVCachePass(StaticKVConfig(max_cache_len=64, window_cache=True))(
        load_model(mixed).model, make_pass_context()
    ).artifacts
    artifacts = MaskRewritePass()(artifacts, make_pass_context()).artifacts
    result = SplitPass(SplitConfig(parts=3))(artifacts, make_pass_context())
    assert [p["num_layers"] for p in result.report.details["parts"]] == [2, 2, 2]
    folder = tmp_path / "out"
    folder.mkdir()
    stage_artifacts(
        [(a.name, a.model) for a in result.artifacts.artifacts], folder, external=True, data_name="model.onnx.data"
    ).commit()
    last = read_contract(onnx.load(str(folder / "model.part2.onnx"), load_external_data=False))
    assert last is not None and [(e.layer, e.slot_mapping) for e in last.cache] == [(4, "ring"), (5, "position")]
    report = verify(mixed, folder / "model.onnx", prompt=_prompt("llama_gqa_optimum", 11), steps=40)
    assert report.passed, report.failures


def test_a_host_drives_a_split_member_through_the_host_api(tmp_path: Path) -> None:
    """``GraphSetDecoder.member`` of a split set is a chain a host calls on its own buffers, as any graph."""
    name = "llama_gqa_optimum"
    primary, _ = _split(name, tmp_path / "out", {"parts": 2}, step_lens=[1, 4], max_cache_lens=[16, 32])
    tokens = _prompt(name, 9)
    with open_decoder(primary) as decoder:
        assert isinstance(decoder, GraphSetDecoder)
        want = [x for x, _ in decoder.feed(tokens)]
        member = decoder.member(1, 32)
        assert isinstance(member, PartChain) and member.contract.num_layers == 2
        buffers = allocate_buffers(member.contract)  # every layer's buffers: the host owns them
        got = [member.call(buffers, StepInputs.uniform(member.contract, [t], p))[0][0, 0] for p, t in enumerate(tokens)]
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True) if b is not None) < 1e-5
