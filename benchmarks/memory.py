"""Cache bytes and peak RSS of a decode for issue 18's three memory remedies, against the plain static graph.

1. **Ring caches** (``static_kv {window_cache: true}``) on the Mistral fixture (every layer a sliding window of 8):
   the static graph at ``max_cache_len`` 64 = 8 × the window against its ring graph (``W + max(step_lens) − 1``
   slots per layer), each decoding 60 positions; and on the mixed-layer fixture ``gemma3_mixed`` (5 layers with a
   window of 16, 1 global) at ``max_cache_len`` 128 = 8 × the window, 100 positions.
2. **Sinks + recent** (``cache_policy: {sinks: 4, recent: 60}`` at ``max_cache_len`` 64) on the trained fixture:
   256 positions (4 × the cache) through the policy host, against the plain static graph that must hold all 256.
3. **Split** on the real model (SmolLM2-135M's optimum export, ``fixtures/_export_real.py``; skipped when absent):
   the static graph (``max_cache_len`` 256) and its parts at K = 2 and 3. Each part is opened **alone** in its own
   process and run 32 calls on a random hidden state, so its peak RSS is what a device holding only that part
   pays; it is compared with the part's weight bytes + cache bytes + the fixed overhead, which is what the whole
   graph's decode pays beyond its own weights and cache (its peak RSS − weight bytes − cache bytes: the imports,
   ORT's session and arena).

Cache bytes are read off each graph's contract (every past input's shape × the cache dtype's size). Peak RSS is
``VmHWM`` of a fresh ``.venv/bin/python`` per measurement (one decode, ORT's CPU EP, one thread), reset after the
imports (``/proc/self/clear_refs`` 5: the imports' transient peak is not the decode's); the RSS after the imports
(the fixed overhead) is printed beside it. Figures are printed and written to ``WORK_DIR/results.json``;
nothing is asserted. Usage::

    nice -n 10 .venv/bin/python benchmarks/memory.py [--work-dir /tmp/onnxdeploy-memory] [--skip-real]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
REAL = Path(os.environ.get("ONNXDEPLOY_CACHE", Path.home() / ".cache" / "onnxdeploy")) / "real"
REAL_MODEL = REAL / "smollm2-135m-instruct" / "optimum" / "model.onnx"

PROBE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from onnxdeploy.contract import read_contract
    from onnxdeploy.runner import open_decoder
    from onnxdeploy.runner.cache_policy import SinkRecentHost
    from onnxdeploy.runner.host import StepInputs, allocate_buffers
    from onnxdeploy.runner.parts import PartDecoder
    from onnxdeploy.runner.session import open_session, read_header
    mode, path, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def status(key):
        line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
        return int(line.split()[1])
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: the imports' transient peak is not the decode's
        f.write("5")
    base = status("VmRSS")
    tokens = np.random.default_rng(0).integers(1, 200, size=count).tolist()
    if mode == "decode":
        with open_decoder(path) as d:
            d.feed(tokens)
    elif mode == "policy":
        with open_decoder(path) as d:
            SinkRecentHost(d).feed(tokens)
    elif mode == "part":
        session = open_session(path)
        c = read_contract(session.model)
        part = PartDecoder(session, c)
        buffers = allocate_buffers(c)
        hidden = None
        if c.part.hidden_in:
            hidden = np.random.default_rng(0).standard_normal((c.batch, c.step_len, c.part.hidden_size)).astype(
                np.float32
            )
        for p in range(count):
            part.call_part(buffers, StepInputs.uniform(c, [tokens[p]], p), hidden)
        part.close()
    print(json.dumps({"baseline_kib": base, "peak_kib": status("VmHWM")}))
    """
)


