"""grouped_attention on the real exports: no copy of the cache into attention, and the same decode on ORT."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy import model_io
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes._cache_reads import cache_buffers, find_cache_reads, head_repeats
from onnxdeploy.passes.grouped_attention import GroupedAttentionConfig, GroupedAttentionPass
from onnxdeploy.passes.mask_rewrite import MaskRewriteConfig, MaskRewritePass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import verify
from tests.conftest import FIXTURE_NAMES, fixture_entry

PROMPT8 = [1, 17, 42, 99, 7, 3, 5, 8]
STEPS = 64
L = 128


def _static(name: str, **cfg) -> ir.Model:
    model = model_io.load_model(fixture_entry(name)["model_path"]).model
    return StaticKVCachePass(StaticKVConfig(**cfg))(model, make_pass_context()).artifacts.primary


def _assert_same_outputs(static: ir.Model, grouped: ir.Model, tokens: list[int], start: int, tmp_path) -> None:
    """Run both graphs on ORT at positions ``start ..`` over a random cache of 32 slots; outputs within 1e-5."""
    contract = read_contract(static)
    positions = np.arange(start, start + len(tokens), dtype=np.int64)
    feeds = {
        "input_ids": np.array([tokens], np.int64),
        "cache_position": positions,
        "position_ids": positions[None],
        "attention_mask": (np.arange(32) <= positions[-1]).astype(np.int64)[None],
    }
    rng = np.random.default_rng(0)
    for past, _ in contract.cache_pairs():
        feeds[past] = rng.standard_normal(contract.cache_input_shape()).astype(np.float32)
    outs = []
    for model, folder in ((static, tmp_path / "static"), (grouped, tmp_path / "grouped")):
        folder.mkdir()
        session = ort.InferenceSession(str(model_io.write_for_ort(model, folder)), providers=["CPUExecutionProvider"])
        names = {i.name for i in session.get_inputs()}
        outs.append(session.run(None, {k: v for k, v in feeds.items() if k in names}))
    for want, got in zip(*outs, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _cache_sized_copies(model: ir.Model, heads: int) -> list[str]:
    """Node outputs of at least ``max_cache_len × H_q × D`` elements that are not a cache buffer.

    A K buffer transposed straight into a MatMul is allowed: ONNX Runtime fuses it into FusedMatMul(transB=1)
    (and with H_q = H_kv it is the buffer's own size, so any rewrite would have to keep a read of that size).
    """
    contract = read_contract(model)
    limit = contract.max_cache_len * heads * contract.head_dim
    buffers = cache_buffers(model)
    found = []
    for node in model.graph:
        if node.op_type == "Transpose" and node.inputs[0] in buffers:
            if {u.node.op_type for u in node.outputs[0].uses()} == {"MatMul"}:
                continue
        for out in node.outputs:
            shape = out.shape
            if out in buffers or shape is None or not all(isinstance(d, int) for d in shape):
                continue
            if math.prod(shape) >= limit:
                found.append(f"{node.op_type} '{node.name}' -> {list(shape)}")
    return found


# dynamo23: the head repeat feeds opset-23 Attention; grouped_attention splits the op itself (no mask_rewrite first).
# fp16: attention computes in float32, the repeated V is cast up (Cast after the repeat): the Cast moves onto the
# buffer (H_kv heads), K stays float16.
@pytest.mark.parametrize("name", [*FIXTURE_NAMES, "llama_gqa_dynamo23", "llama_gqa_fp16"])
def test_grouped_attention_removes_the_head_repeat_and_decodes_the_same(tmp_path, name):
    entry = fixture_entry(name)
    tolerance = entry["expect"].tol(1e-4)
    heads = entry["config"]["heads"]
    static = _static(name, max_cache_len=L)
    assert _cache_sized_copies(static, heads), "the exporter's attention should copy the cache before the rewrite"

    result = GroupedAttentionPass()(static, make_pass_context())
    grouped = result.artifacts.primary
    layers = entry["config"]["layers"]
    assert result.modified and result.report.warnings == []
    split = [c for c in result.report.changes if "Attention node" in c and "decomposed" in c]
    assert len(split) == entry["expect"].attention_ops
    assert "Attention" not in {n.op_type for n in grouped.graph}
    rewritten = len(result.report.changes) - len(split)
    assert rewritten == (2 * layers if entry["config"]["kv_heads"] < heads else layers)

    assert _cache_sized_copies(grouped, heads) == []
    assert head_repeats(grouped) == []
    reads = find_cache_reads(grouped)
    assert len(reads) == 2 * layers
    want = {("Transpose",), ("Cast",)} if entry["expect"].fp16 else {("Transpose",), ()}
    assert {tuple(n.op_type for n in r.nodes) for r in reads} == want
    assert {r.form for r in reads} == {"key", "value"}  # K and V both read the buffer
    assert all(not r.scales for r in reads)
    assert read_contract(grouped) == read_contract(static)
    assert [v.name for v in grouped.graph.inputs] == [v.name for v in static.graph.inputs]
    assert [v.name for v in grouped.graph.outputs] == [v.name for v in static.graph.outputs]

    path = model_io.write_for_ort(grouped, tmp_path)
    res = verify(str(entry["model_path"]), path, prompt=PROMPT8, steps=STEPS, max_abs_logit_diff=tolerance)
    for mode in res.modes.values():
        assert mode.positions == len(PROMPT8) + STEPS
        assert mode.top1_agreement == 1.0, mode.failures
        assert mode.max_abs_logit_diff <= tolerance, mode.failures
    assert res.passed


def test_grouped_attention_on_a_prefill_graph_matches_the_static_graph(tmp_path):
    """S = 4 query positions per head: the (G, S) order of the grouped Q must match the scores' (H_q, S)."""
    static = _static("llama_gqa_optimum", step_len=4, max_cache_len=32, prefill_logits="all")
    grouped = GroupedAttentionPass()(static, make_pass_context()).artifacts.primary
    assert head_repeats(grouped) == [] and head_repeats(static)
    _assert_same_outputs(static, grouped, [5, 9, 11, 2], 6, tmp_path)


def test_a_head_repeat_left_unrewritten_is_named_in_a_warning():
    """A repeat the rewrite cannot take (its copy is also a graph output, so no MatMul chain reaches the buffer)."""
    static = _static("llama_gqa_optimum", max_cache_len=32)
    value_read = next(r for r in find_cache_reads(static) if r.form == "value")
    repeat = next(n for n in value_read.nodes if n.op_type == "Expand")
    static.graph.outputs.append(repeat.outputs[0])  # read by a graph output too: not attention's alone
    result = GroupedAttentionPass()(static, make_pass_context())
    assert [n.name for n in head_repeats(result.artifacts.primary)] == [repeat.name]
    assert [w for w in result.report.warnings if f"Expand '{repeat.name}'" in w], result.report.warnings
    assert len(result.report.changes) == 3  # the other V read and both K reads are rewritten


def test_grouped_attention_requires_a_static_graph():
    model = model_io.load_model(fixture_entry("llama_gqa_optimum")["model_path"]).model
    with pytest.raises(PreconditionError, match="run static_kv before grouped_attention"):
        GroupedAttentionPass()(model, make_pass_context())


def test_grouped_attention_then_mask_rewrite_on_opset_23_attention_decodes_the_same(tmp_path):
    """Either order works: after grouped_attention split Attention-23, mask_rewrite finds its Softmax and mask."""
    entry = fixture_entry("llama_gqa_dynamo23")
    grouped = GroupedAttentionPass()(_static("llama_gqa_dynamo23", max_cache_len=L), make_pass_context()).artifacts
    masked = MaskRewritePass(MaskRewriteConfig())(grouped, make_pass_context())
    assert not [c for c in masked.report.changes if "decomposed" in c]  # split once, by grouped_attention
    model = masked.artifacts.primary
    assert head_repeats(model) == [] and "attention_mask" not in {v.name for v in model.graph.inputs}
    path = model_io.write_for_ort(model, tmp_path)
    res = verify(str(entry["model_path"]), path, prompt=PROMPT8, steps=24, max_abs_logit_diff=1e-4)
    assert res.passed, [m.failures for m in res.modes.values()]
    assert all(m.top1_agreement == 1.0 and m.positions == len(PROMPT8) + 24 for m in res.modes.values())


@pytest.mark.parametrize("max_rank", [4, 5])
def test_grouped_attention_rank_of_the_one_token_products(tmp_path, max_rank):
    """Rank 5 leads with the query groups (G, B, H_kv, 1, ·) and reads the buffer broadcast; rank 4 folds G·S."""
    static = _static("llama_gqa_optimum", max_cache_len=32)
    result = GroupedAttentionPass(GroupedAttentionConfig(max_rank=max_rank))(static, make_pass_context())
    grouped = result.artifacts.primary
    added = [n for n in grouped.graph if (n.name or "").startswith("onnxdeploy/grouped_attention/")]
    ranks = {len(v.shape) for n in added for v in n.outputs if v.shape is not None}
    assert max(ranks) == max_rank
    assert all(("buffer broadcast" in line) == (max_rank == 5) for line in result.report.changes)
    _assert_same_outputs(static, grouped, [5], 9, tmp_path)
