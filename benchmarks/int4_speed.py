"""INT4 static decode step against the float32 original in the runner's own sessions, prepacking's memory, and the
accuracy phase's time (issue 15, "Quantized graphs that run fast").

A model (default: the ~125M random-init LLaMA export of ``benchmarks/decode.py``, exported once into
``/tmp/onnxdeploy-decode``; ``--model`` any exporter-convention ``.onnx``, e.g. SmolLM2-135M's optimum export) is
made static with the library's passes and cached in ``WORK/sets/<name>/``:

* ``float``: ``static_kv {step_lens: [1, 16], max_cache_lens: [512]}`` → ``mask_rewrite`` → ``grouped_attention``
  → ``fuse_matmuls``;
* ``int4``: the same → ``quantize_weights {bits: 4, block_size: 32, format: matmulnbits, accuracy_level: 4}``
  (every MatMul and the LM head): ORT runs it at level 4 as written (``verify.accuracy``'s ``default_optimized``
  figures), the runner's ``weight_only`` session at level 0.

Then, in one process, variants interleaved call by call (the order rotates every round), at context 256 (tokens
already in the cache), every session opened by :func:`onnxdeploy.runner.session.open_session` with the options
it decides from the graph (one intra-op thread, spinning off; prepacking off for float weights, on for quantized):

* ``original``: the float32 export, past ``(1, H_kv, 256, D)`` per layer as numpy feeds;
* ``float static``: the float set's decode graph (bound buffers);
* ``int4 level 0`` / ``int4 level 4``: the INT4 set's decode graph with ``session.qdq_matmulnbits_accuracy_level``
  0 (fp32 activations: the session of ``verify.accuracy``'s ``weight_only`` figures) / 4 (int8 activations: the
  graph as written, the session of its ``default_optimized`` figures);
* ``int4 unpacked``: level 0 with prepacking off, as the runner opened every session before issue 15
  (``--rounds-unpacked`` calls, it is slow).

Printed: median ms and the ratio to the original, each with the accuracy_level it was taken at, and beside them
the calling thread's CPU time per call and its ratio (ORT computes on that thread with one intra-op thread; on a
loaded machine the wall time adds whatever the other processes took, the CPU time does not; nor does it count a
step's own time off the CPU: the float original's wall time exceeded its CPU time by 6-8 ms at low load); an ORT
profile of each quantized step, taken the way it is timed (bound buffers rewound to context 256):
``session.run``, the sum of every node's median kernel time, and the op classes that take it (MatMulNBits by
bits, the LM head apart); the peak RSS of opening and stepping each decode graph, and of
each whole set as ``verify`` opens it (every graph a session), with prepacking on and off (a fresh process each,
``VmHWM`` less the interpreter's) against the set's weight bytes; and the
accuracy phase of ``verify`` (:func:`onnxdeploy.runner.accuracy.evaluate_accuracy` on ``--tokens`` held-out ids)
against its budget: 3 × (one ORT call of the original over those tokens with an empty past + one step-1 decode of
them through the INT4 set's decode graph). Figures are printed, not asserted. Usage::

    nice -n 10 .venv/bin/python benchmarks/int4_speed.py [--model PATH] [--rounds 20] [--tokens 300] [--json]
        [--quant JSON --tag TAG] [--also TAG2=JSON2 ...] [--step-levels 4]

``--also`` builds more quantized sets the same way and times their step at accuracy_level 4 in the same
interleaved rounds (variants of one candidate against the original in one run); ``--step-levels 4`` skips the
level-0 step of the ``--tag`` set (a mixed INT4/INT8 set's level-0 step is slow: no fp32 kernel for 8 bits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from onnxdeploy.artifacts import Artifact
from onnxdeploy.contract import read_contract
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import ArtifactSet, get_pass
from onnxdeploy.runner.accuracy import WEIGHT_ONLY_ENTRIES, evaluate_accuracy
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.decoder import make_decoder
from onnxdeploy.runner.exporter_decoder import ExporterDecoder
from onnxdeploy.runner.graph_set import GraphSetDecoder
from onnxdeploy.runner.session import ACCURACY_LEVEL_KEY, PREPACKING_KEY, open_session, session_options
from onnxdeploy.runner.verify import logits_vocab
from onnxdeploy.text import load_codec, text_token_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import SIZE, interleave  # noqa: E402  (benchmarks/ is not a package)
from scale import ensure_export  # noqa: E402

CTX = 256
CACHE_LEN = 512
TOKEN = 17
STATIC = [
    ("static_kv", {"max_cache_lens": [CACHE_LEN], "step_lens": [1, 16]}),
    ("mask_rewrite", {}),
    ("grouped_attention", {}),
    ("fuse_matmuls", {}),
]
INT4 = ("quantize_weights", {"bits": 4, "block_size": 32, "format": "matmulnbits", "accuracy_level": 4})
LEVEL = {0: WEIGHT_ONLY_ENTRIES, 4: {ACCURACY_LEVEL_KEY: "4"}}


def build_set(model: Path, out: Path, passes: list[tuple[str, dict]], calibration: list[int] | None = None) -> Path:
    """Run ``passes`` on ``model`` and write the set into ``out`` (reused when its primary graph exists).

    ``calibration``: token ids the passes calibrate on (GPTQ, act-order, scale search), or None.
    """
    if (out / "model.onnx").exists():
        return out / "model.onnx"
    artifacts = ArtifactSet([Artifact("model.onnx", load_model(model).model)], input_was_external=True)
    # alive until written: passes keep new weights in its scratch folder
    context = make_pass_context(calibration=[calibration] if calibration else [])
    for name, cfg in passes:
        cls = get_pass(name)
        start = time.perf_counter()
        artifacts = cls(cls.config_model(**cfg))(artifacts, context).artifacts
        print(f"[{out.name}] {name}: {time.perf_counter() - start:.1f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    graphs = [(a.name, a.model) for a in artifacts.artifacts]
    stage_artifacts(graphs, out, external=True, data_name="model.onnx.data").commit()
    return out / "model.onnx"


class Original:
    """The export at context CTX: numpy feeds (past of the shapes its inputs declare), ORT allocates the presents."""

    def __init__(self, path: Path, entries: dict[str, str] | None = None):
        self.session = open_session(path, config_entries=entries)
        rng = np.random.default_rng(0)
        self.feeds: dict[str, np.ndarray] = {
            "input_ids": np.array([[TOKEN]], np.int64),
            "attention_mask": np.ones((1, CTX + 1), np.int64),
            "position_ids": np.array([[CTX]], np.int64),
        }
        inputs = {a.name for a in self.session.session.get_inputs()}
        self.feeds = {k: v for k, v in self.feeds.items() if k in inputs}
        for arg in self.session.session.get_inputs():
            if arg.name.startswith("past_key_values"):
                shape = (1, arg.shape[1], CTX, arg.shape[3])
                self.feeds[arg.name] = rng.standard_normal(shape).astype(np.float32)

    def step(self) -> float:
        start = time.perf_counter()
        self.session.session.run(None, self.feeds)
        return (time.perf_counter() - start) * 1e3


class Static:
    """A contract decoder with bound buffers rewound to CTX before every call (the same context each time)."""

    def __init__(self, path: Path, entries: dict[str, str] | None = None):
        session = open_session(path, config_entries=entries)
        self.settings = session.settings
        self.decoder = ContractDecoder(session, read_contract(session.model), bind_buffers=True)
        rng = np.random.default_rng(0)
        for buffer in self.decoder.cache_buffers().values():
            buffer[:, :, :CTX] = rng.standard_normal(buffer[:, :, :CTX].shape)

    def step(self) -> float:
        self.decoder.load_cache(self.decoder.cache_buffers(), CTX)
        ((_, ms),) = self.decoder.run_chunk([TOKEN])
        return ms


def _head_node(header: onnx.ModelProto) -> str | None:
    """Name of the MatMul-like node producing the logits (walked back from the ``logits`` output through
    single-data-input ops: Reshape, Slice, Gather, Cast...), or None."""
    producer = {out: node for node in header.graph.node for out in node.output}
    name = next((o.name for o in header.graph.output if o.name == "logits"), None)
    while name in producer:
        node = producer[name]
        if node.op_type in ("MatMul", "Gemm", "MatMulNBits", "FusedMatMul"):
            return node.name
        name = node.input[0] if node.input else None
    return None


def _op_class(node: onnx.NodeProto, head: str | None) -> str:
    """Profile row of a node: its op type; MatMulNBits by bits, and the LM head apart."""
    label = node.op_type
    if node.op_type == "MatMulNBits":
        label += str(next((a.i for a in node.attribute if a.name == "bits"), 4))
    return f"{label} (LM head)" if node.name == head else label


def profile_ops(path: Path, entries: dict[str, str], calls: int = 10, top: int = 8) -> list[tuple[str, float, float]]:
    """ORT's profile of the timed step (:class:`Static`: bound buffers rewound to CTX before every call, the
    runner's session options), ``calls`` calls after 3 warm-up calls.

    Returns:
        Rows ``(label, ms per call, share of kernel time)``: ``session.run`` (median wall time of ORT's
        ``model_run``), ``kernels`` (the sum of each node's median kernel time over the calls; the rest is the
        executor between kernels), then the ``top`` op classes (:func:`_op_class`: the LM head and each
        MatMulNBits bit width apart; a node ORT fused under a new name by its op type).
    """
    runner = open_session(path, config_entries=entries)  # its scratch copy holds a relevelled graph, if any
    assert runner.settings is not None
    options = session_options({PREPACKING_KEY: "0" if runner.settings.prepacking else "1", **entries})
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(os.environ.get("TMPDIR", "/tmp")) / "onnxdeploy-int4-profile")
    target = next(runner.scratch.glob("*.onnx")) if runner.scratch else path
    header = onnx.load(str(target), load_external_data=False)
    head = _head_node(header)
    classes = {node.name: _op_class(node, head) for node in header.graph.node}
    profiled = ort.InferenceSession(str(target), sess_options=options, providers=["CPUExecutionProvider"])
    own, runner.session = runner.session, profiled  # the decoder drives the profiled session
    decoder = ContractDecoder(runner, read_contract(runner.model), bind_buffers=True)
    rng = np.random.default_rng(0)
    for buffer in decoder.cache_buffers().values():
        buffer[:, :, :CTX] = rng.standard_normal(buffer[:, :, :CTX].shape)
    warmup = 3
    for _ in range(warmup + calls):
        decoder.load_cache(decoder.cache_buffers(), CTX)
        decoder.run_chunk([TOKEN])
    trace_file = Path(profiled.end_profiling())
    trace = json.loads(trace_file.read_text())
    trace_file.unlink(missing_ok=True)
    runner.session = own
    runner.close()
    runs = sorted(e["ts"] for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run")
    first = runs[-calls]  # the last `calls` runs (the decoder runs the session once more when it opens)
    per_node: dict[tuple[str, str], list[float]] = {}
    for event in trace:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time") and event["ts"] >= first:
            key = (event["name"][: -len("_kernel_time")], event["args"].get("op_name", "?"))
            per_node.setdefault(key, []).append(event["dur"])
    per_op: Counter[str] = Counter()  # each node's median over the calls: a call preempted by the load counts once
    for (node, op), durations in per_node.items():
        per_op[classes.get(node, op)] += float(np.median(durations)) / 1e3
    total = sum(per_op.values()) or 1.0
    run_ms = float(np.median([e["dur"] for e in trace if e.get("name") == "model_run" and e["ts"] >= first])) / 1e3
    rows = [(op, ms, ms / total) for op, ms in per_op.most_common(top)]
    return [("session.run", run_ms, 1.0), ("kernels", total, 1.0), *rows]


def _vm_hwm() -> int:
    """This process's peak resident memory (``VmHWM`` of ``/proc/self/status``, bytes).

    Not ``ru_maxrss``: Linux carries it over ``execve`` from the forking parent, so a child of a large parent
    reports the parent's peak; ``VmHWM`` belongs to the new address space.
    """
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def rss_child(path: str, entries_json: str, whole_set: str) -> None:
    """In a fresh process: open ``path`` (or its whole set, as verify does) with the entries, run every graph once,
    print the peak RSS growth over the interpreter's."""
    base = _vm_hwm()
    entries = json.loads(entries_json)
    if whole_set == "1":
        with make_decoder(open_session(path, config_entries=entries)) as decoder:
            assert isinstance(decoder, GraphSetDecoder)
            decoder.warm_up()  # one call of every graph
    else:
        Static(Path(path), entries).step()
    print(json.dumps({"peak_growth": _vm_hwm() - base}))


