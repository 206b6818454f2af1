"""model_io: header checks, external-data safety, loading by reference, the staged shared-weights writer.

Every model here is a real fixture export, re-saved with external data where a test needs it. Locations
that leave the model's folder point at a FIFO: opening it would block, so a check that opened the file
instead of refusing it first is caught by a deadline rather than passing by luck.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxdeploy.errors import ModelLoadError
from onnxdeploy.model_io import (
    check_external_data,
    input_files,
    load_model,
    read_model_header,
    stage_artifacts,
    write_for_ort,
)
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import Artifact, ArtifactSet
from onnxdeploy.passes.external_data import EmbedExternalDataPass, ExternalizePass
from tests.conftest import fixture_entry

FIXTURE = fixture_entry("llama_gqa_optimum")["model_path"]

# ------------------------------------------------------------------------------------------ model builders
# (also used by tests/core/test_cli_model_files.py)


def sha256(path: Path) -> str:
    """The sha256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_external(src: Path, folder: Path, name: str = "model.onnx", data: str = "model.onnx.data") -> Path:
    """Re-save ``src`` into ``folder`` with every initializer in one external data file ``data``."""
    (folder / data).parent.mkdir(parents=True, exist_ok=True)
    path = folder / name
    ir.save(ir.load(src), path, external_data=data, size_threshold_bytes=0)
    return path


def edit_external(path: Path, edit: Callable[[onnx.TensorProto, dict[str, str]], dict[str, str] | None]) -> None:
    """Rewrite the external-data entries of ``path``'s header in place (tensor data is never touched).

    ``edit(tensor, entries)`` returns the new entries of that tensor, or None to keep them.
    """
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        new = edit(tensor, {e.key: e.value for e in tensor.external_data})
        if new is not None:
            del tensor.external_data[:]
            for key, value in new.items():
                tensor.external_data.add(key=key, value=value)
    onnx.save(proto, str(path))


