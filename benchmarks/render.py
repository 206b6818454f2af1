"""Report rendering time for a long verification: report.html and report.md of a 3,000-step report.

A real run (the llama_gqa_optimum fixture, ``static_kv`` to 64 slots, 24 verified steps) gives a real report; its
per-position records are then repeated, positions renumbered, to ``--steps`` per mode (the figures stay real, the
count grows), as a 3,000-step verification would give. Then, interleaved over ``--rounds`` rounds:

* ``json``: ``RunReport.model_dump_json`` (the baseline: what writing report.json costs);
* ``html``: :func:`onnxdeploy.html_report.render_html` (tables and one error and one latency plot per graph and mode);
* ``md``: :func:`onnxdeploy.render.render_markdown`.

Printed: the first HTML render alone (it imports the plotting module), then the median of each over the rounds
(ms) and its ratio to the baseline. The issue "What a user sees" targets html <= 0.5 s for 3,000 steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from onnxdeploy.config import load_pipeline  # noqa: E402
from onnxdeploy.pipeline import run_pipeline  # noqa: E402
from onnxdeploy.report import RunReport  # noqa: E402
from tests.conftest import fixture_entry  # noqa: E402


def real_report(folder: Path) -> RunReport:
    """A verified run on the fixture; its report as written (rows up to max_rows)."""
    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(folder / "out"),
        "passes": [{"static_kv": {"max_cache_len": 64}}],
        "verify": {"prompt": [1, 17, 42, 99, 7, 3], "steps": 24},
        "cache": None,
    }
    (folder / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    return run_pipeline(load_pipeline(folder / "pipeline.yaml")).report


def grown(report: RunReport, steps: int) -> RunReport:
    """``report`` with each mode's records repeated to ``steps`` positions (renumbered), summaries kept."""
    modes = {}
    for name, mode in report.verify.modes.items():
        base = mode.steps
        records = [base[i % len(base)].model_copy(update={"position": i}) for i in range(steps)]
        modes[name] = mode.model_copy(update={"steps": records, "positions": steps})
    return report.model_copy(update={"verify": report.verify.model_copy(update={"modes": modes})})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000, help="positions per decode mode")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = grown(real_report(Path(tmp)), args.steps)
    from onnxdeploy.html_report import render_html
    from onnxdeploy.render import render_markdown

    start = time.perf_counter()
    render_html(report, max_rows=200)
    first = time.perf_counter() - start
    variants = {
        "json": lambda: report.model_dump_json(indent=2),
        "html": lambda: render_html(report, max_rows=200),
        "md": lambda: render_markdown(report),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate so no variant always follows another
            start = time.perf_counter()
            variants[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    modes = len(report.verify.modes)
    print(f"report: {modes} mode(s) x {args.steps} positions; first html render (with imports): {first:.2f} s")
    base = statistics.median(times["json"])
    print(f"{'variant':8s} {'median ms':>10s} {'/ json':>8s}")
    for name in names:
        med = statistics.median(times[name])
        print(f"{name:8s} {med:10.1f} {med / base:8.2f}")


if __name__ == "__main__":
    main()