def peak_rss(path: Path, entries: dict[str, str], *, whole_set: bool = False) -> int:
    """Peak RSS growth (bytes) of opening ``path`` (or its set) and running it, measured in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(path), json.dumps(entries), "1" if whole_set else "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(out.strip().splitlines()[-1])["peak_growth"])


def weight_bytes(folder: Path) -> int:
    """Bytes of the set's shared weights file (``model.onnx.data``)."""
    return (folder / "model.onnx.data").stat().st_size


def step1_decode(int4: Path, tokens: list[int], entries: dict[str, str]) -> float:
    """Seconds to feed ``tokens`` one at a time through the INT4 set's decode graph (bound buffers), warmed up."""
    session = open_session(int4, config_entries=entries)
    with ContractDecoder(session, read_contract(session.model), bind_buffers=True) as step:
        step.feed(tokens[:4])
        step.reset()
        start = time.perf_counter()
        for token in tokens:
            step.feed([token])
        return time.perf_counter() - start


def accuracy_phase(original: Path, int4: Path, tokens: list[int], levels: tuple[int, ...] = (4, 0)) -> dict[str, float]:
    """``evaluate_accuracy``'s wall time against 3 × (the original in one call + one step-1 decode of the tokens).

    The step-1 decode is timed at both accuracy levels: 4 (the graph as written, the faster) and 0 (the level of
    the ``weight_only`` figures the thresholds apply to); the budget is given for each.
    """
    with ExporterDecoder(open_session(original)) as decoder:
        decoder.feed(tokens[:8])  # warm-up
        decoder.reset()
        start = time.perf_counter()
        decoder.feed(tokens)
        one_call = time.perf_counter() - start
    # INT8 MatMulNBits has no fp32-compute kernel in ORT 1.32's MLAS: at level 0 it dequantizes every call, so a
    # mixed INT4/INT8 set's level-0 step-1 decode takes minutes (--budget-levels 4 skips it).
    step = {level: step1_decode(int4, tokens, LEVEL[level]) for level in levels}
    start = time.perf_counter()
    report = evaluate_accuracy(original, int4, tokens)
    phase = time.perf_counter() - start
    budget = {level: 3 * (one_call + s) for level, s in step.items()}
    return {
        "tokens": len(tokens),
        "original_one_call_s": one_call,
        **{f"int4_step1_decode_s_level{lv}": s for lv, s in step.items()},
        **{f"budget_s_level{lv}": b for lv, b in budget.items()},
        "accuracy_phase_s": phase,
        **{f"phase_over_budget_level{lv}": phase / b for lv, b in budget.items()},
        "weight_only_mean_kl": report.weight_only.mean_kl,
        "default_mean_kl": report.default_optimized.mean_kl,
    }


