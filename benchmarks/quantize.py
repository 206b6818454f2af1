"""onnxdeploy's ``quantize_weights`` against ONNX Runtime's own weight-only quantizers, measured in one run.

Models: ``bytes`` (the trained byte-level fixture ``fixtures/llama_bytes/torchscript``: float weights, held-out
text ``eval.txt``), ``smollm2`` (SmolLM2-135M-Instruct exported by ``fixtures/`` into
``~/.cache/onnxdeploy/real/smollm2-135m-instruct/``, when present; ``--smollm2-model`` names another path; held-out
text CPython's ``LICENSE.txt``, calibration numpy's shipped license files) and
``125m`` (a random-init LLaMA-shaped export made at benchmark time: speed and memory only).

Quantizers (INT4 ``MatMulNBits``, each in its own subprocess on a scratch copy of the model, wall time with
imports and peak RSS of the process tree sampled every 50 ms by ``scale.measure``), at ``block_size`` 32 and 128:

* ORT 1.32 ``onnxruntime.quantization.matmul_nbits_quantizer``: ``DefaultWeightOnlyQuantConfig``
  ``is_symmetric`` true and false, ``RTNWeightOnlyQuantConfig`` and ``KQuantWeightOnlyQuantConfig``
  (asymmetric: ``MatMulNBitsQuantizer(is_symmetric=False)``, their default scheme), ``HQQWeightOnlyQuantConfig``
  (needs torch: run by the fixtures' torch venv ``/tmp/onnxdeploy-fixture-venvs/torchscript/bin/python``, same
  onnxruntime 1.32) and ``GPTQWeightOnlyQuantConfig`` (asymmetric, act-order off, ``percdamp`` 0.01; its data
  path imports torch too, so the same venv) with a calibration data reader
  feeding the decoder's past-cache inputs (empty past, the calibration tokens in chunks of 256);
* onnxdeploy ``quantize_weights``: RTN symmetric (bit-identical to ORT's default symmetric), RTN asymmetric,
  ``method: gptq`` + act-order, and the candidate ``method: gptq`` + act-order + ``scale_search: mse`` +
  ``symmetric: false`` (:mod:`onnxdeploy.passes._quant_search`), on the same calibration tokens.

Every quantizer writes ``accuracy_level`` 0 (unset: the weights dequantized, fp32 compute), the level the
accuracy figures are taken at. Printed per output: bits per weight (packed weights + scales + zero points over
the weights quantized, from the written file; scales float32), wall time, peak RSS, teacher-forced mean KL /
top-1 agreement / perplexity ratio on held-out tokens (``runner.accuracy``'s ``teacher_forced_logits`` and
``accuracy_figures``, weight-only session entries), then the ratios the issue's goals name. Figures are printed
and saved (``WORK_DIR/quantize_results.json``), never asserted. Usage::

    .venv/bin/python benchmarks/quantize.py [--models bytes,smollm2,125m] [--blocks 32,128]
        [--only ort-default-sym,od-best] [--work-dir /tmp/onnxdeploy-quantize]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402  (benchmarks/scale.py: process-tree RSS, cached exports)

REPO = Path(__file__).resolve().parents[1]
BYTES_MODEL = REPO / "fixtures" / "llama_bytes" / "torchscript" / "model.onnx"
SMOLLM2_DIR = Path.home() / ".cache" / "onnxdeploy" / "real" / "smollm2-135m-instruct"
TORCH_VENVS = ("torchscript", "real-torch")  # the fixtures' torch venvs (make_fixtures.py, _export_real.py)
TORCH_PYTHON = next(
    (p for v in TORCH_VENVS if (p := Path(f"/tmp/onnxdeploy-fixture-venvs/{v}/bin/python")).is_file()),
    Path(f"/tmp/onnxdeploy-fixture-venvs/{TORCH_VENVS[0]}/bin/python"),
)
SIZE_125M = scale.ModelSize(
    "125m", hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2048, vocab=32000
)
ACCURACY_LEVEL = 0
CALIBRATION_CHUNK = 256

QUANTIZERS: dict[str, dict[str, Any]] = {
    "ort-default-sym": {"side": "ort", "algo": "default", "symmetric": True},
    "ort-default-asym": {"side": "ort", "algo": "default", "symmetric": False},
    "ort-rtn": {"side": "ort", "algo": "rtn", "symmetric": False},
    "ort-kquant": {"side": "ort", "algo": "kquant", "symmetric": False},
    "ort-hqq": {"side": "ort", "algo": "hqq", "symmetric": False},
    "ort-gptq": {"side": "ort", "algo": "gptq", "symmetric": False, "calibrated": True},
    "ort-int8": {"side": "ort", "algo": "default", "symmetric": True, "bits": 8},
    "od-rtn-sym": {"side": "onnxdeploy", "config": {"symmetric": True}},
    "od-int8": {"side": "onnxdeploy", "config": {"symmetric": True, "bits": 8}},
    "od-rtn-asym": {"side": "onnxdeploy", "config": {"symmetric": False}},
    "od-gptq-ao": {"side": "onnxdeploy", "config": {"method": "gptq", "act_order": True}, "calibrated": True},
    "od-rtn-search": {
        "side": "onnxdeploy",
        "config": {"symmetric": False, "scale_search": "mse"},
        "calibrated": True,
    },
    "od-gptq-ao-asym": {
        "side": "onnxdeploy",
        "config": {"method": "gptq", "act_order": True, "symmetric": False},
        "calibrated": True,
    },
    "od-best": {
        "side": "onnxdeploy",
        "config": {"method": "gptq", "act_order": True, "symmetric": False, "scale_search": "mse"},
        "calibrated": True,
    },
}

WORKER = r"""
import json, sys, time
t0 = time.perf_counter()
spec = json.loads(sys.argv[1])
src, out, calib = sys.argv[2:5]
from pathlib import Path
import numpy as np
block, sym, level = spec["block"], spec["symmetric"], spec["accuracy_level"]
if spec["side"] == "ort":
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq
    from onnxruntime.quantization.calibrate import CalibrationDataReader
    model = onnx.load(src)

    class Reader(CalibrationDataReader):
        # The decoder's own inputs: an empty past cache, the calibration tokens in chunks.
        def __init__(self):
            ids = np.load(calib).astype(np.int64)
            self.feeds = []
            for start in range(0, len(ids), spec["chunk"]):
                piece = ids[start : start + spec["chunk"]][None]
                feed = {}
                for inp in model.graph.input:
                    name = inp.name
                    dims = [d.dim_value if d.HasField("dim_value") else (0 if "past" in d.dim_param else 1)
                            for d in inp.type.tensor_type.shape.dim]
                    if name == "input_ids":
                        feed[name] = piece
                    elif name == "attention_mask":
                        feed[name] = np.ones_like(piece)
                    elif name == "position_ids":
                        feed[name] = np.arange(piece.shape[1], dtype=np.int64)[None]
                    else:
                        feed[name] = np.zeros(dims, dtype=onnx.helper.tensor_dtype_to_np_dtype(
                            inp.type.tensor_type.elem_type))
                self.feeds.append(feed)
            self.i = 0
        def get_next(self):
            self.i += 1
            return self.feeds[self.i - 1] if self.i <= len(self.feeds) else None

    algo = spec["algo"]
    if algo == "default":
        cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=sym, accuracy_level=level,
                                               bits=spec.get("bits", 4))
    elif algo == "rtn":
        cfg = mnq.RTNWeightOnlyQuantConfig()
    elif algo == "kquant":
        cfg = mnq.KQuantWeightOnlyQuantConfig()
    elif algo == "hqq":
        cfg = mnq.HQQWeightOnlyQuantConfig(block_size=block, bits=4)
    else:
        cfg = mnq.GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader(), percdamp=0.01, block_size=block)
    quant = mnq.MatMulNBitsQuantizer(model, bits=spec.get("bits", 4), block_size=block, is_symmetric=sym,
                                     accuracy_level=level, algo_config=cfg)
    quant.process()
    quant.model.save_model_to_file(str(Path(out) / "model.onnx"), use_external_data_format=True)
