"""Continuous batching on a static graph: B rows of cache, a queue of requests, a row refilled the moment it frees.

The host drives a graph set made by ``static_kv {batch: B, row_positions: true, prefill_batch: 1}`` and
``mask_rewrite`` (README, "Continuous batching"), through the shared host API (:mod:`onnxdeploy.runner.host`):

* **Decode.** One call of the set's step-1 graph of ``B`` rows per step (cache length: the largest, or
  ``decode_cache``). Every active row feeds its last token at its own position (``cache_position`` ``(B, 1)``);
  a free row is *idle*: fed token 0 at position 0, its logits ignored. The slot it writes is rewritten before it
  is read (a refilled row's prefill copy covers ``[0, p)``), and every slot above a row's position is masked, so
  neither an idle row nor a row's stale values from its previous sequence reach any row's logits.
* **Prefill.** A request admitted into a free row is prefilled alone by the set's batch-1 prefill graphs (step
  length > 1: the largest bucket while it fits whole, then the smallest that holds the rest, padded at its end)
  into batch-1 buffers of their own, and slots ``[0, p)`` are copied into the free row of the B-row decode
  buffers (:func:`~onnxdeploy.runner.host.copy_row_slots`, the move graph sets make between cache lengths). The
  prefill's last logits give the request's first token; from the next step the row decodes with the others.
* **Prefill through the rows** (``prefill="rows"``, and the default on a set without batch-1 prefill graphs: a
  one-graph set ``static_kv {batch: B, row_positions: true}``). The admitted request's prompt is fed one token
  per step in its row of the decode graph, from position 0, while the other rows decode; the logits of its last
  prompt token give its first token. No other graph runs, so only the decode graph's session holds the weights:
  with prepacking on (what an M > 1 call needs on ORT CPU) that is one packed copy instead of one per session
  (README, "Continuous batching", the memory figures), at the price of one row-step per prompt token.
* **Concurrent prefill** (``prefill_workers=N``, prefill graphs). The prefills run on N worker threads while the
  decode thread keeps calling the decode graph (ORT's ``Run`` releases the GIL; each session keeps its own
  intra-op threads, so the host uses N + 1 threads' worth of cores). Continuous: a waiting request's prefill
  begins while fewer prefills are in flight than free rows + N (so one may be ready before a row frees); at each
  step boundary the decode thread places the finished ones, in admission order, into free rows (slot copy, first
  token) and goes on; with no row decoding it waits for the first to end. Static: the batch's prefills run N at
  a time and the batch starts when all have ended. When a prefill is placed depends on timing (the first step
  boundary after its worker finished), so a request's row and steps may differ from run to run, but never its
  tokens or logits: rows never interact, each prefill has buffers of its own, and every request's tokens and
  logits are bit-identical to the one-thread host's (``tests/runner/test_batching.py``).
* **Freeing.** A row whose request has its ``max_new_tokens`` tokens or has produced its ``stop_token`` is free
  at once; the next waiting request is admitted before the next step.
* **Clock.** A request's ``arrival`` is counted in decode steps of this host (a deterministic trace). When no row
  is active and the next request has not arrived, the clock jumps to its arrival (no wall time passes).

``policy="static"`` is static batching for comparison: a batch starts when ``B`` requests wait (or no more
will arrive) and ends when its longest request finishes; finished rows sit idle until then. A set of batch 1 run
``continuous`` is batch-1 serving: one request at a time, in arrival order.

Buffers are zeroed once, at allocation (contract ``cache_init: zeros``); the host never clears a row again.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from onnxdeploy.errors import ConfigError, ContractError
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.graph_set import GraphSetDecoder
from onnxdeploy.runner.host import Buffers, StepInputs, allocate_buffers, copy_row_slots

__all__ = ["BatchRun", "BatchingHost", "Finished", "Policy", "Prefill", "Request", "poisson_trace"]

Policy = Literal["continuous", "static"]
"""``continuous``: a freed row is refilled at once; ``static``: a batch of B runs until its longest finishes."""
Prefill = Literal["graphs", "rows"]
"""``graphs``: a prompt runs alone through the set's batch-1 prefill graphs and is copied into its row; ``rows``: it
is fed one token per step in its own row of the decode graph (module docstring)."""


@dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
        id: the caller's id (reported back).
        prompt: prompt token ids (at least one).
        max_new_tokens: tokens to generate (>= 1), the first from the prefill's logits.
        stop_token: generation ends once this token is produced (it is kept); None: only ``max_new_tokens``.
        arrival: the decode step at which the request enters the queue (>= 0).
    """

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token: int | None = None
    arrival: int = 0


