"""mask_rewrite: the exporter's mask becomes a select from cache_position; nothing in an unused slot leaks."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import onnx
import onnx.reference
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy import model_io
from onnxdeploy.artifacts import Artifact, ArtifactSet
from onnxdeploy.contract import CacheBinding, ContractInputs, DecodeContract, read_contract, write_contract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.mask_rewrite import MaskRewriteConfig, MaskRewritePass, lowest_finite
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import verify
from tests.conftest import ALL_FIXTURE_NAMES, fixture_entry

L = 128
PROMPT = [1, 17, 42, 99, 7, 3, 5, 11]
STEPS = 64


def _static(name: str, step_len: int) -> ir.Model:
    model = model_io.load_model(fixture_entry(name)["model_path"]).model
    return StaticKVCachePass(StaticKVConfig(max_cache_len=L, step_len=step_len))(
        model, make_pass_context()
    ).artifacts.primary


@functools.cache
def _rewritten(name: str, padding: bool = False):
    """The decode graph and a step_len 4 graph of ``name``, static, then rewritten together as one set."""
    static = ArtifactSet([Artifact("model.onnx", _static(name, 1)), Artifact("model.s4.onnx", _static(name, 4))])
    return static, MaskRewritePass(MaskRewriteConfig(padding=padding))(static, make_pass_context())


def _session(model: ir.Model, folder) -> ort.InferenceSession:
    folder.mkdir(parents=True, exist_ok=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(model_io.write_for_ort(model, folder)), opts, providers=["CPUExecutionProvider"])


def _dynamic_values(model: ir.Model) -> list[str]:
    inferred = onnx.shape_inference.infer_shapes(model_io.stand_in_proto(model), strict_mode=True, data_prop=True)
    g = inferred.graph
    return [
        vi.name
        for vi in [*g.input, *g.output, *g.value_info]
        if not vi.type.tensor_type.HasField("shape")
        or any(not d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)
    ]


@pytest.mark.parametrize("name", ALL_FIXTURE_NAMES)
def test_rewritten_graphs_are_static_maskless_and_decode_the_same(tmp_path, name):
    expect = fixture_entry(name)["expect"]
    static, result = _rewritten(name)
    decode, prefill = (a.model for a in result.artifacts.artifacts)
    for model in (decode, prefill):
        ops = {node.op_type for node in model.graph}
        assert not {"Shape", "Range", "Trilu", "NonZero", "IsNaN", "Attention"} & ops, ops
        assert "attention_mask" not in {v.name for v in model.graph.inputs}
        assert _dynamic_values(model) == []
        contract = read_contract(model)
        assert contract.inputs.attention_mask is None and contract.mask == "cache_position"
        assert contract.cache_init == "zeros" and contract.contract_version >= 2
        assert contract.sliding_window == {"mistral_sw_optimum": 8}.get(
            name, fixture_entry(name)["config"].get("sliding_window")
        )
    assert [read_contract(a.model).step_len for a in static.artifacts] == [1, 4]  # the input set is untouched
    changes = result.report.changes
    if expect.exporter_mask:
        assert sum("masked by select" in c and "IsNaN guard" in c for c in changes) == 2, changes
    else:  # GroupQueryAttention masks by seqlens_k inside the op: both graphs pass through
        assert sum("unchanged" in c and expect.cache_op in c for c in changes) == 2, changes
    assert sum("Attention node" in c and "decomposed" in c for c in changes) == 2 * expect.attention_ops, changes

    tolerance = expect.tol(1e-4)
    report = verify(
        fixture_entry(name)["model_path"],
        model_io.write_for_ort(decode, tmp_path),
        prompt=PROMPT,
        steps=STEPS,
        max_abs_logit_diff=tolerance,
    )
    for mode in report.modes.values():
        assert mode.positions == len(PROMPT) + STEPS  # past the 8-token window of mistral_sw
        assert mode.top1_agreement == 1.0 and mode.max_abs_logit_diff <= tolerance, mode.failures
    assert report.passed
    assert report.numerics is not None  # the CPU EP computes fp16 MatMul/Softmax in fp32: emulated, never native
    assert (report.numerics.compute_dtype, report.numerics.execution) == (
        ("float16", "emulated") if expect.fp16 else ("float32", "native")
    )


def _decode_with_garbage(
    session: ort.InferenceSession, contract: DecodeContract, tokens: list[int]
) -> dict[int, np.ndarray]:
    """Feed ``tokens`` chunk by chunk; before each call, fill every slot >= the call's position with garbage.

    Asserts each garbage run gives the same logits (bitwise) as zero-filled slots. Returns the zero-filled
    run's logits (V,) by position (every position, or the last of each chunk under ``prefill_logits: last``).
    Stale V values are ±(0.5..1)× the cache dtype's largest finite value (±3e38 in fp32, ±65504 in fp16).
    """
    S = contract.step_len
    dtype = contract.kv_numpy_dtype
    rng = np.random.default_rng(0)
    keys = [e.key_in for e in contract.cache]
    values = [e.value_in for e in contract.cache]
    outputs = [contract.logits, *(out for _, out in contract.cache_pairs())]
    buffers = {name: np.zeros(contract.cache_input_shape(), dtype) for name in keys + values}
    big = float(ml_dtypes.finfo(dtype).max)
    stale = rng.choice([-big, big], size=contract.cache_input_shape()) * rng.uniform(
        0.5, 1, contract.cache_input_shape()
    )
    garbage = [
        ("K NaN", keys, dtype.type(np.nan)),
        ("K +inf", keys, dtype.type(np.inf)),
        ("V stale", values, stale.astype(dtype)),
    ]
    logits: dict[int, np.ndarray] = {}
    for p in range(0, len(tokens), S):
        positions = np.arange(p, p + S, dtype=np.int64)
        feeds = {"input_ids": np.array([tokens[p : p + S]], np.int64), "cache_position": positions}
        if contract.inputs.position_ids:
            feeds["position_ids"] = positions[None]
        if contract.inputs.attention_mask:
            feeds[contract.inputs.attention_mask] = (np.arange(L) < p + S).astype(np.int64)[None]
        if contract.inputs.last_token_index:
            feeds[contract.inputs.last_token_index] = np.array([S - 1], np.int64)
        clean = session.run(outputs, {**feeds, **buffers})
        for label, names, fill in garbage:
            dirty = {k: v.copy() for k, v in buffers.items()}
            for n in names:
                dirty[n][:, :, p:] = fill if np.ndim(fill) == 0 else fill[:, :, p:]
            got = session.run(outputs, {**feeds, **dirty})
            assert np.array_equal(got[0], clean[0]), f"{label} at position {p} changed the logits"
            for a, b in zip(got[1:], clean[1:], strict=True):  # slots written so far are equal too
                assert np.array_equal(a[:, :, : p + S], b[:, :, : p + S]), f"{label} at position {p}"
        buffers = {past: out for (past, _), out in zip(contract.cache_pairs(), clean[1:], strict=True)}
        rows = clean[0][0]
        logits.update(zip(range(p + S - len(rows), p + S), rows, strict=True))
    return logits


def _original_logits(session: ort.InferenceSession, contract: DecodeContract, tokens: list[int]) -> np.ndarray:
    """The exporter-convention original's logits (T, V) for ``tokens`` in one call from an empty cache."""
    T = len(tokens)
    names = {arg.name for arg in session.get_inputs()}
    empty = np.zeros((1, contract.num_kv_heads, 0, contract.head_dim), contract.kv_numpy_dtype)
    feeds = {"input_ids": np.array([tokens], np.int64), "attention_mask": np.ones((1, T), np.int64)}
    feeds |= {past: empty for past, _ in contract.cache_pairs()}
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(T, dtype=np.int64)[None]
    return session.run([contract.logits], feeds)[0][0]