def middle_tensor(path: Path) -> str:
    """The name of an external initializer half-way through the header (earlier ones stay valid)."""
    inits = onnx.load(str(path), load_external_data=False).graph.initializer
    return inits[len(inits) // 2].name


def relocate(path: Path, tensor: str, location: str) -> None:
    """Point one tensor's external data at ``location`` (offset and length kept)."""
    edit_external(path, lambda t, e: {**e, "location": location} if t.name == tensor else None)


UNSAFE_KINDS = ("dotdot", "absolute", "symlinked_folder", "symlinked_file")


def unsafe_model(tmp_path: Path, kind: str, *, target: str = "fifo") -> tuple[Path, str, str, Path]:
    """A fixture copy one of whose tensors reads data outside the model's folder.

    Args:
        tmp_path: scratch root; the model goes to ``tmp_path/model/``, the outside data to ``tmp_path/outside/``.
        kind: ``dotdot`` (``../outside/…``), ``absolute``, ``symlinked_folder`` (``shards/`` links outside),
            ``symlinked_file`` (a data file in the folder that is a symlink to the outside file).
        target: ``fifo`` (any open() blocks) or ``copy`` (a regular file holding the right bytes).

    Returns:
        ``(model path, tensor name, location, outside file)``.
    """
    model = save_external(FIXTURE, tmp_path / "model")
    outside = tmp_path / "outside"
    outside.mkdir()
    target_file = outside / "weights.bin"
    if target == "fifo":
        os.mkfifo(target_file)
    else:
        target_file.write_bytes((model.parent / "model.onnx.data").read_bytes())
    location = {
        "dotdot": "../outside/weights.bin",
        "absolute": str(target_file),
        "symlinked_folder": "shards/weights.bin",
        "symlinked_file": "weights.bin",
    }[kind]
    if kind == "symlinked_folder":
        (model.parent / "shards").symlink_to(outside, target_is_directory=True)
    elif kind == "symlinked_file":
        (model.parent / "weights.bin").symlink_to(target_file)
    tensor = middle_tensor(model)
    relocate(model, tensor, location)
    return model, tensor, location, target_file


def unblock_fifo(fifo: Path) -> None:
    """Give a reader blocked in ``open(fifo)`` a writer, so its open returns (then EOF)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def within_deadline(fn: Callable[[], object], fifo: Path | None, seconds: float = 20.0) -> object:
    """Call ``fn`` in a thread; fail the test if it is still running after ``seconds`` (it opened the FIFO)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            unblock_fifo(fifo)
        thread.join(5)
        pytest.fail(f"still running after {seconds} s: the file outside the model's folder ({fifo}) was opened")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def hf_cache_model(tmp_path: Path, *, model_is_link: bool = True) -> Path:
    """The fixture in a Hugging Face cache layout; returns ``…/snapshots/<rev>/model.onnx``.

    ``models--org--name/snapshots/<rev>/model.onnx.data`` is a relative symlink into ``…/blobs/<sha>``, as
    ``huggingface_hub`` writes it; with ``model_is_link`` the ``.onnx`` is one too.
    """
    plain = save_external(FIXTURE, tmp_path / "plain")
    repo = tmp_path / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / "0123abcd"
    blobs = repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        blob = blobs / sha256(plain.parent / name)
        os.replace(plain.parent / name, blob)
        if name == "model.onnx" and not model_is_link:
            os.replace(blob, snapshot / name)
        else:
            (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot / "model.onnx"


def one_token_feed(path: Path | str) -> dict[str, np.ndarray]:
    """Exporter-convention inputs for one token (id 17) at position 0 with an empty cache."""
    header = onnx.load(str(path), load_external_data=False)
    feed: dict[str, np.ndarray] = {}
    for vi in header.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        if vi.name == "input_ids":
            feed[vi.name] = np.array([[17]], dtype=np.int64)
        elif vi.name in ("attention_mask", "position_ids"):
            feed[vi.name] = np.array([[1]] if vi.name == "attention_mask" else [[0]], dtype=np.int64)
        else:  # past K/V (B, H_kv, past, D): batch 1, no past
            feed[vi.name] = np.zeros([1, dims[1], 0, dims[3]], dtype=np.float32)
    return feed


def ort_logits(path: Path | str) -> np.ndarray:
    """Logits of one decode call on ONNX Runtime (CPU), opened by path."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], one_token_feed(path))[0]


@pytest.fixture(scope="module")
def fixture_weights() -> dict[str, np.ndarray]:
    """Every initializer of the fixture as a numpy array, by name."""
    return {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(FIXTURE)).graph.initializer}


@pytest.fixture(scope="module")
def fixture_logits() -> np.ndarray:
    """The fixture's logits for :func:`one_token_feed`."""
    return ort_logits(FIXTURE)


def assert_weights_equal(model: ir.Model, expected: dict[str, np.ndarray]) -> None:
    """Every initializer of ``model`` equals the fixture's, bit for bit (and none is missing or extra)."""
    got = {name: v.const_value.numpy() for name, v in model.graph.initializers.items()}
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)


# ------------------------------------------------------------------------------ external-data location safety


@pytest.mark.parametrize("target", ["fifo", "copy"])
@pytest.mark.parametrize("kind", UNSAFE_KINDS)
def test_a_location_leaving_the_folder_is_refused_before_anything_is_opened(tmp_path, kind, target):
    model, tensor, location, outside = unsafe_model(tmp_path, kind, target=target)
    for fn in (read_model_header, load_model):
        with pytest.raises(ModelLoadError) as err:
            within_deadline(lambda fn=fn: fn(model), outside if target == "fifo" else None)
        text = str(err.value)
        assert f"tensor '{tensor}'" in text and f"'{location}'" in text, text
        assert {"dotdot": "'..'", "absolute": "absolute", "symlinked_folder": "symlinked folder"}.get(
            kind, "symlink"
        ) in text, text


def test_symlinks_that_stay_inside_the_folder_are_followed(tmp_path, fixture_weights):
    model = save_external(FIXTURE, tmp_path / "model", data="real/model.onnx.data")
    (model.parent / "alias").symlink_to("real", target_is_directory=True)
    (model.parent / "linked.data").symlink_to(Path("real", "model.onnx.data"))
    half = middle_tensor(model)
    edit_external(model, lambda t, e: {**e, "location": "alias/model.onnx.data" if t.name < half else "linked.data"})
    assert_weights_equal(load_model(model).model, fixture_weights)


def test_a_blob_linking_outside_the_cache_is_refused(tmp_path):
    """The Hugging Face exception follows the link to its end: a blob that is itself a link out is refused."""
    model = hf_cache_model(tmp_path)
    blob = Path(os.path.realpath(model.parent / "model.onnx.data"))
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)
    blob.unlink()
    blob.symlink_to(fifo)
    with pytest.raises(ModelLoadError, match="symlink") as err:
        within_deadline(lambda: read_model_header(model), fifo)
    assert "model.onnx.data" in str(err.value)


