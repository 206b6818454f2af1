"""The ``onnxdeploy plan`` command (registered by :mod:`onnxdeploy.cli`): sizing arithmetic and a pipeline snippet.

``onnxdeploy plan MODEL --memory BYTES [--latency-p99-ms X] [--prompt-lengths FILE] [--prefill rows] [--measure]``
prints :func:`onnxdeploy.plan.make_plan`'s arithmetic and proposal; ``--measure`` builds the proposed set and serves a
trace on ONNX Runtime (:func:`onnxdeploy.plan_measure.measure_plan`) and prints the measured figures beside the
predicted ones. Exit status: 0, or 2 on bad input (a one-line error naming the option or file).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from onnxdeploy.errors import EXIT_OK, ConfigError, OnnxDeployError

if TYPE_CHECKING:
    from rich.console import Console

    from onnxdeploy.plan import Plan

__all__ = ["parse_bytes", "plan_cmd"]

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``8GiB``, ``512M``, ``1.5e9`` or a plain integer → bytes (``k/M/G/T`` decimal, ``Ki/Mi/Gi/Ti`` binary).

    Raises:
        ConfigError: not a positive size (names ``--memory``).
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    try:
        value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()] if match else 0.0
    except ValueError:
        value = 0.0
    if value < 1:
        raise ConfigError(f"--memory: expected a size in bytes such as 8GiB or 4000000000, got {text!r}")
    return int(value)


def plan_cmd(
    model: Annotated[Path, typer.Argument(help="The exporter's ONNX decoder (dynamic KV cache).")],
    *,
    memory: Annotated[str, typer.Option("--memory", help="Device memory budget, bytes (8GiB, 512M, 4e9).")],
    latency_p99_ms: Annotated[
        float | None, typer.Option("--latency-p99-ms", help="Per-step latency target (ms) the batch must meet.")
    ] = None,
    prompt_lengths: Annotated[
        Path | None, typer.Option("--prompt-lengths", help="File of prompt lengths, one per line.")
    ] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Tokens a request generates at most.")] = 128,
    bandwidth_gbs: Annotated[
        float | None, typer.Option("--bandwidth-gbs", help="GB/s a step reads at on the device (default: ORT CPU).")
    ] = None,
    prefill: Annotated[
        str,
        typer.Option(
            "--prefill",
            help="graphs (batch-1 prefill buckets), shared (the same, one packed copy: C API container) or rows "
            "(prompts through the decode rows).",
        ),
    ] = "graphs",
    measure: Annotated[
        bool, typer.Option("--measure", help="Build the proposed set, serve a trace on ORT, print measured figures.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Size a batch, cache lengths, prefill buckets and KV dtype for a device; print a pipeline snippet."""
    from onnxdeploy.cli_common import consoles, fail  # noqa: PLC0415
    from onnxdeploy.plan import DEFAULT_BANDWIDTH, make_plan, model_facts, pipeline_snippet, read_prompt_lengths

    out, err = consoles(as_json)
    try:
        budget = parse_bytes(memory)
        if new_tokens < 1:
            raise ConfigError(f"--new-tokens: expected >= 1, got {new_tokens}")
        if bandwidth_gbs is not None and not bandwidth_gbs > 0:
            raise ConfigError(f"--bandwidth-gbs: expected a rate > 0 GB/s, got {bandwidth_gbs}")
        if latency_p99_ms is not None and not latency_p99_ms > 0:
            raise ConfigError(f"--latency-p99-ms: expected a target > 0 ms, got {latency_p99_ms}")
        lengths = read_prompt_lengths(prompt_lengths) if prompt_lengths is not None else None
        facts = model_facts(model)
        bandwidth = bandwidth_gbs * 1e9 if bandwidth_gbs is not None else DEFAULT_BANDWIDTH
        plan = make_plan(
            facts, budget, latency_p99_ms=latency_p99_ms, prompt_lengths=lengths, new_tokens=new_tokens,
            bandwidth=bandwidth, prefill=prefill,
        )  # fmt: skip
        measured = None
        if measure:
            from onnxdeploy.plan_measure import measure_plan  # noqa: PLC0415

            measured = measure_plan(model, plan, lengths, new_tokens)
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=as_json) from None
    payload = {
        "batch": plan.batch,
        "max_cache_len": plan.max_cache_len,
        "step_lens": plan.step_lens,
        "kv_dtype": plan.kv_dtype,
        "prefill": plan.prefill,
        "predicted": {"memory_bytes": plan.total, "step_ms": round(plan.step_ms, 2),
                      "tokens_per_s": round(plan.tokens_per_s, 1)},
        "arithmetic": plan.lines,
        "pipeline": pipeline_snippet(plan),
        "measured": measured,
    }  # fmt: skip
    if as_json:
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    _print_plan(out, plan, budget, measured)
    raise typer.Exit(EXIT_OK)


def _print_plan(out: Console, plan: Plan, budget: int, measured: dict[str, Any] | None) -> None:
    """The arithmetic, the proposal line, the measured figures (``--measure``) and the pipeline snippet."""
    from onnxdeploy.plan import pipeline_snippet  # noqa: PLC0415

    for line in plan.lines:
        out.print(line, highlight=False, markup=False)
    out.print(
        f"proposal: batch {plan.batch}, prefill {plan.prefill}, max_cache_len {plan.max_cache_len}, step_lens "
        f"{plan.step_lens}, kv_dtype {plan.kv_dtype}; predicted memory {plan.total / 2**20:.1f} MiB of "
        f"{budget / 2**20:.1f} MiB, step {plan.step_ms:.1f} ms, {plan.tokens_per_s:.1f} tokens/s",
        highlight=False,
        markup=False,
    )
    if measured is not None:
        out.print(
            f"measured: step P50 {measured['step_p50_ms']} ms, P99 {measured['step_p99_ms']} ms, "
            f"{measured['tokens_per_s']} tokens/s, peak RSS {measured['peak_rss'] / 2**20:.1f} MiB",
            highlight=False,
            markup=False,
        )
    out.print(pipeline_snippet(plan), highlight=False, markup=False, end="")
