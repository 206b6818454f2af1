"""How ``onnxdeploy run`` scales with model size, on both input forms: peak memory and wall time.

For each size, a LLaMA-shaped decoder (4 KV heads, intermediate ≈ 2.7 × hidden, fp32, seeded random init) is
exported once with the TorchScript flat-KV path of the fixtures (``fixtures/_export_scale.py`` in the fixtures'
``torchscript`` venv, made by ``fixtures/make_fixtures.py``) into ``WORK_DIR/models/SIZE/`` as ``model.onnx`` +
one external data file, and cached there. Below the 2 GiB protobuf limit it is also saved **inline** (one
``.onnx`` with every weight in it, the form the TorchScript exporter and optimum write below 2 GB) into
``WORK_DIR/models/SIZE-inline/`` (``onnx.load`` + ``onnx.save``, in a subprocess; cached). Then, interleaved in one run:

1. baseline: ``onnx.load`` + ``onnx.save(save_as_external_data=True)`` of the external form, in a subprocess;
2. for each chain, ``onnxdeploy run pipeline.yaml --json`` on each input form (external, then inline) in a
   subprocess: ``basic`` is ``static_kv {batch: 1, step_len: 1, max_cache_len: 64}``; ``fast`` is issue 15's
   chain ``static_kv {step_lens: [1, 16], max_cache_lens: [128, 512]}`` → ``mask_rewrite`` →
   ``grouped_attention`` → ``fuse_matmuls``; both with the default checks and an 8-step verify;
3. the baseline again.

Each subprocess's peak RSS is the largest sum of RSS over the process and all its descendants, sampled from
``/proc`` every 50 ms; ``ru_maxrss`` from ``wait4`` (the largest single process) is a cross-check. Peak PSS
(``smaps_rollup``, every 250 ms) counts a file page shared by several mappings once: were a graph set's ORT
sessions each to map the one weights file (ORT's own mappings), RSS would count its pages once per session and PSS
once; the runner maps it once for all of them, so the two agree. Printed:
peak RSS / model bytes (the form's ``.onnx`` + data file), the inline run's peak against the external run's
of the same chain, wall time / baseline wall time (mean of the two baselines), and each run's per-phase times
and peak RSS from ``report.json``; for each fast-chain output, the step-1 graph's p50 latency with the runner's
shared weight map (``runner/shared_weights.py``) against ORT's own per-session mappings, interleaved in one
subprocess (:data:`STEP_PROBE`). Figures are not asserted: a run that fails or refuses the model (exit 1 or 2)
is printed and the benchmark goes on; it exits non-zero only when something crashed (an export, a baseline, or
an ``onnxdeploy`` run killed by a signal or ending without its JSON). Usage::

    .venv/bin/python benchmarks/scale.py [--sizes 1g,2.4g] [--forms external,inline] [--chains basic,fast]
                                         [--work-dir /tmp/onnxdeploy-scale] [--keep]

``--sizes tiny`` (hidden 256, 2 layers, 15 MB) is a quick smoke run. Exports are always kept (delete
``WORK_DIR/models`` to remake them); ``--keep`` also keeps each run's output model and the baseline copies.
Results go to stdout and ``WORK_DIR/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
ONNXDEPLOY = REPO / ".venv" / "bin" / "onnxdeploy"
DATA_NAME = "model.onnx.data"
PAGE = os.sysconf("SC_PAGE_SIZE")
CHAINS: dict[str, list[dict[str, Any]]] = {
    "basic": [{"static_kv": {"batch": 1, "step_len": 1, "max_cache_len": 64}}],
    "fast": [
        {"static_kv": {"batch": 1, "step_lens": [1, 16], "max_cache_lens": [128, 512]}},
        {"mask_rewrite": {}},
        {"grouped_attention": {}},
        {"fuse_matmuls": {}},
    ],
}
"""The pass chains measured (issue 15: the fast chain is the one SmolLM2-135M goes through)."""
FORMS = ("external", "inline")
PROTOBUF_LIMIT_BYTES = 2**31 - 1
VERIFY = {"prompt": [1, 17, 42, 99, 7, 3], "steps": 8}
GB = 1e9


@dataclass(frozen=True)
class ModelSize:
    """A LLaMA shape; ``vocab`` is derived from ``target_bytes`` (untied embedding + LM head) unless given."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    target_bytes: int | None = None
    vocab: int | None = None

    def body_params(self) -> int:
        """Parameters outside the embedding and LM head (attention, MLP, norms)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + self.hidden

    def vocab_size(self) -> int:
        """The vocabulary: given, or sized (a multiple of 128) so fp32 weights total about ``target_bytes``."""
        if self.vocab is not None:
            return self.vocab
        assert self.target_bytes is not None
        rows = (self.target_bytes / 4 - self.body_params()) / (2 * self.hidden)
        return int(round(rows / 128)) * 128

    def llama_config(self) -> dict[str, Any]:
        """``LlamaConfig`` keyword arguments (JSON-able)."""
        return {
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size(),
            "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
        }


SIZES = {
    "tiny": ModelSize("tiny", hidden=256, layers=2, heads=8, kv_heads=4, head_dim=32, intermediate=704, vocab=4096),
    "1g": ModelSize("1g", hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=64, intermediate=2752,
                    target_bytes=int(1.0 * GB)),
    "2.4g": ModelSize("2.4g", hidden=1536, layers=20, heads=24, kv_heads=4, head_dim=64, intermediate=4160,
                      target_bytes=int(2.4 * GB)),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Process-tree memory
# ---------------------------------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from ``/proc/*/stat`` (this kernel has no ``/proc/PID/task/*/children``)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def tree_rss(root: int) -> int:
    """Sum of the resident set sizes (bytes) of ``root`` and all its descendants now."""
    tree, todo, total = _children(), [root], 0
    while todo:
        pid = todo.pop()
        todo += tree.get(pid, [])
        try:
            with open(f"/proc/{pid}/statm", "rb") as fh:
                total += int(fh.read().split()[1]) * PAGE
        except OSError:
            pass
    return total


def tree_pss(root: int) -> int:
    """Sum of the proportional set sizes (bytes; ``/proc/PID/smaps_rollup`` ``Pss``) of ``root`` and its descendants.

    Unlike RSS, a file page several mappings share (each ORT session of a graph set maps the one weights file) is
    counted once in all, split between them: PSS is what the tree really holds.
    """
    tree, todo, total = _children(), [root], 0
    while todo:
        pid = todo.pop()
        todo += tree.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
                for line in fh:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


@dataclass
class Measured:
    """One subprocess: exit code, wall time (s), peak tree RSS and PSS (bytes), ``ru_maxrss`` (bytes), outputs."""

    cmd: list[str]
    exit_code: int
    wall_s: float
    peak_tree_rss: int
    peak_tree_pss: int
    ru_maxrss: int
    samples: int
    stdout: str
    stderr_tail: str


def measure(cmd: list[str], log_dir: Path, tag: str, env: dict[str, str] | None = None, interval: float = 0.05):
    """Run ``cmd`` to completion, sampling the RSS of its whole process tree every ``interval`` seconds.

    Args:
        cmd: the command line.
        log_dir: where ``TAG.stdout`` and ``TAG.stderr`` are written.
        tag: file name stem of the logs.
        env: environment (default: this process's).
        interval: sampling period in seconds.

    Returns:
        A :class:`Measured`; ``exit_code`` is negative when a signal ended the process.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / f"{tag}.stdout", log_dir / f"{tag}.stderr"
    peak, pss, samples, stop = [0], [0], [0], threading.Event()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], tree_rss(proc.pid))
                if samples[0] % 5 == 0:  # smaps_rollup walks the page tables: every 5th sample (250 ms)
                    pss[0] = max(pss[0], tree_pss(proc.pid))
                samples[0] += 1
                stop.wait(interval)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        stop.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: keep Popen from waiting again
    stderr = err_path.read_text(errors="replace")
    return Measured(
        cmd=[str(c) for c in cmd],
        exit_code=proc.returncode,
        wall_s=wall,
        peak_tree_rss=peak[0],
        peak_tree_pss=pss[0],
        ru_maxrss=usage.ru_maxrss * 1024,  # KiB on Linux
        samples=samples[0],
        stdout=out_path.read_text(errors="replace"),
        stderr_tail="\n".join(stderr.strip().splitlines()[-15:]),
    )


