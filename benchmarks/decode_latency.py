"""Per-call decode latency: the original (growing cache, Concat) vs static_kv graphs (fixed buffer, Scatter).

Baseline: the original exporter-convention model, measured in the same run on the same prompt.
Prints P50/P99 per-call latency (ms) of the generate phase and the ratio static / original, for each
fixture, ``max_cache_len`` and ``cache_update``. Usage::

    python benchmarks/decode_latency.py [--steps 48] [--max-cache-len 64 256 1024]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from onnxdeploy.model_io import load_model, write_for_ort
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import open_decoder

REPO = Path(__file__).resolve().parents[1]
PROMPT = [1, 17, 42, 99, 7, 3]


def _generate_latencies(path: Path, steps: int) -> list[float]:
    decoder = open_decoder(path)
    decoder.feed(PROMPT)  # warm-up
    decoder.reset()
    decoder.feed(PROMPT)
    token = 5
    lat = []
    for _ in range(steps):
        (logits, ms), *_ = decoder.feed([token])
        lat.append(ms)
        token = int(np.argmax(logits))
    return lat


def main() -> None:
    """Run the benchmark and print a table (and JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--max-cache-len", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    registry = json.loads((REPO / "fixtures" / "registry.json").read_text())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in registry:
            original = REPO / entry["path"]
            base = _generate_latencies(original, args.steps)
            b50, b99 = np.percentile(base, 50), np.percentile(base, 99)
            rows.append((entry["name"], "original (baseline)", "-", b50, b99, 1.0))
            for length in args.max_cache_len:
                if length < len(PROMPT) + args.steps:
                    continue
                for update in ("full_buffer", "new_token_only"):
                    cfg = StaticKVConfig(max_cache_len=length, cache_update=update)
                    static = StaticKVCachePass(cfg)(load_model(original).model, make_pass_context()).artifacts.primary
                    folder = Path(tmp) / f"{entry['name']}_{length}_{update}"
                    folder.mkdir()
                    path = write_for_ort(static, folder)
                    lat = _generate_latencies(path, args.steps)
                    p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
                    rows.append((entry["name"], f"static {update}", str(length), p50, p99, p50 / b50))
    if args.json:
        keys = ("fixture", "graph", "max_cache_len", "p50_ms", "p99_ms", "p50_ratio_vs_original")
        print(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=2))
        return
    print(f"{'fixture':24} {'graph':22} {'max_cache_len':>13} {'p50 ms':>8} {'p99 ms':>8} {'p50 / original':>15}")
    for name, graph, length, p50, p99, ratio in rows:
        print(f"{name:24} {graph:22} {length:>13} {p50:8.3f} {p99:8.3f} {ratio:15.2f}")


if __name__ == "__main__":
    main()
