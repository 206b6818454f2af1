"""static_kv on the real exports: static, folded, contract right, and numerically the same on ORT."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from pydantic import ValidationError

from onnxdeploy import model_io
from onnxdeploy.artifacts import Artifact, ArtifactSet
from onnxdeploy.contract import CONTRACT_KEY, DecodeContract
from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.kv_cache import find_kv_cache
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import open_session, verify
from onnxdeploy.settings import PipelineSettings
from tests.conftest import ALL_FIXTURE_NAMES, FIXTURE_NAMES, PROMPT, FixtureExpectations, fixture_entry


def _load(name: str) -> ir.Model:
    return model_io.load_model(fixture_entry(name)["model_path"]).model


def _static(model: ir.Model, **cfg) -> ir.Model:
    return StaticKVCachePass(StaticKVConfig(**cfg))(model, make_pass_context()).artifacts.primary


def _contract(model: ir.Model) -> DecodeContract:
    return DecodeContract.model_validate_json(model.metadata_props[CONTRACT_KEY])


def _write(model: ir.Model, folder) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    return str(model_io.write_for_ort(model, folder))


def _check_graph(model: ir.Model, expect: FixtureExpectations, folder) -> str:
    """Write ``model`` for ORT; onnx's full checker where it knows every op, an ORT session always (genai's contrib
    ops fail onnx.checker: the session is their check). Returns the written path."""
    if expect.onnx_checkable:
        # the weights as typed stand-ins (the project's own check path): a fixture's inline weights are mapped
        # from its .onnx, so a plain serialisation would carry external references the checker cannot follow
        onnx.checker.check_model(model_io.stand_in_proto(model, as_inputs=True), full_check=True)
    path = _write(model, folder)
    ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return path


def _not_static(model: ir.Model) -> list[str]:
    """Every value that strict onnx shape inference leaves untyped or not fully static."""
    inferred = onnx.shape_inference.infer_shapes(model_io.stand_in_proto(model), strict_mode=True, data_prop=True)
    g = inferred.graph
    bad = []
    for vi in [*g.input, *g.output, *g.value_info]:
        tt = vi.type.tensor_type
        if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
            bad.append(vi.name)
    typed = {vi.name for vi in [*g.value_info, *g.output]}
    bad += [f"{t}: untyped" for n in g.node for t in n.output if t and t not in typed]
    return bad


def _ops(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("name", ALL_FIXTURE_NAMES)
@pytest.mark.parametrize(
    ("cache_update", "max_cache_len"), [("full_buffer", 40), ("full_buffer", 128), ("new_token_only", 64)]
)
def test_static_kv_is_static_and_decodes_the_same(tmp_path, name, max_cache_len, cache_update):
    entry = fixture_entry(name)
    expect = entry["expect"]
    static_kv = StaticKVCachePass(StaticKVConfig(max_cache_len=max_cache_len, cache_update=cache_update))
    if cache_update == "new_token_only" and not expect.new_token_only:
        with pytest.raises(PreconditionError, match=f"cache_update new_token_only: .*{expect.cache_op} '"):
            static_kv(_load(name), make_pass_context())
        return
    result = static_kv(_load(name), make_pass_context())
    static = result.artifacts.primary
    report = result.report

    assert _not_static(static) == []
    hist = _ops(static)
    assert not {"Shape", "Range", "Trilu"} & set(hist), hist
    assert hist.get(expect.cache_op) == expect.cache_op_count
    scatters = expect.cache_op_count if expect.cache_op == "ScatterElements" else None
    assert report.ops_added.get("ScatterElements") == scatters, report.ops_added
    assert any(expect.cache_op in c for c in report.changes)
    if expect.exporter_mask:
        assert any("attention_mask[1]" in d for d in report.dims_fixed)
    else:  # the op held the mask's lengths: they come from cache_position now
        assert "attention_mask" not in {v.name for v in static.graph.inputs}
    path = _check_graph(static, expect, tmp_path / "static")

    contract = _contract(static)
    assert (contract.max_cache_len, contract.cache_update, contract.num_layers) == (
        max_cache_len,
        cache_update,
        entry["config"]["layers"],
    )
    assert contract.num_kv_heads == entry["config"]["kv_heads"]
    assert contract.head_dim == entry["config"]["head_dim"]

    steps = min(24, max_cache_len - len(PROMPT))
    tolerance = expect.tol(1e-4)
    res = verify(str(entry["model_path"]), path, prompt=PROMPT, steps=steps, max_abs_logit_diff=tolerance)
    assert res.passed, [m.failures for m in res.modes.values()]
    for mode in ("teacher_forced", "free_running"):
        m = res.modes[mode]
        assert m.positions == len(PROMPT) + steps
        assert m.top1_agreement == 1.0
        assert m.max_abs_logit_diff <= tolerance
        assert m.first_divergent_step is None


@pytest.mark.parametrize("name", ALL_FIXTURE_NAMES)
def test_first_static_step_equals_original_at_past_zero(tmp_path, name):
    entry = fixture_entry(name)
    expect = entry["expect"]
    model = _load(name)
    kv = find_kv_cache(model)
    has_positions = "position_ids" in {v.name for v in model.graph.inputs}
    static = _static(model, max_cache_len=64)
    contract = _contract(static)
    token = PROMPT[0]

    orig = ort.InferenceSession(str(entry["model_path"]), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[token]], np.int64), "attention_mask": np.ones((1, 1), np.int64)}
    if has_positions:
        feeds["position_ids"] = np.zeros((1, 1), np.int64)
    for past, _ in kv.pairs():  # the head dim from the contract: genai's inputs leave it symbolic
        feeds[past] = np.zeros((1, contract.num_kv_heads, 0, contract.head_dim), expect.dtype)
    want = orig.run(["logits"], feeds)[0]

    sess = ort.InferenceSession(_write(static, tmp_path / "s"), providers=["CPUExecutionProvider"])
    sfeeds = {"input_ids": np.array([[token]], np.int64), "cache_position": np.array([0], np.int64)}
    if contract.inputs.position_ids:
        sfeeds["position_ids"] = np.zeros((1, 1), np.int64)
    if contract.inputs.attention_mask:
        mask = np.zeros((1, 64), np.int64)
        mask[0, 0] = 1
        sfeeds[contract.inputs.attention_mask] = mask
    assert (contract.inputs.attention_mask is not None) == expect.exporter_mask
    for (past, _), shape in zip(contract.cache_pairs(), contract.pair_input_shapes(), strict=True):
        sfeeds[past] = np.zeros(shape, contract.kv_numpy_dtype)
    got = sess.run([contract.logits], sfeeds)[0]
    assert got.dtype == want.dtype == expect.dtype
    np.testing.assert_allclose(got, want, atol=expect.tol(1e-5), rtol=0)


def _rename_cache(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Rename every cache input/output and every node: names must not matter."""
    renamed = onnx.ModelProto()
    renamed.CopyFrom(proto)
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