# ---------------------------------------------------------------------------------------------------------
# Exports (cached)
# ---------------------------------------------------------------------------------------------------------
def export_env(work: Path) -> dict[str, str]:
    """The fixtures' offline environment for the export venv (no hub, no user site, reproducible hashing)."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(work / "hf_home"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.pop("PYTHONPATH", None)
    return env


def model_bytes(folder: Path) -> int:
    """Bytes of ``model.onnx`` plus its data file (none for the inline form)."""
    return sum((folder / n).stat().st_size for n in ("model.onnx", DATA_NAME) if (folder / n).exists())


def cached_export(folder: Path, size: ModelSize) -> dict[str, Any] | None:
    """The export's info if ``folder`` holds a complete export of exactly this config, else None."""
    try:
        info = json.loads((folder / "export.json").read_text())
        files = {n: (folder / n).stat().st_size for n in info["files"]}
    except (OSError, ValueError, KeyError):
        return None
    if info.get("config") != size.llama_config() or files != info["files"]:
        return None
    return info


def ensure_export(size: ModelSize, work: Path, venv_dir: Path) -> tuple[dict[str, Any], Measured | None]:
    """Reuse or make ``WORK/models/SIZE/{model.onnx, model.onnx.data}``.

    Returns:
        The export info (``fixtures/_export_scale.py``'s JSON) and, when it was made now, its measurement.

    Raises:
        RuntimeError: the export failed (its log is named).
    """
    folder = work / "models" / size.name
    info = cached_export(folder, size)
    if info is not None:
        return info, None
    sys.path.insert(0, str(FIXTURES))
    import make_fixtures  # the fixtures' pinned venvs (stdlib only)

    py = make_fixtures.ensure_venv(venv_dir, "torchscript")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = folder / "config.json"
    cfg.write_text(json.dumps(size.llama_config(), indent=2) + "\n")
    print(f"[{size.name}] exporting {size.llama_config()} ...", flush=True)
    m = measure([str(py), str(FIXTURES / "_export_scale.py"), cfg, folder, folder / "export.json.tmp"],
                folder, "export", env=export_env(work))  # fmt: skip
    if m.exit_code != 0:
        raise RuntimeError(f"export of {size.name} failed (exit {m.exit_code}); see {folder}/export.stderr\n"
                           f"{m.stderr_tail}")  # fmt: skip
    info = json.loads((folder / "export.json.tmp").read_text())
    info["measured"] = {"wall_s": round(m.wall_s, 2), "peak_tree_rss": m.peak_tree_rss, "ru_maxrss": m.ru_maxrss}
    (folder / "export.json").write_text(json.dumps(info, indent=2) + "\n")
    (folder / "export.json.tmp").unlink()
    return info, m