def measure_steps(
    original: Path,
    float_set: Path,
    int4: Path,
    rounds: int,
    rounds_unpacked: int,
    levels: tuple[int, ...] = (0, 4),
    extra: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """Median step ms per variant, interleaved (module docstring), and each INT4 level's ratio to the original.

    ``levels``: the accuracy_levels the INT4 set's step is timed at; ``extra``: more quantized sets (label → decode
    graph), each timed at accuracy_level 4 in the same interleaved rounds.
    """
    variants: dict[str, Callable[[], float]] = {
        "original": Original(original).step,
        "float static": Static(float_set).step,
        **{f"int4 level {level}": Static(int4, LEVEL[level]).step for level in levels},
        **{f"{label} level 4": Static(path, LEVEL[4]).step for label, path in (extra or {}).items()},
    }
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    times = interleave({name: _cpu_timed(step, cpu[name]) for name, step in variants.items()}, rounds)
    med = {name: float(np.median(t)) for name, t in times.items()}
    cpu_med = {name: float(np.median(t[-rounds:])) for name, t in cpu.items()}  # the warm-up calls dropped
    if rounds_unpacked:  # apart: one call takes seconds
        slow = {
            "original": Original(original).step,
            "int4 unpacked": Static(int4, {**LEVEL[0], PREPACKING_KEY: "1"}).step,
        }
        slow_times = interleave(slow, rounds_unpacked, warmup=1)
        unpacked = float(np.median(slow_times["int4 unpacked"]))
    ratio = {k: v / med["original"] for k, v in med.items() if k != "original"}
    if rounds_unpacked:
        med["int4 unpacked"] = unpacked
        ratio["int4 unpacked"] = unpacked / float(np.median(slow_times["original"]))  # against its own rounds
    cpu_ratio = {k: v / cpu_med["original"] for k, v in cpu_med.items() if k != "original"}
    return {"median_ms": med, "ratio": ratio, "median_cpu_ms": cpu_med, "cpu_ratio": cpu_ratio}


def _cpu_timed(step: Callable[[], float], cpu_ms: list[float]) -> Callable[[], float]:
    """``step`` that also appends the calling thread's CPU time of each call (ms) to ``cpu_ms``.

    ORT with one intra-op thread computes on the calling thread, so this is the step's compute without the time
    other processes held the core: on a loaded machine a steadier figure than the wall time, printed beside it.
    """

    def call() -> float:
        start = time.thread_time()
        ms = step()
        cpu_ms.append((time.thread_time() - start) * 1e3)
        return ms

    return call


def _license_tokens(model: Path, count: int) -> list[int]:
    """The first ``count`` tokens of numpy's shipped license files (``benchmarks/quantize.py``'s calibration)."""
    licenses = sorted((Path(np.__file__).parent.parent / f"numpy-{np.__version__}.dist-info").rglob("LICENSE*"))
    text = "\n\n".join(p.read_text(errors="replace") for p in licenses)
    return load_codec(model.parent / "tokenizer.json", key="tokenizer").encode(text)[:count]


def main() -> int:
    """Build (or reuse) the sets, measure, print; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an exporter-convention .onnx (default: decode.py's 125M export)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-int4"))
    ap.add_argument("--decode-work-dir", type=Path, default=Path("/tmp/onnxdeploy-decode"))
    ap.add_argument("--venv-dir", type=Path, default=Path("/tmp/onnxdeploy-fixture-venvs"))
    ap.add_argument("--rounds", type=int, default=20, help="timed calls per variant")
    ap.add_argument("--rounds-unpacked", type=int, default=3, help="timed calls of the prepacking-off INT4 step")
    ap.add_argument("--tokens", type=int, default=300, help="held-out tokens of the accuracy phase (0: skip)")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rss-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--quant", type=json.loads, help="the INT4 set's quantize_weights config as JSON (default: INT4)")
    ap.add_argument(
        "--quant-before-fuse", action="store_true", help="quantize_weights before fuse_matmuls (per-projection rules)"
    )
    ap.add_argument("--tag", default="int4", help="the quantized set's folder name under WORK/<model>/")
    ap.add_argument("--prefill-logits", choices=["last", "all"], default="last", help="static_kv prefill_logits")
    ap.add_argument(
        "--calibration-tokens", type=int, default=0, help="calibration: numpy's license files' first N tokens"
    )
    ap.add_argument("--text-file", type=Path, help="accuracy phase: held-out text (tokenizer.json beside --model)")
    ap.add_argument("--budget-levels", default="4,0", help="accuracy_levels of the budget's step-1 decode")
    ap.add_argument("--no-steps", action="store_true", help="skip the step timings and profiles")
    ap.add_argument("--step-levels", default="0,4", help="accuracy_levels the INT4 set's step is timed at")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="TAG=JSON",
        help="another quantize_weights config (built like --quant, tagged TAG), its step timed at level 4 in the "
        "same interleaved rounds; repeatable",
    )
    args = ap.parse_args()
    if args.rss_child:
        rss_child(*args.rss_child)
        return 0
    if args.model is None:
        ensure_export(SIZE, args.decode_work_dir.resolve(), args.venv_dir.resolve())
        args.model = args.decode_work_dir.resolve() / "models" / SIZE.name / "model.onnx"
    name = args.model.parent.name
    work = args.work_dir.resolve() / name
    static = [(n, c | {"prefill_logits": args.prefill_logits} if n == "static_kv" else c) for n, c in STATIC]
    suffix = "" if args.prefill_logits == "last" else "-all"
    quant = INT4 if args.quant is None else ("quantize_weights", args.quant)
    calibration = _license_tokens(args.model, args.calibration_tokens) if args.calibration_tokens else None
    float_set = build_set(args.model, work / "float", STATIC)  # its decode step only: prefill_logits is moot
    # Rules naming q/k/v or gate/up apart need them unfused: quantize before fuse_matmuls (it fuses float MatMuls).
    chain = [*static[:3], quant, *static[3:]] if args.quant_before_fuse else [*static, quant]
    int4 = build_set(args.model, work / f"{args.tag}{suffix}", chain, calibration)
    print(f"[{args.tag}] {json.dumps(quant[1])}, prefill_logits {args.prefill_logits}", flush=True)
    extra: dict[str, Path] = {}
    for spec in args.also:
        tag, _, cfg = spec.partition("=")
        also = ("quantize_weights", json.loads(cfg))
        also_chain = [*static[:3], also, *static[3:]] if args.quant_before_fuse else [*static, also]
        extra[tag] = build_set(args.model, work / f"{tag}{suffix}", also_chain, calibration)
        print(f"[{tag}] {json.dumps(also[1])}, prefill_logits {args.prefill_logits}", flush=True)
    step_levels = tuple(int(v) for v in args.step_levels.split(","))
    print(f"{os.cpu_count()} CPUs; onnxruntime {ort.__version__}; model {args.model}; context {CTX}, L={CACHE_LEN}")
    results: dict[str, Any] = {"model": str(args.model), "context": CTX, "max_cache_len": CACHE_LEN}
    if not args.no_steps:
        results["steps"] = steps = measure_steps(
            args.model, float_set, int4, args.rounds, args.rounds_unpacked, step_levels, extra
        )
        print(f"\n== decode step at context {CTX}, median of {args.rounds} interleaved calls, runner sessions ==")
        labels = {"original": "-", "float static": "-", "int4 level 0": "0", "int4 level 4": "4", "int4 unpacked": "0"}
        for variant, ms in steps["median_ms"].items():
            ratio = steps["ratio"].get(variant)
            tail = f"  x{ratio:.3f} of the original" if ratio is not None else ""
            if variant in steps["median_cpu_ms"]:
                cpu_ratio = steps["cpu_ratio"].get(variant)
                tail += f"; CPU {steps['median_cpu_ms'][variant]:7.2f} ms" + (f" x{cpu_ratio:.3f}" if cpu_ratio else "")
            level = labels.get(variant, variant.rsplit(" ", 1)[-1] if variant.endswith(" level 4") else "-")
            shown = args.tag + variant[4:] if variant.startswith("int4 ") else variant  # the --tag set
            print(f"  {shown:30s} accuracy_level {level:>2}  {ms:9.2f} ms{tail}")
        results["profile"] = {}
        profiled = [(args.tag, int4, level) for level in step_levels] + [(tag, p, 4) for tag, p in extra.items()]
        for label, path, level in profiled:
            ops = profile_ops(path, LEVEL[level])
            results["profile"][f"{label} level {level}"] = ops
            (_, run_ms, _), (_, kernel_ms, _), *rows = ops
            print(
                f"  {label} level {level} profile: session.run {run_ms:.2f} ms, kernels {kernel_ms:.2f} ms: "
                + ", ".join(f"{op} {ms:.2f} ms ({share:.0%})" for op, ms, share in rows)
            )
    if not args.no_rss:
        rss = results["rss"] = {}
        print("\n== peak RSS growth of opening + one step (fresh process each) ==")
        graphs = len(list(float_set.parent.glob("*.onnx")))
        for label, path in (("float", float_set), ("int4", int4)):
            nbytes = weight_bytes(path.parent)
            for whole_set in (False, True):
                for packing in ("1", "0"):
                    grown = peak_rss(path, {PREPACKING_KEY: packing}, whole_set=whole_set)
                    state = "off" if packing == "1" else "on"
                    what = f"{label} {'set of ' + str(graphs) if whole_set else 'decode graph'}"
                    rss[f"{what}, prepacking {state}"] = {"bytes": grown, "weights": nbytes}
                    print(
                        f"  {what:22s} prepacking {state:3s} {grown / 2**20:8.0f} MiB  "
                        f"({grown / nbytes:.2f}x its {nbytes / 2**20:.0f} MiB of weights)"
                    )
    if args.tokens:
        if args.text_file:
            codec = load_codec(args.model.parent / "tokenizer.json", key="tokenizer")
            tokens = text_token_ids(args.text_file, codec, args.tokens, key="text_file")
        else:
            vocab = logits_vocab(int4) or SIZE.vocab_size()
            tokens = np.random.default_rng(0).integers(3, vocab, size=args.tokens).tolist()
        levels = tuple(int(v) for v in args.budget_levels.split(","))
        results["accuracy_phase"] = phase = accuracy_phase(args.model, int4, tokens, levels)
        print(f"\n== accuracy phase, {args.tokens} tokens ==")
        steps = ", ".join(f"{phase[f'int4_step1_decode_s_level{lv}']:.2f} s at accuracy_level {lv}" for lv in levels)
        print(f"  original, one call: {phase['original_one_call_s']:.2f} s; quantized step-1 decode: {steps}")
        for lv in levels:
            over = phase[f"phase_over_budget_level{lv}"]
            print(
                f"  evaluate_accuracy: {phase['accuracy_phase_s']:.1f} s = {over:.2f}x "
                f"the budget 3x(one call + step-1 decode at level {lv}) = {phase[f'budget_s_level{lv}']:.1f} s"
            )
        print(
            f"  weight_only (level 0) mean KL {phase['weight_only_mean_kl']:.4g}, "
            f"default_optimized (level 4) {phase['default_mean_kl']:.4g}"
        )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
