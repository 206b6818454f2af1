"""Decode step time of static graph sets against the original export, and against the memory-bandwidth bound.

A ~125M LLaMA-shaped decoder (hidden 768, 12 layers, 12 heads, 4 KV heads, head dim 64, intermediate 2048,
vocab 32000, fp32, seeded random init) is exported once at benchmark time with the fixtures' TorchScript
flat-KV path (``benchmarks/scale.py``'s :func:`ensure_export`, ``fixtures/_export_scale.py`` in the fixtures'
``torchscript`` venv) into ``WORK_DIR/models/125m/`` and cached there. From it, with the library's passes, four
graph sets are written (one shared weights file each):

* ``static``: ``static_kv {max_cache_lens: [128, 512, 1024], step_lens: [1, 64]}`` → ``mask_rewrite`` →
  ``grouped_attention`` → ``fuse_matmuls`` (the pipeline the README recommends for a fast static step);
* ``unfused``: the same without ``fuse_matmuls`` (decode graphs only), to show what the fusion buys;
* ``rank5``: the same as ``static`` with ``grouped_attention {max_rank: 5}`` (decode graphs only): the query
  groups leading ``(G, B, H_kv, 1, D)`` with the buffer broadcast, instead of folded into rows ``(B, H_kv, G, D)``;
* ``ungrouped``: without ``grouped_attention`` and ``fuse_matmuls`` (decode graphs only).

Then, in one process and one run, interleaving the variants call by call (the order rotates every round so
no variant always follows the same one), at contexts 64, 256 and 1000 (tokens already in the cache):

* ``original``: the export with numpy feeds, past ``(1, 4, ctx, 64)`` per layer (ORT allocates the presents);
* ``static numpy`` / ``static bound``: the decode graph of the set that fits (smallest ``max_cache_len`` >
  ctx) driven by the runner's :class:`ContractDecoder` with numpy feeds / with past and present bound to one
  buffer (ORT IOBinding); the position is rewound to ctx before every call, so every call sees the same context;
* ``unfused bound`` / ``rank5 bound`` / ``ungrouped bound``: that set's decode graph that fits, bound buffers;
* ``matvec``: an ORT MatMul ``(1, 4096) × (4096, 32768)`` fp32 (512 MiB matrix, fed as an input), whose
  bytes / time is the memory bandwidth the step is held to;
* ``matmuls only``: the model's weight MatMuls alone, shaped as in the static set (q/k/v and gate/up fused, o,
  down per layer and the LM head; weights as initializers, one token, nothing else): the floor any graph of
  these weights reaches on ORT's CPU MatMul kernel with these options, so ``mm/bound`` is what no graph
  rewrite can go under.

Every session uses the runner's options (:func:`onnxdeploy.runner.session.session_options`: one intra-op
thread, thread spinning off, ORT's weight prepacking off so external weights stay memory-mapped); ``--threads
N`` and ``--prepack`` change them for every session alike (the original, the static graphs, the matvec and
the kernel floor), so the ratios compare graphs, not session settings. The matvec's weight is an input, never
prepacked, so ``--prepack`` leaves the bound as it is.

Printed per context: median step time (ms) of each variant,
static / original ratios, the bandwidth bound of the static step (bytes it must read ÷ the matvec bandwidth:
every weight once, the embedding table one row, both cache buffers of every layer in full) and step / bound.
Then prompt throughput (tokens/s) of a 128-token prompt: through the 64-token prefill bucket (2 calls), token
by token through the decode graph (bound buffers), and the original in one call. Figures are printed, not
asserted. Usage::

    .venv/bin/python benchmarks/decode.py [--rounds 30] [--work-dir /tmp/onnxdeploy-decode] [--threads 1] [--prepack]
                                          [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.artifacts import Artifact
from onnxdeploy.contract import read_contract
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import ArtifactSet, get_pass
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.session import ModelSession, open_session, read_header, session_options

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import ModelSize, ensure_export  # noqa: E402  (benchmarks/ is not a package)

SIZE = ModelSize("125m", hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2048, vocab=32000)
CACHE_LENS = [128, 512, 1024]
PREFILL = 64
CONTEXTS = [64, 256, 1000]
PROMPT_LEN = 128
MATVEC = (4096, 32768)  # 512 MiB of fp32
TOKEN = 17
THREADS = 1
"""Intra-op threads of every session (``--threads``)."""


def build_sets(model_path: Path, work: Path) -> dict[str, dict[tuple[int, int], Path]]:
    """Write the ``static``, ``unfused`` and ``ungrouped`` graph sets; return ``{set: {(step_len, L): path}}``."""
    sets: dict[str, dict[tuple[int, int], Path]] = {}
    base = [("mask_rewrite", {})]
    plans = {
        "static": [
            ("static_kv", {"max_cache_lens": CACHE_LENS, "step_lens": [1, PREFILL]}),
            *base,
            ("grouped_attention", {}),
            ("fuse_matmuls", {}),
        ],
        "unfused": [("static_kv", {"max_cache_lens": CACHE_LENS}), *base, ("grouped_attention", {})],
        "rank5": [
            ("static_kv", {"max_cache_lens": CACHE_LENS}),
            *base,
            ("grouped_attention", {"max_rank": 5}),
            ("fuse_matmuls", {}),
        ],
        "ungrouped": [("static_kv", {"max_cache_lens": CACHE_LENS}), *base],
    }
    for name, passes in plans.items():
        out = work / "sets" / name
        loaded = load_model(model_path)
        artifacts = ArtifactSet([Artifact("model.onnx", loaded.model)], input_was_external=True)
        context = make_pass_context()  # lives until the set is written: fuse_matmuls' weights are in its scratch folder
        for pass_name, cfg in passes:
            cls = get_pass(pass_name)
            start = time.perf_counter()
            artifacts = cls(cls.config_model(**cfg))(artifacts, context).artifacts
            print(f"[{name}] {pass_name}: {time.perf_counter() - start:.1f} s, {len(artifacts.artifacts)} graph(s)")
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            old.unlink()
        graphs = [(a.name, a.model) for a in artifacts.artifacts]
        paths = stage_artifacts(graphs, out, external=True, data_name="model.onnx.data").commit()
        found = {}
        for path in paths:
            if path.suffix == ".onnx":
                contract = read_contract(read_header(path))
                found[(contract.step_len, contract.max_cache_len)] = path
        sets[name] = found
    return sets


def weights_read_per_step(path: Path) -> int:
    """Bytes of initializers one decode step reads: every one in full, a Gather's table one row per token."""
    header = read_header(path)
    sizes = {t.name: (int(np.prod(t.dims)) if t.dims else 1) * 4 for t in header.graph.initializer}
    gathered = {n.input[0]: n for n in header.graph.node if n.op_type == "Gather" and n.input[0] in sizes}
    total = 0
    for name, nbytes in sizes.items():
        if name in gathered:
            dims = next(t.dims for t in header.graph.initializer if t.name == name)
            total += nbytes // dims[0]  # one row per token (batch 1, one token)
        else:
            total += nbytes
    return total


