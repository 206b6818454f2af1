"""The CLI on model files of every kind: unsafe or broken external data, incomplete files, the Hugging Face
cache layout, external-data inputs and outputs, weights over 2 GiB, unsorted graphs, interrupted runs.

``run``, ``verify`` and ``inspect`` are held to the same answers. Builders live in ``tests/core/test_model_io.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from tests.conftest import PROMPT, REPO
from tests.core.test_model_io import (
    FIXTURE,
    NOT_A_MODEL,
    UNSAFE_KINDS,
    edit_external,
    external_locations,
    hf_cache_model,
    middle_tensor,
    relocate,
    save_external,
    sha256,
    shuffled_fixture,
    unblock_fifo,
    unsafe_model,
)

runner = CliRunner()
COMMANDS = ("run", "verify", "inspect")


def _invoke(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    return result, (result.stdout or "") + (result.stderr or "")


def _pipeline(folder: Path, model: Path, *, steps: int = 4, **overrides) -> Path:
    """A pipeline file in ``folder``: static_kv (64 slots), the default checks, a short verification."""
    cfg = {
        "model": str(model),
        "output_dir": str(folder / "out"),
        "passes": [{"static_kv": {"batch": 1, "step_len": 1, "max_cache_len": 64}}],
        "verify": {"prompt": PROMPT, "steps": steps},
    }
    cfg.update(overrides)
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _argv(command: str, model: Path, workdir: Path) -> list[str]:
    """``command`` on ``model`` (``verify``: as the original, the fixture as the candidate)."""
    if command == "run":
        return ["run", str(_pipeline(workdir, model))]
    if command == "verify":
        return ["verify", str(model), str(FIXTURE), "--steps", "2"]
    return ["inspect", str(model)]


# --------------------------------------------------------------- 1. locations leaving the folder (FIFO targets)

# CLI invocations run in a child process so that a blocked open() of a FIFO cannot hang the test session; one
# child runs them all (CliRunner, one JSON line before and after each), which costs one interpreter start-up
# instead of one per invocation. A child still running at the deadline names the invocation it is stuck in.
_DRIVER = r"""
import json, sys, time
from typer.testing import CliRunner
from onnxdeploy.cli import app

runner = CliRunner()
for key, argv in json.loads(sys.stdin.read()):
    print(json.dumps({"key": key, "started": True}), flush=True)
    start = time.perf_counter()
    result = runner.invoke(app, argv)
    output = (result.stdout or "") + (result.stderr or "")
    print(json.dumps({"key": key, "exit_code": result.exit_code, "output": output,
                      "seconds": time.perf_counter() - start}), flush=True)
