"""The per-pass cache and determinism: cold runs give the same bytes, a warm run is served from the cache and says
so per pass, a changed config, model or tool version misses, the size bound and a broken entry are handled.

Runs go through the CLI in-process (typer's CliRunner) on the LLaMA optimum fixture.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml
from typer.testing import CliRunner

import onnxdeploy.pass_cache as pass_cache
from onnxdeploy import cache_entries
from onnxdeploy.cli import app
from onnxdeploy.config import load_pipeline
from onnxdeploy.model_io import load_model
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.run_stages import open_pass_cache
from tests.conftest import PROMPT, fixture_entry

runner = CliRunner()
FIXTURE = fixture_entry("llama_gqa_optimum")["model_path"]
GRAPH_SET = {"static_kv": {"max_cache_lens": [32, 64], "step_lens": [1, 4]}}
TIMING_KEYS = {
    "wall_time_s",
    "latency_ms",
    "reference_latency_ms",
    "latency_ms_candidate",
    "latency_ms_reference",
    "prefill",
    "reference_prefill",
    "phases",
    "rss_growth_bytes",
}
"""Report keys that hold timings or memory readings (they differ between identical runs)."""


def _pipeline(folder: Path, model: Path = FIXTURE, *, passes=None, verify=None, **extra) -> Path:
    cfg = {
        "model": str(model),
        "output_dir": str(folder / "out"),
        "passes": passes if passes is not None else [GRAPH_SET, {"mask_rewrite": {}}],
        "verify": verify,
        **extra,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(pipeline: Path, out: Path, *args: str) -> dict:
    result = runner.invoke(app, ["run", str(pipeline), "--output-dir", str(out), "--json", *args])
    assert result.exit_code == 0, (result.stdout or "") + (result.stderr or "")
    return json.loads(result.stdout)


def _artifacts(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if not p.name.startswith("report.")}


def _without_timings(obj, out: Path):
    """The report with timing/memory keys dropped and the output folder's path replaced by a placeholder."""
    if isinstance(obj, dict):
        return {k: _without_timings(v, out) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list):
        return [_without_timings(v, out) for v in obj]
    if isinstance(obj, str):
        return obj.replace(str(out), "<out>")
    return obj


def test_two_cold_runs_give_identical_bytes_and_a_warm_run_is_served_from_the_cache(tmp_path):
    pipeline = _pipeline(tmp_path, verify={"prompt": PROMPT, "steps": 4, "modes": ["teacher_forced"]})
    cache = tmp_path / "cache"
    cold = _run(pipeline, tmp_path / "a", "--cache-dir", str(cache))
    other = _run(pipeline, tmp_path / "b", "--no-cache", "--cache-dir", str(tmp_path / "unused"))
    assert not (tmp_path / "unused").exists(), "--no-cache neither reads nor writes a cache"
    assert [p["cache"] for p in cold["passes"]] == ["stored", "stored"]
    assert [p["cache"] for p in other["passes"]] == ["off", "off"]
    files = _artifacts(tmp_path / "a")
    assert sorted(files) == sorted(_artifacts(tmp_path / "b").keys()) and len(files) == 5  # 4 graphs + weights
    assert files == _artifacts(tmp_path / "b")
    a, b = (_without_timings(r, tmp_path / d) for r, d in ((cold, "a"), (other, "b")))
    for report in (a, b):
        for p in report["passes"]:
            p.pop("cache")
    assert a == b

    warm = _run(pipeline, tmp_path / "w", "--cache-dir", str(cache))
    assert [p["cache"] for p in warm["passes"]] == ["hit", "hit"]
    assert _artifacts(tmp_path / "w") == files, "an artifact served from the cache is the same bytes"
    assert warm["verify"]["passed"] and "verify" in [ph["name"] for ph in warm["phases"]], "verify is never cached"
    stripped = _without_timings(warm, tmp_path / "w")
    assert stripped["graphs"] == a["graphs"] and stripped["findings"] == a["findings"]
    text = runner.invoke(app, ["run", str(pipeline), "--output-dir", str(tmp_path / "t"), "--cache-dir", str(cache)])
    assert "(cached)" in text.stdout and "from the cache" in text.stderr, text.stdout + text.stderr


