"""Each cache-edit step on a tiny inline decoder layer, checked by numerical parity on ORT."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy import model_io
from onnxdeploy.contract import write_contract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.kv_cache import find_kv_cache, find_logits_output
from onnxdeploy.passes._cache_edits import (
    add_cache_position,
    build_contract,
    fix_io_dims,
    replace_neg_inf,
    rewrite_cache_writes,
)
from onnxdeploy.passes._edit import clone, fold_and_infer
from onnxdeploy.passes._query_positions import feed_query_positions

VOCAB_OUT = 80  # the weight W is (4, 80) float32 = 1280 bytes: above the 1 KiB stand-in threshold
_W = ", ".join(f"{(i % 7 - 3) / 10:.1f}" for i in range(4 * VOCAB_OUT))


def _toy(batch: str = "B") -> ir.Model:
    """One attention layer with a KV cache, a query-position Range and a past-length read (exporter style).

    Inputs: input_ids int64 (B, S), attention_mask int64 (B, P+S), past_key/past_value float (B, 2, P, 4).
    Outputs: logits (B, 2, S, 80), present_key/present_value (B, 2, P+S, 4), past_seen int64 [1] (= P).
    """
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    toy (int64[{batch}, S] input_ids, int64[{batch}, T] attention_mask, float[{batch}, 2, P, 4] past_key,
         float[{batch}, 2, P, 4] past_value)
      => (float[{batch}, 2, S, {VOCAB_OUT}] logits, float[{batch}, 2, T, 4] present_key,
          float[{batch}, 2, T, 4] present_value, int64[1] past_seen)
      <float[4, {VOCAB_OUT}] W = {{{_W}}}>
    {{
        ids_f = Cast <to = 1> (input_ids)
        ax13 = Constant <value = int64[2] {{1, 3}}> ()
        ids4 = Unsqueeze (ids_f, ax13)
        head_scale = Constant <value = float[1, 2, 1, 4] {{0.1, 0.2, 0.3, 0.4, -0.1, -0.2, -0.3, -0.4}}> ()
        x = Mul (ids4, head_scale)
        k = Concat <axis = 2> (past_key, x)
        present_key = Identity (k)
        xv = Neg (x)
        v = Concat <axis = 2> (past_value, xv)
        present_value = Identity (v)
        shp = Shape (past_key)
        two = Constant <value = int64[1] {{2}}> ()
        plen1 = Gather <axis = 0> (shp, two)
        plen = Squeeze (plen1)
        sid = Shape (input_ids)
        one = Constant <value = int64[1] {{1}}> ()
        s1 = Gather <axis = 0> (sid, one)
        s = Squeeze (s1)
        end = Add (plen, s)
        step = Constant <value = int64 {{1}}> ()
        qpos = Range (plen, end, step)
        past_seen = Identity (plen1)
        kt = Transpose <perm = [0, 1, 3, 2]> (k)
        scores = MatMul (x, kt)
        mf = Cast <to = 1> (attention_mask)
        one_f = Constant <value = float {{1.0}}> ()
        big = Constant <value = float {{1000000000.0}}> ()
        d = Sub (mf, one_f)
        bias = Mul (d, big)
        ax12 = Constant <value = int64[2] {{1, 2}}> ()
        bias4 = Unsqueeze (bias, ax12)
        masked = Add (scores, bias4)
        probs = Softmax <axis = -1> (masked)
        out = MatMul (probs, v)
        qf = Cast <to = 1> (qpos)
        ax013 = Constant <value = int64[3] {{0, 1, 3}}> ()
        qf4 = Unsqueeze (qf, ax013)
        shifted = Add (out, qf4)
        logits = MatMul (shifted, W)
    }}
    """
    return ir.serde.deserialize_model(onnx.parser.parse_model(text))


def _run(model: ir.Model, feeds: dict[str, np.ndarray], tmp_path, name: str = "m.onnx") -> dict[str, np.ndarray]:
    folder = tmp_path / name.replace(".onnx", "")
    folder.mkdir()
    path = model_io.write_for_ort(model, folder)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


P, L, TOKEN = 3, 6, 5


def _original_feeds(rng: np.random.Generator, batch: int = 1) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.full((batch, 1), TOKEN, np.int64),
        "attention_mask": np.ones((batch, P + 1), np.int64),
        "past_key": rng.standard_normal((batch, 2, P, 4)).astype(np.float32),
        "past_value": rng.standard_normal((batch, 2, P, 4)).astype(np.float32),
    }