@pytest.mark.parametrize("where", ["not_a_snapshot", "other_sibling"])
def test_a_symlink_into_a_blobs_folder_is_refused_outside_the_hugging_face_layout(tmp_path, where):
    model = hf_cache_model(tmp_path)
    repo = model.parent.parent.parent
    blob = os.path.realpath(model.parent / "model.onnx.data")
    if where == "not_a_snapshot":  # same files, but the model's folder is not …/snapshots/<rev>/
        moved = repo / "checkout"
        os.rename(model.parent, moved)
        model = moved / "model.onnx"
    else:  # the link leaves for a sibling of blobs/, not blobs/ itself
        other = repo / "refs"
        other.mkdir()
        os.rename(blob, other / "weights")
        (model.parent / "model.onnx.data").unlink()
        (model.parent / "model.onnx.data").symlink_to(other / "weights")
    with pytest.raises(ModelLoadError, match="symlink"):
        read_model_header(model)


@pytest.mark.parametrize("model_is_link", [True, False])
def test_hugging_face_cache_layout_loads_and_opens_in_ort_through_write_for_ort(
    tmp_path, model_is_link, fixture_weights, fixture_logits
):
    model = hf_cache_model(tmp_path, model_is_link=model_is_link)
    (entry,) = check_external_data(read_model_header(model), model)
    assert entry.path.parent.name == "blobs" and entry.location == "model.onnx.data"
    loaded = load_model(model)
    assert_weights_equal(loaded.model, fixture_weights)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    written = write_for_ort(loaded.model, scratch)
    np.testing.assert_array_equal(ort_logits(written), fixture_logits)
    data = [p for p in scratch.iterdir() if p.suffix != ".onnx"]
    blob = Path(os.path.realpath(model.parent / "model.onnx.data"))
    assert [os.path.samefile(p, blob) for p in data] == [True], "mapped weights must be linked, not copied"


# ---------------------------------------------------------------------------------- missing and short files


def test_a_missing_data_file_is_refused_naming_the_tensor_and_the_file(tmp_path):
    model = save_external(FIXTURE, tmp_path / "model")
    tensor = middle_tensor(model)
    relocate(model, tensor, "gone.data")
    with pytest.raises(ModelLoadError) as err:
        load_model(model)
    text = str(err.value)
    assert f"tensor '{tensor}'" in text and "gone.data" in text and "not found" in text, text


def test_a_short_data_file_is_refused_naming_the_tensor_and_the_file(tmp_path):
    model = save_external(FIXTURE, tmp_path / "model")
    data = model.parent / "model.onnx.data"
    last = onnx.load(str(model), load_external_data=False).graph.initializer[-1].name
    os.truncate(data, data.stat().st_size - 1)
    with pytest.raises(ModelLoadError) as err:
        load_model(model)
    text = str(err.value)
    assert f"tensor '{last}'" in text and str(data) in text and "short" in text, text


def test_a_tensor_without_length_takes_it_from_shape_and_dtype(tmp_path, fixture_weights):
    model = save_external(FIXTURE, tmp_path / "model")
    edit_external(model, lambda t, e: {k: v for k, v in e.items() if k != "length"})
    header = onnx.load(str(model), load_external_data=False)
    assert not any(e.key == "length" for t in header.graph.initializer for e in t.external_data)
    (entry,) = check_external_data(read_model_header(model), model)
    assert entry.bytes_needed == (model.parent / "model.onnx.data").stat().st_size
    assert_weights_equal(load_model(model).model, fixture_weights)

    data = model.parent / "model.onnx.data"
    os.truncate(data, data.stat().st_size - 4)
    with pytest.raises(ModelLoadError, match=rf"tensor '{header.graph.initializer[-1].name}'.*short"):
        load_model(model)