def _measure(mode: str, path: Path | str, count: int) -> dict[str, int]:
    out = subprocess.run(
        [str(PYTHON), "-c", PROBE, mode, str(path), str(count)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cache_bytes(path: Path) -> int:
    """Bytes of every cache buffer the graph (or its chain) takes, from its contract."""
    import onnx

    from onnxdeploy.contract import read_contract

    contract = read_contract(onnx.load(str(path), load_external_data=False))
    assert contract is not None
    total = 0
    files = [path] if contract.part is None else [path.with_name(e.file) for e in contract.parts]
    for file in files:
        c = read_contract(onnx.load(str(file), load_external_data=False))
        assert c is not None
        total += sum(math.prod(s) * c.kv_numpy_dtype.itemsize for s in c.pair_input_shapes())
    return total


def _weight_bytes(path: Path) -> int:
    """Bytes of the initializers one graph file reads (external or inline), each once."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        length = next((int(kv.value) for kv in t.external_data if kv.key == "length"), None)
        total += length if length is not None else len(t.raw_data)
    return total


def _build(model: Path, folder: Path, passes: list[tuple[str, dict]]) -> Path:
    from onnxdeploy.model_io import load_model, stage_artifacts
    from onnxdeploy.pass_context import make_pass_context
    from onnxdeploy.passes import get_pass

    if (folder / "model.onnx").exists():
        return folder / "model.onnx"
    artifacts = load_model(model)
    current = None
    for name, config in passes:
        cls = get_pass(name)
        pass_ = cls(cls.config_model(**config))
        result = pass_(current if current is not None else artifacts.model, make_pass_context(model_path=model))
        current = result.artifacts
    assert current is not None
    folder.mkdir(parents=True, exist_ok=True)
    stage_artifacts(
        [(a.name, a.model) for a in current.artifacts], folder, external=True, data_name="model.onnx.data"
    ).commit()
    return folder / "model.onnx"


def _row(label: str, path: Path, mode: str, count: int, plain: dict | None = None) -> dict[str, Any]:
    rss = _measure(mode, path, count)
    row = {"graph": label, "positions": count, "cache_bytes": _cache_bytes(path), **rss}
    if plain is not None:
        row["cache_ratio"] = row["cache_bytes"] / plain["cache_bytes"]
    print(
        f"  {label:<34} cache {row['cache_bytes']:>12,d} B"
        + (f" ({row['cache_ratio']:.3f}x)" if plain is not None else " " * 9)
        + f"  peak RSS {rss['peak_kib'] / 1024:8.1f} MiB (after imports {rss['baseline_kib'] / 1024:.1f} MiB)"
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/onnxdeploy-memory"))
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="rebuild the graphs")
    args = parser.parse_args(argv)
    work: Path = args.work_dir
    if args.fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    fixtures = REPO / "fixtures"

    print("1. ring caches: Mistral fixture (sliding window 8), max_cache_len 64 = 8x the window, 60 positions")
    mistral = fixtures / "mistral_sw" / "optimum" / "model.onnx"
    plain = _build(mistral, work / "mistral_plain", [("static_kv", {"max_cache_len": 64}), ("mask_rewrite", {})])
    ring = _build(
        mistral,
        work / "mistral_ring",
        [("static_kv", {"max_cache_len": 64, "window_cache": True}), ("mask_rewrite", {})],
    )
    p = _row("static, max_cache_len 64", plain, "decode", 60)
    results["ring"] = [p, _row("window_cache ring (8 slots)", ring, "decode", 60, p)]
    print("1b. ring caches, mixed layers: gemma3_mixed (5 local window 16 : 1 global), max_cache_len 128 = 8x")
    mixed = fixtures / "gemma3_mixed" / "optimum" / "model.onnx"
    plain = _build(mixed, work / "mixed_plain", [("static_kv", {"max_cache_len": 128}), ("mask_rewrite", {})])
    ring = _build(
        mixed, work / "mixed_ring", [("static_kv", {"max_cache_len": 128, "window_cache": True}), ("mask_rewrite", {})]
    )
    p = _row("static, max_cache_len 128", plain, "decode", 100)
    results["ring_mixed"] = [p, _row("window_cache: 5 rings of 16 + 1 of 128", ring, "decode", 100, p)]

    print("2. sinks + recent: trained fixture, 256 positions (4x max_cache_len 64)")
    trained = fixtures / "llama_bytes" / "torchscript" / "model.onnx"
    full = _build(trained, work / "bytes_plain256", [("static_kv", {"max_cache_len": 256}), ("mask_rewrite", {})])
    policy = _build(
        trained,
        work / "bytes_policy64",
        [("static_kv", {"max_cache_len": 64, "cache_policy": {"sinks": 4, "recent": 60}}), ("mask_rewrite", {})],
    )
    p = _row("static, max_cache_len 256", full, "decode", 256)
    results["cache_policy"] = [p, _row("cache_policy 4 + 60 at 64 slots", policy, "policy", 256, p)]

    if args.skip_real or not REAL_MODEL.exists():
        print(f"3. split: skipped ({REAL_MODEL} {'not built' if not REAL_MODEL.exists() else 'skipped'})")
    else:
        print("3. split: SmolLM2-135M optimum export, max_cache_len 256, 32 calls per graph or part")
        static = [("static_kv", {"max_cache_len": 256}), ("mask_rewrite", {})]
        whole = _build(REAL_MODEL, work / "real_plain", static)
        w = _weight_bytes(whole)
        row = _row("static, whole", whole, "decode", 32)
        overhead = row["peak_kib"] * 1024 - w - row["cache_bytes"]
        print(f"  fixed overhead: peak RSS - weights {w / 2**20:.1f} MiB - cache = {overhead / 2**20:.1f} MiB")
        results["split"] = {"whole": {**row, "weight_bytes": w}, "fixed_overhead_bytes": overhead}
        for k in (2, 3):
            chain = _build(REAL_MODEL, work / f"real_split{k}", [*static, ("split", {"parts": k})])
            import onnx

            from onnxdeploy.contract import read_contract

            contract = read_contract(onnx.load(str(chain), load_external_data=False))
            assert contract is not None
            parts = []
            for entry in contract.parts:
                part = chain.with_name(entry.file)
                rss = _measure("part", part, 32)
                weights, cache = _weight_bytes(part), _cache_bytes_of_part(part)
                bound = weights + cache + overhead
                parts.append({"file": entry.file, "weight_bytes": weights, "cache_bytes": cache, **rss, "bound": bound})
                print(
                    f"  K={k} {entry.file:<22} layers {entry.first_layer}..{entry.first_layer + entry.num_layers - 1}"
                    f"  weights {weights / 2**20:7.1f} MiB  cache {cache / 2**20:5.2f} MiB  peak RSS "
                    f"{rss['peak_kib'] / 1024:7.1f} MiB <= weights + cache + overhead {bound / 2**20:7.1f} MiB: "
                    f"{rss['peak_kib'] * 1024 <= bound}"
                )
            results["split"][f"k{k}"] = parts
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(f"results: {work / 'results.json'}")
    return 0


def _cache_bytes_of_part(path: Path) -> int:
    import onnx

    from onnxdeploy.contract import read_contract

    c = read_contract(onnx.load(str(path), load_external_data=False))
    assert c is not None
    return sum(math.prod(s) * c.kv_numpy_dtype.itemsize for s in c.pair_input_shapes())


if __name__ == "__main__":
    sys.exit(main())