def _static_feeds(orig: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same step for a static graph: past in slots 0..P-1 of L-slot zeroed buffers, mask 1 for slots <= P."""
    batch = orig["input_ids"].shape[0]
    feeds = {"input_ids": orig["input_ids"], "cache_position": np.array([P], np.int64)}
    mask = np.zeros((batch, L), np.int64)
    mask[:, : P + 1] = 1
    feeds["attention_mask"] = mask
    for name in ("past_key", "past_value"):
        buf = np.zeros((batch, 2, L, 4), np.float32)
        buf[:, :, :P] = orig[name]
        feeds[name] = buf
    return feeds


def _rewrite(model: ir.Model, cache_update: str = "full_buffer", query_positions=("qpos",)) -> ir.Model:
    g = model.graph
    kv = find_kv_cache(model)
    pos = add_cache_position(g, 1)
    rewrite_cache_writes(g, kv, cache_position=pos, cache_update=cache_update, max_cache_len=L, step_len=1)
    feed_query_positions(g, list(query_positions), pos)
    return model


def test_add_cache_position_adds_int64_input_once():
    model = _toy()
    value = add_cache_position(model.graph, 3)
    assert value in model.graph.inputs
    assert (value.name, value.dtype, list(value.shape)) == ("cache_position", ir.DataType.INT64, [3])
    with pytest.raises(PreconditionError, match="cache_position"):
        add_cache_position(model.graph, 3)


@pytest.mark.parametrize("cache_update", ["full_buffer", "new_token_only"])
def test_rewrite_cache_writes_scatters_at_cache_position_and_matches(tmp_path, cache_update):
    rng = np.random.default_rng(0)
    orig_feeds = _original_feeds(rng)
    want = _run(_toy(), orig_feeds, tmp_path, "orig.onnx")
    static = _rewrite(_toy(), cache_update)
    ops = [n.op_type for n in static.graph]
    assert ops.count("ScatterElements") == 2 and ops.count("Concat") == 0
    got = _run(static, _static_feeds(orig_feeds), tmp_path, "static.onnx")

    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5, rtol=0)
    # readers of the past other than the write see L - S slots, so past_len + S lands on L
    assert got["past_seen"].tolist() == [L - 1]
    for name in ("present_key", "present_value"):
        if cache_update == "full_buffer":
            assert got[name].shape == (1, 2, L, 4)
            np.testing.assert_array_equal(got[name][:, :, : P + 1], want[name])
            assert not got[name][:, :, P + 1 :].any()
        else:
            np.testing.assert_array_equal(got[name], want[name][:, :, P : P + 1])


def test_rewrite_refuses_other_layouts():
    model = _toy()
    kv = find_kv_cache(model)
    pos = add_cache_position(model.graph, 1)
    with pytest.raises(ValueError, match="BHSD"):
        rewrite_cache_writes(model.graph, kv, cache_position=pos, layout="BSH2D", max_cache_len=L, step_len=1)  # type: ignore[arg-type]


def test_fix_io_dims_reports_each_changed_dim():
    model = _toy()
    kv = find_kv_cache(model)
    add_cache_position(model.graph, 1)
    fixed = fix_io_dims(model.graph, kv, batch=1, step_len=1, max_cache_len=L)
    assert "input_ids[0]: B -> 1" in fixed and "attention_mask[1]: T -> 6" in fixed
    assert "past_key[2]: P -> 6" in fixed and not any(f.startswith("cache_position") for f in fixed)
    shapes = {v.name: list(v.shape) for v in model.graph.inputs}
    assert shapes["past_value"] == [1, 2, L, 4] and shapes["attention_mask"] == [1, L]
    assert all(v.shape is None or not any(isinstance(d, int) for d in v.shape) for v in model.graph.outputs)


def test_fold_and_infer_folds_shapes_keeps_weights_and_numerics(tmp_path):
    rng = np.random.default_rng(1)
    orig_feeds = _original_feeds(rng)
    want = _run(_toy(), orig_feeds, tmp_path, "orig.onnx")
    model = _rewrite(_toy())
    weight = model.graph.initializers["W"].const_value
    fix_io_dims(model.graph, find_kv_cache(_toy()), batch=1, step_len=1, max_cache_len=L)
    folded = fold_and_infer(model)

    assert folded.graph.initializers["W"].const_value is weight  # re-attached, never copied
    ops = {n.op_type for n in folded.graph}
    assert not {"Shape", "Range", "Gather"} & ops, ops
    for value in [*folded.graph.outputs, *(o for n in folded.graph for o in n.outputs)]:
        assert value.shape is not None and all(isinstance(d, int) for d in value.shape), (value.name, value.shape)
    assert {v.name: list(v.shape) for v in folded.graph.outputs}["present_key"] == [1, 2, L, 4]
    got = _run(folded, _static_feeds(orig_feeds), tmp_path, "folded.onnx")
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5, rtol=0)
    assert not any(k.startswith("onnxsim") for k in folded.metadata_props)


def test_replace_neg_inf_in_initializers_and_constants(tmp_path):
    model = ir.serde.deserialize_model(
        onnx.parser.parse_model(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2] x) => (float[2] y, float[2] z) <float[2] init = {0.0, -inf}> {
                c = Constant <value = float[2] {-inf, 1.0}> ()
                shape = Constant <value = int64[1] {2}> ()
                f = ConstantOfShape <value = float[1] {-inf}> (shape)
                a = Add (x, init)
                b = Add (a, c)
                y = Softmax (b)
                z = Max (f, x)
            }
            """
        )
    )
    assert replace_neg_inf(model.graph) == 3
    assert replace_neg_inf(model.graph) == 0
    low = np.finfo(np.float32).min
    assert model.graph.initializers["init"].const_value.numpy().tolist() == [0.0, low]
    got = _run(model, {"x": np.array([1.0, 2.0], np.float32)}, tmp_path)
    assert np.isfinite(got["y"]).all() and np.isfinite(got["z"]).all()


