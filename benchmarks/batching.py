"""Continuous batching on a static graph: t(B), then a fixed request trace served every way (issue 17).

On the ~125M LLaMA export of ``benchmarks/decode.py`` (``scale.py``'s :func:`ensure_export`, cached in
``WORK_DIR/models/125m/``), one graph set per B in 1, 2, 4, 8: ``static_kv {batch: B, row_positions: true,
prefill_batch: 1, step_lens: [1, 16], max_cache_lens: [256]}`` → ``mask_rewrite`` → ``grouped_attention``; and per
``--chunks`` S a one-graph B=4 set ``static_kv {batch: 4, row_positions: true, step_len: S, max_cache_len: 256}``
(same passes) whose host feeds the prompts through its rows (``BatchingHost(prefill="rows")``).

1. ``t(B)``: the decode graph's step with every row at position 200, prepacking off (the runner's default for
   float weights) and on, one intra-op thread, median of ``--rounds`` calls interleaved over B; with prepacking
   also the rows graphs' step (one real token per row padded to S).
2. The fixed trace (:func:`onnxdeploy.runner.batching.poisson_trace`): 16 requests, prompt lengths uniform in
   4..48, max new tokens uniform in 8..64, arrivals Poisson with a mean gap of 2 steps, seed 0. Served by the
   continuous-batching host on the B=4 set (batch-1 prefill graphs; ORT's Python sessions and, one packed copy of
   the weights, :class:`SharedPrepacking`), each with its prefills on the decode thread between decode calls and
   with them on **one prefill thread beside the decode loop** (``BatchingHost(prefill_workers=1)``: two threads at
   work); by the continuous host on each rows set; by batch 1 (the host on the B=1 set: one request at a time, one
   thread) and, a reference, batch 1 with 2 intra-op threads; by static batching on the B=4 set (a batch starts
   when 4 requests wait and ends when its longest finishes) with its prefills on the decode thread and two at a
   time on 2 prefill threads (the two-thread budget of the prefill-thread ways: the ratios of those compare with
   it), and on the ``--host-chunk`` rows set. Interleaved in one run for ``--trace-rounds`` rounds, every session
   with the host's options (prepacking on: ORT's MatMul re-packs the weights for every M > 1 call without it; one
   intra-op thread; past and present bound to one buffer, the Python sessions). Tokens/s counts generated tokens
   over the wall time of the whole run (prefill, copies, host work; idle waits for arrivals take none); each
   way's figures are its best round, with where its wall time went (``BatchRun.phases``: decode calls, prefill
   calls, copies, waits for a prefill thread, host work), and the ratios are given per round too (adjacent runs
   of the same round). Every way must serve the same tokens (asserted): with a prefill thread a request's row
   and steps depend on timing, its tokens do not.
3. Peak RSS (``VmHWM``) of a child process that opens the B=4 set (Python sessions; shared prepacking, with and
   without the prefill thread) or the ``--host-chunk`` rows set with the host's options and serves the trace once:
   the load's peak, the serving peak and the process's (the larger), against the goal (1.5 × the model's bytes +
   the B=4 cache) and against ``onnxdeploy plan``'s prediction (:func:`onnxdeploy.plan.host_memory`).

The load average is printed before and after (the machine may be shared).

Usage::

    nice -n 10 .venv/bin/python benchmarks/batching.py [--work-dir /tmp/onnxdeploy-batching] [--rounds 10]
        [--trace-rounds 4] [--chunks 4] [--host-chunk 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
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
from onnxdeploy.runner.prepacked_sessions import SharedPrepacking
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
THREAD = " + prefill thread"
"""Suffix of the ways whose prefills run on a thread beside the decode loop (two threads at work)."""
THREADS_2 = ", prefills 2 at a time"
"""Suffix of static batching with its batch's prefills on two threads (the same two-thread budget)."""


