"""Sessions by path: model_io checks first, weights mapped not copied, scratch copies, closing; one model at a time."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.errors import CacheOverflowError, ConfigError, ContractError, DecodeRunError, ModelLoadError
from onnxdeploy.model_io import read_model_header
from onnxdeploy.runner import decoder as decoder_module
from onnxdeploy.runner import exporter_logits_output, open_decoder, open_session, verify
from onnxdeploy.runner.session import ModelSession
from tests.conftest import fixture_entry
from tests.runner.tiny_decoder import TINY_PROMPT, build_tiny_decoder

FIXTURE = fixture_entry("llama_gqa_optimum")
PROMPT = np.load(FIXTURE["reference_path"])["prompt"].tolist()


def save_external(src: Path, folder: Path, data: str = "model.onnx_data") -> Path:
    """Re-save ``src`` into ``folder`` with every initializer in one external data file ``data``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    ir.save(ir.load(src), path, external_data=data, size_threshold_bytes=0)
    return path


def hugging_face_layout(tmp_path: Path) -> Path:
    """The fixture as ``huggingface_hub`` stores it: ``snapshots/<rev>/model.onnx_data`` links into ``blobs/``."""
    repo = tmp_path / "models--org--tiny"
    snapshot = save_external(FIXTURE["model_path"], repo / "snapshots" / "0123abc").parent
    (repo / "blobs").mkdir()
    os.rename(snapshot / "model.onnx_data", repo / "blobs" / "5e1f")
    (snapshot / "model.onnx_data").symlink_to(Path("..", "..", "blobs", "5e1f"))
    return snapshot / "model.onnx"


def first_logits(path: Path) -> np.ndarray:
    with open_decoder(path) as decoder:
        return np.stack([logits for logits, _ in decoder.feed(PROMPT)])


@pytest.fixture(scope="module")
def fixture_logits() -> np.ndarray:
    return first_logits(FIXTURE["model_path"])