class Original:
    """The export at a fixed context: numpy feeds, presents allocated by ORT."""

    def __init__(self, path: Path, ctx: int, entries: dict[str, str]):
        self.session = open_session(path, config_entries=entries, threads=THREADS)
        rng = np.random.default_rng(0)
        self.feeds: dict[str, np.ndarray] = {
            "input_ids": np.array([[TOKEN]], np.int64),
            "attention_mask": np.ones((1, ctx + 1), np.int64),
            "position_ids": np.array([[ctx]], np.int64),
        }
        for arg in self.session.session.get_inputs():
            if arg.name.startswith("past_key_values"):
                self.feeds[arg.name] = rng.standard_normal((1, SIZE.kv_heads, ctx, SIZE.head_dim)).astype(np.float32)

    def step(self) -> float:
        start = time.perf_counter()
        self.session.session.run(None, self.feeds)
        return (time.perf_counter() - start) * 1e3


class Static:
    """A contract decoder rewound to ``ctx`` before every call (the same context each time)."""

    def __init__(self, path: Path, ctx: int, entries: dict[str, str], *, bind: bool):
        model_session = open_session(path, config_entries=entries, threads=THREADS)
        self.decoder = ContractDecoder(model_session, read_contract(model_session.model), bind_buffers=bind)
        rng = np.random.default_rng(0)
        buffers = self.decoder.cache_buffers()
        for buffer in buffers.values():
            buffer[:, :, :ctx] = rng.standard_normal(buffer[:, :, :ctx].shape)
        self.ctx = ctx

    def step(self) -> float:
        self.decoder.load_cache(self.decoder.cache_buffers(), self.ctx)  # same buffers: nothing copied or rebound
        ((_, ms),) = self.decoder.run_chunk([TOKEN])
        return ms


