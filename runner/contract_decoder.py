"""Decode loop for a transformed model that carries a decode contract (docs/ARCHITECTURE.md, "The decode contract").

The host owns fixed cache buffers of ``max_cache_len`` slots, zero at reset. Each call feeds exactly
``step_len`` tokens at positions ``p .. p + step_len - 1``: ``input_ids`` (B, step_len),
``cache_position`` (step_len,) = those positions, ``position_ids`` (B, step_len) = the same, and
``attention_mask`` (B, max_cache_len) with 1 for slots <= the last position of the call. With
``cache_update: full_buffer`` the present outputs replace the buffers; with ``new_token_only`` they hold
only the call's K/V and the host writes them into the buffers at ``cache_position``.

A chunk of fewer real tokens than ``step_len`` (:meth:`ContractDecoder.run_chunk`, contract ``padding:
trailing``) is padded at its end: the padding continues the positions (all below ``max_cache_len``), the
causal mask hides their slots from the real tokens, ``attention_mask`` is 0 there, and the next call
overwrites them. With ``prefill_logits: last`` the graph returns the logits of the position named by
``last_token_index`` only.

The feeds, buffer moves and present writes are the shared host API's (:mod:`onnxdeploy.runner.host`); this
decoder is the host of one sequence fed to every row, and :meth:`ContractDecoder.call` is the step call other
hosts (continuous batching, ring caches) run on buffers they own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from onnxdeploy.contract import DecodeContract
from onnxdeploy.errors import CacheOverflowError, ContractError
from onnxdeploy.runner.bound_buffers import BufferBinding
from onnxdeploy.runner.decode_state import DecodeState
from onnxdeploy.runner.host import StepInputs, allocate_buffers, move_slots, step_feeds, store_presents
from onnxdeploy.runner.session import ModelSession

__all__ = ["ContractDecoder"]

_REFUSED = frozenset({"missing", "unnamed_input", "dtype", "shape"})
"""Contract mismatch kinds that stop the decoder: it could not feed the graph or read what it returns."""


class ContractDecoder(DecodeState):
    """Greedy-decode driver for a static-shape model described by a :class:`DecodeContract`.

    Tokens are fed in chunks of ``step_len``, one ``session.run`` per chunk; a feed whose length is
    not a multiple of ``step_len`` is refused rather than padded, because padding tokens would be
    written into cache slots (and could overflow the buffer) that the host never asked for. Batch
    rows all receive the same tokens; logits are returned for row 0. Shapes and dtypes come from the
    contract (:meth:`DecodeContract.cache_input_shape`, :attr:`DecodeContract.kv_numpy_dtype`, ...), so
    every layout is driven: ``BHSD`` ``(B, H_kv, max_cache_len, D_padded)``, ``BSH2D`` ``(B, max_cache_len, H_kv,
    2·D_padded)`` and ``BHDS_K`` (K ``(B, H_kv, D_padded, max_cache_len)``, V as BHSD); buffers are written and
    moved on each tensor's own sequence axis (:meth:`DecodeContract.pair_sequence_axes`).

    Args:
        model_session: the loaded model; the decoder closes it in :meth:`close`.
        contract: the model's contract (``read_contract(model_session.model)``).
        bind_buffers: bind each layer's past input and present output to one host buffer with ORT IOBinding
            (``cache_update: full_buffer`` only; :mod:`onnxdeploy.runner.bound_buffers`), checked bit-exact
            against numpy feeds once (:meth:`check_binding`); False feeds numpy arrays.

    Raises:
        ContractError: the graph disagrees with the contract (:meth:`DecodeContract.mismatches`: a named input or
            output the graph lacks, an input the contract does not name, a wrong dtype, a conflicting rank or
            static dim), or ``kv_dtype`` is one ORT's Python API cannot feed
            (bfloat16); with ``bind_buffers``, a contract other than ``full_buffer`` or a binding that changes
            the results (:meth:`check_binding`).
    """

    def __init__(self, model_session: ModelSession, contract: DecodeContract, *, bind_buffers: bool = False):
        DecodeState.__init__(self, model_session)
        self.contract = contract
        self._pairs = contract.cache_pairs()
        self._check_graph()
        if contract.kv_dtype == "bfloat16":
            raise ContractError(f"{self.source}: kv_dtype bfloat16 cannot be fed through ONNX Runtime's Python API")
        pasts = [past for past, _ in self._pairs]
        self._buffer_shapes = dict(zip(pasts, contract.pair_input_shapes(), strict=True))
        self._written_shapes = dict(zip(pasts, contract.pair_output_shapes(), strict=True))
        self._output_names = [contract.logits, *(present for _, present in self._pairs)]
        self._buffers: dict[str, np.ndarray] = {}
        self._binding: BufferBinding | None = None
        self._owner, self._other_threads = threading.get_ident(), threading.local()
        if bind_buffers:
            if contract.cache_update != "full_buffer":
                raise ContractError(
                    f"{self.source}: bound buffers need cache_update full_buffer (past and present are one buffer); "
                    f"this graph's is {contract.cache_update}"
                )
            self._binding = BufferBinding(model_session._live(), self._pairs, contract.logits)
            self.check_binding()
        self.reset()

    def _check_graph(self) -> None:
        """Refuse a graph the contract does not describe (:meth:`DecodeContract.mismatches`, read from the header).

        Refused: a named tensor the graph lacks, a graph input the contract does not name, a wrong dtype, a rank
        or static dim that conflicts. A symbolic dim, an output without a shape or one the contract does not name
        is left to the run (the ``contract`` check reports them).

        Raises:
            ContractError: lists every refused mismatch.
        """
        header = self.model_session.model
        defaults = {t.name for t in header.graph.initializer}
        found = self.contract.mismatches(header.graph.input, header.graph.output, defaults=defaults)
        refused = [m.message for m in found if m.kind in _REFUSED]
        if refused:
            raise ContractError(f"{self.source}: the graph disagrees with its contract: {'; '.join(refused)}")

    @property
    def binds_buffers(self) -> bool:
        """Whether each call runs on bound buffers (IOBinding) rather than numpy feeds."""
        return self._binding is not None

    def _thread_binding(self) -> BufferBinding | None:
        """The calling thread's binding: the decoder's own on the thread that made it, one per other thread.

        An IOBinding holds one call's inputs, so two threads calling :meth:`call` at once (a host's prefills run
        two at a time, :mod:`onnxdeploy.runner.batching`) each need their own; ORT's ``Run`` itself may be called
        concurrently on one session.
        """
        if self._binding is None or threading.get_ident() == self._owner:
            return self._binding
        binding = getattr(self._other_threads, "binding", None)
        if binding is None:
            binding = BufferBinding(self.model_session._live(), self._pairs, self.contract.logits)
            self._other_threads.binding = binding
        return binding

    def check_binding(self) -> None:
        """Check that bound buffers give bit-identical logits and buffers to numpy feeds, then reset.

        One call at position ``min(2, max_cache_len - step_len)`` from the same random cache contents (normal,
        seeded) with numpy feeds and with bound buffers. ORT 1.32's CPU ScatterElements writes in place when its
        input and output are one buffer; a kernel that does not, or a node reading the past after the write,
        shows up here.

        Raises:
            ContractError: the two calls differ (names the first tensor that does), or the decoder does not bind.
        """
        binding = self._binding
        if binding is None:
            raise ContractError(f"{self.source}: the decoder does not bind buffers")
        c = self.contract
        rng = np.random.default_rng(0)
        start = {
            past: rng.standard_normal(self._buffer_shapes[past]).astype(c.kv_numpy_dtype) for past, _ in self._pairs
        }
        position = min(2, c.max_cache_len - c.step_len)
        outcomes = []
        for bound in (None, binding):
            self._binding = bound
            self.reset()
            self.load_cache({past: buffer.copy() for past, buffer in start.items()}, position)
            logits = [x for x, _ in self._run_step([1] * c.step_len) if x is not None]
            outcomes.append({"logits": np.stack(logits), **self._buffers})
        self._binding = binding
        self.reset()
        for name, want in outcomes[0].items():
            if not np.array_equal(want, outcomes[1][name], equal_nan=True):
                raise ContractError(
                    f"{self.source}: binding past and present to one buffer changes '{name}' (max abs diff "
                    f"{float(np.nanmax(np.abs(want - outcomes[1][name]))):.3g}) on "
                    f"{', '.join(self.model_session.providers_active)}: the graph or kernel does not update in "
                    "place exactly; decode with numpy feeds (bind_buffers=False)"
                )

    def cache_buffers(self) -> dict[str, np.ndarray]:
        """The host cache buffers by past-input name (``contract.pair_input_shapes()``, ``kv_dtype``); not copies."""
        return self._buffers

    def load_cache(self, buffers: dict[str, np.ndarray], position: int) -> None:
        """Continue another graph's decode: take its cache at ``position`` (a cache-length switch of a graph set).

        Buffers of this graph's shape are taken as they are (no copy); others (a smaller ``max_cache_len``) are
        copied: slots ``[0, position)`` on the sequence axis into zeroed buffers of this graph's shape. Slots
        from ``position`` on are never read before they are written, so they are not carried over.

        Args:
            buffers: past-input name → buffer, as :meth:`cache_buffers` of a graph with the same cache names,
                layout and dtype.
            position: tokens already in the cache; the next call starts there.

        Raises:
            CacheOverflowError: ``position`` is above this graph's ``max_cache_len``.
            ContractError: a buffer is missing or its shape differs on an axis other than the sequence axis.
        """
        self._buffers = move_slots(buffers, self.contract, position, source=self.source)
        self._position = position

    def reset(self) -> None:
        """Zero the cache buffers; the next :meth:`feed` starts at position 0."""
        self._buffers = allocate_buffers(self.contract)
        self._reset_counters()

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray | None, float]]:
        """Run the model on ``tokens``, ``step_len`` tokens per ``session.run``.

        The whole feed is checked against ``max_cache_len`` first: if any slot it would write is
        ``>= max_cache_len`` nothing runs and the decoder state is unchanged.

        Args:
            tokens: token ids for positions ``position .. position + len(tokens) - 1``; the count
                must be a multiple of ``step_len``.

        Returns:
            One ``(logits, latency_ms)`` per token: logits float32 ``(V,)`` of batch row 0 at that
            position (None where a ``prefill_logits: last`` graph computes none); latency_ms is the wall time
            of the ``session.run`` that computed it (ms).

        Raises:
            CacheOverflowError: a slot to write is ``>= max_cache_len`` (raised before ``session.run``).
            ContractError: ``len(tokens)`` is not a multiple of ``step_len``, or a present output's
                shape disagrees with ``cache_update``.
            DecodeRunError: ONNX Runtime failed, or the decoder is closed.
        """
        c = self.contract
        if len(tokens) % c.step_len:
            raise ContractError(
                f"{self.source}: step_len={c.step_len} graph is fed {c.step_len} tokens per call; "
                f"got {len(tokens)} tokens (not a multiple)"
            )
        end = self._position + len(tokens)
        if end > c.max_cache_len:
            raise CacheOverflowError(max(self._position, c.max_cache_len), c.max_cache_len)
        results: list[tuple[np.ndarray, float]] = []
        for start in range(0, len(tokens), c.step_len):
            results.extend(self._run_step(tokens[start : start + c.step_len]))
        return results

    def run_chunk(self, tokens: Sequence[int]) -> list[tuple[np.ndarray | None, float]]:
        """Run one call on 1..``step_len`` real tokens, padding a short chunk at its end (contract ``padding``).

        Args:
            tokens: token ids for positions ``position .. position + len(tokens) - 1``.

        Returns:
            One ``(logits float32 (V,) of batch row 0 or None, latency_ms)`` per real token; logits are None
            for the positions a ``prefill_logits: last`` graph does not compute (all but the last real one).

        Raises:
            ContractError: no tokens, more than ``step_len``, or fewer on a graph whose contract declares no
                padding.
            CacheOverflowError: the call's ``step_len`` slots (padding included) pass ``max_cache_len``.
            DecodeRunError: ONNX Runtime failed, or the decoder is closed.
        """
        c = self.contract
        if not 0 < len(tokens) <= c.step_len:
            raise ContractError(f"{self.source}: a call takes 1..{c.step_len} tokens, got {len(tokens)}")
        if len(tokens) < c.step_len and c.padding is None:
            raise ContractError(
                f"{self.source}: step_len={c.step_len} graph is fed {c.step_len} tokens per call and its contract "
                f"declares no padding; got {len(tokens)}"
            )
        if self._position + c.step_len > c.max_cache_len:
            raise CacheOverflowError(max(self._position, c.max_cache_len), c.max_cache_len)
        return self._run_step(tokens)

    def _run_step(self, chunk: Sequence[int]) -> list[tuple[np.ndarray | None, float]]:
        """One ``session.run`` on ``chunk`` (1..step_len tokens, trailing padding) fed to every row; buffers updated."""
        real = len(chunk)
        logits, latency_ms = self.call(self._buffers, StepInputs.uniform(self.contract, chunk, self._position))
        self._position += real
        if self.contract.prefill_logits == "last":
            return [(None, latency_ms)] * (real - 1) + [(logits[0, 0], latency_ms)]
        return [(logits[0, i], latency_ms) for i in range(real)]

    def call(self, buffers: dict[str, np.ndarray], inputs: StepInputs) -> tuple[np.ndarray, float]:
        """One ``session.run`` of this graph on ``buffers`` (:class:`~onnxdeploy.runner.host.GraphStep`).

        The decoder's own position is not moved (a host that owns ``buffers`` keeps its own); the call is timed
        and recorded (:attr:`call_records`, ``start`` = row 0's first position; on a thread other than the one that
        opened the decoder, the decoder's position). Several threads may call at once on buffers of their own
        (each its own IOBinding: :meth:`_thread_binding`).

        Args:
            buffers: past-input name → buffer of this graph's shapes; ``full_buffer`` presents replace the entries
                (bound buffers: written in place), ``new_token_only`` ones are written at each row's slots.
            inputs: ``batch`` rows of ``step_len`` tokens (:class:`~onnxdeploy.runner.host.StepInputs`).

        Returns:
            ``(logits float32 (B, P, V), latency_ms)``, P = ``contract.logits_positions()``.

        Raises:
            ContractError: a present output's shape disagrees with ``cache_update``, or rows at different slots
                for a graph without ``row_positions``.
            DecodeRunError: ONNX Runtime failed, or the decoder is closed.
        """
        c = self.contract
        feeds: dict[str, np.ndarray] = {**step_feeds(c, inputs), **buffers}
        tokens = int(inputs.real.max())
        binding = self._thread_binding()
        owner = threading.get_ident() == self._owner  # another thread leaves the position (its record's start) be
        saved = self._position
        if owner:
            self._position = int(inputs.positions[0, 0])
        try:
            if binding is None:
                results, latency_ms = self._timed_run(self._output_names, feeds, tokens=tokens)
            else:
                results, latency_ms = binding.run(
                    feeds, buffers, lambda b: self._timed_run((), feeds, tokens=tokens, binding=b)[1]
                )
        finally:
            if owner:
                self._position = saved
        store_presents(c, buffers, results[1:], inputs, written_shapes=self._written_shapes, source=str(self.source))
        return np.asarray(results[0], dtype=np.float32), latency_ms