@dataclass
class Finished:
    """What a request produced and when (in decode steps of the host).

    Attributes:
        request: the request.
        tokens: the greedy tokens generated (ids).
        logits: float32 ``(V,)`` per generated token, the logits it was chosen from (when the host keeps them).
        row: the decode row it ran in.
        admitted: the step at which it was prefilled; finished: the step after which its row was free.
    """

    request: Request
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    row: int = -1
    admitted: int = 0
    finished: int = 0


@dataclass
class BatchRun:
    """The outcome of :meth:`BatchingHost.run`.

    Attributes:
        finished: one :class:`Finished` per request, in request order.
        step_ms: wall time of every decode call (ms).
        prefill_ms: wall time of every prefill call (ms), on the decode thread or (``prefill_workers``) a worker.
        wall_s: wall time of the whole run (s), prefill, copies and host work included.
        steps: decode calls made.
        copy_ms: wall time of every prefill cache's copy into its row (ms).
        wait_ms: wall time the decode thread waited for a prefill worker, no row having anything to decode (ms).
        prefill_workers: the host's prefill worker threads (0: every prefill on the decode thread).
    """

    finished: list[Finished]
    step_ms: list[float]
    prefill_ms: list[float]
    wall_s: float
    steps: int
    copy_ms: list[float] = field(default_factory=list)
    wait_ms: list[float] = field(default_factory=list)
    prefill_workers: int = 0

    @property
    def generated(self) -> int:
        """Tokens generated over all requests."""
        return sum(len(f.tokens) for f in self.finished)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    def step_percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) of the decode calls' wall time, ms (nan without calls)."""
        return float(np.percentile(self.step_ms, q)) if self.step_ms else float("nan")

    def phases(self) -> dict[str, float]:
        """Where the wall time went, in seconds.

        ``decode``, ``prefill`` (every prefill call, wherever it ran), ``copy`` and ``wait`` (the decode thread
        blocked on a prefill worker) are sums of the timed calls; ``host`` is the rest of the wall time on the
        decode thread (feeds, argmax, bookkeeping): ``wall - decode - copy - wait``, minus ``prefill`` when it ran
        on the decode thread. With prefill workers ``prefill`` overlaps the decode calls and is not subtracted.
        """
        decode, prefill = sum(self.step_ms) / 1e3, sum(self.prefill_ms) / 1e3
        copy, waited = sum(self.copy_ms) / 1e3, sum(self.wait_ms) / 1e3
        on_thread = 0.0 if self.prefill_workers else prefill
        return {
            "decode": decode,
            "prefill": prefill,
            "copy": copy,
            "wait": waited,
            "host": self.wall_s - decode - on_thread - copy - waited,
        }