@pytest.mark.parametrize("name", ALL_FIXTURE_NAMES)
def test_cache_found_by_data_flow_not_names(tmp_path, name):
    entry = fixture_entry(name)
    proto = onnx.load(entry["model_path"])
    renamed = _rename_cache(proto)
    assert not any(i.name.startswith("past_key_values") for i in renamed.graph.input)
    renamed_path = tmp_path / "renamed.onnx"
    onnx.save(renamed, renamed_path)

    plain = _contract(_static(_load(name), max_cache_len=64))
    other_model = _static(model_io.load_model(renamed_path).model, max_cache_len=64)
    other = _contract(other_model)
    assert plain.model_dump(exclude={"cache"}) == other.model_dump(exclude={"cache"})
    # Layer i's key/value of the renamed copy are the tensors that stood for layer i's key/value.
    back = dict(zip([v.name for v in renamed.graph.input], [v.name for v in proto.graph.input], strict=True))
    back |= dict(zip([v.name for v in renamed.graph.output], [v.name for v in proto.graph.output], strict=True))
    for a, b in zip(plain.cache, other.cache, strict=True):
        assert (a.key_in, a.value_in, a.key_out, a.value_out) == (
            back[b.key_in],
            back[b.value_in],
            back[b.key_out],
            back[b.value_out],
        )
    tolerance = entry["expect"].tol(1e-4)
    res = verify(
        str(renamed_path), _write(other_model, tmp_path / "s"), prompt=PROMPT, steps=8, max_abs_logit_diff=tolerance
    )
    assert res.passed, [m.failures for m in res.modes.values()]