else:
    sys.path.insert(0, spec["repo"])
    from onnxdeploy.model_io import load_model, stage_artifacts
    from onnxdeploy.pass_context import make_pass_context
    from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig, QuantizeWeightsPass
    cfg = QuantizeWeightsConfig(**(dict(bits=4, block_size=block, format="matmulnbits", accuracy_level=level)
                                   | spec["config"]))
    calibration = [np.load(calib).tolist()] if spec.get("calibrated") else []
    loaded = load_model(src)
    ctx = make_pass_context(model_path=Path(src), calibration=calibration, scratch_dir=Path(out) / "scratch")
    result = QuantizeWeightsPass(cfg)(loaded.model, ctx)
    staged = stage_artifacts([("model.onnx", result.artifacts.primary)], Path(out), external=True,
                             data_name="model.onnx.data")
    staged.commit()
    import shutil; shutil.rmtree(Path(out) / "scratch")
    (Path(out) / "pass_report.json").write_text(json.dumps(result.report.details.get("bits_per_weight")))
print(json.dumps({"total_s": time.perf_counter() - t0}))
"""


def files_bytes(folder: Path) -> int:
    """Bytes of every file in ``folder`` (the model and its data)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def bits_per_weight(path: Path) -> dict[str, Any]:
    """Bits per weight of a written model: every ``MatMulNBits`` (``B`` + scales + zero points) and every
    ``DequantizeLinear`` of a constant (values + scale + zero point), over the ``N × K`` weights they hold;
    an initializer read by several nodes counts once."""
    import onnx_ir as ir

    model = ir.load(path)
    inits = model.graph.initializers
    seen: set[str] = set()
    bits = weights = 0
    scale_types: set[str] = set()

    def add(value: ir.Value | None) -> int:
        if value is None or str(value.name) not in inits or str(value.name) in seen:
            return 0
        seen.add(str(value.name))
        return inits[str(value.name)].const_value.nbytes * 8

    for node in model.graph:
        if node.op_type == "MatMulNBits":
            k, n = node.attributes.get_int("K"), node.attributes.get_int("N")
            if str(node.inputs[1].name) not in seen:
                weights += k * n
            bits += sum(add(v) for v in node.inputs[1:4])
            scale_types.add(str(node.inputs[2].dtype))
        elif node.op_type == "DequantizeLinear" and str(node.inputs[0].name) in inits:
            if str(node.inputs[0].name) not in seen:
                weights += int(np.prod(node.inputs[0].shape.numpy()))
            bits += sum(add(v) for v in node.inputs[:3])
            scale_types.add(str(node.inputs[1].dtype))
    return {"bits_per_weight": bits / max(weights, 1), "weights": weights, "scale_dtypes": sorted(scale_types)}