def build_set(model_path: Path, work: Path, batch: int, *, chunk: int | None = None) -> Path:
    """Write (or reuse) the B-row set (with ``chunk``: its one graph of that step_len); return its primary graph."""
    out = work / "sets" / (f"b{batch}" if chunk is None else f"b{batch}-s{chunk}")
    primary = out / "model.onnx"
    if primary.exists() and (out / "done").exists():
        return primary
    passes = [
        ("static_kv", {"batch": batch, "row_positions": True, "step_len": chunk, "max_cache_len": CACHE} if chunk else
                      {"batch": batch, "row_positions": True, "prefill_batch": 1, "step_lens": [1, PREFILL],
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


def open_host_set(primary: Path, prepack: bool, threads: int = 1) -> GraphSetDecoder:
    """The set on ORT CPU, ``threads`` intra-op threads (the host's: 1), past and present bound to one buffer,
    prepacking as asked (the host's: on)."""
    return open_graph_set(
        primary, config_entries={PREPACKING_KEY: "0" if prepack else "1"}, threads=threads, bind_buffers=True
    )


def t_of_b(graphs: dict[str, tuple[Path, int]], prepack: bool, rounds: int) -> dict[str, float]:
    """Median decode step (ms) per graph ``label -> (primary, B)``, every row 1 token at POSITION, interleaved.

    A graph of step_len S > 1 (the rows sets) is fed one real token per row padded to S: a decoding row's call.
    """
    decoders = {k: open_host_set(p, prepack) for k, (p, _) in graphs.items()}
    try:
        calls = {}
        for k, d in decoders.items():
            b = graphs[k][1]
            member = d.member(min(s for _, s, _ in d.graphs()), CACHE)
            buffers = allocate_buffers(member.contract)
            inputs = StepInputs.rows(member.contract, [[17]] * b, [POSITION] * b)
            calls[k] = (member, buffers, inputs)
        times: dict[str, list[float]] = {k: [] for k in calls}
        for r in range(rounds + 2):
            order = list(calls)[r % len(calls) :] + list(calls)[: r % len(calls)]
            for k in order:
                member, buffers, inputs = calls[k]
                _, ms = member.call(buffers, inputs)
                if r >= 2:  # two warm-up rounds
                    times[k].append(ms)
        return {k: round(float(np.median(v)), 2) for k, v in times.items()}
    finally:
        for d in decoders.values():
            d.close()


def summary(run: BatchRun, threads: int = 1) -> dict[str, Any]:
    """Tokens/s, per-step P50/P99, counts and phases of one served trace; ``threads``: at work at once."""
    return {
        "tokens_per_s": round(run.tokens_per_s, 2),
        "step_p50_ms": round(run.step_percentile(50), 2),
        "step_p99_ms": round(run.step_percentile(99), 2),
        "steps": run.steps,
        "generated": run.generated,
        "wall_s": round(run.wall_s, 2),
        "prefill_calls": len(run.prefill_ms),
        "threads": threads,
        "phases_s": {k: round(v, 2) for k, v in run.phases().items()},
    }


def serve(sets: dict[str, Path], chunks: list[int], host_chunk: int, rounds: int) -> dict[str, dict[str, Any]]:
    """The trace served every way, interleaved; per way the round of median throughput and every round's tokens/s.

    Ways: continuous on the B=4 set (batch-1 prefill graphs; Python sessions and shared prepacking, each on the
    decode thread alone and with one prefill thread beside it), continuous with the prompts through the rows of
    each B=4 one-graph set of step_len in ``chunks``, batch 1 (and, a reference, batch 1 on 2 intra-op threads),
    static batching on the B=4 set (its prefills on the decode thread, or two at a time on 2 prefill threads: the
    same two-thread budget) and on the rows set of ``host_chunk``.
    """
    requests = poisson_trace(vocab=SIZE.vocab, **TRACE)  # type: ignore[arg-type]
    opened = {k: open_host_set(p, True) for k, p in sets.items()}
    opened["b1 2 threads"] = open_host_set(sets["b1"], True, threads=2)
    sharing = SharedPrepacking()  # the maps' pages dropped while loading
    opened["b4 shared"] = open_graph_set(sets["b4"], opener=sharing.open)
    try:
        hosts = {"continuous": (BatchingHost(opened["b4"], prefill="graphs"), "continuous")}
        hosts[f"continuous{THREAD}"] = (BatchingHost(opened["b4"], prefill_workers=1), "continuous")
        hosts["continuous shared prepacking"] = (BatchingHost(opened["b4 shared"], prefill="graphs"), "continuous")
        hosts[f"continuous shared prepacking{THREAD}"] = (BatchingHost(opened["b4 shared"], prefill_workers=1),
                                                          "continuous")  # fmt: skip
        for c in chunks:
            hosts[f"continuous rows S={c}"] = (BatchingHost(opened[f"b4-s{c}"], prefill="rows"), "continuous")
        hosts["batch 1"] = (BatchingHost(opened["b1"], prefill="graphs"), "continuous")
        hosts["batch 1, 2 intra-op threads"] = (BatchingHost(opened["b1 2 threads"]), "continuous")
        hosts["static"] = (BatchingHost(opened["b4"], prefill="graphs"), "static")
        hosts[f"static{THREADS_2}"] = (BatchingHost(opened["b4"], prefill_workers=2), "static")
        hosts[f"static rows S={host_chunk}"] = (BatchingHost(opened[f"b4-s{host_chunk}"], prefill="rows"), "static")
        threads = {k: 2 if THREAD in k or THREADS_2 in k or "2 intra-op" in k else 1 for k in hosts}
        for host, _ in hosts.values():  # warm-up: first-call allocations out of the timed runs
            host.run(requests[:2])
        runs: dict[str, list[BatchRun]] = {k: [] for k in hosts}
        for r in range(rounds):
            names = list(hosts)[r % len(hosts) :] + list(hosts)[: r % len(hosts)]
            for name in names:
                host, policy = hosts[name]
                runs[name].append(host.run(requests, policy=policy))  # type: ignore[arg-type]
                print(f"[trace] round {r} {name}: {summary(runs[name][-1], threads[name])}", flush=True)
        tokens = [[f.tokens for f in v[0].finished] for v in runs.values()]
        assert all(t == tokens[0] for t in tokens), "the ways served different tokens"
        out = {}
        for k, v in runs.items():  # the best round (the least disturbed on a shared machine), and every round's
            best = max(v, key=lambda run: run.tokens_per_s)
            out[k] = {**summary(best, threads[k]), "rounds_tokens_per_s": [round(x.tokens_per_s, 2) for x in v]}
        return out
    finally:
        for d in opened.values():
            d.close()


def child_rss(primary: Path, prefill: str, workers: int = 0) -> dict[str, int]:
    """Peak RSS (bytes, ``VmHWM``) of this process over opening ``primary`` and serving the trace once continuous.

    ``VmHWM`` belongs to the process's own memory map; ``ru_maxrss`` would carry the parent's peak over exec. With
    ``prefill="shared"`` the set opens through one :class:`SharedPrepacking` (graph prefill; the maps' pages dropped
    while loading); ``workers``: prefill threads beside the decode loop. The peak is read after the load
    (``load_peak``), reset (``/proc/self/clear_refs`` 5) and read after serving (``serving_peak``); ``peak_rss`` is
    the larger: the process's peak.
    """
    requests = poisson_trace(vocab=SIZE.vocab, **TRACE)  # type: ignore[arg-type]
    shared = prefill == "shared"
    opened = open_graph_set(primary, opener=SharedPrepacking().open) if shared else open_host_set(primary, True)
    with opened as decoder:
        load_peak = peak_rss()
        Path("/proc/self/clear_refs").write_text("5")
        mode = "graphs" if shared else prefill
        BatchingHost(decoder, prefill=mode, prefill_workers=workers).run(requests)  # type: ignore[arg-type]
    serving = peak_rss()
    return {"peak_rss": max(load_peak, serving), "load_peak": load_peak, "serving_peak": serving}


def peak_rss() -> int:
    """This process's peak resident set (bytes), from ``/proc/self/status`` ``VmHWM``."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-batching"))
    ap.add_argument("--venv-dir", type=Path, default=Path("/tmp/onnxdeploy-fixture-venvs"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--trace-rounds", type=int, default=4)
    ap.add_argument("--chunks", default="4", help="step lengths of the rows sets (prompts through the rows)")
    ap.add_argument("--host-chunk", type=int, default=4, help="the rows set measured for memory and static batching")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child-rss", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_rss is not None:
        print(json.dumps(child_rss(Path(args.child_rss[0]), args.child_rss[1], int(args.child_rss[2]))))
        return 0
    chunks = sorted({int(c) for c in args.chunks.split(",")} | {args.host_chunk})
    work = args.work_dir.resolve()
    info, _ = ensure_export(SIZE, work, args.venv_dir.resolve())
    model = work / "models" / SIZE.name / "model.onnx"
    sets = {f"b{b}": build_set(model, work, b) for b in BATCHES}
    sets |= {f"b4-s{c}": build_set(model, work, HOST_B, chunk=c) for c in chunks}
    result: dict[str, Any] = {"load_before": os.getloadavg(), "t_ms": {}}
    by_b = {f"B={b}": (sets[f"b{b}"], b) for b in BATCHES}
    result["t_ms"]["prepack off"] = t_of_b(by_b, False, args.rounds)
    rows_graphs = {f"B=4 S={c}": (sets[f"b4-s{c}"], HOST_B) for c in chunks if c > 1}
    result["t_ms"]["prepack on"] = t_of_b(by_b | rows_graphs, True, args.rounds)
    result["trace"] = serve({k: v for k, v in sets.items() if k in ("b1", "b4") or "-s" in k}, chunks,
                            args.host_chunk, args.trace_rounds)  # fmt: skip
    facts = model_facts(model)
    weights = (sets["b4"].parent / "model.onnx.data").stat().st_size
    cache = 2 * SIZE.layers * HOST_B * CACHE * SIZE.kv_heads * SIZE.head_dim * 4
    result["memory"] = {"weights": weights, "cache": cache, "goal": int(1.5 * weights + cache)}
    for way, primary, prefill, steps, workers in (
        ("continuous", sets["b4"], "graphs", [1, PREFILL], 0),
        ("continuous shared prepacking", sets["b4"], "shared", [1, PREFILL], 0),
        (f"continuous shared prepacking{THREAD}", sets["b4"], "shared", [1, PREFILL], 1),
        (f"continuous rows S={args.host_chunk}", sets[f"b4-s{args.host_chunk}"], "rows", [args.host_chunk], 0),
    ):
        out = subprocess.run([sys.executable, __file__, "--child-rss", str(primary), prefill, str(workers)],
                             capture_output=True, text=True, check=True)  # fmt: skip
        measured = json.loads(out.stdout)
        rss = measured["peak_rss"]
        predicted = sum(host_memory(facts, HOST_B, CACHE, steps, facts.kv_dtype, prefill=prefill)) + HOST_BASELINE_BYTES
        result["memory"][way] = {**measured, "plan_predicted": predicted,
                                 "peak rss / goal": round(rss / result["memory"]["goal"], 3),
                                 "plan predicted / peak rss": round(predicted / rss, 3)}  # fmt: skip
    result["load_after"] = os.getloadavg()
    t_on = result["t_ms"]["prepack on"]
    ceiling = 4 * t_on["B=1"] / t_on["B=4"]
    tr = result["trace"]
    result["ratios"] = {"ceiling 4*t(1)/t(4)": round(ceiling, 2)}
    for way in [k for k in tr if k.startswith("continuous")]:
        static = tr.get(f"static rows S={args.host_chunk}") if "rows" in way else tr["static"]
        if THREAD in way:  # the same two-thread budget: static batching's prefills two at a time
            static = tr[f"static{THREADS_2}"]
        c, b1 = tr[way]["tokens_per_s"], tr["batch 1"]["tokens_per_s"]
        mine, single = tr[way]["rounds_tokens_per_s"], tr["batch 1"]["rounds_tokens_per_s"]
        per_round = [x / y for x, y in zip(mine, single, strict=True)]
        result["ratios"][way] = {
            "/ batch 1": round(c / b1, 2),
            "/ static (same prefill, same threads)": round(c / static["tokens_per_s"], 2) if static else None,
            "/ batch 1 on 2 intra-op threads": round(c / tr["batch 1, 2 intra-op threads"]["tokens_per_s"], 2),
            "/ ceiling": round(c / b1 / ceiling, 2),
            "/ batch 1 per round (same round)": [round(x, 2) for x in per_round],
            "/ static per round": [round(x / y, 2) for x, y in zip(mine, static["rounds_tokens_per_s"], strict=True)]
            if static else None,
        }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    for option, t in result["t_ms"].items():
        print(f"t(B) {option}: " + ", ".join(f"{k} {ms:.1f} ms" for k, ms in t.items()))
    for name, s in tr.items():
        print(f"{name:>45}: {s['tokens_per_s']:7.2f} tok/s (rounds {s['rounds_tokens_per_s']}), step P50 "
              f"{s['step_p50_ms']:.1f} ms, P99 {s['step_p99_ms']:.1f} ms, {s['steps']} steps, {s['prefill_calls']} "
              f"prefill calls, {s['generated']} tokens, {s['threads']} thread(s), {s['wall_s']} s = "
              f"{s['phases_s']}")  # fmt: skip
    m = result["memory"]
    print(
        f"weights {m['weights'] / 2**20:.0f} MiB, cache {m['cache'] / 2**20:.1f} MiB, goal {m['goal'] / 2**20:.0f} MiB"
    )
    for way in [k for k in m if k.startswith("continuous")]:
        w = m[way]
        print(f"{way}: peak RSS {w['peak_rss'] / 2**20:.0f} MiB ({w['peak rss / goal']} of the goal; load "
              f"{w['load_peak'] / 2**20:.0f}, serving {w['serving_peak'] / 2**20:.0f}), plan "
              f"{w['plan_predicted'] / 2**20:.0f} MiB ({w['plan predicted / peak rss']}x)")  # fmt: skip
    for k, v in result["ratios"].items():
        print(f"{k}: {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
