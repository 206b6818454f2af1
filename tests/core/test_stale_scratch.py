"""Temporary folders of a run killed by SIGKILL: named after their process, removed by the next run (run_scratch.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from onnxdeploy.pipeline import _claimed
from onnxdeploy.run_scratch import (
    RUN_TEMP_PREFIX,
    STAGING_PREFIX,
    host_name,
    owner_tag,
    remove_own,
    remove_stale,
    run_temp_root,
)
from tests.conftest import PROMPT, REPO, fixture_entry


def _dead_pid() -> int:
    """The PID of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_folders_of_dead_processes_on_this_host_are_removed(tmp_path):
    dead, host = _dead_pid(), host_name()
    names = {
        "dead": f"{STAGING_PREFIX}p{dead}-{host}-abc123_x",
        "alive": f"{STAGING_PREFIX}{owner_tag()}zz9",
        "parent": f"{STAGING_PREFIX}p{os.getppid()}-{host}-q1",
        "other host": f"{STAGING_PREFIX}p{dead}-elsewhere_box-abc123",
        "no owner": f"{STAGING_PREFIX}k2j3h4",
        "other prefix": f"{RUN_TEMP_PREFIX}p{dead}-{host}-abc",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(b"x")
    (tmp_path / f"{STAGING_PREFIX}p{dead}-{host}-file").write_text("a file, not a folder")
    removed = remove_stale(tmp_path, STAGING_PREFIX)
    assert removed == [tmp_path / names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(n for k, n in names.items() if k != "dead"), f"{STAGING_PREFIX}p{dead}-{host}-file"]
    )
    assert remove_stale(tmp_path / "missing", STAGING_PREFIX) == []


def test_remove_own_takes_this_processs_folders_only(tmp_path):
    mine = tmp_path / f"{STAGING_PREFIX}{owner_tag()}a1"
    other = tmp_path / f"{STAGING_PREFIX}p{os.getppid()}-{host_name()}-b2"
    for folder in (mine, other):
        folder.mkdir()
    assert remove_own(tmp_path, STAGING_PREFIX) == [mine]
    assert [p.name for p in tmp_path.iterdir()] == [other.name]


def test_a_signal_before_the_staging_folder_is_registered_leaves_nothing(tmp_path):
    """Ctrl-C right after ``mkdtemp`` made the staging folder (the run does not hold its path yet)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("pre-existing")
    with pytest.raises(KeyboardInterrupt), _claimed(out_dir) as run:
        tempfile.mkdtemp(prefix=STAGING_PREFIX + owner_tag(), dir=out_dir)
        assert run.staged is None
        raise KeyboardInterrupt
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"]


def test_the_run_temp_root_holds_the_runs_temporary_folders_and_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"{RUN_TEMP_PREFIX}p{_dead_pid()}-{host_name()}-old1"
    (stale / "onnxdeploy-scratch-x").mkdir(parents=True)
    with run_temp_root() as root:
        assert not stale.exists()
        assert root.parent == tmp_path and root.name.startswith(RUN_TEMP_PREFIX + owner_tag())
        scratch = Path(tempfile.mkdtemp(prefix="onnxdeploy-scratch-"))
        assert scratch.parent == root
    assert not root.exists() and tempfile.gettempdir() == str(tmp_path)


def test_a_run_after_a_killed_one_removes_what_it_left(tmp_path):
    """SIGKILL while the outputs are staged leaves the staging and temp folders; the next run removes them."""
    out_dir, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    pipeline = tmp_path / "pipeline.yaml"
    model = fixture_entry("llama_gqa_optimum")["model_path"]
    pipeline.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "output_dir": str(out_dir),
                "passes": [{"static_kv": {"batch": 1, "step_len": 1, "max_cache_len": 64}}],
                "verify": {"prompt": PROMPT, "steps": 16},
                "cache": None,
            }
        )
    )
    argv = [str(Path(sys.executable).parent / "onnxdeploy"), "run", str(pipeline)]
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    deadline = time.monotonic() + 120
    staged: list[Path] = []
    while proc.poll() is None and time.monotonic() < deadline and not staged:
        staged = list(out_dir.glob(f"{STAGING_PREFIX}*")) if out_dir.is_dir() else []
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before its outputs were staged"
    left_tmp = list(tmp.glob(f"{RUN_TEMP_PREFIX}p{proc.pid}-*"))
    assert staged and all(p.is_dir() and f"p{proc.pid}-" in p.name for p in staged), staged
    assert len(left_tmp) == 1, sorted(tmp.iterdir())

    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    assert "removed 1 staging folder(s) of killed runs" in done.stderr, done.stderr
    assert not list(out_dir.glob(f"{STAGING_PREFIX}*")) and not left_tmp[0].exists()
    assert not list(tmp.glob("onnxdeploy-*")), sorted(tmp.iterdir())
    assert sorted(p.name for p in out_dir.iterdir()) == ["model.onnx", "report.html", "report.json", "report.md"]


def test_a_run_removes_dead_runs_staging_in_the_pass_cache_too(tmp_path):
    """The pass cache stages its entries in its own folder: a killed run's staging there goes as well."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from onnxdeploy.cli import app  # noqa: PLC0415

    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    dead = f"{STAGING_PREFIX}p{_dead_pid()}-{host_name()}-zz1"
    for folder in (out_dir, cache):
        (folder / dead).mkdir(parents=True)
        (folder / dead / "weights.data").write_bytes(b"\0" * 16)
    live = cache / f"{STAGING_PREFIX}{owner_tag()}keep"  # this process: alive
    live.mkdir()
    pipeline = tmp_path / "pipeline.yaml"
    model = fixture_entry("llama_gqa_optimum")["model_path"]
    cfg = {"model": str(model), "output_dir": str(out_dir), "passes": [{"static_kv": {"max_cache_len": 16}}]}
    pipeline.write_text(yaml.safe_dump({**cfg, "verify": {"prompt": PROMPT[:3], "steps": 2}}))
    result = CliRunner().invoke(app, ["run", str(pipeline), "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.output
    assert "removed 2 staging folder(s) of killed runs" in result.stderr, result.stderr
    assert not (out_dir / dead).exists() and not (cache / dead).exists() and live.is_dir()
