"""``onnxdeploy plan --measure``: build the proposed graph set and serve a trace on it with ONNX Runtime.

The set is written by the library's passes (the plan's pipeline snippet) into a temporary folder; a child process
(``python -m onnxdeploy.plan_measure SET TRACE_JSON``) opens it with the batching host's session options (ORT CPU,
one intra-op thread, weight prepacking on, past and present bound to one buffer; the prompts through the batch-1
prefill graphs — with ``prefill: shared`` their sessions sharing one packed copy — or with ``prefill: rows``
through the one graph's rows) and serves a
:func:`~onnxdeploy.runner.batching.poisson_trace` of 16 requests (prompt lengths uniform between the shortest and
longest given, max new tokens between a quarter of ``new_tokens`` and ``new_tokens``, a mean gap of 2 steps, seed
0), so its peak RSS (``VmHWM``) is the host's alone, not the build's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnxdeploy.errors import ConfigError
from onnxdeploy.plan import Plan

__all__ = ["build_plan_set", "measure_plan"]


def build_plan_set(model: str | Path, plan: Plan, folder: Path) -> Path:
    """Run the plan's passes on ``model`` and write the set into ``folder``; return its primary graph."""
    from onnxdeploy.artifacts import Artifact  # noqa: PLC0415
    from onnxdeploy.model_io import load_model, stage_artifacts  # noqa: PLC0415
    from onnxdeploy.pass_context import make_pass_context  # noqa: PLC0415
    from onnxdeploy.passes import ArtifactSet, get_pass  # noqa: PLC0415

    static: dict = {"batch": plan.batch, "row_positions": True, "prefill_batch": 1, "step_lens": plan.step_lens,
                    "max_cache_lens": [plan.max_cache_len]}  # fmt: skip
    if plan.prefill == "rows":  # one graph; the host feeds the prompts through its rows
        static = {"batch": plan.batch, "row_positions": True, "step_len": plan.step_lens[0],
                  "max_cache_len": plan.max_cache_len}  # fmt: skip
    if plan.kv_dtype != plan.facts.kv_dtype:
        static["kv_dtype"] = plan.kv_dtype
    artifacts = ArtifactSet([Artifact("model.onnx", load_model(model).model)], input_was_external=True)
    context = make_pass_context()
    for name, cfg in (("static_kv", static), ("mask_rewrite", {}), ("grouped_attention", {})):
        cls = get_pass(name)
        artifacts = cls(cls.config_model(**cfg))(artifacts, context).artifacts
    graphs = [(a.name, a.model) for a in artifacts.artifacts]
    stage_artifacts(graphs, folder, external=True, data_name="model.onnx.data").commit()
    return folder / "model.onnx"


def measure_plan(model: str | Path, plan: Plan, lengths: Sequence[int] | None, new_tokens: int) -> dict[str, Any]:
    """Build the plan's set, serve the trace in a child process, return its measured figures.

    Returns:
        ``tokens_per_s``, ``step_p50_ms``, ``step_p99_ms``, ``steps``, ``generated``, ``peak_rss`` (bytes).

    Raises:
        ConfigError: the child failed (its last stderr line).
    """
    shortest, longest = (min(lengths), max(lengths)) if lengths else (4, 48)
    longest = min(longest, plan.max_cache_len - new_tokens - (plan.step_lens[0] - 1 if plan.prefill == "rows" else 0))
    trace = {"count": 16, "prompt_lens": [min(shortest, longest), longest],
             "new_tokens": [max(1, new_tokens // 4), new_tokens], "mean_gap": 2.0, "seed": 0,
             "vocab": plan.facts.vocab, "prefill": plan.prefill}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="onnxdeploy-plan-") as tmp:
        primary = build_plan_set(model, plan, Path(tmp))
        done = subprocess.run(
            [sys.executable, "-m", "onnxdeploy.plan_measure", str(primary), json.dumps(trace)],
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"plan --measure: serving the trace failed: {tail}")
    return json.loads(done.stdout)


def _serve(primary: str, trace: dict[str, Any]) -> dict[str, Any]:
    """Child: open the set with the host's options, serve the trace once after a warm-up, report the figures."""
    from onnxdeploy.runner.batching import BatchingHost, poisson_trace  # noqa: PLC0415
    from onnxdeploy.runner.graph_set import open_graph_set  # noqa: PLC0415
    from onnxdeploy.runner.session import PREPACKING_KEY  # noqa: PLC0415

    requests = poisson_trace(
        trace["count"], tuple(trace["prompt_lens"]), tuple(trace["new_tokens"]), trace["mean_gap"],
        seed=trace["seed"], vocab=trace["vocab"],
    )  # fmt: skip
    if trace.get("prefill") == "shared":  # one packed copy for every graph (onnxdeploy.runner.prepacked_sessions)
        from onnxdeploy.runner.prepacked_sessions import SharedPrepacking  # noqa: PLC0415

        opened = open_graph_set(primary, opener=SharedPrepacking().open)  # the maps' pages dropped while loading
    else:
        opened = open_graph_set(primary, config_entries={PREPACKING_KEY: "0"}, threads=1, bind_buffers=True)
    with opened as decoder:
        host = BatchingHost(decoder)
        host.run(requests[:2])
        run = host.run(requests)
    return {
        "tokens_per_s": round(run.tokens_per_s, 2),
        "step_p50_ms": round(run.step_percentile(50), 2),
        "step_p99_ms": round(run.step_percentile(99), 2),
        "steps": run.steps,
        "generated": run.generated,
        "peak_rss": _peak_rss(),
    }


def _peak_rss() -> int:
    """This process's peak RSS (bytes, ``/proc/self/status`` ``VmHWM``: ``ru_maxrss`` keeps the parent's over exec)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1], json.loads(sys.argv[2]))))
