"""``onnxdeploy plan``: the sizing arithmetic against figures computed by hand for two configurations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onnxdeploy.cli import app
from onnxdeploy.errors import ConfigError
from onnxdeploy.plan import HOST_BASELINE_BYTES, make_plan, model_facts, pipeline_snippet, read_prompt_lengths
from onnxdeploy.plan_cli import parse_bytes
from tests.conftest import fixture_entry

MiB = 2**20


def test_llama_fixture_memory_bound_plan_by_hand() -> None:
    facts = model_facts(fixture_entry("llama_gqa_optimum")["model_path"])
    # hidden 64, 2 layers, 4 heads / 2 KV heads of 16, intermediate 128, vocab 512, untied, fp32:
    # embedding 512x64 + LM head 64x512 + 2 x (q 64x64 + k, v 64x32 + o 64x64 + gate, up, down 64x128) = 139264 x 4 B
    # (the RMSNorm weights, 256 B each, are below the 1 KiB weight threshold)
    assert (facts.layers, facts.kv_heads, facts.head_dim, facts.vocab, facts.hidden) == (2, 2, 16, 512, 64)
    assert facts.weight_bytes == {"float": 557_056} and facts.kv_dtype == "float32"
    assert facts.table_bytes == 512 * 64 * 4  # the embedding: only Gather reads it
    assert facts.kv_row_slot_bytes() == 2 * 2 * 2 * 16 * 4 == 512
    plan = make_plan(facts, 200 * MiB)
    # no prompt lengths: max_cache_len 1024, step_lens [1, 64] (2 sessions). Memory at B rows:
    # 2 x (557056 - 131072) x 7 / 6 = 993962 packed weights + 3 x 512 x 1024 x (B + 1) cache
    # + 4 x 64 x (16 x 64 + 512) = 393216 activations + 110 MiB = 116730538 + 1572864 (B + 1) <= 209715200
    # ->  B + 1 <= 59.1  ->  B = 32 (the largest power of two)
    assert (plan.batch, plan.max_cache_len, plan.step_lens, plan.kv_dtype) == (32, 1024, [1, 64], "float32")
    assert (plan.weights, plan.cache, plan.activations) == (993_962, 51_904_512, 393_216)
    assert plan.total == 168_635_050 == 993_962 + 51_904_512 + 393_216 + HOST_BASELINE_BYTES
    assert "= 512 B" in plan.lines[1] and "static_kv: {batch: 32, row_positions: true" in pipeline_snippet(plan)


def test_llama_fixture_plan_with_prefill_through_the_rows_by_hand() -> None:
    facts = model_facts(fixture_entry("llama_gqa_optimum")["model_path"])
    plan = make_plan(facts, 200 * MiB, prefill="rows")
    # one graph of step_len 4 (ROWS_STEP_LEN), one session: 1 x (557056 - 131072) x 7 / 6 = 496981 packed weights
    # + 3 x 512 x 1024 x B cache (no prefill row) + 4 x 4B x (16 x 64 + 512) activations + 110 MiB
    # = 115840341 + 1597440 B <= 209715200  ->  B <= 58.8  ->  B = 32
    assert (plan.batch, plan.max_cache_len, plan.step_lens, plan.prefill) == (32, 1024, [4], "rows")
    assert (plan.weights, plan.cache, plan.activations) == (496_981, 50_331_648, 786_432)
    assert plan.total == 496_981 + 50_331_648 + 786_432 + HOST_BASELINE_BYTES
    assert "1 session ×" in plan.lines[0] and "(32 rows) × 3 copies" in plan.lines[2]
    assert "static_kv: {batch: 32, row_positions: true, step_len: 4, max_cache_len: 1024}" in pipeline_snippet(plan)
    graphs = make_plan(facts, 200 * MiB)  # the same step model, × 1.34 for a call of 4 positions per row
    assert plan.step_ms == pytest.approx(graphs.step_ms * 1.34, rel=1e-9) and "× 1.34 for step_len 4" in plan.lines[-1]
    shared = make_plan(facts, 200 * MiB, prefill="shared")  # the graphs' set and buffers, one packed copy
    assert shared.weights == plan.weights and shared.step_lens == [1, 64] and shared.cache == 3 * 512 * 1024 * 33
    with pytest.raises(ConfigError, match="--prefill: expected graphs, shared or rows, got 'chunks'"):
        make_plan(facts, 200 * MiB, prefill="chunks")


def test_gpt2_fixture_latency_bound_plan_from_prompt_lengths_by_hand(tmp_path: Path) -> None:
    facts = model_facts(fixture_entry("gpt2_optimum")["model_path"])
    # hidden 64, 2 layers, 4 heads of 16, intermediate 256, vocab 512, 256 positions, tied embeddings (exported as a
    # second, transposed initializer): wte 512x64 + wpe 256x64 + LM head 64x512 + 2 x (c_attn 64x192 + c_proj 64x64
    # + c_fc 64x256 + c_proj 256x64) = 180224 x 4 B (the biases are at most 1 KiB)
    assert facts.weight_bytes == {"float": 720_896} and facts.kv_row_slot_bytes() == 2 * 2 * 4 * 16 * 4 == 1024
    assert facts.table_bytes == (512 + 256) * 64 * 4  # wte and wpe
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# observed\n10\n20\n30\n\n40\n100\n")
    assert read_prompt_lengths(lengths) == [10, 20, 30, 40, 100]
    plan = make_plan(
        facts, 256 * MiB, latency_p99_ms=1.2, prompt_lengths=read_prompt_lengths(lengths), new_tokens=28,
        bandwidth=1e9, row_cost=0.08,
    )  # fmt: skip
    # P99 of the lengths 97.6 -> 98 + 28 new = 126 -> 128 slots; P50 30 -> bucket 32, P90 76 -> 128
    assert (plan.max_cache_len, plan.step_lens) == (128, [1, 32, 128])
    # t(1) = (720896 + 1024 x 128) B / 1 GB/s = 0.851968 ms; t(B) = t(1)(1 + 0.08 (B-1)) + 131072 (B-1) B / 1 GB/s
    # t(2) = 0.920125 + 0.131072 = 1.051197 <= 1.2; t(4) = 1.056440 + 0.393216 = 1.449656 > 1.2  ->  B = 2
    assert plan.batch == 2 and plan.step_ms == pytest.approx(1.051197, abs=1e-6)
    # 3 sessions x (720896 - 196608) x 7 / 6 + 3 x 1024 x 128 x 3 + 4 x 128 x (16 x 64 + 512) + 110 MiB
    assert plan.weights == 1_835_008
    assert plan.total == 1_835_008 + 1_179_648 + 786_432 + HOST_BASELINE_BYTES
    assert plan.tokens_per_s == pytest.approx(2 / 1.051197e-3, rel=1e-6)


def test_a_tied_table_read_by_gather_and_the_lm_head_still_gives_the_hidden_size(tmp_path: Path) -> None:
    """SmolLM2's optimum form: one ``wte`` feeds the lookup ``Gather`` and ``Transpose`` -> the LM head."""
    import onnx  # noqa: PLC0415
    from onnx import numpy_helper  # noqa: PLC0415

    model = onnx.load(str(fixture_entry("gpt2_optimum")["model_path"]))
    inits = {t.name: t for t in model.graph.initializer}
    embed, folded = "transformer.wte.weight", "onnx::MatMul_670"
    assert (numpy_helper.to_array(inits[folded]) == numpy_helper.to_array(inits[embed]).T).all()
    model.graph.initializer.remove(inits[folded])
    model.graph.node.insert(0, onnx.helper.make_node("Transpose", [embed], [folded], name="tied_T", perm=[1, 0]))
    onnx.save(model, str(tmp_path / "model.onnx"))
    facts = model_facts(tmp_path / "model.onnx")
    assert (facts.vocab, facts.hidden) == (512, 64)  # read 0 before: the table was not Gather-only
    assert facts.table_bytes == 256 * 64 * 4  # wpe only: wte is also the LM head's weight, which a session packs