def test_a_changed_config_model_or_version_misses_the_cache(tmp_path, monkeypatch):
    model = tmp_path / "m" / "model.onnx"
    model.parent.mkdir()
    shutil.copy2(FIXTURE, model)
    cache = tmp_path / "cache"
    two = [{"static_kv": {"max_cache_len": 32}}, {"mask_rewrite": {}}]

    def states(passes, path=model, **extra) -> list[str]:
        report = _run(_pipeline(tmp_path, path, passes=passes, **extra), tmp_path / "out", "--cache-dir", str(cache))
        return [p["cache"] for p in report["passes"]]

    assert states(two) == ["stored", "stored"]
    assert states(two) == ["hit", "hit"]
    assert states([two[0], {"mask_rewrite": {"padding": True}}]) == ["hit", "stored"]  # the prefix still hits
    assert states([{"static_kv": {"max_cache_len": 48}}, two[1]]) == ["stored", "stored"]

    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, touched: the default key misses
    assert states(two) == ["stored", "stored"]
    assert states(two) == ["hit", "hit"]

    versions = pass_cache.cache_versions()
    monkeypatch.setattr(pass_cache, "cache_versions", lambda: {**versions, "onnxruntime": "0.0.0"})
    assert states(two) == ["stored", "stored"]
    monkeypatch.undo()
    assert pass_cache.cache_versions()["onnxdeploy_code"] == pass_cache.code_digest()
    monkeypatch.setattr(pass_cache, "code_digest", lambda: "edited")  # a fixed pass, same version number
    assert states(two) == ["stored", "stored"]
    monkeypatch.undo()

    full = {"cache": {"full_hash": True}}
    assert states(two, **full) == ["stored", "stored"]  # full_hash is another key
    copy = tmp_path / "copy" / "model.onnx"
    copy.parent.mkdir()
    shutil.copy(model, copy)  # another path and mtime, same bytes
    assert states(two, copy, **full) == ["hit", "hit"]
    assert states(two, copy) == ["stored", "stored"]  # size + mtime: a copy is another model


def test_another_output_name_misses_and_a_hit_never_writes_over_the_input(tmp_path):
    """A fresh user's repro: run a filled the cache; run b (output_dir = the input's folder, output_name other.onnx)
    was served a's entry with a's file names and wrote model.onnx over its input."""
    folder = tmp_path / "in"
    folder.mkdir()
    model = folder / "model.onnx"
    shutil.copy2(FIXTURE, model)
    before = model.read_bytes()
    cache = tmp_path / "cache"
    passes = [{"static_kv": {"max_cache_len": 48}}]
    a = _run(_pipeline(tmp_path / "a", model, passes=passes), tmp_path / "o3", "--cache-dir", str(cache))
    assert [p["cache"] for p in a["passes"]] == ["stored"]
    b = _run(
        _pipeline(tmp_path / "b", model, passes=passes, output_name="other.onnx"), folder, "--cache-dir", str(cache)
    )
    assert [p["cache"] for p in b["passes"]] == ["stored"], "another output_name is another key"
    assert model.read_bytes() == before, "the input is never written"
    assert (folder / "other.onnx").is_file()
    again = _run(
        _pipeline(tmp_path / "b", model, passes=passes, output_name="other.onnx"), folder, "--cache-dir", str(cache)
    )
    assert [p["cache"] for p in again["passes"]] == ["hit"] and model.read_bytes() == before
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("report.")) == ["model.onnx", "other.onnx"]


def test_the_size_bound_and_a_broken_entry(tmp_path):
    passes = [{"static_kv": {"max_cache_len": 32}}]
    cache = tmp_path / "cache"
    report = _run(
        _pipeline(tmp_path, passes=passes, cache={"max_bytes": 0}), tmp_path / "out", "--cache-dir", str(cache)
    )
    assert report["passes"][0]["cache"] == "not_stored"
    assert any("exceed cache.max_bytes=0" in n for n in report["notes"]), report["notes"]

    pipeline = _pipeline(tmp_path, passes=passes)
    assert _run(pipeline, tmp_path / "out", "--cache-dir", str(cache))["passes"][0]["cache"] == "stored"
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert sorted(p.name for p in entry.iterdir()) == ["checksums.json", "entry.json", "model.onnx", "weights.data"]
    (entry / "weights.data").unlink()  # e.g. a clean-up that removed files, not folders
    report = _run(pipeline, tmp_path / "out", "--cache-dir", str(cache))
    assert report["passes"][0]["cache"] == "stored"
    assert any("unreadable" in n for n in report["notes"]), report["notes"]
    assert (entry / "weights.data").is_file(), "the broken entry was replaced"

    passes2 = [{"static_kv": {"max_cache_len": 48}}]
    size = sum(p.stat().st_size for p in entry.iterdir())
    bound = {"cache": {"max_bytes": int(size * 1.5)}}  # room for one entry: the older one goes
    report = _run(_pipeline(tmp_path, passes=passes2, **bound), tmp_path / "out", "--cache-dir", str(cache))
    assert report["passes"][0]["cache"] == "stored"
    assert [p.name for p in cache.iterdir() if p.is_dir()] != [entry.name] and not entry.exists()