def poisson_trace(
    count: int,
    prompt_lens: tuple[int, int],
    new_tokens: tuple[int, int],
    mean_gap: float,
    *,
    seed: int,
    vocab: int,
) -> list[Request]:
    """A deterministic trace: prompt lengths and new tokens uniform in the given inclusive ranges, arrivals Poisson.

    The gaps between arrivals are exponential with mean ``mean_gap`` decode steps (a Poisson process), the arrival
    the floor of their running sum (the first request arrives at step 0); prompt tokens uniform in ``1..vocab-1``.
    Drawn from one ``numpy.random.default_rng(seed)`` in this order: lengths, new tokens, gaps, prompts.

    Args:
        count: requests.
        prompt_lens: ``(lowest, highest)`` prompt length.
        new_tokens: ``(lowest, highest)`` ``max_new_tokens``.
        mean_gap: mean steps between arrivals.
        seed: the generator's seed.
        vocab: vocabulary size.
    """
    rng = np.random.default_rng(seed)
    lens = rng.integers(prompt_lens[0], prompt_lens[1] + 1, size=count)
    new = rng.integers(new_tokens[0], new_tokens[1] + 1, size=count)
    gaps = rng.exponential(mean_gap, size=count)
    gaps[0] = 0.0
    arrivals = np.floor(np.cumsum(gaps)).astype(int)
    return [
        Request(
            id=i,
            prompt=tuple(rng.integers(1, vocab, size=int(lens[i])).tolist()),
            max_new_tokens=int(new[i]),
            arrival=int(arrivals[i]),
        )
        for i in range(count)
    ]


