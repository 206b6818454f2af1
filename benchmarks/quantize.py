"""onnxdeploy's ``quantize_weights`` against onnxruntime's ``MatMulNBitsQuantizer``, measured in one run.

Models: the trained byte-level fixture (``fixtures/llama_bytes/torchscript``) and a ~125M LLaMA-shaped export
made at benchmark time (``fixtures/_export_scale.py`` in the fixtures' torchscript venv, through
``benchmarks/scale.py``'s cached-export machinery; hidden 768, 12 layers, 12 heads, 4 KV heads, vocab 32000,
seeded random init).

For each model, each quantizer runs in its own subprocess (wall time including imports; peak RSS of the
process tree sampled every 50 ms by ``scale.measure``), interleaved: onnxdeploy, ORT, onnxdeploy, ORT (times
and RSS are the means of the two runs). Settings are the same on both sides: INT4, ``block_size`` 32,
symmetric, round-to-nearest, ``MatMulNBits`` with ``accuracy_level`` 4 (ORT: ``DefaultWeightOnlyQuantConfig``).
onnxdeploy is also run with ``method: gptq, act_order: true`` on calibration tokens (another stdlib file's
bytes for the trained fixture; seeded random ids for the 125M one, only with ``--gptq bytes,125m``).

Printed for each output: wall time, peak RSS, file size (``.onnx`` + data), weight MSE (dequantized
MatMulNBits weights against the float ones; not for act-order, whose stored channels are permuted),
teacher-forced mean KL / top-1 agreement / perplexity on held-out tokens (``runner.accuracy``: weight-only
figures, ``session.qdq_matmulnbits_accuracy_level=0``; for MatMulNBits nodes the node's own
``accuracy_level`` decides), and decode step latency (p50 over 32 greedy steps, one thread, spinning off,
prepacking on as ORT ships; interleaved, mean of two runs); then the ratios
onnxdeploy / ORT. Figures are printed and saved (``WORK_DIR/quantize_results.json``), never asserted. Usage::

    .venv/bin/python benchmarks/quantize.py [--models bytes,125m] [--work-dir /tmp/onnxdeploy-quantize]
        [--export-cache /tmp/onnxdeploy-decode]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402  (benchmarks/scale.py: process-tree RSS, cached exports)

REPO = Path(__file__).resolve().parents[1]
BYTES_MODEL = REPO / "fixtures" / "llama_bytes" / "torchscript" / "model.onnx"
SIZE_125M = scale.ModelSize(
    "125m", hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2048, vocab=32000
)
BITS, BLOCK, SYMMETRIC, ACCURACY_LEVEL = 4, 32, True, 4
EVAL_TOKENS = 257
CALIBRATION_TOKENS = 1024
DECODE_STEPS = 32

WORKER = """
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {repo!r})
kind, src, out, calib = sys.argv[1:5]
from pathlib import Path
import numpy as np
if kind == "ort":
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
    model = onnx.load(src)
    cfg = DefaultWeightOnlyQuantConfig(
        block_size={block}, is_symmetric={symmetric}, accuracy_level={level}, bits={bits}
    )
    quant = MatMulNBitsQuantizer(model, algo_config=cfg)
    quant.process()
    quant.model.save_model_to_file(str(Path(out) / "model.onnx"), use_external_data_format=True)
else:
    from onnxdeploy.model_io import load_model, stage_artifacts
    from onnxdeploy.pass_context import make_pass_context
    from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig, QuantizeWeightsPass
    extra = dict(method="gptq", act_order=True) if kind == "onnxdeploy-gptq" else {{}}
    cfg = QuantizeWeightsConfig(bits={bits}, block_size={block}, symmetric={symmetric}, format="matmulnbits",
                                accuracy_level={level}, **extra)
    calibration = [np.load(calib).tolist()] if extra else []
    loaded = load_model(src)
    ctx = make_pass_context(model_path=Path(src), calibration=calibration, scratch_dir=Path(out) / "scratch")
    result = QuantizeWeightsPass(cfg)(loaded.model, ctx)
    staged = stage_artifacts([("model.onnx", result.artifacts.primary)], Path(out), external=True,
                             data_name="model.onnx.data")
    staged.commit()
    import shutil; shutil.rmtree(Path(out) / "scratch")
print(json.dumps({{"total_s": time.perf_counter() - t0}}))
"""


def private_copy(src: Path, dest: Path) -> Path:
    """Copy the export's files into ``dest`` once (not hard links).

    onnx.load refuses a data file with several hard links ("potential hardlink attack"), which a shared export
    cache gets from the runner's scratch copies.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("model.onnx", "model.onnx.data"):
        if not (dest / name).is_file() or (dest / name).stat().st_size != (src / name).stat().st_size:
            shutil.copyfile(src / name, dest / name)
    return dest


