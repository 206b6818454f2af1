"""CLI start-up: wall time of the commands that should answer at once, against the issue's 1.0 s goal.

Timed as a user runs them (the venv's ``onnxdeploy`` console script, a fresh process each time, output discarded):

* ``passes``: ``onnxdeploy passes`` (the pass catalogue, no pass module imported);
* ``matrix list``: ``onnxdeploy matrix list`` (every target's YAML validated);
* ``inspect``: ``onnxdeploy inspect MODEL`` on the llama_gqa_optimum fixture (reads the protobuf: imports onnx);
* ``bad key``: ``onnxdeploy run p.yaml`` whose ``passes[0].static_kv`` has an unknown key (exit 2);
* ``missing``: ``onnxdeploy run missing.yaml`` (exit 2);
* the baseline ``python -c pass`` (the interpreter's own start), measured in the same rounds;
* with ``--compare PYTHON``, each command again with the ``onnxdeploy`` installed beside that interpreter
  (``<name> @compare``), e.g. a venv of the commit before a change.

The variants are interleaved over ``--rounds`` rounds (rotated, so none always follows another). Printed per
command: the median wall time, the median less the baseline's median (what the issue's goal counts), and that
over the goal (<= 1.00 meets it); then the median CPU time (the child's user + system seconds) and that less the
baseline's: on a machine shared with other jobs the wall time grows with the load average (printed) while the CPU
time stays near what an idle machine's wall time would be.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import fixture_entry  # noqa: E402

GOAL_S = 1.0
"""Issue 20 "What a user sees": each of these commands <= 1.0 s wall, less ``python -c pass``."""


def _cli(python: str) -> list[str]:
    """The console script beside ``python`` (as installed by ``pip install -e .``), else the same via -c."""
    script = Path(python).parent / "onnxdeploy"
    return [str(script)] if script.exists() else [python, "-c", "from onnxdeploy.cli import main; main()"]


def _commands(folder: Path, compare: str | None) -> dict[str, tuple[list[str], int]]:
    """Name -> (argv, expected exit status); with ``compare``, each command also as ``<name> @compare``."""
    model = str(fixture_entry("llama_gqa_optimum")["model_path"])
    bad = folder / "bad.yaml"
    bad.write_text(f"model: {model}\npasses:\n  - static_kv: {{max_cache_len: 64, max_cache_lenn: 3}}\n")
    commands = {"python -c pass": ([sys.executable, "-c", "pass"], 0)}
    for python, suffix in ((sys.executable, ""), *(((compare, " @compare"),) if compare else ())):
        cli = _cli(python)
        commands |= {
            f"passes{suffix}": ([*cli, "passes"], 0),
            f"matrix list{suffix}": ([*cli, "matrix", "list"], 0),
            f"inspect{suffix}": ([*cli, "inspect", model], 0),
            f"bad key{suffix}": ([*cli, "run", str(bad)], 2),
            f"missing{suffix}": ([*cli, "run", str(folder / "missing.yaml")], 2),
        }
    return commands


def _time(argv: list[str], expected: int, env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s: the child's user + system time) of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != expected:
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}, expected {expected}\n{done.stderr.decode()}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median over them)")
    ap.add_argument(
        "--compare",
        metavar="PYTHON",
        help="also time the onnxdeploy installed beside this interpreter (e.g. an earlier commit's venv), interleaved",
    )
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    with tempfile.TemporaryDirectory() as tmp:
        commands = _commands(Path(tmp), args.compare)
        names = list(commands)
        for name in names:  # one untimed run each: bytecode caches written, files in the page cache
            _time(*commands[name], env)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(_time(*commands[name], env))
    wall = {name: statistics.median(w for w, _ in runs) for name, runs in times.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in times.items()}
    base, base_cpu = wall["python -c pass"], cpu["python -c pass"]
    print(f"median of {args.rounds} interleaved rounds; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'command':26s} {'wall s':>8s} {'- python':>9s} {'/ goal':>7s} {'cpu s':>7s} {'- python':>9s}")
    for name in names:
        if name == "python -c pass":
            print(f"{name:26s} {base:8.3f} {'':>9s} {'':>7s} {base_cpu:7.3f}")
            continue
        net, net_cpu = wall[name] - base, cpu[name] - base_cpu
        print(f"{name:26s} {wall[name]:8.3f} {net:9.3f} {net / GOAL_S:7.2f} {cpu[name]:7.3f} {net_cpu:9.3f}")


if __name__ == "__main__":
    main()