class BatchingHost:
    """Serve requests on a graph set with ``row_positions`` (module docstring).

    Args:
        decoder: the open set (:func:`~onnxdeploy.runner.graph_set.open_graph_set`); the host drives its graphs
            through :meth:`GraphSetDecoder.member` and owns its own buffers. Not closed by the host.
        decode_cache: the decode graph's ``max_cache_len``; None: the largest of the set.
        keep_logits: keep every generated token's logits (verification); False keeps only the tokens.
        idle_rows: rows never filled (always fed idle); a test may put anything, NaN included, in them.
        prefill: ``graphs`` or ``rows`` (module docstring); None: ``graphs`` when the set has a batch-1 prefill
            graph (step_len above the decode graph's), else ``rows``.
        decode_step: the decode graph's step_len S; None: the smallest of the set (1 in a set with prefill
            buckets). With S > 1 (``rows``: chunked prefill) a decoding row feeds 1 token padded to S, a prefilling
            row up to S prompt tokens, and the logits are each row's at its last real token.
        prefill_workers: threads that run the batch-1 prefills (``prefill="graphs"``) beside the decode thread
            (module docstring, "Concurrent prefill"); 0: every prefill on the decode thread, between decode calls.

    Raises:
        ContractError: no graph of that step length and cache length, a decode graph of step_len > 1 without
            trailing padding, a decode graph of batch > 1 without
            ``row_positions`` or not masked from ``cache_position``, or (``prefill="graphs"``) no batch-1 prefill
            graph (step_len > 1) with trailing padding.
        ConfigError: ``prefill`` neither ``graphs``, ``rows`` nor None; ``prefill_workers`` negative, or above 0
            with ``prefill="rows"``.
    """

    def __init__(
        self,
        decoder: GraphSetDecoder,
        *,
        decode_cache: int | None = None,
        keep_logits: bool = False,
        idle_rows: Collection[int] = (),
        prefill: Prefill | None = None,
        decode_step: int | None = None,
        prefill_workers: int = 0,
    ) -> None:
        graphs = decoder.graphs()
        step = decode_step if decode_step is not None else min(s for _, s, _ in graphs)
        caches = sorted({c for _, s, c in graphs if s == step})
        if not caches:
            raise ContractError(f"{decoder.source}: the set has no step_len {step} graph to decode with")
        self.decode: ContractDecoder = decoder.member(step, decode_cache if decode_cache is not None else caches[-1])
        c = self.decode.contract
        if c.step_len > 1 and c.padding is None:
            raise ContractError(f"{self.decode.source}: a decode graph of step_len {c.step_len} needs trailing padding")
        if c.batch > 1 and not (c.row_positions and c.mask == "cache_position"):
            raise ContractError(
                f"{self.decode.source}: a decode graph of {c.batch} rows needs row_positions and mask cache_position "
                "(static_kv {row_positions: true} then mask_rewrite)"
            )
        self.prefill = sorted(
            (m for _, s, cl in graphs if s > step and (m := decoder.member(s, cl)).contract.batch == 1),
            key=lambda m: (m.contract.step_len, m.contract.max_cache_len),
        )
        if prefill not in (None, "graphs", "rows"):
            raise ConfigError(f"prefill must be graphs or rows, got {prefill!r}")
        self.prefill_mode: Prefill = prefill or ("graphs" if self.prefill else "rows")
        if self.prefill_mode == "rows":
            self.prefill = []
        elif not self.prefill or any(m.contract.padding is None for m in self.prefill):
            raise ContractError(
                f"{decoder.source}: the set has no batch-1 prefill graph with padding (static_kv prefill_batch: 1, "
                "step_lens with a value > 1)"
            )
        if prefill_workers < 0 or (prefill_workers and self.prefill_mode == "rows"):
            raise ConfigError(
                f"prefill_workers must be >= 0, and 0 with prefill through the rows; got {prefill_workers}"
            )
        self.prefill_workers = prefill_workers
        self.batch = c.batch
        self.keep_logits = keep_logits
        self.idle_rows = frozenset(idle_rows)
        self.buffers = allocate_buffers(c)
        self._contracts = {m.contract.max_cache_len: m.contract for m in self.prefill}
        self._spare: dict[int, list[Buffers]] = {n: [allocate_buffers(c)] for n, c in self._contracts.items()}

    # -- prefill ------------------------------------------------------------------------------------

    def prefill_plan(self, length: int) -> tuple[int, list[tuple[int, int]]]:
        """``(cache length, [(step_len, real tokens), ...])`` of the batch-1 calls that prefill ``length`` tokens.

        Raises:
            ConfigError: no prefill cache length holds the chunks.
        """
        steps = sorted({m.contract.step_len for m in self.prefill})
        chunks, left = [], length
        while left > 0:
            whole = [s for s in steps if s <= left]
            step = whole[-1] if whole and (whole[-1] == steps[-1] or left == whole[-1]) else None
            if step is None:
                step = next(s for s in steps if s >= left) if left <= steps[-1] else steps[-1]
            real = min(step, left)
            chunks.append((step, real))
            left -= real
        end = length - chunks[-1][1] + chunks[-1][0]
        for cache in sorted({m.contract.max_cache_len for m in self.prefill}):
            there = {m.contract.step_len for m in self.prefill if m.contract.max_cache_len == cache}
            if cache >= end and all(s in there for s, _ in chunks):
                return cache, chunks
        raise ConfigError(f"a prompt of {length} tokens fits no prefill graph of the set (needs {end} slots)")

    def _prefill(self, prompt: Sequence[int], cache: int, buffers: Buffers) -> tuple[np.ndarray, list[float]]:
        """Prefill ``prompt`` alone into ``buffers`` (of the ``cache``-slot prefill graphs); any thread may call it.

        Returns:
            The last position's logits float32 ``(V,)`` and each call's wall time (ms).
        """
        _, chunks = self.prefill_plan(len(prompt))
        members = {m.contract.step_len: m for m in self.prefill if m.contract.max_cache_len == cache}
        position, logits, times = 0, None, []
        for step, real in chunks:
            member = members[step]
            inputs = StepInputs.uniform(member.contract, prompt[position : position + real], position)
            out, ms = member.call(buffers, inputs)
            times.append(ms)
            logits = out[0, -1] if member.contract.prefill_logits == "last" else out[0, real - 1]
            position += real
        assert logits is not None
        return np.asarray(logits, dtype=np.float32), times

    # -- the loop -----------------------------------------------------------------------------------

    def _check(self, requests: Sequence[Request]) -> None:
        limit, pad = self.decode.contract.max_cache_len, self.decode.contract.step_len - 1
        for r in requests:
            if not r.prompt or r.max_new_tokens < 1 or r.arrival < 0:
                raise ConfigError(f"request {r.id}: needs a prompt, max_new_tokens >= 1 and arrival >= 0")
            if len(r.prompt) + r.max_new_tokens - 1 + pad > limit:
                padded = f" (+ {pad} padding slots of the last call)" if pad else ""
                raise ConfigError(
                    f"request {r.id}: {len(r.prompt)} prompt + {r.max_new_tokens} new tokens{padded} pass the decode "
                    f"cache of {limit} slots"
                )
            if self.prefill_mode == "graphs":
                self.prefill_plan(len(r.prompt))

    def _decode_step(
        self,
        rows: dict[int, int],
        position: list[int],
        last: list[int],
        prompt_left: dict[int, list[int]],
        step_ms: list[float],
    ) -> dict[int, np.ndarray]:
        """One decode call: each active row's last token, or its next prompt chunk (``rows``), at its position.

        Advances ``position`` and ``prompt_left`` in place and appends the call's wall time to ``step_ms``.

        Returns:
            row -> float32 ``(V,)`` logits at the row's last real token, for each row that produces a token now
            (a row still inside its prompt produces none).
        """
        S = self.decode.contract.step_len
        fed = {r: left[:S] for r, left in prompt_left.items()}  # each prefilling row's next prompt chunk
        chunks = [fed.get(r, [last[r]]) if r in rows else [0] for r in range(self.batch)]
        at = [position[r] if r in rows else 0 for r in range(self.batch)]
        logits, ms = self.decode.call(self.buffers, StepInputs.rows(self.decode.contract, chunks, at))
        step_ms.append(ms)
        every = self.decode.contract.logits_positions() == S  # logits (B, S, V), else (B, 1, V)
        produced = {}
        for row in rows:
            position[row] += len(chunks[row])
            if row in fed:
                del prompt_left[row][:S]
                if prompt_left[row]:
                    continue  # more prompt to feed: these logits predict a prompt token
                del prompt_left[row]
            produced[row] = np.asarray(logits[row, len(chunks[row]) - 1 if every else 0], dtype=np.float32)
        return produced

    def run(self, requests: Sequence[Request], *, policy: Policy = "continuous") -> BatchRun:
        """Serve ``requests`` to the end (module docstring) and return what each produced and the timings.

        Raises:
            ConfigError: a request that cannot run (no prompt, passes the decode cache or every prefill graph),
                checked before any call; an unknown ``policy``.
            DecodeRunError: ONNX Runtime failed.
        """
        if policy not in ("continuous", "static"):
            raise ConfigError(f"policy must be continuous or static, got {policy!r}")
        self._check(requests)
        pool = ThreadPoolExecutor(self.prefill_workers, "prefill") if self.prefill_workers else None
        try:
            return self._serve(requests, policy, pool)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _serve(self, requests: Sequence[Request], policy: Policy, pool: ThreadPoolExecutor | None) -> BatchRun:
        """The loop of :meth:`run`; ``pool``: the prefill workers (None: prefill on this thread)."""
        order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
        waiting: list[int] = []  # request indices that have arrived, in arrival order
        upcoming = list(order)
        results = [Finished(request=r) for r in requests]
        rows: dict[int, int] = {}  # row -> request index
        pending: list[tuple[int, int, Buffers, Future]] = []  # (request, cache, buffers, its prefill), in order
        position = [0] * self.batch  # next position of each active row
        last = [0] * self.batch  # last generated token of each active row
        prompt_left: dict[int, list[int]] = {}  # prefill="rows": row -> prompt tokens not fed yet
        usable = [r for r in range(self.batch) if r not in self.idle_rows]
        step_ms, prefill_ms, copy_ms, wait_ms = [], [], [], []  # wall ms of each call, copy and wait
        clock = 0
        start = time.perf_counter()

        def finish(row: int, index: int) -> bool:
            return _finish(results[index], rows, row, clock)

        def emit(row: int, index: int, logits: np.ndarray) -> None:
            last[row] = _emit(results[index], logits, self.keep_logits)

        def place(row: int, index: int, cache: int, buffers: Buffers, logits: np.ndarray, times: list[float]) -> None:
            """A finished prefill into a free row: slots [0, p) copied, the first token taken, the row decoding."""
            prefill_ms.extend(times)
            p, begin = len(requests[index].prompt), time.perf_counter()
            copy_row_slots(buffers, 0, self.buffers, row, p, self.decode.contract)
            copy_ms.append((time.perf_counter() - begin) * 1e3)
            self._spare[cache].append(buffers)
            rows[row], position[row], results[index].row = index, p, row
            emit(row, index, logits)
            finish(row, index)

        def collect(block: bool) -> None:
            _collect(pending, [r for r in usable if r not in rows], policy, wait_ms, place, block)

        ahead = self.prefill_workers if policy == "continuous" else 0  # prefills begun before a row frees
        while upcoming or waiting or rows or pending:
            while upcoming and requests[upcoming[0]].arrival <= clock:
                waiting.append(upcoming.pop(0))
            collect(block=False)
            free = [r for r in usable if r not in rows]
            admit = policy == "continuous" or (
                not rows and not pending and (len(waiting) >= len(usable) or not upcoming)
            )
            while admit and waiting and (len(pending) < len(free) + ahead if pool else free):
                index = waiting.pop(0)
                prompt = requests[index].prompt
                results[index].admitted = clock
                if self.prefill_mode == "rows":  # fed by the decode calls from position 0
                    row = free.pop(0)
                    rows[row], position[row], prompt_left[row], results[index].row = index, 0, list(prompt), row
                    continue
                cache, _ = self.prefill_plan(len(prompt))
                spare = self._spare[cache]
                buffers = spare.pop() if spare else allocate_buffers(self._contracts[cache])
                if pool is not None:  # the decode loop goes on; placed at the first step boundary after it ends
                    pending.append((index, cache, buffers, pool.submit(self._prefill, prompt, cache, buffers)))
                    continue
                place(free.pop(0), index, cache, buffers, *self._prefill(prompt, cache, buffers))
            if not rows:
                if pending:  # nothing to decode until a prefill ends
                    collect(block=True)
                elif upcoming:  # nothing to decode until the next arrival (static: until a batch is full)
                    clock = max(clock, requests[upcoming[0]].arrival)
                elif waiting and not admit:
                    raise AssertionError("unreachable: the last requests are always admitted")
                continue
            produced = self._decode_step(rows, position, last, prompt_left, step_ms)
            clock += 1
            for row, logits in produced.items():
                index = rows[row]
                emit(row, index, logits)
                finish(row, index)
        wall = time.perf_counter() - start
        return BatchRun(results, step_ms, prefill_ms, wall, len(step_ms), copy_ms, wait_ms, self.prefill_workers)


