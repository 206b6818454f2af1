"""``kv_layout`` and ``cache_write``: every layout, padded or not, every write, decodes like the original export.

Each case writes the static graph(s) like the pipeline does and runs :func:`onnxdeploy.runner.verify` against the
fixture's export: 6 prompt tokens + 32 steps on a one-graph decode (teacher-forced), and one graph set per layout
(step lengths 1 and 4, cache lengths 16 and 48: prefill buckets, padded remainders and the 16 -> 48 cache switch,
both modes). Tolerance: max abs logit diff <= 1e-5, top-1 100%.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from pydantic import ValidationError

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.contract import CACHE_WRITES, DecodeContract, read_contract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.grouped_attention import GroupedAttentionPass
from onnxdeploy.passes.kv_layout import KVLayoutConfig, KVLayoutPass
from onnxdeploy.passes.mask_rewrite import MaskRewritePass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import open_decoder, verify
from tests.conftest import PROMPT, fixture_entry

FIXTURES = ["llama_gqa_optimum", "llama_gqa_dynamo", "mistral_sw_optimum", "gpt2_optimum"]
LAYOUTS = ["BHSD", "BSH2D", "BHDS_K"]
STEPS = 32
TOLERANCE = 1e-5
WRITE_OPS = {"scatter_elements": "ScatterElements", "scatter_nd": "ScatterND", "where": "Where", "host": "Where"}


@cache
def _static(name: str, cache_write: str, graph_set: bool) -> ArtifactSet:
    """static_kv on the fixture (cached: the layout cases share it; kv_layout never edits its input)."""
    shape = {"step_lens": [1, 4], "max_cache_lens": [16, 48]} if graph_set else {"max_cache_len": 40}
    config = StaticKVConfig(cache_write=cache_write, **shape)
    return StaticKVCachePass(config)(load_model(fixture_entry(name)["model_path"]).model, make_pass_context()).artifacts


def _write(artifacts: ArtifactSet, folder: Path) -> Path:
    folder.mkdir(parents=True)
    staged = stage_artifacts(
        [(a.name, a.model) for a in artifacts.artifacts], folder, external=artifacts.external(), data_name="m.data"
    )
    staged.commit()
    return folder / "model.onnx"


def _assert_written_in_layout(model: ir.Model, contract: DecodeContract, cache_write: str) -> None:
    """Each past input goes straight (through a dtype Cast at most) into its write: no relayout of the buffer."""
    inputs = {str(v.name): v for v in model.graph.inputs}
    for past, shape in zip([p for p, _ in contract.cache_pairs()], contract.pair_input_shapes(), strict=True):
        value = inputs[past]
        assert tuple(value.shape) == shape
        readers = [use.node for use in value.uses()]
        if [n.op_type for n in readers] == ["Cast"]:
            readers = [use.node for use in readers[0].outputs[0].uses()]
        assert [n.op_type for n in readers] == [WRITE_OPS[cache_write]], (past, [n.op_type for n in readers])


def _cases() -> list[tuple[str, str, int | None, str]]:
    """fixture x layout x padding; the write cycles so every layout meets every write on some fixture."""
    cases = []
    for layout in LAYOUTS:
        combos = [(name, pad) for name in FIXTURES for pad in (None, 32)]
        for i, (name, pad) in enumerate(combos):
            cases.append((name, layout, pad, CACHE_WRITES[i % len(CACHE_WRITES)]))
    return cases


@pytest.mark.parametrize(("name", "layout", "pad", "cache_write"), _cases())
def test_every_layout_and_write_decodes_like_the_original(tmp_path, name, layout, pad, cache_write) -> None:
    result = KVLayoutPass(KVLayoutConfig(layout=layout, pad_head_dim_to=pad))(
        _static(name, cache_write, False), make_pass_context()
    )
    model = result.artifacts.primary
    contract = read_contract(model)
    assert contract is not None and contract.kv_layout == layout
    assert contract.head_dim_padded == (32 if pad else contract.head_dim)
    assert contract.cache_update == ("new_token_only" if cache_write == "host" else "full_buffer")
    assert contract.contract_version == (3 if layout == "BHDS_K" else 2)
    assert len(contract.cache_pairs()) == (1 if layout == "BSH2D" else 2) * contract.num_layers
    _assert_written_in_layout(model, contract, cache_write)
    path = _write(result.artifacts, tmp_path / "out")
    report = verify(
        fixture_entry(name)["model_path"],
        path,
        prompt=PROMPT,
        steps=STEPS,
        modes=["teacher_forced"],
        max_abs_logit_diff=TOLERANCE,
    )
    mode = report.modes["teacher_forced"]
    assert report.passed, mode.failures
    assert mode.positions == len(PROMPT) + STEPS
    assert mode.top1_agreement == 1.0 and mode.max_abs_logit_diff <= TOLERANCE


# one graph set per layout: buckets, padded remainders and the cache switch; BHDS_K after mask_rewrite and
# grouped_attention, whose K Transpose then reads the stored Kᵀ itself
SET_CASES = [("BHSD", 32, "scatter_nd", False), ("BSH2D", 32, "where", False), ("BHDS_K", 32, "where", True)]


@pytest.mark.parametrize(("layout", "pad", "cache_write", "attention_passes"), SET_CASES)
def test_graph_sets_in_every_layout_cross_buckets_and_cache_lengths(
    tmp_path, layout, pad, cache_write, attention_passes
) -> None:
    name = "llama_gqa_optimum"
    artifacts = _static(name, cache_write, True)
    if attention_passes:
        artifacts = GroupedAttentionPass()(
            MaskRewritePass()(artifacts, make_pass_context()).artifacts, make_pass_context()
        ).artifacts
    result = KVLayoutPass(KVLayoutConfig(layout=layout, pad_head_dim_to=pad))(artifacts, make_pass_context())
    assert len(result.artifacts.artifacts) == 4
    if attention_passes:
        assert all("0 reader(s) of K transpose it back" in line for line in result.report.changes[1::2])
    path = _write(result.artifacts, tmp_path / "out")
    prompt = np.random.default_rng(0).integers(1, 512, size=11).tolist()
    report = verify(fixture_entry(name)["model_path"], path, prompt=prompt, steps=STEPS, max_abs_logit_diff=TOLERANCE)
    assert report.passed, [m.failures for m in report.modes.values()]
    for mode in report.modes.values():
        assert mode.top1_agreement == 1.0 and mode.max_abs_logit_diff <= TOLERANCE
        # 11 + 32 positions: a 4-bucket prefill, the 16 -> 48 switch, decode on both cache lengths
        assert {"model.s4.c16.onnx", "model.s1.c16.onnx", "model.onnx"} <= set(mode.positions_by_graph)
    # bound buffers (past and present one host buffer) are exact in the new layout too; logits as with numpy feeds
    with open_decoder(path, bind_buffers=True) as bound, open_decoder(path) as fed:
        assert [(x is None, None if x is None else x.tolist()) for x, _ in bound.feed(prompt)] == [
            (x is None, None if x is None else x.tolist()) for x, _ in fed.feed(prompt)
        ]


def test_the_trained_fixture_packs_and_pads_to_64_bit_exactly(tmp_path) -> None:
    # head dim 32: padding to 64 doubles the cache's last axis. The trained weights give larger logits, where
    # static_kv itself moves them by ~1.1e-5 from the export (attention over the whole buffer sums in another
    # order); kv_layout adds nothing to that: its graph equals the BHSD static graph bit for bit.
    name = "llama_bytes_torchscript"
    static = _static(name, "where", False)
    result = KVLayoutPass(KVLayoutConfig(layout="BSH2D", pad_head_dim_to=64))(static, make_pass_context())
    contract = read_contract(result.artifacts.primary)
    assert contract is not None and contract.pair_input_shapes()[0] == (1, 40, 2, 128)
    eval_tokens = np.load(fixture_entry(name)["reference_path"])["eval_tokens"].ravel()[:6].tolist()
    report = verify(
        _write(static, tmp_path / "bhsd"),
        _write(result.artifacts, tmp_path / "bsh2d"),
        prompt=eval_tokens,
        steps=STEPS,
        modes=["teacher_forced"],
        max_abs_logit_diff=0.0,
    )
    assert report.passed, report.modes["teacher_forced"].failures
    assert report.modes["teacher_forced"].max_abs_logit_diff == 0.0


def test_kv_layout_chooses_its_own_write(tmp_path) -> None:
    # a ScatterElements static graph repacked with the host write: new_token_only, no Scatter left
    name = "llama_gqa_dynamo"
    result = KVLayoutPass(KVLayoutConfig(layout="BSH2D", cache_write="host"))(
        _static(name, "scatter_elements", False), make_pass_context()
    )
    contract = read_contract(result.artifacts.primary)
    assert contract is not None and contract.cache_update == "new_token_only"
    assert contract.pair_output_shapes() == [(1, 1, 2, 32)] * contract.num_layers
    _assert_written_in_layout(result.artifacts.primary, contract, "host")
    report = verify(
        fixture_entry(name)["model_path"],
        _write(result.artifacts, tmp_path / "out"),
        prompt=PROMPT,
        steps=STEPS,
        modes=["teacher_forced"],
        max_abs_logit_diff=TOLERANCE,
    )
    assert report.passed, report.modes["teacher_forced"].failures


def test_the_rk3588_target_defaults_to_the_select_write() -> None:
    model = load_model(fixture_entry("llama_gqa_optimum")["model_path"]).model
    result = StaticKVCachePass(StaticKVConfig(max_cache_len=16))(model, make_pass_context(target="rknn-rk3588"))
    ops = {n.op_type for n in result.artifacts.primary.graph}
    assert "ScatterElements" not in ops and {"Equal", "Where"} <= ops
    assert any("cache write: where (target rknn-rk3588 default)" in line for line in result.report.changes)


def test_cache_write_host_is_new_token_only() -> None:
    assert StaticKVConfig(max_cache_len=16, cache_write="host").cache_update == "new_token_only"
    with pytest.raises(ValidationError, match="cache_write host means cache_update new_token_only"):
        StaticKVConfig(max_cache_len=16, cache_write="host", cache_update="full_buffer")


def test_a_cache_inside_group_query_attention_is_refused() -> None:
    entry = fixture_entry("llama_gqa_genai")
    static = StaticKVCachePass(StaticKVConfig(max_cache_len=16))(
        load_model(entry["model_path"]).model, make_pass_context(model_path=entry["model_path"])
    )
    with pytest.raises(PreconditionError, match="inside com.microsoft::GroupQueryAttention .* only as BNSH"):
        KVLayoutPass(KVLayoutConfig(layout="BSH2D"))(static.artifacts, make_pass_context())


def test_a_bhds_k_contract_needs_version_3_and_gives_k_and_v_their_own_shapes() -> None:
    fields = {
        "batch": 1,
        "step_len": 1,
        "max_cache_len": 6,
        "num_layers": 1,
        "num_kv_heads": 2,
        "head_dim": 4,
        "head_dim_padded": 8,
        "kv_layout": "BHDS_K",
        "inputs": {"input_ids": "input_ids", "cache_position": "cache_position"},
        "cache": [{"layer": 0, "key_in": "k", "value_in": "v", "key_out": "k_out", "value_out": "v_out"}],
    }
    with pytest.raises(ValidationError, match="needs contract_version >= 3"):
        DecodeContract.model_validate({**fields, "contract_version": 2})
    contract = DecodeContract.model_validate({**fields, "contract_version": 3})
    assert contract.pair_input_shapes() == [(1, 2, 8, 6), (1, 2, 6, 8)]  # K (B, H, Dp, M), V (B, H, M, Dp)
    assert contract.pair_sequence_axes() == [3, 2]
    new_only = contract.model_copy(update={"cache_update": "new_token_only"})
    assert new_only.pair_output_shapes() == [(1, 2, 8, 1), (1, 2, 1, 8)]
    with pytest.raises(ValueError, match="use pair_input_shapes"):
        contract.cache_input_shape()
