"""Continuous batching on a static graph: t(B), then a fixed request trace served three ways (issue 17).

On the ~125M LLaMA export of ``benchmarks/decode.py`` (``scale.py``'s :func:`ensure_export`, cached in
``WORK_DIR/models/125m/``), one graph set per B in 1, 2, 4, 8: ``static_kv {batch: B, row_positions: true,
prefill_batch: 1, step_lens: [1, 16], max_cache_lens: [256]}`` → ``mask_rewrite`` → ``grouped_attention``.

1. ``t(B)``: the decode graph's step with every row at position 200, prepacking off (the runner's default for
   float weights) and on, one intra-op thread, median of ``--rounds`` calls interleaved over B.
2. The fixed trace (:func:`onnxdeploy.runner.batching.poisson_trace`): 16 requests, prompt lengths uniform in
   4..48, max new tokens uniform in 8..64, arrivals Poisson with a mean gap of 2 steps, seed 0. Served by the
   continuous-batching host on the B=4 set, by batch 1 (the host on the B=1 set: one request at a time), and by
   static batching on the B=4 set (a batch starts when 4 requests wait and ends when its longest finishes), the
   three interleaved in one run for ``--trace-rounds`` rounds, every session with the host's options (prepacking
   on: ORT's MatMul re-packs the weights for every M > 1 call without it; one thread; past and present bound to one
   buffer). Tokens/s counts generated
   tokens over the wall time of the whole run (prefill, copies, host work; idle waits for arrivals take none).
3. Peak RSS (``VmHWM``) of a child process that opens the B=4 set with the host's options and serves the trace
   once, against the model's bytes plus the cache and against ``onnxdeploy plan``'s prediction.

Usage::

    nice -n 10 .venv/bin/python benchmarks/batching.py [--work-dir /tmp/onnxdeploy-batching] [--rounds 10]
        [--trace-rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from onnxdeploy.artifacts import Artifact
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import ArtifactSet, get_pass
from onnxdeploy.plan import HOST_BASELINE_BYTES, host_memory, model_facts
from onnxdeploy.runner.batching import BatchingHost, BatchRun, poisson_trace
from onnxdeploy.runner.graph_set import GraphSetDecoder, open_graph_set
from onnxdeploy.runner.host import StepInputs, allocate_buffers
from onnxdeploy.runner.session import PREPACKING_KEY

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import SIZE  # noqa: E402  (benchmarks/ is not a package)
from scale import ensure_export  # noqa: E402

BATCHES = [1, 2, 4, 8]
CACHE = 256
POSITION = 200
PREFILL = 16
TRACE = {"count": 16, "prompt_lens": (4, 48), "new_tokens": (8, 64), "mean_gap": 2.0, "seed": 0}
HOST_B = 4


def build_set(model_path: Path, work: Path, batch: int) -> Path:
    """Write (or reuse) the B-row set; return its primary graph."""
    out = work / "sets" / f"b{batch}"
    primary = out / "model.onnx"
    if primary.exists() and (out / "done").exists():
        return primary
    passes = [
        ("static_kv", {"batch": batch, "row_positions": True, "prefill_batch": 1, "step_lens": [1, PREFILL],
                       "max_cache_lens": [CACHE]}),
        ("mask_rewrite", {}),
        ("grouped_attention", {}),
    ]  # fmt: skip
    artifacts = ArtifactSet([Artifact("model.onnx", load_model(model_path).model)], input_was_external=True)
    context = make_pass_context()
    for name, cfg in passes:
        cls = get_pass(name)
        start = time.perf_counter()
        artifacts = cls(cls.config_model(**cfg))(artifacts, context).artifacts
        print(f"[b{batch}] {name}: {time.perf_counter() - start:.1f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    graphs = [(a.name, a.model) for a in artifacts.artifacts]
    stage_artifacts(graphs, out, external=True, data_name="model.onnx.data").commit()
    (out / "done").write_text("ok\n")
    return primary


def open_host_set(primary: Path, prepack: bool) -> GraphSetDecoder:
    """The set on ORT CPU, one thread, past and present bound to one buffer, prepacking as asked (the host's: on)."""
    return open_graph_set(
        primary, config_entries={PREPACKING_KEY: "0" if prepack else "1"}, threads=1, bind_buffers=True
    )


def t_of_b(sets: dict[int, Path], prepack: bool, rounds: int) -> dict[int, float]:
    """Median decode step (ms) per B, every row at POSITION, calls interleaved over B."""
    decoders = {b: open_host_set(p, prepack) for b, p in sets.items()}
    try:
        calls = {}
        for b, d in decoders.items():
            member = d.member(1, CACHE)
            buffers = allocate_buffers(member.contract)
            inputs = StepInputs.rows(member.contract, [[17]] * b, [POSITION] * b)
            calls[b] = (member, buffers, inputs)
        times: dict[int, list[float]] = {b: [] for b in calls}
        for r in range(rounds + 2):
            order = list(calls)[r % len(calls) :] + list(calls)[: r % len(calls)]
            for b in order:
                member, buffers, inputs = calls[b]
                _, ms = member.call(buffers, inputs)
                if r >= 2:  # two warm-up rounds
                    times[b].append(ms)
        return {b: float(np.median(v)) for b, v in times.items()}
    finally:
        for d in decoders.values():
            d.close()


def summary(run: BatchRun) -> dict[str, Any]:
    """Tokens/s, per-step P50/P99 and counts of one served trace."""
    return {
        "tokens_per_s": round(run.tokens_per_s, 2),
        "step_p50_ms": round(run.step_percentile(50), 2),
        "step_p99_ms": round(run.step_percentile(99), 2),
        "steps": run.steps,
        "generated": run.generated,
        "wall_s": round(run.wall_s, 2),
        "prefill_calls": len(run.prefill_ms),
    }


def serve(sets: dict[int, Path], rounds: int) -> dict[str, dict[str, Any]]:
    """The trace served continuous (B=4), batch 1, static (B=4), interleaved; the best-throughput round of each."""
    requests = poisson_trace(vocab=SIZE.vocab, **TRACE)  # type: ignore[arg-type]
    batched, single = open_host_set(sets[HOST_B], True), open_host_set(sets[1], True)
    try:
        hosts = {
            "continuous": (BatchingHost(batched), "continuous"),
            "batch 1": (BatchingHost(single), "continuous"),
            "static": (BatchingHost(batched), "static"),
        }
        for host, _ in hosts.values():  # warm-up: first-call allocations out of the timed runs
            host.run(requests[:2])
        runs: dict[str, list[BatchRun]] = {k: [] for k in hosts}
        for r in range(rounds):
            names = list(hosts)[r % 3 :] + list(hosts)[: r % 3]
            for name in names:
                host, policy = hosts[name]
                runs[name].append(host.run(requests, policy=policy))  # type: ignore[arg-type]
                print(f"[trace] round {r} {name}: {summary(runs[name][-1])}", flush=True)
        tokens = {k: [f.tokens for f in v[0].finished] for k, v in runs.items()}
        assert tokens["continuous"] == tokens["batch 1"] == tokens["static"], "the three served different tokens"
        return {k: summary(max(v, key=lambda run: run.tokens_per_s)) for k, v in runs.items()}
    finally:
        batched.close()
        single.close()


def child_rss(primary: Path) -> int:
    """Peak RSS (bytes, ``VmHWM``) of this process after serving the trace once continuous on ``primary``.

    ``VmHWM`` belongs to the process's own memory map; ``ru_maxrss`` would carry the parent's peak over exec.
    """
    requests = poisson_trace(vocab=SIZE.vocab, **TRACE)  # type: ignore[arg-type]
    with open_host_set(primary, True) as decoder:
        BatchingHost(decoder).run(requests)
    return peak_rss()


def peak_rss() -> int:
    """This process's peak resident set (bytes), from ``/proc/self/status`` ``VmHWM``."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-batching"))
    ap.add_argument("--venv-dir", type=Path, default=Path("/tmp/onnxdeploy-fixture-venvs"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--trace-rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child-rss", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_rss is not None:
        print(json.dumps({"peak_rss": child_rss(args.child_rss)}))
        return 0
    work = args.work_dir.resolve()
    info, _ = ensure_export(SIZE, work, args.venv_dir.resolve())
    model = work / "models" / SIZE.name / "model.onnx"
    sets = {b: build_set(model, work, b) for b in BATCHES}
    result: dict[str, Any] = {"t_ms": {}}
    for prepack in (False, True):
        result["t_ms"]["prepack on" if prepack else "prepack off"] = t_of_b(sets, prepack, args.rounds)
    result["trace"] = serve(sets, args.trace_rounds)
    out = subprocess.run(
        [sys.executable, __file__, "--child-rss", str(sets[HOST_B])], capture_output=True, text=True, check=True
    )
    weights = (sets[HOST_B].parent / "model.onnx.data").stat().st_size
    cache = 2 * SIZE.layers * HOST_B * CACHE * SIZE.kv_heads * SIZE.head_dim * 4
    facts = model_facts(model)
    predicted = sum(host_memory(facts, HOST_B, CACHE, [1, PREFILL], facts.kv_dtype)) + HOST_BASELINE_BYTES
    result["memory"] = {"peak_rss": json.loads(out.stdout)["peak_rss"], "weights": weights, "cache": cache,
                        "plan_predicted": predicted}  # fmt: skip
    t_on = result["t_ms"]["prepack on"]
    c, b1, st = (result["trace"][k]["tokens_per_s"] for k in ("continuous", "batch 1", "static"))
    result["ratios"] = {
        "ceiling 4*t(1)/t(4)": round(4 * t_on[1] / t_on[4], 2),
        "continuous / batch 1": round(c / b1, 2),
        "continuous / static": round(c / st, 2),
        "continuous / (0.8 * ceiling)": round(c / b1 / (0.8 * 4 * t_on[1] / t_on[4]), 2),
        "peak rss / (1.5 * weights + cache)": round(result["memory"]["peak_rss"] / (1.5 * weights + cache), 2),
        "plan predicted / peak rss": round(predicted / result["memory"]["peak_rss"], 3),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for option, t in result["t_ms"].items():
        print(f"t(B) {option}: " + ", ".join(f"B={b} {ms:.1f} ms" for b, ms in t.items()))
    for name, s in result["trace"].items():
        print(f"{name:>10}: {s['tokens_per_s']:7.2f} tok/s, step P50 {s['step_p50_ms']:.1f} ms, P99 "
              f"{s['step_p99_ms']:.1f} ms, {s['steps']} steps, {s['generated']} tokens, {s['wall_s']} s")  # fmt: skip
    m = result["memory"]
    print(f"peak RSS {m['peak_rss'] / 2**20:.0f} MiB; weights {m['weights'] / 2**20:.0f} MiB, cache "
          f"{m['cache'] / 2**20:.1f} MiB")  # fmt: skip
    for k, v in result["ratios"].items():
        print(f"{k}: {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