def files_bytes(folder: Path) -> int:
    """Bytes of every file in ``folder`` (the model and its data)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def quantize(kind: str, model: Path, out: Path, calib: Path, tag: str) -> scale.Measured:
    """Run one quantizer in a subprocess into a fresh ``out``; raise when it fails."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    code = WORKER.format(repo=str(REPO), block=BLOCK, symmetric=SYMMETRIC, level=ACCURACY_LEVEL, bits=BITS)
    m = scale.measure([sys.executable, "-c", code, kind, str(model), str(out), str(calib)], out.parent, tag)
    if m.exit_code != 0:
        raise RuntimeError(f"{tag} failed (exit {m.exit_code}):\n{m.stderr_tail}")
    return m


def nbits_weight_mse(original: Path, quantized: Path) -> float:
    """Mean squared error of every MatMulNBits weight (dequantized) against the float weight it replaced."""
    import onnx_ir as ir

    src = ir.load(original)
    q = ir.load(quantized)
    floats = {str(name): v.const_value for name, v in src.graph.initializers.items()}
    inits = q.graph.initializers
    total, count = 0.0, 0
    for node in q.graph:
        if node.op_type != "MatMulNBits":
            continue
        k, n = node.attributes.get_int("K"), node.attributes.get_int("N")
        bits, block = node.attributes.get_int("bits"), node.attributes.get_int("block_size")
        b = inits[str(node.inputs[1].name)].const_value.numpy()
        scales = inits[str(node.inputs[2].name)].const_value.numpy().reshape(n, -1)
        if bits == 4:
            u = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, -1).astype(np.float32)
        else:
            u = b.reshape(n, -1).astype(np.float32)
        zp = float(1 << (bits - 1))
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            raise NotImplementedError("asymmetric weights are not compared here")
        deq = (u - zp) * np.repeat(scales, block, axis=1)
        name = str(node.inputs[1].name).rsplit(f"_Q{bits}", 1)[0]
        w = floats[name].numpy().astype(np.float32).T  # (N, K)
        total += float(((deq[:, :k] - w) ** 2).sum())
        count += w.size
    return total / max(count, 1)


def decode_latency_ms(path: Path, prompt: list[int]) -> float:
    """p50 wall time (ms) of one greedy decode step: one thread, spinning off, prepacking on."""
    import onnxruntime as ort

    from onnxdeploy.runner import make_decoder, open_session

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    model_session = open_session(path)
    model_session.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    with make_decoder(model_session) as decoder:
        outputs = decoder.feed(prompt)
        for _ in range(2):  # warm-up
            outputs = decoder.feed([int(np.argmax(outputs[-1][0]))])
        decoder.reset()
        outputs = decoder.feed(prompt)
        for _ in range(DECODE_STEPS):
            outputs = decoder.feed([int(np.argmax(outputs[-1][0]))])
        return statistics.median(decoder.call_latencies_ms[1:])


def bench_model(
    name: str, model: Path, eval_tokens: list[int], calib: Path, work: Path, with_gptq: bool
) -> dict[str, Any]:
    """Quantize ``model`` with every quantizer (interleaved; GPTQ once, when asked), then measure each output."""
    from onnxdeploy.runner.accuracy import evaluate_accuracy

    runs: dict[str, list[scale.Measured]] = {"onnxdeploy": [], "ort": [], "onnxdeploy-gptq": []}
    for round_ in range(2):
        for kind in ("onnxdeploy", "ort"):
            print(f"[{name}] {kind} run {round_ + 1}", flush=True)
            runs[kind].append(quantize(kind, model, work / name / kind, calib, f"{name}-{kind}-{round_}"))
    outputs = {"onnxdeploy": work / name / "onnxdeploy", "ort": work / name / "ort"}
    if with_gptq:
        print(f"[{name}] onnxdeploy-gptq", flush=True)
        runs["onnxdeploy-gptq"].append(quantize("onnxdeploy-gptq", model, work / name / "gptq", calib, f"{name}-gptq"))
        outputs["onnxdeploy-gptq"] = work / name / "gptq"
    result: dict[str, Any] = {"model": str(model), "model_bytes": files_bytes(model.parent), "quantizers": {}}
    latencies: dict[str, list[float]] = {k: [] for k in outputs}
    prompt = eval_tokens[:6]
    for _ in range(2):
        for kind, folder in outputs.items():
            latencies[kind].append(decode_latency_ms(folder / "model.onnx", prompt))
    float_latency = decode_latency_ms(model, prompt)
    for kind, folder in outputs.items():
        path = folder / "model.onnx"
        acc = evaluate_accuracy(model, path, eval_tokens)
        result["quantizers"][kind] = {
            "wall_s": statistics.mean(m.wall_s for m in runs[kind]),
            "peak_rss_bytes": statistics.mean(m.peak_tree_rss for m in runs[kind]),
            "file_bytes": files_bytes(folder),
            # act-order permutes K (and producers' N): the stored weights do not line up with the float ones.
            "weight_mse": nbits_weight_mse(model, path) if kind != "onnxdeploy-gptq" else float("nan"),
            "mean_kl": acc.weight_only.mean_kl,
            "top1_agreement": acc.weight_only.top1_agreement,
            "ppl": acc.weight_only.ppl_candidate,
            "ppl_float": acc.weight_only.ppl_original,
            "mean_kl_default_session": acc.default_optimized.mean_kl,
            "decode_step_ms_p50": statistics.mean(latencies[kind]),
        }
    result["float_decode_step_ms_p50"] = float_latency
    return result