def test_a_length_disagreeing_with_the_shape_is_refused(tmp_path):
    model = save_external(FIXTURE, tmp_path / "model")
    tensor = middle_tensor(model)
    edit_external(model, lambda t, e: {**e, "length": str(int(e["length"]) - 4)} if t.name == tensor else None)
    with pytest.raises(ModelLoadError, match=rf"'{tensor}'.*length"):
        read_model_header(model)


# ------------------------------------------------------------------------------------ not a (whole) model


def _without_opset_import(tmp_path: Path) -> Path:
    proto = onnx.load(str(FIXTURE))
    proto.ClearField("opset_import")
    path = tmp_path / "no_opset.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def _cut_before_opset_import(tmp_path: Path) -> Path:
    """The fixture's bytes cut where ``opset_import`` starts (protobuf writes fields by number: graph is 7,
    opset_import 8), i.e. a file whose writer stopped after the graph."""
    full = FIXTURE.read_bytes()
    head = onnx.load(str(FIXTURE))
    for name in ("opset_import", "metadata_props", "training_info", "functions", "configuration"):
        head.ClearField(name)
    prefix = head.SerializeToString()
    assert full.startswith(prefix) and len(prefix) < len(full)
    path = tmp_path / "cut.onnx"
    path.write_bytes(prefix)
    return path