def quantize(name: str, spec: dict, model: Path, out: Path, calib: Path, tag: str) -> scale.Measured:
    """Run one quantizer in a subprocess into a fresh ``out``; raise when it fails."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # HQQ needs torch, and ORT's GPTQ data path (neural_compressor.util.to_numpy) imports it: the torch venv.
    python = str(TORCH_PYTHON) if spec.get("algo") in ("hqq", "gptq") else sys.executable
    full = spec | {"repo": str(REPO), "chunk": CALIBRATION_CHUNK, "accuracy_level": ACCURACY_LEVEL}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [python, "-c", WORKER, json.dumps(full), str(model), str(out), str(calib)]
    m = scale.measure(cmd, out.parent, tag, env=env)
    if m.exit_code != 0:
        raise RuntimeError(f"{tag} ({name}) failed (exit {m.exit_code}):\n{m.stderr_tail}")
    return m


def bench_model(
    name: str,
    model: Path,
    eval_tokens: list[int],
    calib: Path,
    work: Path,
    blocks: list[int],
    only: list[str],
    od_extra: dict | None = None,
) -> dict[str, Any]:
    """Quantize ``model`` with every quantizer at every block size, then measure each output's accuracy."""
    from onnxdeploy.runner.accuracy import WEIGHT_ONLY_ENTRIES, accuracy_figures, teacher_forced_logits

    od_extra = od_extra or {}
    reference = teacher_forced_logits(model, eval_tokens)
    result: dict[str, Any] = {"model": str(model), "model_bytes": model.stat().st_size, "rows": {}}
    for block in blocks:
        for q, spec in QUANTIZERS.items():
            if only and q not in only:
                continue
            if 8 in (spec.get("bits"), spec.get("config", {}).get("bits")) and block != blocks[0]:
                continue  # INT8 is per output channel: one row
            symmetric = spec["symmetric"] if spec["side"] == "ort" else spec["config"].get("symmetric", True)
            spec = spec | {"block": block, "symmetric": symmetric}
            if spec["side"] == "onnxdeploy":
                spec["config"] = spec["config"] | {"symmetric": symmetric} | od_extra
            row_name = f"{q}@{block}"
            out = work / name / row_name
            print(f"[{name}] {row_name}", flush=True)
            try:
                m = quantize(q, spec, model, out, calib, f"{name}-{row_name}")
            except RuntimeError as exc:
                print(f"  skipped: {str(exc)[-600:]}", flush=True)
                result["rows"][row_name] = {"error": str(exc)[-2000:]}
                continue
            cand = teacher_forced_logits(out / "model.onnx", eval_tokens, config_entries=WEIGHT_ONLY_ENTRIES)
            fig = accuracy_figures(reference, cand, eval_tokens)
            row = {
                "wall_s": m.wall_s,
                "peak_rss_bytes": m.peak_tree_rss,
                "file_bytes": files_bytes(out),
                "mean_kl": fig.mean_kl,
                "top1": fig.top1_agreement,
                "ppl_ratio": fig.ppl_ratio,
                "accuracy_level": ACCURACY_LEVEL,
            } | bits_per_weight(out / "model.onnx")
            result["rows"][row_name] = row
            print(
                f"  bpw {row['bits_per_weight']:.4f} KL {fig.mean_kl:.5f} top1 {fig.top1_agreement:.4f} "
                f"ppl x{fig.ppl_ratio:.4f} wall {m.wall_s:.1f}s rss {m.peak_tree_rss / 1e6:.0f}MB",
                flush=True,
            )
    result["positions"] = len(eval_tokens) - 1
    return result