def print_result(name: str, r: dict[str, Any]) -> None:
    """One table per model, then the onnxdeploy / ORT ratios."""
    q = r["quantizers"]
    print(f"\n== {name}: {r['model']} ({r['model_bytes'] / 1e6:.1f} MB float, decode step "
          f"{r['float_decode_step_ms_p50']:.2f} ms)")  # fmt: skip
    cols = ["wall_s", "peak_rss_bytes", "file_bytes", "weight_mse", "mean_kl", "top1_agreement", "ppl",
            "decode_step_ms_p50"]  # fmt: skip
    print(f"{'quantizer':18s}" + "".join(f"{c:>20s}" for c in cols))
    for kind, v in q.items():
        print(f"{kind:18s}" + "".join(f"{v[c]:>20.6g}" for c in cols))
    ours, ort = q["onnxdeploy"], q["ort"]
    print(f"{'onnxdeploy / ORT':18s}" + "".join(f"{ours[c] / ort[c] if ort[c] else float('nan'):>20.3f}" for c in cols))
    if "onnxdeploy-gptq" in q:
        print(f"{'gptq+act-order/ORT':18s}" + "".join(
            f"{q['onnxdeploy-gptq'][c] / ort[c] if ort[c] else float('nan'):>20.3f}" for c in cols))  # fmt: skip
    print(f"perplexity of the float model on the same tokens: {ours['ppl_float']:.4g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bytes,125m", help="comma-separated: bytes, 125m")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-quantize"))
    ap.add_argument("--gptq", default="bytes",
                    help="models also quantized with GPTQ + act-order (comma-separated; the 125M one takes minutes "
                    "and, random-init with random calibration ids, says little)")  # fmt: skip
    ap.add_argument("--bytes-model", type=Path, default=BYTES_MODEL,
                    help="the trained model (its eval.txt beside it): default the fixture")  # fmt: skip
    ap.add_argument("--export-cache", type=Path, default=Path("/tmp/onnxdeploy-decode"),
                    help="where the 125M export is cached (shared with benchmarks/decode.py: same shape)")  # fmt: skip
    ap.add_argument("--venv-dir", type=Path, default=Path("/tmp/onnxdeploy-fixture-venvs"),
                    help="the fixtures' venvs (fixtures/make_fixtures.py --venv-dir)")  # fmt: skip
    args = ap.parse_args()
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    results: dict[str, Any] = {}
    for name in args.models.split(","):
        calib = work / f"{name}-calibration.npy"
        if name == "bytes":
            model = args.bytes_model.resolve()
            eval_tokens = list((model.parent / "eval.txt").read_bytes()[:EVAL_TOKENS])
            np.save(
                calib,
                np.frombuffer((stdlib / "difflib.py").read_bytes()[:CALIBRATION_TOKENS], np.uint8).astype(np.int64),
            )
        elif name == "125m":
            cache = args.export_cache.resolve()
            info, _ = scale.ensure_export(SIZE_125M, cache, args.venv_dir.resolve())
            model = private_copy(cache / "models" / "125m", work / "src-125m") / "model.onnx"
            print(f"[125m] {info['parameters'] / 1e6:.1f}M parameters", flush=True)
            rng = np.random.default_rng(0)
            eval_tokens = rng.integers(0, SIZE_125M.vocab or 32000, EVAL_TOKENS).tolist()
            np.save(calib, rng.integers(0, SIZE_125M.vocab or 32000, CALIBRATION_TOKENS).astype(np.int64))
        else:
            raise SystemExit(f"unknown model {name!r}; known: bytes, 125m")
        results[name] = bench_model(name, model, eval_tokens, calib, work, name in args.gptq.split(","))
        print_result(name, results[name])
    (work / "quantize_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nresults: {work / 'quantize_results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