def test_replace_neg_inf_on_a_clone_leaves_the_shared_tensors_alone():
    """A clone shares every tensor with its original: the -inf constants are replaced, never written into."""
    model = ir.serde.deserialize_model(
        onnx.parser.parse_model(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2] x) => (float[2] y) <float[2] init = {0.0, -inf}> {
                c = Constant <value = float[2] {-inf, 1.0}> ()
                a = Add (x, init)
                y = Add (a, c)
            }
            """
        )
    )
    copy = clone(model)
    assert replace_neg_inf(copy.graph) == 2
    assert model.graph.initializers["init"].const_value.numpy().tolist() == [0.0, float("-inf")]
    assert model.graph.node(0).attributes["value"].as_tensor().numpy().tolist() == [float("-inf"), 1.0]


def test_replace_neg_inf_in_bfloat16_constants():
    init = onnx.helper.make_tensor("init", onnx.TensorProto.BFLOAT16, [2], [0.0, float("-inf")])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["init"], ["y"])],
        "g",
        [],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.BFLOAT16, [2])],
        [init],
    )
    model = ir.serde.deserialize_model(onnx.helper.make_model(graph))
    assert replace_neg_inf(model.graph) == 1
    got = model.graph.initializers["init"].const_value.numpy()
    assert got.dtype == ml_dtypes.bfloat16
    assert got.astype(np.float32).tolist() == [0.0, float(ml_dtypes.finfo(ml_dtypes.bfloat16).min)]


def test_build_contract_names_and_logits_output():
    model = _rewrite(_toy())
    kv = find_kv_cache(_toy())
    with pytest.raises(PreconditionError, match="one logits output"):
        build_contract(model, kv, batch=1, step_len=1, max_cache_len=L, cache_update="full_buffer")
    past_seen = next(v for v in model.graph.outputs if v.name == "past_seen")
    model.graph.outputs.remove(past_seen)
    contract = build_contract(model, kv, batch=1, step_len=1, max_cache_len=L, cache_update="full_buffer")
    assert contract.logits == "logits" and contract.inputs.cache_position == "cache_position"
    assert contract.inputs.position_ids is None and contract.inputs.attention_mask == "attention_mask"
    assert [(c.key_in, c.value_in, c.key_out, c.value_out) for c in contract.cache] == [
        ("past_key", "past_value", "present_key", "present_value")
    ]
    write_contract(model, contract)
    assert model.metadata_props["onnxdeploy.contract"] == contract.model_dump_json()


def test_find_logits_output_accepts_any_name_and_refuses_none():
    model = _toy()
    graph = model.graph
    graph.outputs.pop()  # past_seen
    graph.outputs[0].name = "lm_logits"
    assert find_logits_output(graph, {"present_key", "present_value"}).name == "lm_logits"
    graph.outputs.pop(0)
    with pytest.raises(PreconditionError, match=r"found \[\]"):
        find_logits_output(graph, {"present_key", "present_value"})