INLINE = textwrap.dedent(
    """
    import sys
    import onnx
    onnx.save(onnx.load(sys.argv[1]), sys.argv[2])  # external data read in, saved without: every weight inline
    """
)


def ensure_inline(size: ModelSize, work: Path) -> tuple[Path | None, str | None]:
    """Reuse or make ``WORK/models/SIZE-inline/model.onnx``, the external export saved with its weights inline.

    Returns:
        (the inline model, None), or (None, why not): over the 2 GiB protobuf limit, or the save failed.
    """
    source = work / "models" / size.name
    folder = work / "models" / f"{size.name}-inline"
    if model_bytes(source) > PROTOBUF_LIMIT_BYTES:
        return None, f"{_gb(model_bytes(source))}: over the 2 GiB protobuf limit, no single-file form exists"
    stamp = {"from": (source / DATA_NAME).stat().st_mtime_ns, "config": size.llama_config()}
    try:
        if json.loads((folder / "inline.json").read_text()) == stamp and (folder / "model.onnx").is_file():
            return folder / "model.onnx", None
    except (OSError, ValueError):
        pass
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"[{size.name}] saving the inline form ...", flush=True)
    m = measure(
        [sys.executable, "-c", INLINE, str(source / "model.onnx"), str(folder / "model.onnx")], folder, "inline"
    )
    if m.exit_code != 0:
        return None, f"saving the inline form failed (exit {m.exit_code}): {m.stderr_tail}"
    (folder / "inline.json").write_text(json.dumps(stamp) + "\n")
    return folder / "model.onnx", None


