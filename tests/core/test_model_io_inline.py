"""model_io on single-file (inline-weight) models: weights mapped where they lie in the .onnx, never copied.

The committed optimum fixture is such a file (optimum writes every model under 2 GB with its weights inline).
Issue 15 item 5: its initializers must be memory-mapped byte ranges of the file, every later stage must handle
them by reference, and a run on it must write the very bytes the same run on the external-data form writes.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper

from onnxdeploy.artifacts import header_only
from onnxdeploy.config import load_pipeline
from onnxdeploy.contract import read_contract
from onnxdeploy.inline_weights import read_header_bytes, write_streamed
from onnxdeploy.mapped_tensor import RangeMappedTensor, unmap
from onnxdeploy.model_io import (
    STAND_IN_THRESHOLD_BYTES,
    check_external_data,
    in_place_tensors,
    input_files,
    load_model,
    read_model_header,
    release_weights,
    stage_artifacts,
    write_for_ort,
)
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.run_stages import graph_io
from onnxdeploy.runner import open_session
from tests.conftest import fixture_entry
from tests.core.test_model_io import save_external, sha256

FIXTURE = Path(fixture_entry("llama_gqa_optimum")["model_path"])
PROMPT = [1, 17, 42, 99, 7]


def _full(path: Path) -> onnx.ModelProto:
    """The model as protobuf parses it, every byte in memory (what the loader must not do)."""
    return onnx.load(str(path), load_external_data=False)


def _mapping(array: np.ndarray) -> object:
    """The object at the bottom of a numpy view chain (an mmap when the array maps a file)."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_the_fixture_is_a_single_file_model():
    full = _full(FIXTURE)
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in full.graph.initializer)
    assert sum(len(t.raw_data) > STAND_IN_THRESHOLD_BYTES for t in full.graph.initializer) >= 10


def test_the_header_references_the_files_own_bytes_and_is_otherwise_what_protobuf_reads():
    full, header = _full(FIXTURE), read_model_header(FIXTURE)
    raw = FIXTURE.read_bytes()
    referenced = 0
    for want, got in zip(full.graph.initializer, header.graph.initializer, strict=True):
        if len(want.raw_data) <= STAND_IN_THRESHOLD_BYTES:
            assert got == want  # small tensors (shapes, axes) stay inline with their data
            continue
        info = {e.key: e.value for e in got.external_data}
        assert got.data_location == onnx.TensorProto.EXTERNAL and info["location"] == FIXTURE.name
        offset, length = int(info["offset"]), int(info["length"])
        assert raw[offset : offset + length] == want.raw_data
        assert (got.name, list(got.dims), got.data_type) == (want.name, list(want.dims), want.data_type)
        referenced += 1
    assert referenced == in_place_tensors(header, FIXTURE) > 0
    full.graph.ClearField("initializer")
    header.graph.ClearField("initializer")
    assert header == full
    assert check_external_data(read_model_header(FIXTURE), FIXTURE) == []  # the .onnx is not a data file
    assert input_files(FIXTURE) == {FIXTURE.resolve()}


def test_loaded_initializers_map_the_file_instead_of_holding_copies():
    loaded = load_model(FIXTURE)
    assert loaded.external_files == [] and loaded.inline_in_place > 0
    full = {t.name: numpy_helper.to_array(t) for t in _full(FIXTURE).graph.initializer}
    large = [v for v in loaded.model.graph.initializers.values() if v.const_value.nbytes > STAND_IN_THRESHOLD_BYTES]
    assert len(large) == loaded.inline_in_place
    for value in large:
        tensor = value.const_value
        assert isinstance(tensor, ir.ExternalTensor) and os.path.samefile(tensor.path, FIXTURE)
        array = tensor.numpy()
        assert isinstance(_mapping(array), mmap.mmap) and not array.flags.writeable
        np.testing.assert_array_equal(array, full[value.name])
        del array
    release_weights(loaded.model)


def test_a_tensor_whose_raw_data_disagrees_with_its_shape_stays_inline_for_the_checks(tmp_path):
    full = _full(FIXTURE)
    bad = next(t for t in full.graph.initializer if len(t.raw_data) > 4 * STAND_IN_THRESHOLD_BYTES)
    bad.raw_data = bad.raw_data[:-4]
    path = tmp_path / "model.onnx"
    onnx.save(full, path)
    header = read_model_header(path)
    kept = next(t for t in header.graph.initializer if t.name == bad.name)
    assert kept.data_location != onnx.TensorProto.EXTERNAL and kept.raw_data == bad.raw_data


