"""Caches inside attention ops (genai GroupQueryAttention, opset-23 Attention) and float16/bfloat16 exports.

The genai, dynamo-23 and fp16 fixtures go through the shared per-fixture tests of static_kv, mask_rewrite
(max_cache_len 128, 8-token prompt + 64 steps, both modes, fp16 labelled emulated) and verify, with the
expectations tests/conftest.py derives from their registry tags. Here: the genai graph's static cache is exact
against the original with NaN in unused slots; what the cache cannot do inside GroupQueryAttention is refused
naming the node; bfloat16 results are verified on a float32 shadow and labelled emulated; a fully masked float16
row stays finite under ``onnx.reference`` (which computes float16 in float16).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx.reference
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy import model_io
from onnxdeploy.errors import PreconditionError
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.mask_rewrite import MaskRewriteConfig, MaskRewritePass, lowest_finite
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import verify
from onnxdeploy.runner.numerics import compute_dtype, float32_shadow
from tests.conftest import fixture_entry

PROMPT8 = [1, 17, 42, 99, 7, 3, 5, 9]


def _gqa_static(tmp_path: Path, **cfg) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    entry = fixture_entry("llama_gqa_genai")
    model = model_io.load_model(entry["model_path"]).model
    static = StaticKVCachePass(StaticKVConfig(**cfg))(model, make_pass_context(model_path=entry["model_path"]))
    path = model_io.write_for_ort(static.artifacts.primary, tmp_path)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    original = ort.InferenceSession(str(entry["model_path"]), opts, providers=["CPUExecutionProvider"])
    return original, ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _names(sess: ort.InferenceSession) -> list[str]:
    return [o.name for o in sess.get_outputs()]


@pytest.mark.parametrize("step_len", [1, 4])
def test_gqa_static_cache_is_exact_with_nan_in_unused_slots(tmp_path, step_len):
    """Past lengths 0, 4, 8 (and on to 16): bitwise the original's logits and cache, NaN in every unused slot."""
    original, static = _gqa_static(tmp_path, max_cache_len=32, step_len=step_len, prefill_logits="all")
    ref = np.load(fixture_entry("llama_gqa_genai")["reference_path"])
    tokens = [int(t) for t in np.concatenate([ref["prompt"], ref["tokens"]])][:16]
    pasts = [f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    grown = {n: np.zeros((1, 2, 0, 16), np.float32) for n in pasts}
    buffers = {n: np.full((1, 2, 32, 16), np.nan, np.float32) for n in pasts}
    for start in range(0, len(tokens), step_len):
        chunk = np.array([tokens[start : start + step_len]], np.int64)
        mask = np.ones((1, start + step_len), np.int64)
        ran = original.run(None, {"input_ids": chunk, "attention_mask": mask, **grown})
        want = dict(zip(_names(original), ran, strict=True))
        fed = {"input_ids": chunk, "cache_position": np.arange(start, start + step_len), **buffers}
        got = dict(zip(_names(static), static.run(None, fed), strict=True))
        assert np.array_equal(got["logits"], want["logits"]), (start, np.abs(got["logits"] - want["logits"]).max())
        for past in pasts:
            present = past.replace("past_key_values", "present")
            grown[past] = want[present]
            assert np.array_equal(got[present][:, :, : start + step_len], want[present])
            buffers[past] = got[present].copy()
            buffers[past][:, :, start + step_len :] = np.nan  # whatever the op left there, NaN is fed next


def test_gqa_refusals_name_the_op_and_node():
    entry = fixture_entry("llama_gqa_genai")
    model = model_io.load_model(entry["model_path"]).model
    context = make_pass_context(model_path=entry["model_path"])
    node = "'/model/layers.0/attn/GroupQueryAttention'"
    cases = {
        "new_token_only": {"max_cache_len": 64, "cache_update": "new_token_only"},
        "cos_cache": {"max_cache_len": 300},
        "batch_size must be 1": {"max_cache_len": 64, "step_len": 4, "batch": 2},
        "cache dtype to equal its compute dtype": {"max_cache_len": 64, "kv_dtype": "float16"},
    }
    for needle, cfg in cases.items():
        with pytest.raises(PreconditionError, match="GroupQueryAttention") as err:
            StaticKVCachePass(StaticKVConfig(**cfg))(model, context)
        assert needle in str(err.value), str(err.value)
        assert needle == "cache dtype to equal its compute dtype" or node in str(err.value)
    static = StaticKVCachePass(StaticKVConfig(max_cache_len=64))(model, context).artifacts
    with pytest.raises(PreconditionError, match=f"padding: true, but .*GroupQueryAttention node {node}"):
        MaskRewritePass(MaskRewriteConfig(padding=True))(static, context)


def test_gqa_head_dim_from_genai_config_must_agree_with_the_weights(tmp_path):
    entry = fixture_entry("llama_gqa_genai")
    folder = tmp_path / "genai"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(entry["model_path"].read_bytes())
    config = Path(entry["model_path"]).parent / "genai_config.json"
    (folder / "genai_config.json").write_text(config.read_text().replace('"head_size": 16', '"head_size": 32'))
    model = model_io.load_model(folder / "model.onnx").model
    with pytest.raises(PreconditionError, match="head dim 32 .* the weights give 16"):
        StaticKVCachePass(StaticKVConfig(max_cache_len=64))(model, make_pass_context(model_path=folder / "model.onnx"))


def test_attention_23_with_past_key_is_refused_naming_op_and_node():
    model = ir.serde.deserialize_model(
        onnx.parser.parse_model(
            """
            <ir_version: 10, opset_import: ["" : 23]>
            g (float[1, 2, S, 4] q, float[1, 2, P, 4] pk, float[1, 2, P, 4] pv)
              => (float[1, 2, S, 4] out, float[1, 2, T, 4] k, float[1, 2, T, 4] v) {
                out, k, v = Attention <is_causal = 1> (q, q, q, , pk, pv)
            }
            """
        )
    )
    expected = "input 'pk' enters ai.onnx::Attention #0 \\(Attention\\) as past_key: the op concatenates"
    with pytest.raises(PreconditionError, match=expected):
        StaticKVCachePass(StaticKVConfig(max_cache_len=8))(model, make_pass_context())


def test_fully_masked_float16_row_stays_finite_under_onnx_reference():
    """The select fill (float16's lowest finite value) keeps a fully masked row finite in float16 arithmetic;
    the -inf fill the exporters' masks turn into makes it NaN (so the check can fail)."""
    lowest = lowest_finite(ir.DataType.FLOAT16)
    assert lowest.dtype == np.float16 and float(lowest) == -65504.0

    def run(fill: float) -> np.ndarray:
        model = onnx.parser.parse_model(
            """
            <ir_version: 10, opset_import: ["" : 21]>
            g (float16[1, 4] scores, bool[1, 4] visible, float16 fill) => (float16[1, 4] probs) {
                masked = Where (visible, scores, fill)
                probs = Softmax <axis = -1> (masked)
            }
            """
        )
        feeds = {
            "scores": np.array([[0.5, -1.0, 3.0, 2.0]], np.float16),
            "visible": np.zeros((1, 4), bool),
            "fill": np.array(fill, np.float16),
        }
        with np.errstate(invalid="ignore"):  # -inf - -inf in the -inf case
            (probs,) = onnx.reference.ReferenceEvaluator(model).run(None, feeds)
        assert probs.dtype == np.float16
        return probs

    np.testing.assert_array_equal(run(float(lowest)), np.full((1, 4), 0.25, np.float16))
    assert np.isnan(run(-np.inf)).all()


def _bf16_copy(src: Path, folder: Path) -> Path:
    """The float32 fixture with every float tensor bfloat16 (a bfloat16 export's types; weights rounded)."""
    model = model_io.load_model(src).model
    f32, bf16 = ir.DataType.FLOAT, ir.DataType.BFLOAT16
    for value in model.graph.initializers.values():
        if value.const_value is not None and value.const_value.dtype == f32:
            array = value.const_value.numpy().astype(ml_dtypes.bfloat16)
            value.const_value = ir.tensor(array, name=value.const_value.name)
    for node in model.graph:
        if node.op_type == "Cast" and node.attributes.get_int("to") == f32:
            node.attributes["to"] = ir.AttrInt64("to", bf16)
    for value in [*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()]:
        if value.dtype == f32:
            value.dtype = bf16
    for node in model.graph:
        for out in node.outputs:
            out.type = None if not out.is_graph_output() else out.type
    folder.mkdir(parents=True)
    return model_io.write_for_ort(model, folder)


def test_bfloat16_model_is_verified_on_its_float32_shadow_and_labelled_emulated(tmp_path):
    bf16 = _bf16_copy(fixture_entry("llama_gqa_torchscript")["model_path"], tmp_path / "bf16")
    header = onnx.load(bf16, load_external_data=False)
    assert compute_dtype(header) == "bfloat16"
    with pytest.raises(Exception, match="(?i)bfloat16|NOT_IMPLEMENTED|implementation"):
        ort.InferenceSession(str(bf16), providers=["CPUExecutionProvider"])
    shadow = float32_shadow(bf16, tmp_path / "shadow")
    assert compute_dtype(onnx.load(shadow, load_external_data=False)) == "float32"
    res = verify(bf16, bf16, prompt=PROMPT8, steps=8, max_abs_logit_diff=0.0)
    assert res.passed, [m.failures for m in res.modes.values()]
    assert res.numerics is not None
    assert (res.numerics.compute_dtype, res.numerics.execution) == ("bfloat16", "emulated")
    assert "float32 shadow" in res.numerics.detail
