"""pin_opset against ONNX's own node tests, at every target opset, beside onnx's ``version_converter``.

Every deterministic node test of the installed onnx wheel (``tests/conformance/node_cases.py``) that ONNX
Runtime CPU runs correctly at its own opset (the baseline) is converted to each target opset by ``pin_opset``
(its real entry point) and by ``onnx.version_converter.convert_version``, and each result is judged on ORT CPU
against the expected outputs at onnx's tolerances (``tests/conformance/harness.py``). Prints, per target opset:

| target | baseline | pin_opset correct | onnx correct | wrong | invalid | ORT lacks kernel | ORT refuses/fails |
  refused | refused (internal msg) | crash | onnx correct, pin_opset not |

Usage (from the repository root; single-threaded ORT, run it nice'd)::

    nice -n 10 python -m benchmarks.conformance                  # every target 11..newest
    nice -n 10 python -m benchmarks.conformance --opsets 13,17,21 --details /tmp/conformance.json

``--details`` writes every non-correct (test, opset) of both converters with its reason (JSON), to iterate on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import onnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conformance import harness  # noqa: E402
from tests.conformance.node_cases import load_node_cases  # noqa: E402

COLUMNS = [
    ("baseline", "baseline"),
    ("pin correct", "correct"),
    ("onnx correct", "onnx_correct"),
    ("wrong", "wrong"),
    ("invalid", "invalid"),
    ("ORT lacks kernel", "ort_no_kernel"),
    ("ORT refuses/fails", "ort_bad"),
    ("refused", "refused"),
    ("refused (internal msg)", "refused_internal"),
    ("crash", "crash"),
    ("onnx correct, pin not", "regressions"),
]


def _row(cases: list, target: int, details: list[dict], probe: bool) -> Counter:
    """Convert every baseline case to ``target`` with both converters; count outcomes, collect the non-correct."""
    row: Counter = Counter()
    config = {} if probe else {"prove": False}
    for case in cases:
        row["baseline"] += 1
        pin = harness.outcome(case, target, "pin_opset", **config)
        ref = harness.outcome(case, target, "onnx")
        status = "ort_bad" if pin.status in ("ort_refuses", "ort_fails") else pin.status
        row[status] += 1
        row["onnx_correct"] += ref.status == "correct"
        if ref.status == "correct" and pin.status != "correct":
            row["regressions"] += 1
        if pin.status != "correct" or ref.status != "correct":
            details.append(
                {
                    "test": case.name,
                    "op": case.op_type,
                    "opset": case.opset,
                    "target": target,
                    "pin_opset": [pin.status, pin.detail],
                    "onnx": [ref.status, ref.detail],
                }
            )
    return row


def main(argv: list[str] | None = None) -> None:
    """Run the suite at the chosen opsets and print the table (see the module docstring)."""
    newest = onnx.defs.onnx_opset_version()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opsets", default=f"11-{newest}", help="e.g. 11-28 or 13,17,21")
    parser.add_argument("--details", type=Path, help="write every non-correct (test, opset) here (JSON)")
    parser.add_argument("--filter", default="", help="only tests whose name contains this")
    parser.add_argument("--no-probe", action="store_true", help="run pin_opset with prove: false")
    args = parser.parse_args(argv)
    if "-" in args.opsets:
        lo, hi = map(int, args.opsets.split("-"))
        opsets = list(range(lo, hi + 1))
    else:
        opsets = [int(o) for o in args.opsets.split(",")]
    start = time.perf_counter()
    cases = [c for c in load_node_cases() if args.filter in c.name]
    baseline = [c for c in cases if c.opset is not None and harness.in_baseline(c)]
    print(
        f"onnx {onnx.__version__}, {len(cases)} deterministic node tests, {len(baseline)} in the baseline "
        f"(ORT runs them correctly at their own opset); {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    details: list[dict] = []
    rows = {}
    for target in opsets:
        t0 = time.perf_counter()
        rows[target] = _row(baseline, target, details, probe=not args.no_probe)
        print(f"  opset {target}: {dict(rows[target])} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print("| target | " + " | ".join(c for c, _ in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for target, row in rows.items():
        print(f"| {target} | " + " | ".join(f"{row[k]:,}" for _, k in COLUMNS) + " |")
    total = Counter()
    for row in rows.values():
        total.update(row)
    print("| all | " + " | ".join(f"{total[k]:,}" for _, k in COLUMNS) + " |")
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    if args.details:
        args.details.write_text(json.dumps(details, indent=1))
        print(f"details: {args.details} ({len(details)} entries)")


if __name__ == "__main__":
    main()
