"""static_kv on the real exports: static, folded, contract right, and numerically the same on ORT."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxdeploy.contract import read_contract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import op_histogram, save_model_atomic, tensor_dims
from onnxdeploy.kv_cache import find_kv_cache
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import verify
from tests.conftest import FIXTURE_NAMES, PROMPT, fixture_entry


def _static(model: onnx.ModelProto, **cfg) -> onnx.ModelProto:
    return StaticKVCachePass(StaticKVConfig(**cfg))(model).model


def _all_dims_static(model: onnx.ModelProto) -> list[str]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    bad = []
    g = inferred.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        dims = tensor_dims(vi)
        if dims is None or any(not isinstance(d, int) for d in dims):
            bad.append(f"{vi.name}: {dims}")
    produced = {o for n in g.node for o in n.output if o}
    typed = {vi.name for vi in list(g.value_info) + list(g.output)}
    bad += [f"{t}: untyped" for t in produced - typed]
    return bad


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("max_cache_len", [40, 64, 128])
@pytest.mark.parametrize("cache_update", ["full_buffer", "new_token_only"])
def test_static_kv_is_static_and_decodes_the_same(tmp_path, name, max_cache_len, cache_update):
    entry = fixture_entry(name)
    model = onnx.load(entry["model_path"])
    static = _static(model, batch=1, step_len=1, max_cache_len=max_cache_len, cache_update=cache_update)

    assert _all_dims_static(static) == []
    hist = op_histogram(static)
    assert not {"Shape", "Range", "Trilu"} & set(hist), hist
    assert hist.get("ScatterElements") == 2 * entry["config"]["layers"]
    onnx.checker.check_model(static, full_check=True)

    contract = read_contract(static)
    assert contract is not None
    assert (contract.max_cache_len, contract.cache_update, contract.num_layers) == (
        max_cache_len,
        cache_update,
        entry["config"]["layers"],
    )
    assert contract.num_kv_heads == entry["config"]["kv_heads"]
    assert contract.head_dim == entry["config"]["head_dim"]

    path = save_model_atomic(static, tmp_path / "static.onnx")
    steps = min(32, max_cache_len - len(PROMPT))
    result = verify(str(entry["model_path"]), str(path), prompt=PROMPT, steps=steps, max_abs_logit_diff=1e-4)
    assert result.passed, [m.failures for m in result.modes.values()]
    for mode in ("teacher_forced", "free_running"):
        m = result.modes[mode]
        assert m.positions == len(PROMPT) + steps
        assert m.top1_agreement == 1.0
        assert m.max_abs_logit_diff <= 1e-4
        assert m.first_divergent_step is None


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_first_static_step_equals_original_at_past_zero(name):
    entry = fixture_entry(name)
    model = onnx.load(entry["model_path"])
    static = _static(model, max_cache_len=64)
    contract = read_contract(static)
    kv = find_kv_cache(model)
    token = PROMPT[0]

    orig = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[token]], np.int64), "attention_mask": np.ones((1, 1), np.int64)}
    if "position_ids" in {i.name for i in model.graph.input}:
        feeds["position_ids"] = np.zeros((1, 1), np.int64)
    for past, _ in kv.pairs():
        feeds[past] = np.zeros((1, kv.num_kv_heads, 0, kv.head_dim), np.float32)
    want = orig.run(["logits"], feeds)[0]

    sess = ort.InferenceSession(static.SerializeToString(), providers=["CPUExecutionProvider"])
    sfeeds = {"input_ids": np.array([[token]], np.int64), "cache_position": np.array([0], np.int64)}
    if contract.inputs.position_ids:
        sfeeds["position_ids"] = np.zeros((1, 1), np.int64)
    mask = np.zeros((1, 64), np.int64)
    mask[0, 0] = 1
    sfeeds["attention_mask"] = mask
    for past, _ in contract.cache_pairs():
        sfeeds[past] = np.zeros((1, contract.num_kv_heads, 64, contract.head_dim), np.float32)
    got = sess.run([contract.logits], sfeeds)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _rename_cache(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rename every cache input/output and every node: names must not matter."""
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    g = renamed.graph
    mapping = {}
    for vi in list(g.input) + list(g.output):
        if vi.name.startswith(("past_key_values", "present")):
            mapping[vi.name] = f"cache_tensor_{len(mapping)}"
    for i, node in enumerate(g.node):
        node.name = f"n{i}"
        for k, t in enumerate(node.input):
            node.input[k] = mapping.get(t, t)
        for k, t in enumerate(node.output):
            node.output[k] = mapping.get(t, t)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        vi.name = mapping.get(vi.name, vi.name)
    return renamed


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_cache_found_by_data_flow_not_names(tmp_path, name):
    entry = fixture_entry(name)
    model = onnx.load(entry["model_path"])
    renamed = _rename_cache(model)
    assert not any(i.name.startswith("past_key_values") for i in renamed.graph.input)

    plain = read_contract(_static(model, max_cache_len=64))
    other = read_contract(_static(renamed, max_cache_len=64))
    names_aside = {"cache"}
    assert plain.model_dump(exclude=names_aside) == other.model_dump(exclude=names_aside)
    # Layer i's key/value of the renamed copy are the tensors that stood for layer i's key/value.
    orig_in = [v.name for v in model.graph.input]
    new_in = [v.name for v in renamed.graph.input]
    back = dict(zip(new_in, orig_in, strict=True))
    orig_out = [v.name for v in model.graph.output]
    back |= dict(zip([v.name for v in renamed.graph.output], orig_out, strict=True))
    for a, b in zip(plain.cache, other.cache, strict=True):
        assert (a.key_in, a.value_in, a.key_out, a.value_out) == (
            back[b.key_in],
            back[b.value_in],
            back[b.key_out],
            back[b.value_out],
        )

    renamed_path = save_model_atomic(renamed, tmp_path / "renamed.onnx")
    static_path = save_model_atomic(_static(renamed, max_cache_len=64), tmp_path / "renamed_static.onnx")
    result = verify(str(renamed_path), str(static_path), prompt=PROMPT, steps=8)
    assert result.passed, [m.failures for m in result.modes.values()]