# ---------------------------------------------------------------------------------------------------------
# Baseline and run
# ---------------------------------------------------------------------------------------------------------
BASELINE = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import onnx
    src, dst = sys.argv[1:3]
    t1 = time.perf_counter()
    model = onnx.load(src)
    t2 = time.perf_counter()
    onnx.save(model, dst, save_as_external_data=True, all_tensors_to_one_file=True, location=sys.argv[3])
    t3 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "save_s": t3 - t2}))
    """
)


def baseline(model: Path, dest_dir: Path, tag: str) -> tuple[Measured, dict[str, float]]:
    """``onnx.load`` + ``onnx.save`` (one external data file) of ``model`` into a fresh ``dest_dir``."""
    shutil.rmtree(dest_dir, ignore_errors=True)  # onnx appends to an existing data file
    dest_dir.mkdir(parents=True)
    m = measure([sys.executable, "-c", BASELINE, str(model), str(dest_dir / "model.onnx"), DATA_NAME],
                dest_dir.parent, tag)  # fmt: skip
    if m.exit_code != 0:
        raise RuntimeError(f"baseline {tag} failed (exit {m.exit_code}):\n{m.stderr_tail}")
    return m, json.loads(m.stdout.strip().splitlines()[-1])


def write_pipeline(model: Path, run_dir: Path, passes: list[dict[str, Any]]) -> Path:
    """The benchmark's pipeline file for ``model`` and ``passes``, writing into ``RUN_DIR/out`` (default checks).

    Values are written as JSON, which YAML reads as flow scalars and mappings.
    """
    lines = [f"model: {json.dumps(str(model))}", f"output_dir: {json.dumps(str(run_dir / 'out'))}", "passes:"]
    lines += [f"  - {json.dumps(p)[1:-1]}" for p in passes]
    lines.append(f"verify: {json.dumps(VERIFY)}")
    lines.append("cache: null  # the pipeline's own cost: no pass cache read or stored")
    path = run_dir / "pipeline.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_onnxdeploy(exe: Path, pipeline: Path, run_dir: Path) -> tuple[Measured, dict[str, Any] | None]:
    """``EXE run PIPELINE --json``; returns the measurement and the report (or JSON error), if any."""
    shutil.rmtree(run_dir / "out", ignore_errors=True)
    m = measure([str(exe), "run", str(pipeline), "--json"], run_dir, "run")
    report_file = run_dir / "out" / "report.json"
    for text in (report_file.read_text() if report_file.exists() else "", m.stdout):
        try:
            doc = json.loads(text)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return m, doc
    return m, None


def timings(report: dict[str, Any]) -> dict[str, float]:
    """Every time-like number the report carries outside the passes and per-step records.

    Keys ending in ``_s`` or holding ``time``, candidate/reference latency P50s, and ``rss_growth_bytes``,
    by dotted path (e.g. ``verify.modes.teacher_forced.latency_ms.p50``).
    """
    found: dict[str, float] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                sub = f"{path}.{key}" if path else key
                if sub == "passes" or key in ("steps", "op_histogram_before", "op_histogram_after"):
                    continue
                if isinstance(value, int | float) and not isinstance(value, bool):
                    timed = key.endswith("_s") or "time" in key or key == "rss_growth_bytes"
                    if timed or (key == "p50" and "latency" in path):
                        found[sub] = float(value)
                else:
                    walk(value, sub)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(report, "")
    return found


@dataclass
class RunResult:
    """One ``onnxdeploy run`` of one chain on one input form."""

    form: str
    chain: str
    model_bytes: int
    run: dict[str, Any] = field(default_factory=dict)
    status: str | None = None
    error: str | None = None
    passes: list[dict[str, Any]] = field(default_factory=list)
    report_timings: dict[str, float] = field(default_factory=dict)
    phases: list[dict] = field(default_factory=list)
    crashed: bool = False
    step_latency: dict[str, Any] = field(default_factory=dict)


@dataclass
class SizeResult:
    """Everything measured for one model size."""

    size: str
    config: dict[str, Any]
    model_bytes: int = 0
    export: dict[str, Any] = field(default_factory=dict)
    export_made_now: bool = False
    baselines: list[dict[str, Any]] = field(default_factory=list)
    runs: list[RunResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    crashed: bool = False


def run_once(exe: Path, model: Path, form: str, chain: str, run_dir: Path) -> RunResult:
    """``onnxdeploy run`` of ``chain`` on ``model`` (the ``form`` input), measured; its report's figures."""
    run_dir.mkdir(parents=True, exist_ok=True)
    res = RunResult(form=form, chain=chain, model_bytes=model_bytes(model.parent))
    m, report = run_onnxdeploy(exe, write_pipeline(model, run_dir, CHAINS[chain]), run_dir)
    res.run = {k: v for k, v in asdict(m).items() if k != "stdout"}
    res.crashed = m.exit_code not in (0, 1, 2) or report is None
    if report is None:
        res.error = (m.stderr_tail.splitlines() or ["(no output)"])[-1]
        return res
    res.status = report.get("status")
    res.error = report.get("error") or ("; ".join(report.get("failures") or []) or None)
    res.passes = [{"name": p.get("name"), "wall_time_s": p.get("wall_time_s")} for p in report.get("passes", [])]
    res.report_timings = timings({k: v for k, v in report.items() if k not in ("error", "phases")})
    res.phases = report.get("phases", [])
    return res