def test_nothing_fits_names_the_arithmetic() -> None:
    facts = model_facts(fixture_entry("llama_gqa_optimum")["model_path"])
    with pytest.raises(ConfigError, match=r"one row needs .* > 100.0 MiB \(--prefill shared or rows"):
        make_plan(facts, 100 * MiB)
    # without prompt lengths the cache still holds the new tokens asked for
    assert make_plan(facts, 4 << 30, new_tokens=2000).max_cache_len == 2048


def test_plan_command_json_and_bad_input(tmp_path: Path) -> None:
    model = fixture_entry("llama_gqa_optimum")["model_path"]
    result = CliRunner().invoke(app, ["plan", str(model), "--memory", "200MiB", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["batch"] == 32 and payload["predicted"]["memory_bytes"] == 168_635_050
    assert payload["pipeline"].startswith("passes:\n  - static_kv: {batch: 32")
    bad = CliRunner().invoke(app, ["plan", str(model), "--memory", "lots"])
    assert bad.exit_code == 2 and "--memory" in bad.stderr
    (tmp_path / "l.txt").write_text("12\nseven\n")
    bad = CliRunner().invoke(app, ["plan", str(model), "--memory", "1G", "--prompt-lengths", str(tmp_path / "l.txt")])
    assert bad.exit_code == 2 and "l.txt:2" in bad.stderr
    for option, value in (("--bandwidth-gbs", "0"), ("--bandwidth-gbs", "-1"), ("--latency-p99-ms", "0")):
        bad = CliRunner().invoke(app, ["plan", str(model), "--memory", "1G", option, value])
        assert bad.exit_code == 2 and option in bad.stderr, (option, value, bad.output)
    # an already-static graph: one short line saying so, not the search for a dynamic cache it cannot find
    (tmp_path / "p.yaml").write_text(
        f"model: {model}\noutput_dir: {tmp_path / 'out'}\n"
        "passes: [{static_kv: {max_cache_len: 32}}]\nverify: null\n"
    )
    assert CliRunner().invoke(app, ["run", str(tmp_path / "p.yaml"), "--quiet"]).exit_code == 0
    bad = CliRunner().invoke(app, ["plan", str(tmp_path / "out" / "model.onnx"), "--memory", "1G"])
    assert bad.exit_code == 2 and "already static" in bad.stderr and len(bad.stderr) < 400, bad.stderr
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("512M") == 512_000_000 and parse_bytes("4e9") == 4 * 10**9
