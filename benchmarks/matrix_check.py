"""The target matrices against what the runtimes really do, on ONNX's own backend node tests (issue 16).

Every deterministic node test of the installed onnx wheel (``tests/conformance/node_cases.py``), at the opset its
case script declares, is asked of two targets:

- ``ort-cpu``: ``predict_supported(model, "ort-cpu")`` against ORT's CPU EP (session creation, every data set run
  and compared with onnx's expected outputs at the case's tolerances): works / imprecise / refused / fails /
  different (``imprecise``: every difference within ``rtol`` of the output's largest magnitude, float rounding,
  e.g. ORT's FFT on DFT/STFT; kept out of the goal figure, which is also printed with them counted);
- ``openvino``: ``predict_supported(model, "openvino")`` against ``openvino.Core().compile_model(model, "CPU")``:
  compiles / refused.

Printed: both confusion tables, the goal figures (ORT: predicted-supported but refused/failing/different as a
share of the baseline, the cases ORT runs correctly; OpenVINO: false "supported" and false "unsupported" as
shares of every model OpenVINO compiles or refuses), and the mispredicted tests per cell (``--list``). Nothing is
asserted. One thread, spinning off. Usage::

    nice -n 10 .venv/bin/python benchmarks/matrix_check.py [--list] [--json PATH] [--limit N]

"Before" is this script run from a checkout of main at 3bfca4b (the matrices and checks there) with the same
onnx/ORT/OpenVINO wheels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conformance.matrix_verdicts import openvino_verdict, ort_verdict, predicted  # noqa: E402
from tests.conformance.node_cases import load_node_cases  # noqa: E402

ORT_ACTUAL = ("works", "imprecise", "refused", "fails", "different", "untested")
OV_ACTUAL = ("compiles", "refused")


def _table(title: str, counts: Counter, actual: tuple[str, ...]) -> str:
    rows = [title, f"{'predicted':<12}" + "".join(f"{a:>11}" for a in actual) + f"{'total':>8}"]
    for pred in ("supported", "unsupported"):
        cells = [counts[(pred, a)] for a in actual]
        rows.append(f"{pred:<12}" + "".join(f"{c:>11}" for c in cells) + f"{sum(cells):>8}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run both cross-checks on the whole suite and print the confusion tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the mispredicted tests of each cell")
    parser.add_argument("--json", type=Path, help="also write the per-test verdicts here")
    parser.add_argument("--limit", type=int, default=0, help="only the first N cases (a quick look)")
    parser.add_argument("--no-openvino", action="store_true", help="skip the OpenVINO table")
    args = parser.parse_args(argv)
    cases = load_node_cases()
    if args.limit:
        cases = cases[: args.limit]
    ort_counts: Counter = Counter()
    ov_counts: Counter = Counter()
    cells: dict[str, list[str]] = defaultdict(list)
    rows = []
    start = time.perf_counter()
    for case in cases:
        opsets = {o.domain or "ai.onnx": o.version for o in case.model.opset_import}
        row = {"name": case.name, "op": case.op_type, "opsets": opsets}
        p_ort = "supported" if predicted(case.model, "ort-cpu") else "unsupported"
        a_ort = ort_verdict(case)
        ort_counts[(p_ort, a_ort)] += 1
        row["ort"] = [p_ort, a_ort]
        if a_ort not in ("untested", "imprecise") and (p_ort == "supported") != (a_ort == "works"):
            cells[f"ort {p_ort} / {a_ort}"].append(case.name)
        if not args.no_openvino:
            p_ov = "supported" if predicted(case.model, "openvino") else "unsupported"
            a_ov = openvino_verdict(case.model)
            ov_counts[(p_ov, a_ov)] += 1
            row["openvino"] = [p_ov, a_ov]
            if (p_ov == "supported") != (a_ov == "compiles"):
                cells[f"openvino {p_ov} / {a_ov}"].append(case.name)
        rows.append(row)
    elapsed = time.perf_counter() - start
    print(f"{len(cases)} node tests at their own opset ({elapsed:.0f} s)\n")
    print(_table("ort-cpu matrix vs ORT CPU (session, run, outputs)", ort_counts, ORT_ACTUAL))
    baseline = ort_counts[("supported", "works")] + ort_counts[("unsupported", "works")]
    false_yes = sum(ort_counts[("supported", a)] for a in ("refused", "fails", "different"))
    false_no = ort_counts[("unsupported", "works")]
    imprecise = ort_counts[("supported", "imprecise")]
    print(
        f"baseline (ORT runs correctly): {baseline}; predicted supported but refused/failing/different: "
        f"{false_yes} ({100 * false_yes / max(baseline, 1):.2f}% of the baseline; goal <= 0.5%); "
        f"predicted unsupported but works: {false_no}; imprecise (within rtol of the output's scale, not counted "
        f"above; counted as different: {100 * (false_yes + imprecise) / max(baseline, 1):.2f}%): {imprecise}\n"
    )
    if not args.no_openvino:
        print(_table("openvino matrix vs OpenVINO CPU compile_model", ov_counts, OV_ACTUAL))
        total = sum(ov_counts.values())
        fs, fu = ov_counts[("supported", "refused")], ov_counts[("unsupported", "compiles")]
        print(
            f"false 'supported': {fs} ({100 * fs / max(total, 1):.2f}%), false 'unsupported': {fu} "
            f"({100 * fu / max(total, 1):.2f}%) of {total} models (goal <= 2% each)\n"
        )
    if args.list:
        for cell, names in sorted(cells.items()):
            print(f"{cell} ({len(names)}): {', '.join(names)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