def test_a_later_pass_runs_on_a_cached_matmulnbits_prefix(tmp_path):
    """Small initializers of a cached entry live in its data file: passes after the hit must still read them."""
    cache = {"dir": str(tmp_path / "cache")}
    quantized = [{"static_kv": {"max_cache_len": 64}}, {"quantize_weights": {"bits": 4, "format": "matmulnbits"}}]
    _run(_pipeline(tmp_path / "a", passes=quantized, cache=cache), tmp_path / "a" / "out")
    report = _run(
        _pipeline(tmp_path / "b", passes=[*quantized, {"pin_opset": {"opset": 17}}], cache=cache),
        tmp_path / "b" / "out",
    )
    assert [p["cache"] for p in report["passes"]] == ["hit", "hit", "stored"]


def test_the_entry_a_run_was_served_from_is_not_evicted_under_it(tmp_path):
    one = [{"static_kv": {"max_cache_len": 64}}]
    _run(_pipeline(tmp_path / "a", passes=one, cache={"dir": str(tmp_path / "cache")}), tmp_path / "a" / "out")
    # about 0.6 MB an entry: storing the second one goes over the bound, and the least recently used entry is
    # the one this run reads its weights from
    small = {"dir": str(tmp_path / "cache"), "max_bytes": 1_000_000}
    report = _run(_pipeline(tmp_path / "b", passes=[*one, {"mask_rewrite": {}}], cache=small), tmp_path / "b" / "out")
    assert [p["cache"] for p in report["passes"]] == ["hit", "stored"]


def test_verify_each_pass_runs_every_pass_instead_of_the_cache(tmp_path):
    cache = {"dir": str(tmp_path / "cache")}
    one = [{"static_kv": {"max_cache_len": 64}}]
    verify = {"prompt": PROMPT, "steps": 4}
    _run(_pipeline(tmp_path / "a", passes=one, cache=cache, verify=verify), tmp_path / "a" / "out")
    report = _run(
        _pipeline(tmp_path / "b", passes=one, cache=cache, verify=verify, verify_each_pass=True), tmp_path / "b" / "out"
    )
    assert [p["cache"] for p in report["passes"]] == ["off"]
    assert [p["name"] for p in report["pass_verification"]] == ["static_kv"]


def _flip_a_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupted_entry_of_the_right_size_is_a_miss_and_is_dropped(tmp_path):
    passes = [{"static_kv": {"max_cache_len": 32}}]
    cache = tmp_path / "cache"
    pipeline = _pipeline(tmp_path, passes=passes)
    assert _run(pipeline, tmp_path / "cold", "--cache-dir", str(cache))["passes"][0]["cache"] == "stored"
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    for name, offset in (("weights.data", 1000), ("model.onnx", 200)):
        _flip_a_byte(entry / name, offset)  # same size: only a digest can tell
        report = _run(pipeline, tmp_path / name, "--cache-dir", str(cache))
        assert report["passes"][0]["cache"] == "stored", name  # a miss: the pass ran and stored a good entry
        assert any(f"{name}: sha256" in n and "dropped" in n for n in report["notes"]), report["notes"]
        assert _artifacts(tmp_path / name) == _artifacts(tmp_path / "cold"), "the corrupted bytes were served"
    assert _run(pipeline, tmp_path / "warm", "--cache-dir", str(cache))["passes"][0]["cache"] == "hit"


def test_an_entry_another_run_is_reading_is_not_evicted_until_it_lets_go(tmp_path):
    """A run served from an entry holds a shared flock on it until the run ends; another run's eviction skips it."""
    one = [{"static_kv": {"max_cache_len": 64}}]
    cache = {"dir": str(tmp_path / "cache")}
    _run(_pipeline(tmp_path / "a", passes=one, cache=cache), tmp_path / "a" / "out")
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    reader = open_pass_cache(
        load_pipeline(_pipeline(tmp_path / "r", passes=one, cache=cache)), load_model(FIXTURE), [], make_pass_context()
    )
    assert reader is not None and reader.lookup() is not None  # the other run, still going
    small = {**cache, "max_bytes": 1_000_000}  # about 0.6 MB an entry: one entry fits
    other = _run(_pipeline(tmp_path / "b", passes=[{"static_kv": {"max_cache_len": 48}}], cache=small), tmp_path / "b")
    assert other["passes"][0]["cache"] == "stored" and entry.is_dir(), "evicted while another run reads it"
    reader.close()
    _run(_pipeline(tmp_path / "c", passes=[{"static_kv": {"max_cache_len": 40}}], cache=small), tmp_path / "c")
    assert not entry.exists(), "once released it is the least recently used entry again"


