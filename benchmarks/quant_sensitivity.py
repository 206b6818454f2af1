"""Which weights of an exporter-convention decoder dominate its INT4 error: per-group sensitivity, measured.

For each group of MatMul weights (every weight of one kind — ``q_proj``, ``v_proj``, ``down_proj``… — across the
layers, then every weight of one layer) the weights of that group alone are replaced by their RTN round trip
(:func:`onnxdeploy.passes._weight_quant.quantize_rtn_kn`, the pass's own RTN: INT4 asymmetric in groups of
``--block`` by default, ``dequantize()`` back to float32) and the model is teacher-forced over held-out tokens in one
ORT call with an empty past; the mean ``KL(p_float ‖ p_group_quantized)`` (nats) and the perplexity ratio of that
call are the group's sensitivity. The float weights are replaced in the session through
``SessionOptions.add_initializer`` (ORT's override of a graph initializer by name), so the model file is read as
is and nothing is written. The KL of the whole model quantized is printed first for reference; per-group KLs add
up to roughly the whole's (they interact a little). This is how the mixed-precision rules of the README's "Real
model" section were chosen: the groups with the largest KL per stored byte go to INT8.

Held-out text: CPython's ``LICENSE.txt`` (as ``benchmarks/quantize.py``), first ``--tokens`` tokens, through the
``tokenizer.json`` beside the model. Figures are printed (``--json PATH`` saves them), never asserted. Usage::

    nice -n 10 .venv/bin/python benchmarks/quant_sensitivity.py \\
        [--model ~/.cache/onnxdeploy/real/smollm2-135m-instruct/optimum/model.onnx] [--tokens 301] [--block 128]
        [--symmetric] [--groups kinds,layers]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from onnxdeploy.passes._weight_quant import quantize_rtn_kn  # noqa: E402
from onnxdeploy.text import load_codec  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "onnxdeploy" / "real" / "smollm2-135m-instruct" / "optimum" / "model.onnx"
LAYER = re.compile(r"layers\.(\d+)/")


def matmul_weights(model: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Node name → (initializer name, float32 ``(K, N)`` weight) of every MatMul reading an initializer as B."""
    m = onnx.load(str(model))
    inits = {t.name: t for t in m.graph.initializer}
    return {
        n.name: (n.input[1], onnx.numpy_helper.to_array(inits[n.input[1]]).astype(np.float32))
        for n in m.graph.node
        if n.op_type == "MatMul" and n.input[1] in inits
    }


def log_softmax_logits(model: Path, tokens: list[int], overrides: dict[str, np.ndarray]) -> np.ndarray:
    """Float64 log-softmax of the logits ``(S, V)`` of one call over ``tokens`` (empty past), weights overridden."""
    options = ort.SessionOptions()
    keep = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)) for a in overrides.values()]
    for name, value in zip(overrides, keep, strict=True):
        options.add_initializer(name, value)
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": np.array([tokens], np.int64),
        "attention_mask": np.ones((1, len(tokens)), np.int64),
        "position_ids": np.arange(len(tokens), dtype=np.int64)[None],
    }
    names = {i.name: i for i in session.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    for name, arg in names.items():
        if name.startswith("past_key_values"):
            feeds[name] = np.zeros((1, int(arg.shape[1]), 0, int(arg.shape[3])), np.float32)
    x = session.run(["logits"], feeds)[0][0].astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def main() -> int:
    """Measure and print the whole model's and each group's KL and perplexity ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=301, help="held-out tokens (positions + 1)")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--symmetric", action="store_true", help="signed INT4 without zero point (default: asymmetric)")
    ap.add_argument("--groups", default="kinds,layers", help="kinds (one kind across layers), layers (one layer)")
    ap.add_argument("--json", type=Path, help="save the figures here")
    args = ap.parse_args()
    codec = load_codec(args.model.parent / "tokenizer.json", key="tokenizer")
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    tokens = codec.encode(text)[: args.tokens]
    weights = matmul_weights(args.model)
    deq = {
        node: quantize_rtn_kn(w, bits=args.bits, block_size=args.block, symmetric=args.symmetric).dequantize().T
        for node, (_, w) in weights.items()
    }
    reference = log_softmax_logits(args.model, tokens, {})
    nxt, rows = np.array(tokens[1:]), np.arange(len(tokens) - 1)

    def figures(nodes: list[str]) -> dict[str, float]:
        lq = log_softmax_logits(args.model, tokens, {weights[n][0]: np.ascontiguousarray(deq[n]) for n in nodes})
        lp = reference[:-1]
        kl = float((np.exp(lp) * (lp - lq[:-1])).sum(axis=-1).mean())
        ppl = float(np.exp(lp[rows, nxt].mean() - lq[:-1][rows, nxt].mean()))
        share = sum(weights[n][1].size for n in nodes) / sum(w.size for _, w in weights.values())
        return {"mean_kl": kl, "ppl_ratio": ppl, "weight_share": share}

    groups: dict[str, list[str]] = {"all": list(weights)}
    if "kinds" in args.groups:
        kinds = sorted({n.rsplit("/", 2)[-2] for n in weights})
        groups |= {f"kind {k}": [n for n in weights if n.rsplit("/", 2)[-2] == k] for k in kinds}
    if "layers" in args.groups:
        layers = sorted({int(m.group(1)) for n in weights if (m := LAYER.search(n))})
        groups |= {
            f"layer {i}": [n for n in weights if (m := LAYER.search(n)) and int(m.group(1)) == i] for i in layers
        }
    form = f"INT{args.bits} {'symmetric' if args.symmetric else 'asymmetric'} block {args.block}"
    print(f"{args.model}: {len(weights)} MatMul weights, {len(tokens) - 1} held-out positions (CPython LICENSE.txt), "
          f"{form} RTN, one group at a time")  # fmt: skip
    results = {}
    for name, nodes in groups.items():
        start = time.perf_counter()
        results[name] = fig = figures(nodes)
        per_share = fig["mean_kl"] / fig["weight_share"]
        print(f"  {name:22s} weights {fig['weight_share']:6.1%}  KL {fig['mean_kl']:.4f}  ppl x{fig['ppl_ratio']:.4f}"
              f"  KL per weight share {per_share:.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "form": form, "groups": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