"""
_DEADLINE_S = 60


@pytest.fixture(scope="module")
def unsafe_results(tmp_path_factory) -> dict[str, dict]:
    """Every command on a model of every unsafe kind (outside targets are FIFOs), run in one child process."""
    jobs, cases, fifos = [], {}, []
    for kind in UNSAFE_KINDS:
        root = tmp_path_factory.mktemp(kind)
        model, tensor, location, fifo = unsafe_model(root, kind, target="fifo")
        fifos.append(fifo)
        for command in COMMANDS:
            workdir = root / command
            workdir.mkdir()
            key = f"{kind}-{command}"
            cases[key] = {"tensor": tensor, "location": location, "out": workdir / "out"}
            jobs.append((key, _argv(command, model, workdir)))
        # the unsafe model as verify's candidate too
        cases[f"{kind}-verify-candidate"] = {"tensor": tensor, "location": location, "out": None}
        jobs.append((f"{kind}-verify-candidate", ["verify", str(FIXTURE), str(model), "--steps", "2"]))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _DRIVER],
            input=json.dumps(jobs),
            capture_output=True,
            text=True,
            timeout=_DEADLINE_S,
            cwd=REPO,
        )
        stdout, stderr, hung = proc.stdout, proc.stderr, False
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        hung = True
    finally:
        for fifo in fifos:
            unblock_fifo(fifo)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    done = {line["key"]: line for line in lines if "exit_code" in line}
    started = [line["key"] for line in lines if line.get("started")]
    stuck = [key for key in started if key not in done]
    for key, case in cases.items():
        if key in done:
            case.update(done[key])
        else:
            case["missing"] = (
                f"stuck in '{key}' after {_DEADLINE_S} s: it opened the FIFO outside the model's folder"
                if hung and stuck == [key]
                else f"never ran ({'deadline' if hung else 'child exited'}; stuck: {stuck}); stderr: {stderr[-2000:]}"
            )
    return cases


@pytest.mark.parametrize("command", [*COMMANDS, "verify-candidate"])
@pytest.mark.parametrize("kind", UNSAFE_KINDS)
def test_data_outside_the_folder_exits_2_naming_tensor_and_location_without_opening_it(unsafe_results, kind, command):
    case = unsafe_results[f"{kind}-{command}"]
    assert "missing" not in case, case.get("missing")
    assert case["exit_code"] == 2, case["output"]
    assert f"'{case['tensor']}'" in case["output"] and case["location"] in case["output"], case["output"]
    assert case["seconds"] < 15, f"{case['seconds']:.1f} s"
    assert "Traceback" not in case["output"]
    if case["out"] is not None:
        assert not case["out"].exists()


# ------------------------------------------------------------------------------- 2. missing and short data


@pytest.fixture
def external_fixture(tmp_path) -> Path:
    """The fixture re-saved with every initializer in ``model.onnx.data`` (threshold 0)."""
    return save_external(FIXTURE, tmp_path / "model")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_data_file_exits_2_naming_tensor_and_file(tmp_path, external_fixture, command):
    tensor = middle_tensor(external_fixture)
    relocate(external_fixture, tensor, "gone.data")
    result, out = _invoke(*_argv(command, external_fixture, tmp_path))
    assert result.exit_code == 2, out
    assert f"'{tensor}'" in out and "gone.data" in out and "not found" in out, out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_short_data_file_exits_2_naming_tensor_and_file(tmp_path, external_fixture, command):
    data = external_fixture.parent / "model.onnx.data"
    last = onnx.load(str(external_fixture), load_external_data=False).graph.initializer[-1].name
    os.truncate(data, data.stat().st_size - 1)
    result, out = _invoke(*_argv(command, external_fixture, tmp_path))
    assert result.exit_code == 2, out
    assert f"'{last}'" in out and "model.onnx.data" in out and "short" in out, out
    assert not (tmp_path / "out").exists()


def test_data_without_length_fields_loads_and_a_short_file_is_still_caught(tmp_path, external_fixture):
    edit_external(external_fixture, lambda t, e: {k: v for k, v in e.items() if k != "length"})
    result, out = _invoke("inspect", external_fixture, "--json")
    assert result.exit_code == 0, out
    (entry,) = json.loads(result.stdout)["external_data"]
    assert entry["bytes"] == (external_fixture.parent / "model.onnx.data").stat().st_size
    result, out = _invoke("verify", external_fixture, FIXTURE, "--steps", "2", "--max-abs-logit-diff", "0")
    assert result.exit_code == 0, out

    data = external_fixture.parent / "model.onnx.data"
    last = onnx.load(str(external_fixture), load_external_data=False).graph.initializer[-1].name
    os.truncate(data, data.stat().st_size - 4)
    for command in COMMANDS:
        result, out = _invoke(*_argv(command, external_fixture, tmp_path))
        assert result.exit_code == 2, (command, out)
        assert f"'{last}'" in out and "short" in out, (command, out)


# ---------------------------------------------------------------------------- 3. Hugging Face cache layout


def test_hugging_face_cache_layout_is_inspected_and_verifies_exactly(tmp_path):
    model = hf_cache_model(tmp_path)
    result, out = _invoke("inspect", model, "--json")
    assert result.exit_code == 0, out
    assert [e["location"] for e in json.loads(result.stdout)["external_data"]] == ["model.onnx.data"]
    report = tmp_path / "verify.json"
    result, out = _invoke("verify", model, FIXTURE, "--steps", "4", "--max-abs-logit-diff", "0", "--report", report)
    assert result.exit_code == 0, out
    for mode in json.loads(report.read_text())["modes"].values():
        assert mode["max_abs_logit_diff"] == 0.0 and mode["top1_agreement"] == 1.0


def test_a_report_onto_a_hugging_face_snapshot_file_is_refused(tmp_path):
    """The snapshot's data file is a link: writing the report there would replace the cache's link."""
    model = hf_cache_model(tmp_path)
    link = model.parent / "model.onnx.data"
    target = os.readlink(link)
    result, out = _invoke("verify", model, FIXTURE, "--steps", "1", "--report", link)
    assert result.exit_code == 2, out
    assert "input file" in out
    assert link.is_symlink() and os.readlink(link) == target


# ------------------------------------------------------------------------------- 4. not a (whole) model


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(NOT_A_MODEL))
def test_what_is_not_a_whole_model_exits_2_naming_what_is_wrong(tmp_path, case, command):
    build, needle = NOT_A_MODEL[case]
    path = build(tmp_path)
    result, out = _invoke(*_argv(command, path, tmp_path))
    assert result.exit_code == 2, out
    assert needle in out and path.name in out, out
    assert "Traceback" not in out
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------- 6. weights over the protobuf limit


def _big_embedding_model(folder: Path) -> tuple[Path, int]:
    """The fixture with its embedding grown past 2 GiB in a sparse external file (real rows first).

    Returns:
        The model path and the embedding's byte size. Prompt ids stay below the fixture's vocabulary, so
        the Gather reads only real rows and the logits are the fixture's.
    """
    proto = onnx.load(str(FIXTURE))
    inits = {t.name: t for t in proto.graph.initializer}
    gather = next(n for n in proto.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    embedding = inits[gather.input[0]]
    rows = onnx.numpy_helper.to_array(embedding)
    hidden = rows.shape[1]
    big_rows = 2**31 // (hidden * rows.itemsize) + 1024
    nbytes = big_rows * hidden * rows.itemsize
    assert nbytes > 2**31
    folder.mkdir()
    with open(folder / "model.onnx.data", "wb") as fh:
        fh.write(rows.tobytes())
    os.truncate(folder / "model.onnx.data", nbytes)  # the rest is a hole: no disk used
    embedding.ClearField("raw_data")
    del embedding.dims[:]
    embedding.dims.extend([big_rows, hidden])
    embedding.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "model.onnx.data"), ("offset", "0"), ("length", str(nbytes))):
        embedding.external_data.add(key=key, value=value)
    onnx.save(proto, str(folder / "model.onnx"))
    return folder / "model.onnx", nbytes


def test_a_decoder_with_an_embedding_over_2_gib_runs_and_keeps_external_data(tmp_path):
    try:
        model, nbytes = _big_embedding_model(tmp_path / "big")
        result, out = _invoke("run", _pipeline(tmp_path, model, steps=2))
        assert result.exit_code == 0, out
        written = tmp_path / "out" / "model.onnx"
        assert external_locations(written) == {"model.onnx.data"}
        assert (tmp_path / "out" / "model.onnx.data").stat().st_size >= nbytes
        assert written.stat().st_size < 2**20
        report = json.loads((tmp_path / "out" / "report.json").read_text())
        assert report["status"] == "passed" and report["verify"]["passed"]
        session = ort.InferenceSession(str(written), providers=["CPUExecutionProvider"])
        assert np.isfinite(session.run(["logits"], _contract_feed(session))[0]).all()
    finally:
        shutil.rmtree(tmp_path / "out", ignore_errors=True)  # ~2 GiB of real blocks
        shutil.rmtree(tmp_path / "big", ignore_errors=True)


# -------------------------------------------------------------------------- 7. external data in and out


def test_external_data_input_gives_external_output_and_is_not_modified(tmp_path, external_fixture):
    data = external_fixture.parent / "model.onnx.data"
    before = (sha256(external_fixture), sha256(data))
    result, out = _invoke("run", _pipeline(tmp_path, external_fixture), "--json")
    assert result.exit_code == 0, out
    report = json.loads(result.stdout)
    assert report["status"] == "passed" and report["verify"]["passed"]
    written = tmp_path / "out" / "model.onnx"
    assert external_locations(written) == {"model.onnx.data"}
    assert sorted(p.name for p in written.parent.iterdir()) == [
        "model.onnx",
        "model.onnx.data",
        "report.html",
        "report.json",
        "report.md",
    ]
    assert (sha256(external_fixture), sha256(data)) == before
    session = ort.InferenceSession(str(written), providers=["CPUExecutionProvider"])
    assert np.isfinite(session.run(["logits"], _contract_feed(session))[0]).all()


def _contract_feed(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    """One call of a static graph at position 0 (shapes from the session: they are all static)."""
    feed = {}
    for i in session.get_inputs():
        dtype = np.int64 if i.type == "tensor(int64)" else np.float32
        feed[i.name] = np.zeros(i.shape, dtype=dtype)
    feed["input_ids"][:] = 17
    if "attention_mask" in feed:
        feed["attention_mask"][..., 0] = 1
    return feed


# -------------------------------------------------------------------------------------- 8. unsorted graph


def test_an_unsorted_decoder_runs_and_the_report_says_it_was_sorted(tmp_path):
    model = shuffled_fixture(tmp_path)
    result, out = _invoke("run", _pipeline(tmp_path, model), "--json")
    assert result.exit_code == 0, out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "passed" and report["verify"]["passed"]
    assert any("sorted at load" in note for note in report["notes"]), report["notes"]


# ------------------------------------------------------------------------------------- 9. interrupted runs


def _interrupt(tmp_path: Path, trigger: str, sig: int = signal.SIGINT) -> tuple[int, str, Path]:
    """Start ``onnxdeploy run`` and send SIGINT once ``trigger`` happens; return (exit code, stderr, out dir).

    ``trigger`` is a progress line prefix printed on stderr (``pass static_kv``, ``verify:``), or ``staging``:
    the writer's ``.onnxdeploy-*`` folder appearing in the output folder.
    """
    out_dir = tmp_path / "out"
    pipeline = _pipeline(tmp_path, FIXTURE, steps=16)
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "onnxdeploy"), "run", str(pipeline)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if trigger == "staging":
            fired = out_dir.is_dir() and any(p.name.startswith(".onnxdeploy-") for p in out_dir.iterdir())
        else:
            fired = any(line.lstrip("• ").startswith(trigger) for line in list(lines))
        if fired:
            proc.send_signal(sig)
            break
        time.sleep(0.005)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    proc.stdout.close()
    return proc.returncode, "".join(lines), out_dir


@pytest.mark.parametrize(
    ("trigger", "existing", "sig"),
    [
        ("pass static_kv", False, signal.SIGINT),
        ("staging", False, signal.SIGINT),
        ("staging", True, signal.SIGINT),
        ("verify:", False, signal.SIGINT),
        ("verify:", False, signal.SIGTERM),  # CI cancel and `timeout` send SIGTERM
        ("staging", True, signal.SIGHUP),
    ],
)
def test_an_interrupted_run_leaves_nothing_in_the_output_folder(tmp_path, trigger, existing, sig):
    if existing:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "keep.txt").write_text("pre-existing")
    code, err, out_dir = _interrupt(tmp_path, trigger, sig)
    left = sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []
    before = ["keep.txt"] if existing else []
    if code == 0:  # the signal came after the last rename: then the outputs are complete
        assert left == sorted([*before, "model.onnx", "report.html", "report.json", "report.md"]), err
        return
    assert code == 130, err
    assert "interrupted" in err, err
    assert left == before, (left, err)
    assert out_dir.exists() == existing, "a folder the run made is removed again"


def test_run_takes_a_hugging_face_snapshot_whose_model_file_is_a_link_too(tmp_path):
    """In a real cache both files are links into blobs/: the data is looked up beside the link, not the blob."""
    model = hf_cache_model(tmp_path, model_is_link=True)
    result, text = _invoke("run", _pipeline(tmp_path, model))
    assert result.exit_code == 0, text


def test_an_inline_run_removes_an_earlier_runs_data_file(tmp_path):
    out = tmp_path / "out"
    model = REPO / "fixtures/llama_gqa/optimum/model.onnx"
    passes = [{"static_kv": {"batch": 1, "step_len": 1, "max_cache_len": 64}}]
    result, text = _invoke("run", _pipeline(tmp_path, model, passes=[*passes, {"externalize": {}}]))
    assert result.exit_code == 0 and (out / "model.onnx.data").exists(), text  # an earlier, external run's
    result, text = _invoke("run", _pipeline(tmp_path, model))
    assert result.exit_code == 0, text
    assert not (out / "model.onnx.data").exists()
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "report.html", "report.json", "report.md"]