def test_cache_notes_are_printed_on_stderr_never_on_stdout_and_not_with_quiet(tmp_path):
    cache = tmp_path / "cache"
    passes = [{"static_kv": {"max_cache_len": 64}}]

    def run(name: str, *args: str, passes=passes, **extra):
        pipeline = _pipeline(tmp_path / name, passes=passes, **extra)
        argv = ["run", str(pipeline), "-o", str(tmp_path / name / "out"), "--cache-dir", str(cache), *args]
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.stdout + result.stderr
        assert "pass cache" not in result.stdout, result.stdout
        return result

    cold = run("cold").stderr
    assert "pass cache: nothing stored for these 1 pass(es)" in cold and "pass cache: stored" in cold, cold
    warm = run("warm", "--json")
    json.loads(warm.stdout)
    assert "pass cache: passes static_kv from the cache" in warm.stderr, warm.stderr
    assert "pass cache" not in run("quiet", "--quiet").stderr
    # about 0.6 MB an entry: storing another evicts the least recently used one, and says so
    small = run("small", passes=[{"static_kv": {"max_cache_len": 48}}], cache={"max_bytes": 1_000_000}).stderr
    assert "pass cache: evicted 1 least recently used entry" in small, small


def test_a_pass_that_keeps_every_weight_adds_no_copy_of_the_weights(tmp_path):
    cache = tmp_path / "cache"
    passes = [{"static_kv": {"max_cache_len": 64}}, {"grouped_attention": {}}]  # the second moves no weight
    pipeline = _pipeline(tmp_path, passes=passes)
    cold = runner.invoke(app, ["run", str(pipeline), "-o", str(tmp_path / "a"), "--cache-dir", str(cache)])
    assert cold.exit_code == 0 and "weights.data hard-linked to pass 1's" in cold.stderr, cold.stderr
    keys = open_pass_cache(load_pipeline(pipeline), load_model(FIXTURE), [], make_pass_context()).keys
    first, second = (cache / key / "weights.data" for key in keys)
    assert first.stat().st_ino == second.stat().st_ino and first.stat().st_nlink == 2
    apparent = sum(p.stat().st_size for key in keys for p in (cache / key).iterdir())
    assert cache_entries.disk_usage(cache)[0] == apparent - first.stat().st_size, "the size bound counts one copy"
    assert [p["cache"] for p in _run(pipeline, tmp_path / "b", "--cache-dir", str(cache))["passes"]] == ["hit", "hit"]


def test_a_changed_target_default_misses(tmp_path, monkeypatch):
    """static_kv reads the target's cache_write default through the pass context: a changed matrix file must miss."""
    import onnxdeploy.matrices as matrices  # noqa: PLC0415

    cache = tmp_path / "cache"
    pipeline = _pipeline(tmp_path, passes=[{"static_kv": {"max_cache_len": 32}}], target="rknn-rk3588")
    cold = runner.invoke(app, ["run", str(pipeline), "-o", str(tmp_path / "a"), "--cache-dir", str(cache)])
    assert cold.exit_code in (0, 1), cold.stderr
    config = load_pipeline(pipeline)
    config.cache.dir = cache
    same = open_pass_cache(config, load_model(FIXTURE), [], make_pass_context(target="rknn-rk3588"))
    assert same.lookup() is not None, "the unchanged target is served from the cache"
    same.close()
    real = matrices.get_target("rknn-rk3588")
    assert real.defaults.cache_write == "where"
    changed = real.model_copy(update={"defaults": real.defaults.model_copy(update={"cache_write": "scatter_nd"})})
    monkeypatch.setattr(matrices, "get_target", lambda name: changed if name == "rknn-rk3588" else real)
    other = open_pass_cache(config, load_model(FIXTURE), [], make_pass_context(target="rknn-rk3588"))
    assert other.keys != same.keys and other.lookup() is None, "a changed default is a miss"