def _finish(f: Finished, rows: dict[int, int], row: int, clock: int) -> bool:
    """Free ``row`` (and stamp ``f.finished``) when its request has all its tokens or its stop token."""
    req = f.request
    done = len(f.tokens) >= req.max_new_tokens or (req.stop_token is not None and f.tokens[-1] == req.stop_token)
    if done:
        f.finished = clock
        del rows[row]
    return done


def _emit(f: Finished, logits: np.ndarray, keep_logits: bool) -> int:
    """Append the greedy token of float32 ``(V,)`` ``logits`` to ``f`` (and the logits when kept); return it."""
    token = int(np.argmax(logits))
    f.tokens.append(token)
    if keep_logits:
        f.logits.append(logits.copy())
    return token


def _collect(pending: list, free: list[int], policy: Policy, wait_ms: list[float], place, block: bool) -> None:
    """Place the prefills the workers have finished into ``free`` rows, in admission order.

    ``pending``: ``(request, cache, buffers, future)`` in admission order, the placed ones removed; ``place``: the
    loop's placing function; ``block``: first wait for one (continuous) or for all (static: a batch starts together),
    the wait's wall ms appended to ``wait_ms``.
    """
    if block and pending:
        begin = time.perf_counter()
        how = FIRST_COMPLETED if policy == "continuous" else ALL_COMPLETED
        wait([f for *_, f in pending], return_when=how)
        wait_ms.append((time.perf_counter() - begin) * 1e3)
    for item in [x for x in pending if x[3].done()][: len(free)]:
        pending.remove(item)
        index, cache, buffers, future = item
        place(free.pop(0), index, cache, buffers, *future.result())