class MatmulsOnly:
    """The model's weight MatMuls alone, chained as in the model (one token), weights as initializers.

    Args:
        entries: ORT session config entries.
        fused: q/k/v and gate/up as ``fuse_matmuls`` leaves them (one MatMul + Split each), as in the static set.
    """

    def __init__(self, entries: dict[str, str], *, fused: bool = True) -> None:
        h, inter, kv, vocab = SIZE.hidden, SIZE.intermediate, SIZE.kv_heads * SIZE.head_dim, SIZE.vocab_size()
        q_width = SIZE.heads * SIZE.head_dim
        rng = np.random.default_rng(0)
        nodes, weights, outputs = [], [], []
        self.feeds: dict[str, np.ndarray] = {"x": rng.standard_normal((1, h)).astype(np.float32)}

        def matmul(x: str, k: int, n: int, tag: str) -> str:
            weights.append(numpy_helper.from_array(rng.random((k, n), np.float32) / k, f"w_{tag}"))
            nodes.append(helper.make_node("MatMul", [x, f"w_{tag}"], [f"y_{tag}"]))
            return f"y_{tag}"

        def split(y: str, widths: list[int], tag: str) -> list[str]:
            sizes = numpy_helper.from_array(np.asarray(widths, np.int64), f"split_{tag}")
            weights.append(sizes)
            names = [f"{y}_{j}" for j in range(len(widths))]
            nodes.append(helper.make_node("Split", [y, sizes.name], names, axis=-1))
            return names

        x = "x"
        for i in range(SIZE.layers):
            if fused:  # as fuse_matmuls leaves them: q/k/v one (h, q+2kv) weight, gate/up one (h, 2·inter)
                q, k, v = split(matmul(x, h, q_width + 2 * kv, f"{i}_qkv"), [q_width, kv, kv], f"{i}_qkv")
                kv_outs = [k, v]
            else:
                q = matmul(x, h, q_width, f"{i}_q")
                kv_outs = [matmul(x, h, kv, f"{i}_{side}") for side in ("k", "v")]
            outputs += [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in kv_outs]
            o = matmul(q, q_width, h, f"{i}_o")
            if fused:
                gate, up = split(matmul(o, h, 2 * inter, f"{i}_gate_up"), [inter, inter], f"{i}_gate_up")
            else:
                gate, up = matmul(o, h, inter, f"{i}_gate"), matmul(o, h, inter, f"{i}_up")
            nodes.append(helper.make_node("Mul", [gate, up], [f"act_{i}"]))
            x = matmul(f"act_{i}", inter, h, f"{i}_down")
        outputs.append(helper.make_tensor_value_info(matmul(x, h, vocab, "lm_head"), TensorProto.FLOAT, None))
        graph = helper.make_graph(
            nodes, "matmuls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, h])], outputs, weights
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        self.session = ort.InferenceSession(
            model.SerializeToString(),
            sess_options=session_options(entries, threads=THREADS),
            providers=["CPUExecutionProvider"],
        )
        self.nbytes = sum(int(np.prod(w.dims)) * 4 for w in weights if w.data_type == TensorProto.FLOAT)

    def step(self) -> float:
        start = time.perf_counter()
        self.session.run(None, self.feeds)
        return (time.perf_counter() - start) * 1e3


class Matvec:
    """ORT MatMul of a (1, K) vector by a (K, N) fp32 matrix fed as an input; its bytes / time is the bandwidth."""

    def __init__(self, entries: dict[str, str]) -> None:
        k, n = MATVEC
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "matvec",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k]),
                helper.make_tensor_value_info("w", TensorProto.FLOAT, [k, n]),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        self.session = ort.InferenceSession(
            model.SerializeToString(),
            sess_options=session_options(entries, threads=THREADS),
            providers=["CPUExecutionProvider"],
        )
        rng = np.random.default_rng(0)
        self.feeds = {"x": rng.standard_normal((1, k)).astype(np.float32), "w": rng.random((k, n), np.float32)}
        self.nbytes = self.feeds["w"].nbytes

    def step(self) -> float:
        start = time.perf_counter()
        self.session.run(None, self.feeds)
        return (time.perf_counter() - start) * 1e3


