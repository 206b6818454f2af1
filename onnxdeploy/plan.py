"""``onnxdeploy plan``: the seeds' sizing arithmetic for a decoder on a device, and the graph set it proposes.

The rule (issue 17, from the seeds' deployment chain): fix the latency target, derive the largest batch from it,
then check that the KV cache ``2 × layers × batch × max_len × H_kv × D × bytes`` fits the device's memory beside
the weights and the activations. From the graph alone (:func:`model_facts`: layers, KV heads, head dim and cache
dtype from :func:`~onnxdeploy.kv_cache.find_kv_cache`, weight bytes by dtype from the initializers' types,
vocabulary from the logits or the embedding table) and the budget, :func:`make_plan`:

* ``max_cache_len``: with prompt lengths, their 99th percentile plus ``new_tokens``, rounded up to a multiple of
  64; without, ``max_len`` (at least ``new_tokens + 1`` rounded up to 64).
* ``step_lens``: 1 and, with prompt lengths, the powers of two at or above their median and 90th percentile
  (capped at 256 and at ``max_cache_len``): the median prompt takes one prefill call, the long ones few; without,
  ``[1, 64]``.
* ``kv_dtype``: the model's; float16 when the model's does not fit one row.
* ``prefill``: ``graphs`` (the default: batch-1 prefill buckets, one session each), ``shared`` (the same graphs,
  their sessions sharing one packed copy through ORT's C API container,
  :mod:`onnxdeploy.runner.prepacked_sessions`) or ``rows`` (the prompts go
  through the decode graph's own rows in chunks of :data:`ROWS_STEP_LEN`: a one-graph set, one session, one
  packed copy of the weights; ``step_lens`` is then ``[ROWS_STEP_LEN]``, and the predicted step ``×
  ROWS_STEP_COST``).
* ``batch``: the largest power of two (at most ``max_batch``) whose memory fits the budget and, with a latency
  target, whose predicted step is within it. The step model: ``t(B) = t(1) × (1 + row_cost × (B − 1))``, ``t(1)``
  the bytes one step reads (every weight once, the decode buffers) over ``bandwidth`` bytes/s. Both constants are
  the device's; the defaults are ORT CPU figures measured here (:data:`DEFAULT_BANDWIDTH`, :data:`DEFAULT_ROW_COST`).

Memory (what the continuous-batching host holds on ORT CPU, :mod:`onnxdeploy.runner.batching`): the MatMul
weights once per session, each prepacked (:data:`PACKED_NUMERATOR`), the B-row decode buffers and the batch-1
prefill buffers (``× RUNTIME_CACHE_COPIES`` live while a call runs), activations of the largest call (its hidden
states and logits), and the process's own baseline (:data:`HOST_BASELINE_BYTES`). ``--measure`` builds the proposed set,
serves a trace on it and reports measured step P50/P99, tokens/s and peak RSS beside the prediction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnxdeploy.errors import ConfigError, PreconditionError
from onnxdeploy.kv_cache import find_kv_cache, find_logits_output
from onnxdeploy.resources import format_bytes

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_ROW_COST",
    "HOST_BASELINE_BYTES",
    "PACKED_DENOMINATOR",
    "PACKED_NUMERATOR",
    "ROWS_STEP_LEN",
    "ModelFacts",
    "Plan",
    "host_memory",
    "make_plan",
    "model_facts",
    "pipeline_snippet",
    "read_prompt_lengths",
]

DEFAULT_BANDWIDTH = 10e9
"""Bytes/s a decode step reads at (ORT CPU here: the 125M export's batch-1 step, 519 MB read in ~45 ms ≈ 11.5 GB/s,
``benchmarks/batching.py``, 2026-12-02); the user's device has its own."""
DEFAULT_ROW_COST = 0.08
"""Extra step time per added row, as a fraction of ``t(1)`` (ORT CPU with prepacking, ``benchmarks/batching.py``:
t(4)/t(1) ≈ 1.23 → (1.23 − 1) / 3 ≈ 0.08, issue 17's measurement)."""
PACKED_NUMERATOR, PACKED_DENOMINATOR = 7, 6
"""Resident bytes per MatMul weight byte, per session: every session of the set (the decode graph and each prefill
graph) prepacks its own private copy of the MatMul weights (ORT's Python API shares no prepacked weights between
sessions), 7/6 of their bytes with the session's own allocations (measured on the 125M export: two sessions added
891 MiB for 381.8 MiB of MatMul weights, ``benchmarks/batching.py``, 2026-12-02). Gather tables (the embedding)
stay mapped and only their looked-up rows are read."""
ROWS_STEP_LEN = 4
"""The one graph's step_len with ``prefill: rows``: a prefilling row feeds 4 prompt tokens per call, a decoding row 1
padded to 4 (``benchmarks/batching.py`` measured step_len 2 and 4 on the 125M export; README, "Continuous
batching")."""
ROWS_STEP_COST = 1.34
"""A decode call of step_len :data:`ROWS_STEP_LEN` over the same call at step_len 1, both at B = 4 with prepacking:
91.7 / 68.6 ms on the 125M export (``benchmarks/batching.py``, 2026-12-02 13:53 UTC, load average 4.1-4.6); the
step model's ``t(B)`` is multiplied by it with ``prefill: rows``."""
HOST_BASELINE_BYTES = 110 * 2**20
"""The host process before any model: Python, numpy, onnx, onnx_ir and ONNX Runtime imported (108-111 MiB RSS here)."""
RUNTIME_CACHE_COPIES = 3
"""Cache buffers alive around a call (the past inputs, the present outputs, the host's), as ``static_kv`` counts."""
_KV_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelFacts:
    """What the planner reads from the graph.

    Attributes:
        layers: decoder layers; kv_heads: H_kv; head_dim: D; kv_dtype: the cache's dtype name.
        vocab: V (logits' last dim, else the embedding table's rows); hidden: the embedding width (0 if unknown).
        weight_bytes: bytes of the initializers by dtype name (weights above 1 KiB).
        table_bytes: bytes of the weights only ``Gather`` reads (the embedding table: rows looked up, not packed).
    """

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    vocab: int
    hidden: int
    weight_bytes: dict[str, int]
    table_bytes: int = 0

    @property
    def weights(self) -> int:
        """All weight bytes."""
        return sum(self.weight_bytes.values())

    def kv_row_slot_bytes(self, kv_dtype: str | None = None) -> int:
        """Bytes of one slot of one row: ``2 × layers × H_kv × D × dtype bytes`` (K and V)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * _KV_BYTES[kv_dtype or self.kv_dtype]


def model_facts(path: str | Path) -> ModelFacts:
    """Read :class:`ModelFacts` from an exporter-convention decoder (weights are never read, only their types).

    Raises:
        ModelLoadError: the file cannot be read.
        PreconditionError: a static model (it has a decode contract), or no KV cache or logits output found (names
            what was looked for).
    """
    from onnxdeploy.contract import read_contract  # noqa: PLC0415
    from onnxdeploy.model_io import load_model  # noqa: PLC0415  (loads onnx_ir's model machinery)

    model = load_model(path).model
    if read_contract(model, source=str(path)) is not None:
        raise PreconditionError(
            "plan",
            f"{path}: already static (it carries an onnxdeploy decode contract); plan sizes a deployment from the "
            "exporter's dynamic decoder: give the export the pipeline's `model:` points at",
        )
    kv = find_kv_cache(model, who="plan")
    by_dtype: dict[str, int] = {}
    tables = []
    table_bytes = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or tensor.nbytes <= 1024:
            continue
        name = str(tensor.dtype.name).lower()
        by_dtype[name] = by_dtype.get(name, 0) + tensor.nbytes
        gathered = [u.node.op_type == "Gather" and u.idx == 0 for u in value.uses()]
        if gathered and all(gathered):  # a lookup table only: never prepacked by a session
            table_bytes += tensor.nbytes
        if any(gathered) and len(tensor.shape) == 2:  # a tied embedding also feeds the LM head: still the table
            tables.append(tuple(int(d) for d in tensor.shape))
    logits = find_logits_output(model.graph, {t.present_name for t in kv.tensors}, who="plan")
    dims = logits.shape
    vocab = int(dims[-1]) if dims is not None and isinstance(dims[-1], int) else (tables[0][0] if tables else 0)
    hidden = max((t[1] for t in tables if t[0] == vocab), default=0)
    kv_name = {ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}
    return ModelFacts(
        layers=len(kv.layers),
        kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        kv_dtype=kv_name.get(kv.dtype, "float32"),
        vocab=vocab,
        hidden=hidden,
        weight_bytes=by_dtype,
        table_bytes=table_bytes,
    )


def read_prompt_lengths(path: str | Path) -> list[int]:
    """Prompt lengths (tokens), one integer per line (blank lines and ``#`` comments skipped).

    Raises:
        ConfigError: the file cannot be read, holds a non-integer or a length < 1, or no length (names the line).
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--prompt-lengths {path}: {exc.strerror}") from exc
    lengths = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not line.isdigit() or int(line) < 1:
            raise ConfigError(f"--prompt-lengths {path}:{number}: expected a length >= 1, got {line!r}")
        lengths.append(int(line))
    if not lengths:
        raise ConfigError(f"--prompt-lengths {path}: no lengths")
    return lengths


@dataclass(frozen=True)
class Plan:
    """A proposed graph set and the arithmetic behind it (all sizes in bytes, times in ms).

    Attributes:
        facts: the model's.
        batch, max_cache_len, step_lens, kv_dtype: the proposal.
        prefill: ``graphs`` or ``rows`` (module docstring).
        budget: the device memory given.
        weights: resident weight bytes (every session's packed MatMul weights, :data:`PACKED_NUMERATOR`).
        cache: B-row decode buffers + batch-1 prefill buffers, × ``RUNTIME_CACHE_COPIES``.
        activations: the largest call's hidden states and logits (float32).
        baseline: the host process before the model.
        step_ms: predicted decode step at ``batch`` (None without a bandwidth model).
        lines: the arithmetic, one line each.
    """

    facts: ModelFacts
    batch: int
    max_cache_len: int
    step_lens: list[int]
    kv_dtype: str
    budget: int
    weights: int
    cache: int
    activations: int
    baseline: int
    step_ms: float
    lines: list[str] = field(default_factory=list)
    prefill: str = "graphs"

    @property
    def total(self) -> int:
        """Predicted peak memory of the host (bytes)."""
        return self.weights + self.cache + self.activations + self.baseline

    @property
    def tokens_per_s(self) -> float:
        """Predicted decode tokens/s with every row busy: ``batch / t(batch)``."""
        return self.batch / self.step_ms * 1e3


def host_memory(
    facts: ModelFacts, batch: int, max_len: int, steps: Sequence[int], kv_dtype: str, *, prefill: str = "graphs"
) -> tuple[int, int, int]:
    """``(weights, cache, activations)`` bytes the batching host holds at ``batch`` rows (module docstring).

    Args:
        facts: the model.
        batch: decode rows B.
        max_len: ``max_cache_len`` of every graph.
        steps: the set's step lengths (1 and the prefill buckets: one session each; ``rows``: the one graph's).
        kv_dtype: the cache dtype name.
        prefill: ``graphs`` (batch-1 prefill graphs and their buffers), ``shared`` (the same, every session in one
            prepacked-weights container: one packed copy, :mod:`onnxdeploy.runner.prepacked_sessions`) or ``rows``
            (the prompts go through the decode graph's rows: one session, no prefill buffers;
            :class:`~onnxdeploy.runner.batching.BatchingHost`).

    Returns:
        Bytes of the packed weights, of the cache buffers (``× RUNTIME_CACHE_COPIES``) and of the activations;
        add :data:`HOST_BASELINE_BYTES` for the process.
    """
    slot = facts.kv_row_slot_bytes(kv_dtype)
    rows = prefill == "rows"
    cache = RUNTIME_CACHE_COPIES * slot * max_len * (batch + (0 if rows else 1))  # + the batch-1 prefill buffers
    width = batch * max(steps) if rows else max(batch, max(steps))  # rows × positions of the largest call
    activations = 4 * width * (16 * facts.hidden + facts.vocab)
    sessions = 1 if prefill in ("rows", "shared") else len(steps)  # the decode graph and one per prefill bucket
    packed = sessions * (facts.weights - facts.table_bytes) * PACKED_NUMERATOR // PACKED_DENOMINATOR
    return packed, cache, activations


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _lengths(
    prompt_lengths: Sequence[int] | None, new_tokens: int, max_len: int, prefill: str
) -> tuple[int, list[int]]:
    """``(max_cache_len, step_lens)`` from the prompt lengths (module docstring; rows: + the last call's padding)."""
    if prompt_lengths:
        lengths = np.asarray(prompt_lengths)
        pad = ROWS_STEP_LEN - 1 if prefill == "rows" else 0
        max_cache_len = _round_up(int(np.ceil(np.percentile(lengths, 99))) + new_tokens + pad, 64)
        buckets = {min(2 ** math.ceil(math.log2(max(2, float(np.percentile(lengths, q))))), 256) for q in (50, 90)}
        steps = [1, *sorted(b for b in buckets if b <= max_cache_len)]
    else:  # no prompt lengths: max_len, yet never fewer slots than the new tokens asked for (and a first token)
        max_cache_len, steps = max(max_len, _round_up(new_tokens + 1, 64)), [1, 64]
    return max_cache_len, [ROWS_STEP_LEN] if prefill == "rows" else steps


def make_plan(
    facts: ModelFacts,
    memory: int,
    *,
    latency_p99_ms: float | None = None,
    prompt_lengths: Sequence[int] | None = None,
    new_tokens: int = 128,
    max_len: int = 1024,
    max_batch: int = 64,
    bandwidth: float = DEFAULT_BANDWIDTH,
    row_cost: float = DEFAULT_ROW_COST,
    prefill: str = "graphs",
) -> Plan:
    """Propose ``batch``, ``max_cache_len``, ``step_lens`` and ``kv_dtype`` for ``memory`` bytes (module docstring).

    Args:
        facts: the model (:func:`model_facts`).
        memory: the device budget (bytes).
        latency_p99_ms: the per-step latency target (ms); None: memory alone bounds the batch.
        prompt_lengths: observed prompt lengths (tokens), for ``max_cache_len`` and ``step_lens``.
        new_tokens: tokens a request generates at most.
        max_len: ``max_cache_len`` without prompt lengths.
        max_batch: the largest batch proposed.
        bandwidth: bytes/s a step reads at on the device.
        row_cost: extra step time per added row, a fraction of ``t(1)``.
        prefill: ``graphs`` or ``rows`` (module docstring).

    Raises:
        ConfigError: not even one row fits the budget (float16 KV included), or the latency target is below
            ``t(1)``; the message spells out the arithmetic; ``prefill`` neither ``graphs`` nor ``rows``.
    """
    if prefill not in ("graphs", "shared", "rows"):
        raise ConfigError(f"--prefill: expected graphs, shared or rows, got {prefill!r}")
    max_cache_len, steps = _lengths(prompt_lengths, new_tokens, max_len, prefill)
    kv_dtype = facts.kv_dtype
    if (
        sum(host_memory(facts, 1, max_cache_len, steps, kv_dtype, prefill=prefill)) + HOST_BASELINE_BYTES > memory
        and kv_dtype != "float16"
    ):
        kv_dtype = "float16"
    slot = facts.kv_row_slot_bytes(kv_dtype)
    t1 = (facts.weights + slot * max_cache_len) / bandwidth * 1e3

    chunk = ROWS_STEP_COST if prefill == "rows" else 1.0  # a call of step_len 4 through the rows

    def step_ms(b: int) -> float:
        return (t1 * (1 + row_cost * (b - 1)) + (slot * max_cache_len * (b - 1)) / bandwidth * 1e3) * chunk

    best = None
    b = 1
    while b <= max_batch:
        fits = (
            sum(host_memory(facts, b, max_cache_len, steps, kv_dtype, prefill=prefill)) + HOST_BASELINE_BYTES <= memory
        )
        fast = latency_p99_ms is None or step_ms(b) <= latency_p99_ms
        if not (fits and fast):
            break
        best, b = b, b * 2
    weights, cache, act = host_memory(facts, best or 1, max_cache_len, steps, kv_dtype, prefill=prefill)
    lines = _arithmetic(facts, (weights, cache, act), best or 1, max_cache_len, steps, kv_dtype, prefill)
    rows = f", × {ROWS_STEP_COST} for step_len {ROWS_STEP_LEN} through the rows" if prefill == "rows" else ""
    lines.append(
        f"t(B) = {t1:.1f} ms × (1 + {row_cost} × (B − 1)) + B−1 rows of cache / {bandwidth / 1e9:.1f} GB/s{rows}"
    )
    if best is None:
        total = weights + cache + act + HOST_BASELINE_BYTES
        why = (
            f"one row needs {format_bytes(total)} > {format_bytes(memory)}"
            if total > memory
            else f"t(1) = {step_ms(1):.1f} ms > --latency-p99-ms {latency_p99_ms}"
        )
        hint = " (--prefill shared or rows: one packed copy of the weights, not one per graph)" * (prefill == "graphs")
        raise ConfigError(f"plan: nothing fits: {why}{hint}\n" + "\n".join(lines))
    return Plan(facts, best, max_cache_len, steps, kv_dtype, memory, weights, cache, act, HOST_BASELINE_BYTES,
                step_ms(best), lines, prefill)  # fmt: skip


def _sessions(n: int) -> str:
    """``1 session`` / ``3 sessions``."""
    return f"{n} session" + "s" * (n != 1)


def _arithmetic(
    facts: ModelFacts,
    memory: tuple[int, int, int],
    batch: int,
    max_cache_len: int,
    steps: Sequence[int],
    kv_dtype: str,
    prefill: str,
) -> list[str]:
    """The memory lines of a plan (weights, KV per row and slot, cache, activations, baseline) as printed."""
    weights, cache, act = memory
    slot = facts.kv_row_slot_bytes(kv_dtype)
    prefill_row, per_position = "" if prefill == "rows" else " + 1 prefill row", 4 * (16 * facts.hidden + facts.vocab)
    return [
        f"weights: {', '.join(f'{k} {format_bytes(v)}' for k, v in facts.weight_bytes.items())}; "
        f"{_sessions(1 if prefill in ('rows', 'shared') else len(steps))} × ({facts.weights} − {facts.table_bytes} "
        f"table) B × {PACKED_NUMERATOR}/{PACKED_DENOMINATOR} packed = {format_bytes(weights)}",
        f"KV per row and slot: 2 × {facts.layers} layers × {facts.kv_heads} KV heads × {facts.head_dim} × "
        f"{_KV_BYTES[kv_dtype]} bytes ({kv_dtype}) = {slot} B",
        f"KV cache: {slot} B × {max_cache_len} slots × ({batch} rows{prefill_row}) × {RUNTIME_CACHE_COPIES} "
        f"copies = {format_bytes(cache)}",
        f"activations: 4 B × {act // per_position} rows·positions × (16 × {facts.hidden} hidden + "
        f"{facts.vocab} vocab) = {format_bytes(act)}",
        f"host baseline: {format_bytes(HOST_BASELINE_BYTES)}",
    ]


def pipeline_snippet(plan: Plan) -> str:
    """The proposal as the ``passes:`` of a pipeline config (YAML)."""
    kv = f", kv_dtype: {plan.kv_dtype}" if plan.kv_dtype != plan.facts.kv_dtype else ""
    if plan.prefill == "rows":  # one graph: the prompts go through its rows
        static = f"step_len: {plan.step_lens[0]}, max_cache_len: {plan.max_cache_len}"
        return (
            "passes:\n"
            f"  - static_kv: {{batch: {plan.batch}, row_positions: true, {static}{kv}}}\n"
            "  - mask_rewrite: {}\n"
            "  - grouped_attention: {}\n"
        )
    return (
        "passes:\n"
        f"  - static_kv: {{batch: {plan.batch}, row_positions: true, prefill_batch: 1, step_lens: {plan.step_lens}, "
        f"max_cache_lens: [{plan.max_cache_len}]{kv}}}\n"
        "  - mask_rewrite: {}\n"
        "  - grouped_attention: {}\n"
    )