def test_bytes_the_walk_cannot_read_fall_back_to_protobuf_and_its_error(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(FIXTURE.read_bytes()[:-7000])  # truncated inside the last field
    assert read_header_bytes(path, STAND_IN_THRESHOLD_BYTES) is None
    with pytest.raises(Exception, match="not an ONNX model|incomplete|cannot read"):
        read_model_header(path)


def test_an_inline_write_streams_the_bytes_protobuf_would_serialize(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    loaded = load_model(FIXTURE)
    staged = stage_artifacts([("model.onnx", loaded.model)], out, external=False, data_name="unused.data")
    staged.commit()
    assert (out / "model.onnx").read_bytes() == ir.serde.serialize_model(ir.load(FIXTURE)).SerializeToString()
    release_weights(loaded.model)


def test_write_streamed_without_stand_ins_is_serialize_to_string(tmp_path):
    proto = _full(FIXTURE)
    with open(tmp_path / "m.onnx", "wb") as fh:
        write_streamed(proto, [], fh)
    assert (tmp_path / "m.onnx").read_bytes() == proto.SerializeToString()


def test_a_session_on_an_inline_model_maps_a_hard_link_of_it(tmp_path):
    with open_session(FIXTURE, scratch_root=tmp_path) as loaded:
        scratch = loaded.scratch
        assert scratch is not None
        data = [p for p in scratch.iterdir() if p.suffix != ".onnx"]
        assert len(data) == 1 and os.path.samefile(data[0], FIXTURE), "weights hard-linked, not copied"
        assert (scratch / "model.onnx").stat().st_size < FIXTURE.stat().st_size / 4
    assert not scratch.exists() and FIXTURE.exists()
    loaded = load_model(FIXTURE)
    path = write_for_ort(loaded.model, tmp_path)
    assert os.path.samefile(tmp_path / "weights-0.bin", FIXTURE) and path.stat().st_size < 200_000
    release_weights(loaded.model)


def _run(tmp_path: Path, model: Path, name: str, extra_pass: str | None) -> Path:
    passes = "  - static_kv: {batch: 1, step_len: 1, max_cache_len: 32}\n"
    if extra_pass:
        passes += f"  - {extra_pass}: {{}}\n"
    pipeline = tmp_path / f"{name}.yaml"
    pipeline.write_text(
        f"model: {model}\noutput_dir: {tmp_path / name}\npasses:\n{passes}cache: null\n"
        f"verify: {{prompt: {PROMPT}, steps: 3, modes: [teacher_forced]}}\n"
    )
    outcome = run_pipeline(load_pipeline(pipeline))
    assert outcome.exit_code == 0, outcome.report.failures
    return tmp_path / name


@pytest.mark.parametrize("form", ["inline", "external"])
def test_a_run_on_the_inline_input_writes_the_bytes_the_external_data_run_writes(tmp_path, form):
    external = save_external(FIXTURE, tmp_path / "external")
    before = sha256(FIXTURE)
    extra = "embed_external_data" if form == "inline" else "externalize"
    from_inline = _run(tmp_path, FIXTURE, "from_inline", extra)
    from_external = _run(tmp_path, external, "from_external", extra)
    files = sorted(p.name for p in from_inline.iterdir() if not p.name.startswith("report"))
    assert files == sorted(p.name for p in from_external.iterdir() if not p.name.startswith("report"))
    assert files == (["model.onnx"] if form == "inline" else ["model.onnx", "model.onnx.data"])
    for name in files:
        assert sha256(from_inline / name) == sha256(from_external / name), name
    assert sha256(FIXTURE) == before  # the input is never written


def test_the_header_walk_maps_nothing(monkeypatch):
    want = read_model_header(FIXTURE)

    def refuse(*args, **kwargs):
        raise AssertionError("the header walk memory-mapped the file")

    monkeypatch.setattr(mmap, "mmap", refuse)  # a map would make whole page-cache folios resident (inline_weights)
    assert read_model_header(FIXTURE) == want


def test_each_weight_maps_only_its_own_byte_range():
    raw = FIXTURE.read_bytes()
    loaded = load_model(FIXTURE)
    large = [
        v.const_value for v in loaded.model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)
    ]
    assert len(large) == loaded.inline_in_place > 0
    for tensor in large:
        assert isinstance(tensor, RangeMappedTensor)
        array = tensor.numpy()
        assert isinstance(_mapping(array), mmap.mmap) and not array.flags.writeable
        assert len(tensor.raw) < tensor.nbytes + mmap.ALLOCATIONGRANULARITY < len(raw)  # not the whole file
        assert tensor.tobytes() == raw[tensor.offset : tensor.offset + tensor.nbytes] == array.tobytes()
        del array
        assert unmap(tensor) and tensor.raw is None
        assert tensor.tobytes() == raw[tensor.offset : tensor.offset + tensor.nbytes]  # maps again when read
    release_weights(loaded.model)


def test_header_only_keeps_what_the_report_reads_and_nothing_else(tmp_path):
    out = _run(tmp_path, FIXTURE, "run", None)
    model = ir.load(out / "model.onnx")
    header = header_only(model)
    assert len(header.graph) == 0 and not header.graph.initializers
    assert read_contract(header) == read_contract(model) is not None
    assert graph_io(header) == graph_io(model)
    assert all(v.producer() is None and not v.uses() for v in [*header.graph.inputs, *header.graph.outputs])