def print_result(name: str, r: dict[str, Any]) -> None:
    """One table per model, then the goal ratios per block size."""
    print(f"\n== {name}: {r['model']} ({r['model_bytes'] / 1e6:.1f} MB), {r['positions']} held-out positions, "
          f"accuracy_level {ACCURACY_LEVEL} (weight-only figures)")  # fmt: skip
    print(f"{'quantizer':24s}{'bpw':>8s}{'mean KL':>10s}{'top-1':>8s}{'ppl ×':>8s}{'wall s':>8s}{'RSS MB':>8s}")
    rows = r["rows"]
    for q, v in rows.items():
        if "error" in v:
            print(f"{q:24s} failed")
            continue
        print(f"{q:24s}{v['bits_per_weight']:8.3f}{v['mean_kl']:10.5f}{v['top1']:8.4f}{v['ppl_ratio']:8.4f}"
              f"{v['wall_s']:8.1f}{v['peak_rss_bytes'] / 1e6:8.0f}")  # fmt: skip
    ok = {k: v for k, v in rows.items() if "error" not in v}
    ort_rows = {k: v for k, v in ok.items() if k.startswith("ort-")}
    for name_at, od in ok.items():
        if not name_at.startswith("od-") or "int8" in name_at:
            continue
        q, block = name_at.rsplit("@", 1)
        line = f"{name_at} ({od['bits_per_weight']:.3f} bpw):"
        sym = ok.get(f"ort-default-sym@{block}")
        if sym:
            line += f" KL / ORT symmetric RTN at block {block} = {od['mean_kl'] / sym['mean_kl']:.3f};"
        # The fair comparison at equal bits: every ORT row (any block) storing at least as many bits per weight.
        richer = {k: v for k, v in ort_rows.items() if v["bits_per_weight"] >= od["bits_per_weight"] - 1e-9}
        if richer:
            k, v = min(richer.items(), key=lambda kv: kv[1]["mean_kl"])
            line += (
                f" / best ORT at >= its bpw ({k}, {v['bits_per_weight']:.3f} bpw) = {od['mean_kl'] / v['mean_kl']:.3f}"
            )
        gptq = ok.get(f"ort-gptq@{block}")
        if gptq:
            line += (
                f"; wall / ORT GPTQ {od['wall_s'] / gptq['wall_s']:.3f}, "
                f"peak RSS / ORT GPTQ {od['peak_rss_bytes'] / gptq['peak_rss_bytes']:.3f}"
            )
        print(line)