@pytest.mark.parametrize("name", ALL_FIXTURE_NAMES)
def test_garbage_in_unused_cache_slots_never_reaches_the_logits(tmp_path, name):
    _, result = _rewritten(name)
    vocab = fixture_entry(name)["config"]["vocab"]
    tolerance = fixture_entry(name)["expect"].tol(1e-4)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, vocab, 16)]  # crosses mistral's 8-token window
    original = _session(model_io.load_model(fixture_entry(name)["model_path"]).model, tmp_path / "original")
    for artifact in result.artifacts.artifacts:  # the decode graph and the step_len 4 graph
        contract = read_contract(artifact.model)
        logits = _decode_with_garbage(_session(artifact.model, tmp_path / artifact.name), contract, tokens)
        assert len(logits) >= len(tokens) // contract.step_len
        want = _original_logits(original, contract, tokens)  # one call over the whole sequence
        for position, row in logits.items():  # causal triangle inside each chunk, window past 8
            np.testing.assert_allclose(row, want[position], atol=tolerance, rtol=0, err_msg=f"position {position}")


def test_garbage_reaches_the_logits_of_the_exporters_mask(tmp_path):
    """The same probe on the static_kv graph alone (additive mask, IsNaN guard) does see NaN in K: it can fail."""
    static, _ = _rewritten("llama_gqa_optimum")
    model = static.primary
    with pytest.raises(AssertionError, match="K NaN at position 0"):
        _decode_with_garbage(_session(model, tmp_path), read_contract(model), [1, 17, 42])