def interleave(variants: dict[str, Callable[[], float]], rounds: int, warmup: int = 3) -> dict[str, list[float]]:
    """Call every variant once per round, rotating the order each round; ``warmup`` rounds are not kept."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            ms = variants[name]()
            if r >= warmup:
                times[name].append(ms)
    return times


def fits(graphs: dict[tuple[int, int], Path], ctx: int, step_len: int = 1) -> tuple[int, Path]:
    """The smallest cache length of the set with a free slot at ``ctx`` (``max_cache_len > ctx``)."""
    length = min(L for (s, L) in graphs if s == step_len and L > ctx)
    return length, graphs[(step_len, length)]


def prompt_throughput(
    original: Path, static: dict[tuple[int, int], Path], repeats: int, entries: dict[str, str]
) -> dict[str, float]:
    """Tokens/s of a PROMPT_LEN-token prompt: 64-token bucket, token by token (bound), original in one call."""
    length, decode_path = fits(static, PROMPT_LEN)
    bucket_path = static[(PREFILL, length)]
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, SIZE.vocab_size(), PROMPT_LEN)]
    opened: list[ModelSession] = []
    bucket_session = open_session(bucket_path, config_entries=entries, threads=THREADS)
    token_session = open_session(decode_path, config_entries=entries, threads=THREADS)
    bucket = ContractDecoder(bucket_session, read_contract(bucket_session.model), bind_buffers=True)
    token = ContractDecoder(token_session, read_contract(token_session.model), bind_buffers=True)
    orig = open_session(original, config_entries=entries, threads=THREADS)
    opened += [bucket_session, token_session, orig]
    orig_feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([prompt], np.int64),
        "attention_mask": np.ones((1, PROMPT_LEN), np.int64),
        "position_ids": np.arange(PROMPT_LEN, dtype=np.int64)[None],
    }
    for arg in orig.session.get_inputs():
        if arg.name.startswith("past_key_values"):
            orig_feeds[arg.name] = np.zeros((1, SIZE.kv_heads, 0, SIZE.head_dim), np.float32)

    def through(decoder: ContractDecoder, size: int) -> float:
        decoder.reset()
        start = time.perf_counter()
        for i in range(0, PROMPT_LEN, size):
            decoder.run_chunk(prompt[i : i + size])
        return time.perf_counter() - start

    def one_call() -> float:
        start = time.perf_counter()
        orig.session.run(None, orig_feeds)
        return time.perf_counter() - start

    runs = interleave(
        {
            f"bucket {PREFILL} (L={length})": lambda: through(bucket, PREFILL),
            f"token by token (L={length})": lambda: through(token, 1),
            "original, one call": one_call,
        },
        repeats,
        warmup=1,
    )
    for s in opened:
        s.close()
    return {name: PROMPT_LEN / float(np.median(ts)) for name, ts in runs.items()}


def main() -> int:
    """Build (or reuse) the export and the graph sets, measure, print; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30, help="timed calls per variant and context")
    ap.add_argument("--prompt-repeats", type=int, default=3, help="timed prompts per prefill variant")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-decode"))
    ap.add_argument("--venv-dir", type=Path, default=Path("/tmp/onnxdeploy-fixture-venvs"),
                    help="the fixtures' venvs (fixtures/make_fixtures.py --venv-dir)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    ap.add_argument("--prepack", action="store_true",
                    help="every session with ORT's weight prepacking on (a copy of the weights)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every session")
    args = ap.parse_args()
    entries = {"session.disable_prepacking": "0" if args.prepack else "1"}
    global THREADS  # noqa: PLW0603  (one setting for every session this run opens)
    THREADS = args.threads
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    info, _ = ensure_export(SIZE, work, args.venv_dir.resolve())
    original = work / "models" / SIZE.name / "model.onnx"
    print(f"export: {info['parameters'] / 1e6:.1f} M parameters, {original}")
    print(
        f"{os.cpu_count()} CPUs; onnxruntime {ort.__version__}; every session: {THREADS} intra-op thread(s), "
        f"spinning off, prepacking {'on' if args.prepack else 'off'}"
    )
    sets = build_sets(original, work)
    matvec = Matvec(entries)
    floor = MatmulsOnly(entries)
    results: dict[str, Any] = {"contexts": {}, "matvec_bytes": matvec.nbytes}
    header = (f"{'ctx':>5} {'L':>5} {'original':>9} {'static np':>9} {'static bd':>9} {'unfus bd':>9} "
              f"{'rank5 bd':>9} {'ungrp bd':>9} {'np/orig':>7} {'bd/orig':>7} {'unfus/orig':>10} "
              f"{'rank5/orig':>10} {'ungrp/orig':>10} {'GB/s':>6} "
              f"{'bound':>7} {'bd/bound':>8} {'mm only':>8} {'mm/bound':>8} {'bd/mm':>6}")  # fmt: skip
    rows = []
    for ctx in CONTEXTS:
        length, path = fits(sets["static"], ctx)
        _, unfused = fits(sets["unfused"], ctx)
        _, rank5 = fits(sets["rank5"], ctx)
        _, ungrouped = fits(sets["ungrouped"], ctx)
        variants = {
            "original": Original(original, ctx, entries),
            "static numpy": Static(path, ctx, entries, bind=False),
            "static bound": Static(path, ctx, entries, bind=True),
            "unfused bound": Static(unfused, ctx, entries, bind=True),
            "rank5 bound": Static(rank5, ctx, entries, bind=True),
            "ungrouped bound": Static(ungrouped, ctx, entries, bind=True),
            "matvec": matvec,
            "matmuls only": floor,
        }
        times = interleave({n: v.step for n, v in variants.items()}, args.rounds)
        med = {n: float(np.median(t)) for n, t in times.items()}
        bandwidth = matvec.nbytes / (med["matvec"] / 1e3)
        cache = 2 * SIZE.layers * SIZE.kv_heads * length * SIZE.head_dim * 4
        read = weights_read_per_step(path) + cache
        bound_ms = read / bandwidth * 1e3
        row = {
            "context": ctx,
            "max_cache_len": length,
            "median_ms": med,
            "p90_ms": {n: float(np.percentile(t, 90)) for n, t in times.items()},
            "static_numpy_over_original": med["static numpy"] / med["original"],
            "static_bound_over_original": med["static bound"] / med["original"],
            "unfused_bound_over_original": med["unfused bound"] / med["original"],
            "rank5_bound_over_original": med["rank5 bound"] / med["original"],
            "ungrouped_bound_over_original": med["ungrouped bound"] / med["original"],
            "bandwidth_gb_s": bandwidth / 1e9,
            "bytes_read_per_step": read,
            "bound_ms": bound_ms,
            "static_bound_over_bound": med["static bound"] / bound_ms,
            "original_over_bound": med["original"] / bound_ms,
            "matmuls_only_over_bound": med["matmuls only"] / (floor.nbytes / bandwidth * 1e3),
            "static_bound_over_matmuls_only": med["static bound"] / med["matmuls only"],
        }
        rows.append(row)
        results["contexts"][str(ctx)] = row
        for v in variants.values():
            closer = getattr(v, "decoder", None) or getattr(v, "session", None)
            if hasattr(closer, "close"):
                closer.close()
    print(f"\n== per-step time, median of {args.rounds} interleaved calls (ms) ==")
    print(header)
    print("-" * len(header))
    for r in rows:
        m = r["median_ms"]
        print(
            f"{r['context']:5d} {r['max_cache_len']:5d} {m['original']:9.2f} {m['static numpy']:9.2f} "
            f"{m['static bound']:9.2f} {m['unfused bound']:9.2f} {m['rank5 bound']:9.2f} {m['ungrouped bound']:9.2f} "
            f"{r['static_numpy_over_original']:7.2f} {r['static_bound_over_original']:7.2f} "
            f"{r['unfused_bound_over_original']:10.2f} {r['rank5_bound_over_original']:10.2f} "
            f"{r['ungrouped_bound_over_original']:10.2f} "
            f"{r['bandwidth_gb_s']:6.1f} {r['bound_ms']:7.2f} {r['static_bound_over_bound']:8.2f} "
            f"{m['matmuls only']:8.2f} {r['matmuls_only_over_bound']:8.2f} {r['static_bound_over_matmuls_only']:6.2f}"
        )
    print(
        "bound = bytes a static step reads (weights once, embedding one row, the whole cache of max_cache_len "
        f"L) / matvec bandwidth; matvec: MatMul (1, {MATVEC[0]}) x ({MATVEC[0]}, {MATVEC[1]}) fp32, "
        f"{matvec.nbytes / 2**20:.0f} MiB; mm only = the model's weight MatMuls alone ({floor.nbytes / 1e6:.0f} MB), "
        "mm/bound = their time / their bytes' bound"
    )
    tput = prompt_throughput(original, sets["static"], args.prompt_repeats, entries)
    results["prompt_tokens_per_s"] = tput
    print(f"\n== prompt of {PROMPT_LEN} tokens: throughput, median of {args.prompt_repeats} (tokens/s) ==")
    for name, value in tput.items():
        print(f"  {name:28s} {value:8.1f}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