STEP_PROBE = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from onnxdeploy.contract import read_contract
    from onnxdeploy.runner.contract_decoder import ContractDecoder
    from onnxdeploy.runner.session import open_session
    path, rounds, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    opened = {v: open_session(path, share_weights=(v == "shared")) for v in ("shared", "own_maps")}
    assert opened["shared"].shared_weights and not opened["own_maps"].shared_weights
    decoders = {v: ContractDecoder(s, read_contract(s.model)) for v, s in opened.items()}
    times = {v: [] for v in decoders}
    logits = {}
    for r in range(rounds):
        for v in (decoders if r % 2 == 0 else reversed(list(decoders))):  # interleaved, order alternated
            d = decoders[v]
            d.reset()
            d.run_chunk([1])
            rows = []
            for i in range(steps):
                t = time.perf_counter()
                (row, _), = d.run_chunk([(7 * i + 3) % 1000])
                times[v].append((time.perf_counter() - t) * 1e3)
                rows.append(row)
            logits[v] = np.stack(rows)
    same = bool(np.array_equal(logits["shared"], logits["own_maps"]))
    print(json.dumps({v: float(np.median(t)) for v, t in times.items()} | {"identical_logits": same}))
""")
"""Times the step-1 decode graph with the runner's shared weight map against ORT's own per-session mappings
(``open_session(share_weights=...)``), interleaved, one intra-op thread; prints p50 ms and whether logits match."""


def step_latency(model: Path, rounds: int = 6, steps: int = 16) -> dict[str, Any]:
    """Run :data:`STEP_PROBE` on ``model`` (a kept fast-chain output) in a subprocess; its p50s and their ratio."""
    proc = subprocess.run(
        [sys.executable, "-c", STEP_PROBE, str(model), str(rounds), str(steps)],
        capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["(no output)"])[-1]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["shared_over_own_maps"] = out["shared"] / out["own_maps"]
    return out


def bench_size(
    size: ModelSize, work: Path, venv_dir: Path, exe: Path, keep: bool, forms: list[str], chains: list[str]
) -> SizeResult:
    """Export (or reuse) both forms, then baseline, every (chain, form) run interleaved, baseline for one size."""
    res = SizeResult(size=size.name, config=size.llama_config())
    try:
        info, made = ensure_export(size, work, venv_dir)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        res.error, res.crashed = str(exc), True
        return res
    res.export, res.export_made_now = info, made is not None
    models = {"external": work / "models" / size.name / "model.onnx"}
    res.model_bytes = model_bytes(models["external"].parent)
    if "inline" in forms:
        inline, why = ensure_inline(size, work)
        if inline is None:
            res.skipped["inline"] = why or "not made"
        else:
            models["inline"] = inline
    run_root = work / "runs" / size.name
    run_root.mkdir(parents=True, exist_ok=True)
    steps = ["baseline_1"] + [(c, f) for c in chains for f in forms if f in models] + ["baseline_2"]
    try:
        for step in steps:
            print(f"[{size.name}] {step if isinstance(step, str) else ' on '.join(step)} ...", flush=True)
            os.sync()  # the previous step's dirty pages are written back before this one is timed
            if isinstance(step, tuple):
                chain, form = step
                r = run_once(exe, models[form], form, chain, run_root / f"{chain}-{form}")
                res.runs.append(r)
                res.crashed = res.crashed or r.crashed
                out_model = run_root / f"{chain}-{form}" / "out" / "model.onnx"
                if chain == "fast" and r.status == "passed" and out_model.exists():
                    r.step_latency = step_latency(out_model)
                if not keep:
                    shutil.rmtree(run_root / f"{chain}-{form}" / "out", ignore_errors=True)
            else:
                m, inner = baseline(models["external"], run_root / f"{step}_copy", step)
                res.baselines.append({**{k: v for k, v in asdict(m).items() if k != "stdout"}, **inner})
    except RuntimeError as exc:
        res.error, res.crashed = str(exc), True
    finally:
        if not keep:
            for name in ("baseline_1_copy", "baseline_2_copy"):
                shutil.rmtree(run_root / name, ignore_errors=True)
    return res


# ---------------------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------------------
def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 2 else f"{n / 1e6:.1f} MB"


def du(path: Path) -> int:
    """Bytes allocated on disk under ``path``."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def print_results(results: list[SizeResult]) -> None:
    """The summary tables: memory and time ratios per (chain, form), inline against external, then details."""
    print("\n== onnxdeploy run vs onnx.load + onnx.save (baseline: mean of the two baselines around the runs) ==")
    head = (f"{'size':6} {'chain':6} {'form':9} {'model':>9} {'exit':>4} {'status':8} {'run s':>7} {'run/base':>8} "
            f"{'peak RSS':>9} {'RSS/model':>9} {'PSS/model':>9} {'ru_maxrss':>9} {'inline/ext':>10}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in results:
        if not r.runs:
            print(f"{r.size:6} not run: {r.error}")
            continue
        base_wall = sum(b["wall_s"] for b in r.baselines) / len(r.baselines) if r.baselines else float("nan")
        for run in r.runs:
            ext = next((x for x in r.runs if x.chain == run.chain and x.form == "external"), None)
            versus = (
                f"{run.run['peak_tree_rss'] / ext.run['peak_tree_rss']:10.2f}"
                if run.form == "inline" and ext is not None and ext.run.get("peak_tree_rss")
                else f"{'-':>10}"
            )
            m = run.run
            print(
                f"{r.size:6} {run.chain:6} {run.form:9} {_gb(run.model_bytes):>9} {m['exit_code']:>4} "
                f"{run.status or '-':8} {m['wall_s']:7.1f} {m['wall_s'] / base_wall:8.2f} "
                f"{_gb(m['peak_tree_rss']):>9} {m['peak_tree_rss'] / run.model_bytes:9.2f} "
                f"{m['peak_tree_pss'] / run.model_bytes:9.2f} {_gb(m['ru_maxrss']):>9} {versus}"
            )
        for form, why in r.skipped.items():
            print(f"{r.size:6} {'':6} {form:9} not run: {why}")
    for r in results:
        print_details(r)


def print_details(r: SizeResult) -> None:
    """One size: its export, the baselines, and each run's passes, report timings and phases."""
    print(f"\n-- {r.size}: {r.config}")
    if r.export:
        t, meas = r.export.get("times", {}), r.export.get("measured", {})
        print(
            f"   export ({'made now' if r.export_made_now else 'cached'}): {r.export['parameters'] / 1e6:.1f} M "
            f"params, {_gb(r.model_bytes)} on disk; took {meas.get('wall_s', float('nan')):.1f} s "
            f"({', '.join(f'{k} {v:.1f}' for k, v in t.items())}), peak tree RSS "
            f"{_gb(meas.get('peak_tree_rss', 0))}; ORT vs torch max |Δ logit| "
            f"{r.export['ort_vs_torch_max_abs_logit_diff']:.2g}"
        )
    for i, b in enumerate(r.baselines, 1):
        print(
            f"   baseline {i}: {b['wall_s']:.2f} s (import {b['import_s']:.2f}, load {b['load_s']:.2f}, save "
            f"{b['save_s']:.2f}), peak tree RSS {_gb(b['peak_tree_rss'])} "
            f"({b['peak_tree_rss'] / r.model_bytes:.2f}x model)"
        )
    if r.error:
        print(f"   error: {r.error}")
    for run in r.runs:
        m = run.run
        print(
            f"   {run.chain} on {run.form}: exit {m['exit_code']}, status {run.status}, {m['wall_s']:.2f} s, peak tree "
            f"RSS {_gb(m['peak_tree_rss'])} ({m['peak_tree_rss'] / run.model_bytes:.2f}x model, {m['samples']} "
            f"samples), ru_maxrss {_gb(m['ru_maxrss'])} ({m['ru_maxrss'] / run.model_bytes:.2f}x)"
        )
        if run.error:
            print(f"     error / failures: {run.error}")
        if run.crashed:
            print(f"     CRASHED; stderr tail:\n{textwrap.indent(m.get('stderr_tail', ''), '       ')}")
        total = run.report_timings.get("wall_time_s")
        for p in run.passes:
            share = f" ({p['wall_time_s'] / total:.0%} of the report's total)" if total and p["wall_time_s"] else ""
            print(f"     pass {p['name']}: {p['wall_time_s']} s{share}")
        if total is not None:
            in_passes = sum(p["wall_time_s"] or 0 for p in run.passes)
            print(f"     report wall_time_s (from the process's start): {total} s; outside the passes: "
                  f"{total - in_passes:.2f} s; process wall - report total: {m['wall_s'] - total:.2f} s")  # fmt: skip
        for ph in run.phases:  # report.json -> phases: time and the process's peak RSS by the end of each phase
            print(
                f"     phase {ph['name']:8s} {ph['wall_time_s']:7.2f} s   peak RSS so far {_gb(ph['peak_rss_bytes'])} "
                f"({ph['peak_rss_bytes'] / run.model_bytes:.2f}x model)   RSS at its end {_gb(ph['rss_bytes'])}"
            )
        lat = run.step_latency
        if lat.get("error"):
            print(f"     step-1 latency probe failed: {lat['error']}")
        elif lat:
            print(f"     step-1 graph p50: shared weight map {lat['shared']:.1f} ms, ORT's own maps "
                  f"{lat['own_maps']:.1f} ms (ratio {lat['shared_over_own_maps']:.3f}, interleaved); "
                  f"logits identical: {lat['identical_logits']}")  # fmt: skip


def _choices(ap: argparse.ArgumentParser, text: str, known, what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        ap.error(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def main() -> int:
    """Run the benchmark; returns the exit status (1 only if something crashed)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1g,2.4g", help=f"comma-separated, from {', '.join(SIZES)}")
    ap.add_argument("--forms", default=",".join(FORMS), help="input forms: external (model.onnx + data), inline")
    ap.add_argument("--chains", default="basic,fast", help=f"pass chains, from {', '.join(CHAINS)}")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-scale"))
    ap.add_argument("--venv-dir", type=Path, default=Path("/tmp/onnxdeploy-fixture-venvs"),
                    help="the fixtures' venvs (fixtures/make_fixtures.py --venv-dir)")  # fmt: skip
    ap.add_argument("--onnxdeploy", type=Path, default=ONNXDEPLOY,
                    help="the onnxdeploy executable to measure (e.g. another checkout's venv)")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep run outputs and baseline copies (exports always stay)")
    args = ap.parse_args()
    names = _choices(ap, args.sizes, SIZES, "size(s)")
    forms = _choices(ap, args.forms, FORMS, "form(s)")
    chains = _choices(ap, args.chains, CHAINS, "chain(s)")
    work = args.work_dir.resolve()
    if work == REPO or REPO in work.parents:
        ap.error(f"--work-dir {work} must be outside the repository")
    work.mkdir(parents=True, exist_ok=True)
    mem = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    print(f"work dir {work}; {os.cpu_count()} CPUs, {mem.split(':')[1].strip()}; measuring {args.onnxdeploy}")

    venvs = args.venv_dir.resolve()
    results = [bench_size(SIZES[n], work, venvs, args.onnxdeploy, args.keep, forms, chains) for n in names]
    print_results(results)
    doc = {"onnxdeploy": str(args.onnxdeploy), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "sizes": [asdict(r) for r in results]}  # fmt: skip
    (work / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    models = work / "models"
    print(f"\ndisk: exports {du(models) / GB:.2f} GB ({models}), work dir in all {du(work) / GB:.2f} GB; "
          f"results in {work / 'results.json'}")  # fmt: skip
    crashed = [r.size for r in results if r.crashed]
    if crashed:
        print(f"crashed: {', '.join(crashed)}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