def _cut_mid_graph(tmp_path: Path) -> Path:
    path = tmp_path / "half.onnx"
    path.write_bytes(FIXTURE.read_bytes()[: FIXTURE.stat().st_size // 2])
    return path


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    return path


def _folder(tmp_path: Path) -> Path:
    path = tmp_path / "folder.onnx"
    path.mkdir()
    return path


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "notes.onnx"
    path.write_text("model: not really\n# a YAML file saved under the wrong name\n")
    return path


NOT_A_MODEL = {
    "no_opset_import": (_without_opset_import, "no opset_import"),
    "cut_before_opset_import": (_cut_before_opset_import, "no opset_import"),
    "cut_mid_graph": (_cut_mid_graph, "not an ONNX model"),
    "empty": (_empty, "empty"),
    "folder": (_folder, "folder"),
    "text": (_text, "ONNX model"),
}
"""name -> (builder(tmp_path) -> path, what the error must say); also used by the CLI tests."""


@pytest.mark.parametrize("case", sorted(NOT_A_MODEL))
def test_what_is_not_a_whole_model_is_refused_naming_what_is_wrong(tmp_path, case):
    build, needle = NOT_A_MODEL[case]
    path = build(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    assert needle in str(err.value) and str(path) in str(err.value), str(err.value)


@pytest.mark.parametrize("model_is_link", [True, False])
def test_input_files_of_a_hugging_face_snapshot_are_the_blobs_it_reads(tmp_path, model_is_link):
    model = hf_cache_model(tmp_path, model_is_link=model_is_link)
    assert input_files(model) == {Path(os.path.realpath(model.parent / n)) for n in ("model.onnx", "model.onnx.data")}


# ---------------------------------------------------------------------------------------------- loading


def test_loaded_weights_map_the_input_read_only(tmp_path):
    model = save_external(FIXTURE, tmp_path / "model")
    before = sha256(model.parent / "model.onnx.data")
    loaded = load_model(model)
    tensor = next(iter(loaded.model.graph.initializers.values())).const_value
    assert isinstance(tensor, ir.ExternalTensor)
    array = tensor.numpy()
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array[0] = 0
    assert sha256(model.parent / "model.onnx.data") == before


def shuffled_fixture(tmp_path: Path, seed: int = 0) -> Path:
    """The fixture with its node order shuffled (fixed seed), saved inline."""
    proto = onnx.load(str(FIXTURE))
    nodes = list(proto.graph.node)
    random.Random(seed).shuffle(nodes)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    path = tmp_path / "shuffled.onnx"
    onnx.save(proto, str(path))
    return path


def test_an_unsorted_graph_is_sorted_at_load_and_says_so(tmp_path, fixture_logits):
    loaded = load_model(shuffled_fixture(tmp_path))
    assert loaded.sorted_at_load and "sorted at load" in loaded.sorted_at_load
    seen: set[str] = {v.name for v in loaded.model.graph.inputs} | set(loaded.model.graph.initializers)
    for node in loaded.model.graph:
        assert all(v is None or v.name in seen or v.name == "" for v in node.inputs), node.name
        seen.update(v.name for v in node.outputs)
    assert load_model(FIXTURE).sorted_at_load is None
    (tmp_path / "ort").mkdir()
    np.testing.assert_array_equal(ort_logits(write_for_ort(loaded.model, tmp_path / "ort")), fixture_logits)


# ---------------------------------------------------------------------------------------------- writing


def external_locations(path: Path) -> set[str]:
    header = onnx.load(str(path), load_external_data=False)
    return {
        e.value
        for t in header.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for e in t.external_data
        if e.key == "location"
    }


def test_two_graphs_of_one_model_share_one_data_file(tmp_path, fixture_logits):
    loaded = load_model(save_external(FIXTURE, tmp_path / "in"))
    copy = loaded.model.clone()
    assert copy is not loaded.model
    for name, value in copy.graph.initializers.items():
        assert value.const_value is loaded.model.graph.initializers[name].const_value, name
    out = tmp_path / "out"
    out.mkdir()
    staged = stage_artifacts(
        [("model.onnx", loaded.model), ("prefill.onnx", copy)], out, external=True, data_name="model.onnx.data"
    )
    staged.commit()
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.onnx.data", "prefill.onnx"]
    large = sum(v.const_value.nbytes for v in loaded.model.graph.initializers.values() if v.const_value.nbytes > 1024)
    assert (out / "model.onnx.data").stat().st_size == large  # each shared tensor once, densely packed
    for name in ("model.onnx", "prefill.onnx"):
        assert external_locations(out / name) == {"model.onnx.data"}, name
        np.testing.assert_array_equal(ort_logits(out / name), fixture_logits, err_msg=name)


def test_a_copied_graph_shares_its_small_initializers_too(tmp_path):
    model = load_model(FIXTURE).model
    copy = model.clone()
    out = tmp_path / "out"
    out.mkdir()
    stage_artifacts(
        [("model.onnx", model), ("prefill.onnx", copy)],
        out,
        external=True,
        data_name="model.onnx.data",
        size_threshold_bytes=0,
    ).commit()
    assert (out / "model.onnx.data").stat().st_size == sum(
        v.const_value.nbytes for v in model.graph.initializers.values()
    )


def _stage(model: ir.Model, out: Path, *, external: bool = True) -> list[Path]:
    out.mkdir(exist_ok=True)
    return stage_artifacts([("model.onnx", model)], out, external=external, data_name="model.onnx.data").commit()


def test_saving_twice_gives_identical_bytes_and_replaces_an_existing_data_file(tmp_path):
    model = load_model(save_external(FIXTURE, tmp_path / "in")).model
    first = {p.name: p.read_bytes() for p in _stage(model, tmp_path / "a")}
    assert sorted(first) == ["model.onnx", "model.onnx.data"]
    assert {p.name: p.read_bytes() for p in _stage(model, tmp_path / "b")} == first
    assert {p.name: p.read_bytes() for p in _stage(model, tmp_path / "a")} == first  # again, after commit

    stale = tmp_path / "c"
    stale.mkdir()
    (stale / "model.onnx.data").write_bytes(b"\xff" * (3 * len(first["model.onnx.data"])))
    assert {p.name: p.read_bytes() for p in _stage(model, stale)} == first
    assert sorted(p.name for p in stale.iterdir()) == ["model.onnx", "model.onnx.data"]


def test_discard_leaves_nothing(tmp_path):
    model = load_model(save_external(FIXTURE, tmp_path / "in")).model
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("pre-existing")
    staged = stage_artifacts([("model.onnx", model)], out, external=True, data_name="model.onnx.data")
    staged.add_text("report.json", "{}")
    assert staged.staging.parent == out and (staged.staging / "model.onnx.data").is_file()
    staged.discard()
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_a_commit_stopped_between_renames_leaves_no_new_file(tmp_path, monkeypatch, error):
    """SIGINT (or a failing rename) after the data file was renamed but before the graph: nothing new stays."""
    import onnxdeploy.model_io as model_io

    model = load_model(save_external(FIXTURE, tmp_path / "in")).model
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("pre-existing")
    staged = stage_artifacts([("model.onnx", model)], out, external=True, data_name="model.onnx.data")
    staged.add_text("report.json", "{}")
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise error("stopped between renames")
        real_replace(src, dst)

    monkeypatch.setattr(model_io.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt if error is KeyboardInterrupt else model_io.OutputError):
        staged.commit()
    assert len(calls) == 2
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_externalize_then_embed_gives_the_fixture_weights(tmp_path, fixture_weights, fixture_logits):
    artifacts = ArtifactSet([Artifact("model.onnx", load_model(FIXTURE).model)])
    assert not artifacts.external()
    artifacts = ExternalizePass()(artifacts, make_pass_context()).artifacts
    assert artifacts.external()
    (ext,) = [
        p for p in _stage(artifacts.primary, tmp_path / "ext", external=artifacts.external()) if p.suffix == ".onnx"
    ]
    assert external_locations(ext) == {"model.onnx.data"}
    reloaded = load_model(ext)
    assert reloaded.external_files
    assert_weights_equal(reloaded.model, fixture_weights)

    back = ArtifactSet([Artifact("model.onnx", reloaded.model)], input_was_external=True)
    assert back.external()  # auto keeps an external input external
    back = EmbedExternalDataPass()(back, make_pass_context()).artifacts
    assert not back.external()
    written = _stage(back.primary, tmp_path / "inline", external=back.external())
    assert [p.name for p in written] == ["model.onnx"]
    proto = onnx.load(str(written[0]), load_external_data=False)
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    assert {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}.keys() == fixture_weights.keys()
    for t in proto.graph.initializer:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(t), fixture_weights[t.name], err_msg=t.name)
    np.testing.assert_array_equal(ort_logits(written[0]), fixture_logits)


@pytest.mark.parametrize(
    ("location", "needle"),
    [("model.onnx.data/", "names a folder"), (".", "names a folder"), ("sub\\model.onnx.data", "separator")],
)
def test_locations_runtimes_cannot_read_are_refused_at_load(tmp_path, location, needle):
    path = save_external(FIXTURE, tmp_path)
    relocate(path, middle_tensor(path), location)
    with pytest.raises(ModelLoadError, match=needle):
        read_model_header(path)


def test_an_unknown_external_data_key_is_refused_naming_it(tmp_path):
    path = save_external(FIXTURE, tmp_path)
    name = middle_tensor(path)
    edit_external(path, lambda t, e: {**e, "compression": "zstd"} if t.name == name else None)
    with pytest.raises(ModelLoadError, match=rf"'{name}'.*unknown external_data key.*compression"):
        read_model_header(path)


def test_a_tensor_defined_twice_is_refused_naming_both_producers(tmp_path):
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y) { t = Relu (x) t = Neg (x) y = Abs (t) }
        """
    )
    path = tmp_path / "twice.onnx"
    onnx.save(model, path)
    with pytest.raises(ModelLoadError, match=r"tensor 't' is defined twice.*Relu.*Neg"):
        load_model(path)


def test_input_files_survives_locations_the_loader_refuses(tmp_path):
    path = save_external(FIXTURE, tmp_path)
    relocate(path, middle_tensor(path), "bad\x00name")
    assert Path(path).resolve() in input_files(path)  # no exception: the loader names the problem later


def test_externalize_with_threshold_0_keeps_small_integer_tensors_inline_and_runs(tmp_path):
    from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig

    # folding leaves the shape arithmetic as small int64 initializers (Reshape shapes, Unsqueeze axes)
    model = StaticKVCachePass(StaticKVConfig(max_cache_len=64))(
        load_model(FIXTURE).model, make_pass_context()
    ).artifacts.primary
    staged = stage_artifacts([("model.onnx", model)], tmp_path, external=True, data_name="model.onnx.data",
                             size_threshold_bytes=0)  # fmt: skip
    staged.commit()
    header = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    inline = [t for t in header.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    assert inline and all(t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.BOOL) for t in inline)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in header.graph.initializer)
    # it loads: ORT reads shape operands at session creation and cannot take them from external data
    ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