def test_graph_without_kv_cache_is_refused_saying_what_was_looked_for():
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        lm (int64[B, S] input_ids) => (float[B, S, 4] logits) {
            table = Constant <value = float[3, 4] {0,1,2,3,4,5,6,7,8,9,10,11}> ()
            logits = Gather (table, input_ids)
        }
        """
    )
    with pytest.raises(PreconditionError) as err:
        StaticKVCachePass(StaticKVConfig(max_cache_len=8))(model)
    text = str(err.value)
    assert "no KV cache found" in text and "Looked for" in text and "input_ids" in text and "logits" in text


def test_input_model_is_not_mutated():
    entry = fixture_entry(FIXTURE_NAMES[0])
    model = onnx.load(entry["model_path"])
    before = model.SerializeToString()
    _static(model, max_cache_len=40)
    assert model.SerializeToString() == before


def test_max_cache_len_below_step_len_is_refused():
    model = onnx.load(fixture_entry(FIXTURE_NAMES[0])["model_path"])
    with pytest.raises(PreconditionError, match="max_cache_len"):
        StaticKVCachePass(StaticKVConfig(max_cache_len=1, step_len=2))(model)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_step_len_2_graph_matches_pytorch_reference(tmp_path, name):
    """A step_len 2 graph needs the exporter's query positions fed from cache_position (causal mask)."""
    from onnxdeploy.runner import open_decoder

    entry = fixture_entry(name)
    ref = np.load(entry["reference_path"])
    tokens = [int(t) for t in ref["prompt"]] + [int(t) for t in ref["tokens"]]
    static = _static(onnx.load(entry["model_path"]), step_len=2, max_cache_len=64)
    decoder = open_decoder(save_model_atomic(static, tmp_path / "step2.onnx"))
    logits = np.stack([logit for logit, _ in decoder.feed(tokens)])
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


def test_batch_2_graph_verifies(tmp_path):
    entry = fixture_entry("llama_gqa_torchscript")
    static = _static(onnx.load(entry["model_path"]), batch=2, max_cache_len=48)
    assert read_contract(static).batch == 2
    path = save_model_atomic(static, tmp_path / "b2.onnx")
    result = verify(str(entry["model_path"]), str(path), prompt=PROMPT, steps=16)
    assert result.passed, [m.failures for m in result.modes.values()]