def test_graph_without_kv_cache_is_refused_saying_what_was_looked_for():
    model = ir.serde.deserialize_model(
        onnx.parser.parse_model(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            lm (int64[B, S] input_ids) => (float[B, S, 4] logits) {
                table = Constant <value = float[3, 4] {0,1,2,3,4,5,6,7,8,9,10,11}> ()
                logits = Gather (table, input_ids)
            }
            """
        )
    )
    with pytest.raises(PreconditionError) as err:
        StaticKVCachePass(StaticKVConfig(max_cache_len=8))(model, make_pass_context())
    text = str(err.value)
    assert "no KV cache found" in text and "Looked for" in text and "input_ids" in text and "logits" in text


def test_input_files_hash_the_same_after_the_pass(tmp_path):
    """Weights memory-map the input's data file read-only; nothing writes the input files."""
    src = model_io.load_model(fixture_entry("llama_gqa_optimum")["model_path"]).model
    folder = tmp_path / "in"
    folder.mkdir()
    ir.save(src, folder / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=0)
    files = [folder / "model.onnx", folder / "model.onnx.data"]
    before = [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]

    loaded = model_io.load_model(folder / "model.onnx")
    assert loaded.external_files
    static = _static(loaded.model, max_cache_len=40)
    res = verify(str(folder / "model.onnx"), _write(static, tmp_path / "out"), prompt=PROMPT, steps=4)
    assert res.passed, [m.failures for m in res.modes.values()]
    model_io.release_weights(static)
    assert [hashlib.sha256(f.read_bytes()).hexdigest() for f in files] == before
    assert sorted(p.name for p in folder.iterdir()) == ["model.onnx", "model.onnx.data"]


def _tensor_bytes(model: ir.Model) -> dict[str, bytes]:
    """Every initializer's and Constant/ConstantOfShape tensor's bytes, by name."""
    found = {name: v.const_value.tobytes() for name, v in model.graph.initializers.items() if v.const_value}
    for i, node in enumerate(model.graph):
        attr = node.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            found[f"#{i} {node.op_type}"] = attr.as_tensor().tobytes()
    return found


@pytest.mark.parametrize("name", ["llama_gqa_optimum", "llama_gqa_genai"])
def test_the_input_graph_and_its_tensors_are_left_as_they_were(name):
    """The rewritten graphs share the input's tensors (clone): each -inf or weight is replaced, never written."""
    entry = fixture_entry(name)
    src = ir.serde.deserialize_model(onnx.load(str(entry["model_path"])))  # in-memory tensors: writable
    before = _tensor_bytes(src)
    names = [(v.name, v.dtype, str(v.shape)) for v in [*src.graph.inputs, *src.graph.outputs]]
    ops = _ops(src)
    context = make_pass_context(model_path=entry["model_path"])
    StaticKVCachePass(StaticKVConfig(step_lens=[1, 2], max_cache_len=40, prefill_logits="last"))(src, context)
    assert _tensor_bytes(src) == before
    assert [(v.name, v.dtype, str(v.shape)) for v in [*src.graph.inputs, *src.graph.outputs]] == names
    assert _ops(src) == ops and CONTRACT_KEY not in src.metadata_props


def test_max_cache_len_below_step_len_is_refused_by_the_config():
    with pytest.raises(ValidationError, match="step length 2 does not fit cache length 1"):
        StaticKVConfig(max_cache_len=1, step_len=2)


def test_an_already_static_model_is_refused_before_any_pass():
    static = StaticKVCachePass(StaticKVConfig(max_cache_len=64))(
        _load(FIXTURE_NAMES[0]), make_pass_context()
    ).artifacts.primary
    with pytest.raises(PreconditionError, match="already carries"):
        StaticKVCachePass(StaticKVConfig(max_cache_len=64)).check_model(static, PipelineSettings())


def test_more_than_one_graph_is_refused():
    model = _load(FIXTURE_NAMES[0])
    artifacts = ArtifactSet([Artifact("model.onnx", model), Artifact("prefill.onnx", _load(FIXTURE_NAMES[0]))])
    with pytest.raises(PreconditionError, match="one graph"):
        StaticKVCachePass(StaticKVConfig(max_cache_len=40))(artifacts, make_pass_context())


def test_a_static_model_is_refused():
    static = _static(_load(FIXTURE_NAMES[0]), max_cache_len=40)
    with pytest.raises(PreconditionError, match="made static before"):
        StaticKVCachePass(StaticKVConfig(max_cache_len=40))(static, make_pass_context())


def test_probe_uses_the_context_session_factory_and_cleans_up(tmp_path):
    opened = []

    def factory(path):
        opened.append(path)
        return open_session(path)

    context = PassContext(session_factory=factory, scratch_dir=tmp_path)
    result = StaticKVCachePass(StaticKVConfig(max_cache_len=40))(_load("mistral_sw_optimum"), context)
    assert len(opened) == 1
    assert list(tmp_path.iterdir()) == []
    assert any("query-position" in c for c in result.report.changes)


@pytest.mark.parametrize("name", ALL_FIXTURE_NAMES)
def test_step_len_2_graph_matches_pytorch_reference(tmp_path, name):
    """A step_len 2 graph needs the exporter's query positions fed from cache_position (causal mask)."""
    from onnxdeploy.runner import open_decoder

    entry = fixture_entry(name)
    ref = np.load(entry["reference_path"])
    tokens = [int(t) for t in ref["prompt"]] + [int(t) for t in ref["tokens"]]
    static = _static(_load(name), step_len=2, max_cache_len=64, prefill_logits="all")
    decoder = open_decoder(_write(static, tmp_path / "step2"))
    logits = np.stack([logit for logit, _ in decoder.feed(tokens)])
    np.testing.assert_allclose(logits, ref["logits"], atol=entry["expect"].tol(1e-4), rtol=0)


def test_batch_2_graph_verifies(tmp_path):
    static = _static(_load("llama_gqa_torchscript"), batch=2, max_cache_len=48)
    assert _contract(static).batch == 2
    entry = fixture_entry("llama_gqa_torchscript")
    res = verify(str(entry["model_path"]), _write(static, tmp_path / "b2"), prompt=PROMPT, steps=16)
    assert res.passed, [m.failures for m in res.modes.values()]


def _fixed_batch_export(name: str, folder, batch: int = 2) -> str:
    """The fixture with its ``batch_size`` dim fixed to ``batch`` on every graph input and output."""
    proto = onnx.load(fixture_entry(name)["model_path"])
    for vi in [*proto.graph.input, *proto.graph.output]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param == "batch_size":
                d.dim_value = batch
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save(proto, path)
    return str(path)


def test_export_with_a_fixed_batch_of_2_gives_the_same_logits(tmp_path):
    original = _fixed_batch_export("llama_gqa_optimum", tmp_path / "b2")
    model = model_io.load_model(original).model
    with pytest.raises(PreconditionError, match="fixed its batch dim to 2"):
        StaticKVCachePass(StaticKVConfig(max_cache_len=40)).check_model(model, PipelineSettings())
    static = _static(model, batch=2, max_cache_len=40)
    assert [v.shape[0] for v in static.graph.inputs if v.name != "cache_position"] == [2] * 7
    res = verify(original, _write(static, tmp_path / "out"), prompt=PROMPT, steps=12, max_abs_logit_diff=1e-4)
    assert res.passed, [m.failures for m in res.modes.values()]


def test_check_settings_refuses_what_verification_cannot_run():
    cfg_pass = StaticKVCachePass(StaticKVConfig(max_cache_len=16))
    with pytest.raises(ConfigError, match=r"^max_cache_len=16 is smaller than the 6 prompt tokens \+ 32 steps = 38"):
        cfg_pass.check_settings(PipelineSettings(verify_positions=38, verify_prompt_len=6))
    cfg_pass.check_settings(PipelineSettings(verify_positions=16, verify_prompt_len=6))
    cfg_pass.check_settings(PipelineSettings())
    # a prefill bucket verifies now (padded chunks); a set is bounded by its largest cache length
    StaticKVCachePass(StaticKVConfig(max_cache_len=64, step_len=2)).check_settings(
        PipelineSettings(verify_positions=10, verify_prompt_len=6)
    )
    sets = StaticKVCachePass(StaticKVConfig(step_lens=[1, 4], max_cache_lens=[8, 16]))
    sets.check_settings(PipelineSettings(verify_positions=16, verify_prompt_len=6))
    with pytest.raises(ConfigError, match=r"^max_cache_lens=\[8, 16\] is smaller than the 6 prompt tokens"):
        sets.check_settings(PipelineSettings(verify_positions=17, verify_prompt_len=6))


def test_check_settings_lets_every_runtime_verify_a_set_or_chunk_graph():
    """Issue 19: openvino / rknn-sim drive graph sets and step_len > 1 graphs as ONNX Runtime does."""
    on_two = PipelineSettings(verify_runtimes=("onnxruntime", "rknn-sim"))
    for cfg in ({"step_lens": [1, 4], "max_cache_len": 64}, {"step_len": 4, "max_cache_len": 64}):
        StaticKVCachePass(StaticKVConfig(**cfg)).check_settings(on_two)


def test_cache_larger_than_memory_is_refused_before_any_work(monkeypatch):
    import onnxdeploy.passes.static_kv as static_kv

    monkeypatch.setattr(static_kv, "available_memory_bytes", lambda: 16 * 2**30)
    model = _load("llama_gqa_optimum")
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        StaticKVCachePass(StaticKVConfig(max_cache_len=100_000_000)).check_model(model, PipelineSettings())
    assert time.perf_counter() - start < 1.0
    text = str(err.value)
    assert "2 × 2 layers × 1 × 2 heads × 100000000 slots × 16 × 4 bytes × 3 copies = 143.1 GiB" in text
    assert "> 16.0 GiB available" in text
    # 10^7 slots: the cache (14.3 GiB) fits 14.5 GiB, not with its folded constants; 64 slots fit
    monkeypatch.setattr(static_kv, "available_memory_bytes", lambda: int(14.5 * 2**30))
    with pytest.raises(ConfigError, match="folded constants"):
        StaticKVCachePass(StaticKVConfig(max_cache_len=10_000_000)).check_model(model, PipelineSettings())
    StaticKVCachePass(StaticKVConfig(max_cache_len=64)).check_model(model, PipelineSettings())
    # a prefill bucket of 8 tokens over 10^6 slots: the cache (1.7 GiB) fits 2 GiB, folding (2.4 GiB) does not
    monkeypatch.setattr(static_kv, "available_memory_bytes", lambda: 2 * 2**30)
    with pytest.raises(ConfigError, match="folding the mask arithmetic needs ~320 bytes × 1000000 slots × 8"):
        StaticKVCachePass(StaticKVConfig(max_cache_len=1_000_000, step_len=8)).check_model(model, PipelineSettings())


def test_available_memory_reads_cgroup_then_meminfo(tmp_path, monkeypatch):
    from onnxdeploy import resources

    v2, v1, meminfo = tmp_path / "memory.max", tmp_path / "limit_in_bytes", tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    monkeypatch.setattr(resources, "_CGROUP_V2_MAX", v2)
    monkeypatch.setattr(resources, "_CGROUP_V1_LIMIT", v1)
    monkeypatch.setattr(resources, "_MEMINFO", meminfo)
    assert resources.available_memory_bytes() == 2048 * 1024
    v2.write_text("max\n")
    v1.write_text("1000\n")
    assert resources.available_memory_bytes() == 1000
    v2.write_text("1500\n")
    assert resources.available_memory_bytes() == 1500
    meminfo.write_text("MemTotal: 1 kB\n")
    assert resources.available_memory_bytes() == 1500


def test_the_graph_given_to_the_pass_is_left_as_it_was():
    model = model_io.load_model(fixture_entry("llama_gqa_optimum")["model_path"]).model
    before = ir.serde.serialize_model(model).SerializeToString()
    result = StaticKVCachePass(StaticKVConfig(max_cache_len=64))(model, make_pass_context())
    assert result.artifacts.primary is not model
    assert ir.serde.serialize_model(model).SerializeToString() == before