def _model_and_text(name: str, args: argparse.Namespace, work: Path) -> tuple[Path, list[int], np.ndarray]:
    """The model, its held-out tokens and the calibration tokens of one ``--models`` entry."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if name == "bytes":
        model = args.bytes_model.resolve()
        text = (model.parent / "eval.txt").read_bytes()
        # Held-out: eval.txt (textwrap.py, never trained on); calibration: difflib.py (neither trained nor held out).
        calib = np.frombuffer((stdlib / "difflib.py").read_bytes()[: args.calibration_tokens], np.uint8)
        return model, list(text[: args.eval_tokens]), calib.astype(np.int64)
    if name == "smollm2":
        model = args.smollm2_model
        if not model.is_file():
            raise SystemExit(f"smollm2: {model} does not exist (build it with the fixtures' real-model script)")
        from tokenizers import Tokenizer  # noqa: PLC0415

        tok = Tokenizer.from_file(str(model.parent / "tokenizer.json"))
        # Held-out: CPython's LICENSE.txt (the PSF license text the stdlib ships; nobody on the project wrote it).
        # Calibration: the license texts numpy's wheel ships (its dist-info licenses/), another text.
        held_out = stdlib / "LICENSE.txt"
        licenses = sorted((Path(np.__file__).parent.parent / f"numpy-{np.__version__}.dist-info").rglob("LICENSE*"))
        calib_text = "\n\n".join(p.read_text(errors="replace") for p in licenses)
        ids = tok.encode(held_out.read_text()).ids[: args.eval_tokens]
        calib = np.array(tok.encode(calib_text).ids[: args.calibration_tokens], dtype=np.int64)
        print(
            f"[smollm2] held-out text {held_out} ({len(ids)} tokens), calibration: numpy's {len(licenses)} "
            f"license files ({len(calib)} tokens)",
            flush=True,
        )
        return model, ids, calib
    if name == "125m":
        cache = args.export_cache.resolve()
        scale.ensure_export(SIZE_125M, cache, args.venv_dir.resolve())
        model = cache / "models" / "125m" / "model.onnx"
        rng = np.random.default_rng(0)
        return model, rng.integers(0, 32000, args.eval_tokens).tolist(), rng.integers(0, 32000, 512).astype(np.int64)
    raise SystemExit(f"unknown model {name!r}; known: bytes, smollm2, 125m")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bytes", help="comma-separated: bytes, smollm2, 125m")
    ap.add_argument("--blocks", default="32,128", help="block sizes, comma-separated")
    ap.add_argument(
        "--only", default="", help="quantizers to run (comma-separated); default all: " + ",".join(QUANTIZERS)
    )
    ap.add_argument("--od-extra", type=json.loads, default={},
                    help="JSON merged into every quantize_weights config, e.g. '{\"lm_head\": false}' (ORT leaves "
                    "a tied LM head, read through a Transpose of the embedding, in float)")  # fmt: skip
    ap.add_argument(
        "--od-config",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="another calibrated quantize_weights candidate, e.g. "
        '\'od-mixed={"method": "gptq", "rules": [{"nodes": "*/v_proj/*", "bits": 8}]}\' (repeat)',
    )
    ap.add_argument("--eval-tokens", type=int, default=1024, help="held-out tokens (positions + 1)")
    ap.add_argument("--calibration-tokens", type=int, default=1024)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-quantize"))
    ap.add_argument("--bytes-model", type=Path, default=BYTES_MODEL, help="the trained model (eval.txt beside it)")
    ap.add_argument("--smollm2-model", type=Path, default=SMOLLM2_DIR / "optimum" / "model.onnx")
    ap.add_argument("--export-cache", type=Path, default=Path("/tmp/onnxdeploy-decode"))
    ap.add_argument("--venv-dir", type=Path, default=Path("/tmp/onnxdeploy-fixture-venvs"))
    args = ap.parse_args()
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    only = [q for q in args.only.split(",") if q]
    for item in args.od_config:
        name, _, text = item.partition("=")
        QUANTIZERS[name] = {"side": "onnxdeploy", "config": json.loads(text), "calibrated": True}
    results: dict[str, Any] = {}
    for name in args.models.split(","):
        model, eval_tokens, calib_ids = _model_and_text(name, args, work)
        calib = work / f"{name}-calibration.npy"
        np.save(calib, calib_ids)
        blocks = [int(b) for b in args.blocks.split(",")]
        results[name] = bench_model(name, model, eval_tokens, calib, work, blocks, only, args.od_extra)
        print_result(name, results[name])
    (work / "quantize_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nresults: {work / 'quantize_results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