def test_padding_keeps_attention_mask_and_matches_the_exporters_padding(tmp_path):
    static, result = _rewritten("mistral_sw_optimum", padding=True)
    old, new = static.primary, result.artifacts.primary
    contract = read_contract(new)
    assert contract.inputs.attention_mask == "attention_mask" and contract.sliding_window == 8
    old_s, new_s = _session(old, tmp_path / "old"), _session(new, tmp_path / "new")
    rng = np.random.default_rng(2)
    buffers = {past: np.zeros(contract.cache_input_shape(), np.float32) for past, _ in contract.cache_pairs()}
    outputs = [contract.logits, *(out for _, out in contract.cache_pairs())]
    differs = 0
    for p, token in enumerate(rng.integers(0, 512, 14)):
        mask = np.zeros((1, L), np.int64)
        mask[0, : p + 1] = rng.integers(0, 2, p + 1)
        mask[0, p] = 1  # the query's own slot (a fully masked row is uniform in both, but its values differ)
        feeds = {
            "input_ids": np.array([[token]], np.int64),
            "cache_position": np.array([p], np.int64),
            "position_ids": np.array([[p]], np.int64),
            "attention_mask": mask,
            **buffers,
        }
        want, got = old_s.run(outputs, feeds), new_s.run(outputs, feeds)
        np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)
        ones = new_s.run(outputs[:1], {**feeds, "attention_mask": (np.arange(L) <= p).astype(np.int64)[None]})
        differs += not np.allclose(ones[0], got[0], atol=1e-3)
        buffers = {past: out for (past, _), out in zip(contract.cache_pairs(), got[1:], strict=True)}
    assert differs > 0  # the padding bits did change attention


# ------------------------------------------------------------------------------------------ inline models

_ATTENTION = """
<ir_version: 8, opset_import: ["" : 18]>
attn (int64[1] cache_position, int64[1,4] attention_mask, {t}[1,1,4,2] past_key,
      {t}[1,1,4,2] past_value) => ({t}[1,1,1,2] out)
<int64[1,4] slots = {{0, 1, 2, 3}}, float[1,1,1,2] q32 = {{1, -1}}, float[1] visible32 = {{{visible}}},
 float[1] f32_min = {{-3.4028235e38}}, int64[1] one = {{1}}>
{{
  q = Cast <to = {to}> (q32)
  visible_value = Cast <to = {to}> (visible32)
  kt = Transpose <perm = [0, 1, 3, 2]> (past_key)
  scores = MatMul (q, kt)
  pos = Unsqueeze (cache_position, one)
  causal = {compare} (slots, pos)
  padded = Cast <to = 9> (attention_mask)
  keep = And (causal, padded)
  hidden_value = Cast <to = {to}> (f32_min)
  additive = Where (keep, visible_value, hidden_value)
  masked = Add (scores, additive)
  probs = Softmax <axis = -1> (masked)
  out = MatMul (probs, past_value)
}}
"""


