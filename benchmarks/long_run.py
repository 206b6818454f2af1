"""A long decode on a static model: does memory grow, does latency spike?

Makes a static graph set of a fixture (``static_kv`` with ``step_lens [1, 16]`` and one cache of
``max_cache_len`` slots, then ``mask_rewrite``) through ``onnxdeploy run``, whose verification decodes the same
``prompt + steps`` positions free-running against the original; the run report carries ``verify.rss_growth_bytes``
and each mode's ``latency_ms.spikes``. Then the candidate alone is decoded again here: the 16-token prompt through
the prefill bucket first, then ``--steps`` single-token steps (greedy), with resident memory sampled every
``--sample-every`` steps and the wall time of every step. Printed: RSS samples, RSS growth from the first sample
after the prefill to the last (bar: < 5 MB), step latency p50/p99/max and spikes (steps slower than 3x the median,
:data:`onnxdeploy.runner.compare.SPIKE_FACTOR`), and the run report's figures beside them.

ORT thread spinning is off (the runner's sessions), one process, nothing else decoding.

Usage: ``.venv/bin/python benchmarks/long_run.py [--fixture llama_gqa_optimum] [--steps 2000] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.resources import rss_bytes
from onnxdeploy.runner.compare import SPIKE_FACTOR
from onnxdeploy.runner.decoder import open_decoder

REPO = Path(__file__).resolve().parents[1]
RSS_BAR_BYTES = 5 * 2**20
PROMPT_LEN = 16


def _fixture_model(name: str) -> Path:
    registry = json.loads((REPO / "fixtures" / "registry.json").read_text())
    entry = next(e for e in registry if e["name"] == name)
    return REPO / entry["path"]


def make_static(model: Path, folder: Path, steps: int, prompt: list[int]) -> tuple[Path, dict]:
    """Run the pipeline (graph set + mask_rewrite, verify free-running over every position); return model and report."""
    max_cache_len = 1 << (len(prompt) + steps - 1).bit_length()
    cfg = {
        "model": str(model),
        "output_dir": str(folder / "out"),
        "passes": [
            {"static_kv": {"step_lens": [1, PROMPT_LEN], "max_cache_len": max_cache_len}},
            {"mask_rewrite": {}},
        ],
        "verify": {"prompt": prompt, "steps": steps, "modes": ["free_running"]},
        "cache": None,
    }
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    outcome = run_pipeline(load_pipeline(path))
    return outcome.model_path, json.loads(outcome.report_json.read_text())


def long_decode(model: Path, prompt: list[int], steps: int, sample_every: int) -> dict:
    """Prefill bucket first, then ``steps`` greedy single-token steps; RSS every ``sample_every`` steps.

    Returns:
        ``rss`` samples (bytes, the first right after the prefill), per-step ``latency_ms``, ``prefill_ms``.
    """
    with open_decoder(model) as decoder:
        decoder.reset()
        start = time.perf_counter()
        outputs = decoder.feed(prompt)  # the 16-token prompt: one call of the step_len 16 bucket
        prefill_ms = (time.perf_counter() - start) * 1e3
        rss = [rss_bytes()]
        latency = []
        last = outputs[-1][0]
        for step in range(1, steps + 1):
            token = int(np.argmax(last))
            start = time.perf_counter()
            (last, _), *_ = decoder.feed([token])
            latency.append((time.perf_counter() - start) * 1e3)
            if step % sample_every == 0:
                rss.append(rss_bytes())
    return {"rss": rss, "latency_ms": latency, "prefill_ms": prefill_ms}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit 1 when RSS grew by 5 MB or more."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default="llama_gqa_optimum", help="A fixtures/registry.json name.")
    parser.add_argument("--steps", type=int, default=2000, help="Single-token decode steps after the prompt.")
    parser.add_argument("--sample-every", type=int, default=100, help="Steps between RSS samples.")
    parser.add_argument("--keep", type=Path, default=None, help="Keep the static model and report in this folder.")
    args = parser.parse_args(argv)

    prompt = [(17 * i + 1) % 256 for i in range(PROMPT_LEN)]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="onnxdeploy-long-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        model, report = make_static(_fixture_model(args.fixture), folder, args.steps, prompt)
        print(f"{args.fixture}: static graph set {model} made and verified in {time.perf_counter() - t0:.1f} s")
        result = long_decode(model, prompt, args.steps, args.sample_every)
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)

    lat = np.array(result["latency_ms"])
    median = float(np.median(lat))
    spikes = int((lat > SPIKE_FACTOR * median).sum())
    rss = result["rss"]
    growth = rss[-1] - rss[0]
    print(f"prefill: {PROMPT_LEN} tokens in one call, {result['prefill_ms']:.2f} ms")
    print("RSS (MiB) every", args.sample_every, "steps:", " ".join(f"{r / 2**20:.1f}" for r in rss))
    print(
        f"decode steps: {len(lat)}, latency p50 {median:.3f} ms, p99 {np.percentile(lat, 99):.3f} ms, "
        f"max {lat.max():.3f} ms; spikes (> {SPIKE_FACTOR:g}x median = {SPIKE_FACTOR * median:.3f} ms): {spikes} "
        f"at steps {[int(i) + 1 for i in np.flatnonzero(lat > SPIKE_FACTOR * median)][:10]}"
    )
    verdict = "OK" if growth < RSS_BAR_BYTES else "OVER the 5 MB bar"
    print(f"RSS growth over {len(lat)} steps: {growth / 2**20:+.2f} MiB ({growth} bytes): {verdict}")
    if len(rss) > 2:
        steady = rss[-1] - rss[1]
        print(f"  of which after step {args.sample_every}: {steady / 2**20:+.2f} MiB (the rest is ORT's first calls)")
    print(f"load average while it ran: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (spikes count other processes)")
    v = report["verify"]
    mode = v["modes"]["free_running"]
    print(
        f"run report ({v['steps']} steps verified, status {report['status']}): rss_growth_bytes "
        f"{v['rss_growth_bytes']} ({v['rss_growth_bytes'] / 2**20:+.2f} MiB, original + candidate), candidate "
        f"latency p50 {mode['latency_ms']['p50']:.3f} ms, p99 {mode['latency_ms']['p99']:.3f} ms, spikes "
        f"{mode['latency_ms']['spikes']} of {mode['latency_ms']['calls']} calls; top-1 {mode['top1_agreement']:.3f}, "
        f"max |diff| {mode['max_abs_logit_diff']:.2g}"
    )
    return 0 if growth < RSS_BAR_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