@pytest.fixture
def sessions_created(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the path of every ORT session created."""
    created: list[str] = []
    original_init = ort.InferenceSession.__init__

    def recording_init(self, path, *args, **kwargs):
        created.append(str(path))
        original_init(self, path, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", recording_init)
    return created


# -- options and memory ---------------------------------------------------------------------------------


def test_sessions_map_external_weights_and_do_not_spin(tiny_dir: Path) -> None:
    with open_session(tiny_dir / "exporter.onnx") as loaded:
        options = loaded.session.get_session_options()
        assert options.get_session_config_entry("session.disable_prepacking") == "1"
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert options.intra_op_num_threads == 1 and options.use_deterministic_compute


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_opening_a_session_does_not_copy_a_64_mib_external_weight(tmp_path: Path) -> None:
    n = 4096  # (4096, 4096) float32: 64 MiB
    weight = numpy_helper.from_array(np.ones((n, n), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(tmp_path / "big.onnx"), save_as_external_data=True, location="w.bin", size_threshold=0)
    del model, graph, weight
    before = _rss_bytes()
    with open_session(tmp_path / "big.onnx") as loaded:
        grown = _rss_bytes() - before
        assert grown < 16 * 2**20, f"opening grew RSS by {grown / 2**20:.0f} MiB for a 64 MiB weight"
        (y,) = loaded.session.run(None, {"x": np.ones((1, n), dtype=np.float32)})
        assert y[0, 0] == n


def test_the_header_keeps_the_graph_but_not_inline_weights(tiny_dir: Path) -> None:
    with open_session(tiny_dir / "exporter.onnx") as loaded:
        big = [t for t in loaded.model.graph.initializer if np.prod(t.dims) * 4 > 1024]
        assert big and all(t.data_location == TensorProto.EXTERNAL and not t.raw_data for t in big)
        assert len(loaded.model.graph.node) == len(build_tiny_decoder().graph.node)


# -- refusals come from model_io, before ORT --------------------------------------------------------------


def _edit_location(path: Path, location: str) -> None:
    proto = onnx.load(str(path), load_external_data=False)
    tensor = proto.graph.initializer[len(proto.graph.initializer) // 2]
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(proto, str(path))


@pytest.mark.parametrize("case", ["absolute", "dotdot", "symlink_out", "short", "truncated"])
def test_model_io_refusals_pass_through_unchanged_before_any_session(
    tmp_path: Path, case: str, sessions_created: list[str]
) -> None:
    model = save_external(FIXTURE["model_path"], tmp_path / "model")
    data = model.parent / "model.onnx_data"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data.read_bytes())
    if case == "absolute":
        _edit_location(model, str(outside))
    elif case == "dotdot":
        _edit_location(model, "../outside.bin")
    elif case == "symlink_out":
        (model.parent / "linked.bin").symlink_to(outside)
        _edit_location(model, "linked.bin")
    elif case == "short":
        os.truncate(data, data.stat().st_size - 1)
    else:
        raw = model.read_bytes()
        model.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ModelLoadError) as expected:
        read_model_header(model)
    with pytest.raises(ModelLoadError) as raised:
        open_session(model)
    assert str(raised.value) == str(expected.value)
    assert sessions_created == []


# -- the Hugging Face cache layout --------------------------------------------------------------------------


def test_a_plain_external_data_model_opens_in_place(tmp_path: Path, fixture_logits: np.ndarray) -> None:
    model = save_external(FIXTURE["model_path"], tmp_path / "model")
    with open_session(model) as loaded:
        assert loaded.scratch is None
    np.testing.assert_array_equal(first_logits(model), fixture_logits)


def test_a_hugging_face_cache_model_opens_through_a_scratch_copy_removed_on_close(
    tmp_path: Path, fixture_logits: np.ndarray, sessions_created: list[str]
) -> None:
    model = hugging_face_layout(tmp_path)
    with pytest.raises(Exception, match="escapes model directory"):  # why the scratch copy exists (ORT 1.32)
        ort.InferenceSession(str(model))
    blob = tmp_path / "models--org--tiny" / "blobs" / "5e1f"
    with open_session(model, scratch_root=tmp_path) as loaded:
        scratch = loaded.scratch
        assert scratch is not None and scratch.parent == tmp_path
        linked = [p for p in scratch.iterdir() if p.suffix != ".onnx"]
        assert [os.path.samefile(p, blob) for p in linked] == [True], "weights are hard-linked, not copied"
        assert sessions_created[-1] == str(scratch / "model.onnx")
    assert not scratch.exists() and loaded.session is None
    assert blob.exists()
    np.testing.assert_array_equal(first_logits(model), fixture_logits)


def test_a_session_never_closed_removes_its_scratch_copy_once_collected(tmp_path: Path) -> None:
    """An API caller that drops a session without closing it leaves no onnxdeploy-session-* folder behind."""
    import gc  # noqa: PLC0415

    loaded = open_session(hugging_face_layout(tmp_path), scratch_root=tmp_path)
    scratch = loaded.scratch
    assert scratch is not None and scratch.exists()
    del loaded
    gc.collect()
    assert not scratch.exists()


def test_a_scratch_copy_is_removed_when_ort_refuses_the_model(tmp_path: Path, monkeypatch) -> None:
    model = hugging_face_layout(tmp_path)
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()

    def refuse(self, *args, **kwargs):
        raise RuntimeError("no")

    monkeypatch.setattr(ort.InferenceSession, "__init__", refuse)
    with pytest.raises(ModelLoadError, match="ONNX Runtime cannot load the model: no"):
        open_session(model, scratch_root=scratch_root)
    assert list(scratch_root.iterdir()) == []


# -- closing ----------------------------------------------------------------------------------------------


def test_a_closed_decoder_refuses_to_run(tiny_dir: Path) -> None:
    with open_decoder(tiny_dir / "full_buffer.onnx") as decoder:
        decoder.feed(TINY_PROMPT[:2])
    assert decoder.model_session.session is None
    decoder.close()  # twice is fine
    with pytest.raises(DecodeRunError, match="closed"):
        decoder.feed([1])


def test_open_decoder_closes_the_session_when_the_model_is_refused(tmp_path: Path, monkeypatch) -> None:
    model = build_tiny_decoder()  # ORT runs it, but with two outputs besides the cache, which are the logits?
    model.graph.node.append(helper.make_node("Identity", ["logits"], ["hidden"]))
    model.graph.output.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, None))
    onnx.save(model, str(tmp_path / "two_outputs.onnx"))
    closed: list[str] = []
    original_close = ModelSession.close
    monkeypatch.setattr(ModelSession, "close", lambda self: (closed.append(self.path), original_close(self)))
    with pytest.raises(ContractError, match="one logits output"):
        open_decoder(tmp_path / "two_outputs.onnx")
    assert closed == [str(tmp_path / "two_outputs.onnx")]


# -- verify holds one model at a time ---------------------------------------------------------------------


def test_verify_never_holds_both_models(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    live: list[str] = []
    peak: list[int] = []
    original_open, original_close = decoder_module.open_session, ModelSession.close

    def tracking_open(path, **kwargs):
        session = original_open(path, **kwargs)
        live.append(session.path)
        peak.append(len(live))
        return session

    def tracking_close(self):
        if self.session is not None:
            live.remove(self.path)
        original_close(self)

    monkeypatch.setattr(decoder_module, "open_session", tracking_open)
    monkeypatch.setattr(ModelSession, "close", tracking_close)
    report = verify(tiny_dir / "exporter.onnx", tiny_dir / "full_buffer.onnx", prompt=TINY_PROMPT, steps=4)
    assert report.passed
    assert peak == [1, 1] and live == []


@pytest.mark.parametrize(
    ("candidate", "steps", "prompt", "error"),
    [
        ("step2.onnx", 2, TINY_PROMPT, ConfigError),  # a prefill bucket
        ("short.onnx", 3, TINY_PROMPT, CacheOverflowError),  # 6 + 3 positions > 8 slots
        ("full_buffer.onnx", 2, [*TINY_PROMPT, 32], ConfigError),  # vocabulary is 32
        ("invalid.onnx", 2, TINY_PROMPT, ContractError),  # kv_dtype float64
    ],
)
def test_verify_refuses_a_bad_candidate_before_any_session(
    tiny_dir: Path, tmp_path: Path, candidate: str, steps: int, prompt: list[int], error: type, sessions_created
) -> None:
    path = tiny_dir / candidate
    if candidate == "invalid.onnx":
        model = build_tiny_decoder("full_buffer")
        entry = next(p for p in model.metadata_props if p.key == "onnxdeploy.contract")
        entry.value = entry.value.replace('"kv_dtype":"float32"', '"kv_dtype":"float64"')
        path = tmp_path / candidate
        onnx.save(model, str(path))
    with pytest.raises(error):
        verify(tiny_dir / "exporter.onnx", path, prompt=prompt, steps=steps)
    assert sessions_created == []


# -- exporter convention: the logits output by elimination --------------------------------------------------


def test_exporter_logits_output_is_the_one_output_besides_the_cache() -> None:
    model = build_tiny_decoder()
    assert exporter_logits_output(model) == "logits"
    model.graph.output[0].name = "lm_logits"
    assert exporter_logits_output(model) == "lm_logits"
    model.graph.output.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, None))
    with pytest.raises(ContractError, match=r"one logits output.*\['lm_logits', 'hidden'\]"):
        exporter_logits_output(model)