def _inline(dtype: str = "float16", visible: float = 0.0, compare: str = "LessOrEqual") -> ir.Model:
    """One attention over a 4-slot cache whose exporter mask adds finfo(float32).min cast to ``dtype``."""
    to = {"float16": onnx.TensorProto.FLOAT16, "float": onnx.TensorProto.FLOAT}[dtype]
    proto = onnx.parser.parse_model(_ATTENTION.format(t=dtype, to=to, visible=visible, compare=compare))
    model = ir.serde.deserialize_model(proto)
    write_contract(
        model,
        DecodeContract(
            batch=1,
            step_len=1,
            max_cache_len=4,
            num_layers=1,
            num_kv_heads=1,
            head_dim=2,
            head_dim_padded=2,
            kv_dtype="float16" if dtype == "float16" else "float32",
            inputs=ContractInputs(
                input_ids="input_ids", cache_position="cache_position", attention_mask="attention_mask"
            ),
            logits="out",
            cache=[
                CacheBinding(
                    layer=0,
                    key_in="past_key",
                    value_in="past_value",
                    key_out="present.0.key",
                    value_out="present.0.value",
                )
            ],
        ),
    )
    return model


def test_fully_masked_row_in_fp16_gives_no_nan_under_onnx_reference():
    old = _inline("float16")
    new = MaskRewritePass(MaskRewriteConfig(padding=True))(old, make_pass_context()).artifacts.primary
    feeds = {
        "cache_position": np.array([2], np.int64),
        "attention_mask": np.zeros((1, 4), np.int64),  # every slot hidden: a fully masked row
        "past_key": np.ones((1, 1, 4, 2), np.float16),
        "past_value": np.arange(8, dtype=np.float16).reshape(1, 1, 4, 2),
    }
    with np.errstate(over="ignore", invalid="ignore"):  # the old graph's -inf and NaN, on purpose
        (before,) = onnx.reference.ReferenceEvaluator(ir.serde.serialize_model(old)).run(None, feeds)
    (after,) = onnx.reference.ReferenceEvaluator(ir.serde.serialize_model(new)).run(None, feeds)
    assert before.dtype == after.dtype == np.float16
    assert np.isnan(before).all()  # finfo(float32).min is -inf in fp16: Softmax of an all -inf row
    assert not np.isnan(after).any()
    fills = [n for n in new.graph.initializers.values() if "lowest" in str(n.name)]
    assert [f.const_value.numpy().item() for f in fills] == [float(lowest_finite(ir.DataType.FLOAT16))] == [-65504.0]

    feeds["attention_mask"] = np.ones((1, 4), np.int64)  # a normal row: slots 0..2 of position 2
    with np.errstate(over="ignore"):
        (want,) = onnx.reference.ReferenceEvaluator(ir.serde.serialize_model(old)).run(None, feeds)
    (got,) = onnx.reference.ReferenceEvaluator(ir.serde.serialize_model(new)).run(None, feeds)
    np.testing.assert_array_equal(got, want)


def test_a_mask_carrying_a_bias_is_refused():
    with pytest.raises(PreconditionError, match="bias"):
        MaskRewritePass()(_inline("float", visible=0.5), make_pass_context())


def test_a_mask_no_causal_or_window_mask_reproduces_is_refused():
    with pytest.raises(PreconditionError, match="selects slots no causal or sliding-window mask"):
        MaskRewritePass()(_inline("float", compare="Less"), make_pass_context())  # a query that cannot see its own slot


def test_a_graph_without_contract_is_refused():
    model = _inline("float")
    del model.metadata_props["onnxdeploy.contract"]
    with pytest.raises(PreconditionError, match="run static_kv before mask_rewrite"):
        MaskRewritePass()(model, make_pass_context())
