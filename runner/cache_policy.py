"""Decoding past ``max_cache_len`` with ``cache_policy: {sinks: N, recent: R}``, and its exact reference.

A host (:class:`SinkRecentHost`, on the host API of :mod:`onnxdeploy.runner.host`) feeds one token per call to a
step-1 graph whose contract has ``cache_policy`` and ``mask: slot_positions`` (``static_kv {cache_policy}`` then
``mask_rewrite``). With ``M = max_cache_len``, position ``p`` is written at slot ``p`` while ``p < M`` and at slot
``N + (p - N) mod (M - N)`` after (a ring over every slot but the sinks'); the host records the position each
slot holds and feeds it as ``slot_positions``, :data:`~onnxdeploy.contract.EMPTY_SLOT` for a slot that holds
none or a position the policy dropped. So the query at ``p`` sees every earlier position while ``p < M`` and,
from ``p = M`` on, the sinks ``0 .. N-1`` and the recent positions ``p - R + 1 .. p`` (:func:`visible`). The slot
a new position takes last held ``p - (M - N)``, which ``N + R <= M`` puts outside the recent window: nothing
visible is overwritten. K is cached after RoPE, so kept keys keep their true positions and queries take their
true ``position_ids``.

The exact reference is the *original export fed the same kept tokens* (:class:`CutPastReference`): the
exporter-convention graph run one token per call with its past cut, before each call, to the positions the next
query sees, its ``position_ids`` the true positions and its ``attention_mask`` ones over the kept past. Both then
compute the same attention over the same keys, so the logits agree to float rounding
(:func:`compare_with_cut_past`). What the policy costs against the full context is a separate figure
(:func:`policy_quality`: KL(full ‖ policy) and top-1 agreement on held-out tokens, the original fed the whole
text in one call). An export without ``position_ids`` cannot be fed true positions with a cut past:
:class:`CutPastReference` refuses it naming the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxdeploy.contract import EMPTY_SLOT, CachePolicy, DecodeContract, read_contract
from onnxdeploy.errors import ConfigError, ContractError
from onnxdeploy.report_verify import AccuracyReport, PolicyQualityFigures
from onnxdeploy.runner.accuracy import evaluate_accuracy
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.decoder import open_decoder
from onnxdeploy.runner.exporter_decoder import ExporterDecoder
from onnxdeploy.runner.graph_set import GraphSetDecoder
from onnxdeploy.runner.host import StepInputs, allocate_buffers
from onnxdeploy.runner.session import DEFAULT_PROVIDERS, open_session, read_header

__all__ = [
    "CutPastReference",
    "PolicyDecoder",
    "PolicyComparison",
    "PolicyQuality",
    "SinkRecentHost",
    "compare_with_cut_past",
    "evaluate_policy_accuracy",
    "policy_quality",
    "visible",
]


def visible(position: int, query: int, policy: CachePolicy, max_cache_len: int) -> bool:
    """Whether the query at ``query`` sees the key at ``position`` (≤ ``query``) under ``policy`` (module docstring)."""
    if query < max_cache_len:
        return True
    return position < policy.sinks or position > query - policy.recent


def _ring_slot(position: int, policy: CachePolicy, max_cache_len: int) -> int:
    if position < max_cache_len:
        return position
    ring = max_cache_len - policy.sinks
    return policy.sinks + (position - policy.sinks) % ring


class SinkRecentHost:
    """One sequence decoded past ``max_cache_len`` on a ``cache_policy`` graph, one token per call.

    Args:
        step: the step-1 graph (a :class:`ContractDecoder`, or its :meth:`GraphSetDecoder.member`), whose contract
            has ``cache_policy`` and ``mask: slot_positions``.

    Raises:
        ContractError: no ``cache_policy``, a step length above 1, or a graph that masks from slot indices (run
            ``mask_rewrite`` after ``static_kv {cache_policy}``).
    """

    def __init__(self, step: ContractDecoder):
        c = step.contract
        if c.cache_policy is None or c.step_len != 1 or c.mask != "slot_positions" or c.batch != 1:
            raise ContractError(
                f"{step.source}: a sinks + recent host needs a batch-1 step-1 graph with cache_policy and mask "
                f"slot_positions (static_kv {{cache_policy}} then mask_rewrite); this one has cache_policy "
                f"{c.cache_policy}, step_len {c.step_len}, mask {c.mask}"
            )
        self.step = step
        self.contract: DecodeContract = c
        self.policy: CachePolicy = c.cache_policy
        self.reset()

    def reset(self) -> None:
        """Zeroed buffers, every slot empty; the next token is position 0."""
        self._buffers = allocate_buffers(self.contract)
        self._held = np.full(self.contract.max_cache_len, -1, dtype=np.int64)
        self.position = 0

    def slot_positions(self, query: int) -> np.ndarray:
        """int64 ``(max_cache_len,)``: what the query at ``query`` may see per slot, EMPTY_SLOT elsewhere."""
        M = self.contract.max_cache_len
        shown = [
            int(p) if p >= 0 and visible(int(p), query, self.policy, M) else EMPTY_SLOT for p in self._held.tolist()
        ]
        return np.asarray(shown, dtype=np.int64)

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray, float]]:
        """Feed ``tokens`` one per call at the next positions, however far past ``max_cache_len``.

        Returns:
            One ``(logits float32 (V,), latency_ms)`` per token.

        Raises:
            DecodeRunError: ONNX Runtime failed.
        """
        out = []
        M = self.contract.max_cache_len
        for token in tokens:
            p = self.position
            slot = _ring_slot(p, self.policy, M)
            self._held[slot] = p
            inputs = StepInputs(
                tokens=np.array([[token]], dtype=np.int64),
                positions=np.array([[p]], dtype=np.int64),
                slots=np.array([[slot]], dtype=np.int64),
                real=np.array([1], dtype=np.int64),
                slot_positions=self.slot_positions(p),
            )
            logits, ms = self.step.call(self._buffers, inputs)
            out.append((logits[0, -1], ms))
            self.position += 1
        return out


class CutPastReference(ExporterDecoder):
    """The original export fed one token per call with its past cut to what the next query sees (module docstring).

    Args:
        model_session: the exporter-convention original; closed by :meth:`close`.
        policy: the candidate's ``cache_policy``.
        max_cache_len: the candidate's ``max_cache_len``.

    Raises:
        ConfigError: the export has no ``position_ids`` input (kept tokens cannot be fed their true positions).
        ContractError: as :class:`ExporterDecoder`.
    """

    def __init__(self, model_session, policy: CachePolicy, max_cache_len: int):
        super().__init__(model_session)
        if not self._has_position_ids:
            raise ConfigError(
                f"{self.source}: the export has no 'position_ids' input, so the cut past cannot be fed its true "
                "positions: a sinks + recent cache_policy cannot be checked against it"
            )
        self.policy, self.max_cache_len = policy, max_cache_len
        self._kept: list[int] = []

    def reset(self) -> None:
        """Empty past; the next token is position 0."""
        super().reset()
        self._kept = []

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray, float]]:
        """Feed ``tokens`` one per call, the past cut before each to the positions that query sees.

        Returns:
            One ``(logits float32 (V,), latency_ms)`` per token.
        """
        out = []
        for token in tokens:
            p = self._position
            keep = [i for i, q in enumerate(self._kept) if visible(q, p, self.policy, self.max_cache_len)]
            if len(keep) < len(self._kept):
                index = np.asarray(keep, dtype=np.int64)
                self._past = {name: np.take(past, index, axis=2) for name, past in self._past.items()}
                self._kept = [self._kept[i] for i in keep]
            feeds = {
                "input_ids": np.full((self._batch, 1), token, dtype=np.int64),
                "position_ids": np.full((self._batch, 1), p, dtype=np.int64),
                **self._past,
            }
            if self._mask_dtype is not None:
                feeds["attention_mask"] = np.ones((self._batch, len(self._kept) + 1), dtype=self._mask_dtype)
            results, ms = self._timed_run(self._output_names, feeds)
            self._past = {past: present for (past, _), present in zip(self._pairs, results[1:], strict=True)}
            self._kept.append(p)
            self._position = p + 1
            out.append((np.asarray(results[0][0, -1], dtype=np.float32), ms))
        return out


@dataclass(frozen=True)
class PolicyComparison:
    """The candidate's sinks + recent decode against the cut-past original, teacher-forced on the same tokens.

    Attributes:
        positions: positions compared (all of them: ``len(tokens)``).
        past_cache_positions: how many of them lie at or past ``max_cache_len`` (where the policy acts).
        max_abs_logit_diff: the largest |candidate − reference| logit over every position.
        top1_agreement: the fraction of positions whose argmax agrees.
    """

    positions: int
    past_cache_positions: int
    max_abs_logit_diff: float
    top1_agreement: float


@dataclass(frozen=True)
class PolicyQuality:
    """What the policy costs against the full context (held-out text, teacher-forced).

    Attributes:
        positions: positions compared.
        evicting_positions: positions at or past ``max_cache_len`` (the others see the full context anyway).
        mean_kl: mean KL(full context ‖ policy) over the evicting positions, nats.
        top1_agreement: argmax agreement over the evicting positions.
    """

    positions: int
    evicting_positions: int
    mean_kl: float
    top1_agreement: float


def _policy_host(candidate: str | Path) -> tuple[SinkRecentHost, object]:
    """The candidate's host and the decoder to close: a graph set's step-1 largest-cache member, or the graph."""
    decoder = open_decoder(candidate)
    if isinstance(decoder, GraphSetDecoder):
        largest = max(c for _, s, c in decoder.graphs() if s == 1)
        return SinkRecentHost(decoder.member(1, largest)), decoder
    if not isinstance(decoder, ContractDecoder):
        decoder.close()
        raise ContractError(f"{candidate}: not a static graph with a decode contract")
    return SinkRecentHost(decoder), decoder


def compare_with_cut_past(
    original: str | Path, candidate: str | Path, tokens: Sequence[int], *, providers: Sequence[str] = DEFAULT_PROVIDERS
) -> PolicyComparison:
    """Teacher-force ``tokens`` through the candidate's sinks + recent host and the cut-past original.

    Args:
        original: the exporter-convention export.
        candidate: the static graph (or set) with ``cache_policy``.
        tokens: token ids, as many as wanted (past ``max_cache_len``: that is the point).
        providers: ORT execution providers for both.

    Returns:
        The figures (:class:`PolicyComparison`).

    Raises:
        ConfigError: the export has no ``position_ids`` input.
        ContractError: the candidate is not a ``cache_policy`` step-1 graph (or set).
    """
    host, decoder = _policy_host(candidate)
    try:
        got = np.stack([x for x, _ in host.feed(tokens)])
    finally:
        decoder.close()  # type: ignore[attr-defined]
    M = host.contract.max_cache_len
    with CutPastReference(open_session(original, providers=providers), host.policy, M) as reference:
        want = np.stack([x for x, _ in reference.feed(tokens)])
    return PolicyComparison(
        positions=len(tokens),
        past_cache_positions=max(0, len(tokens) - M),
        max_abs_logit_diff=float(np.abs(got - want).max()),
        top1_agreement=float((got.argmax(-1) == want.argmax(-1)).mean()),
    )


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def policy_quality(
    original: str | Path, candidate: str | Path, tokens: Sequence[int], *, providers: Sequence[str] = DEFAULT_PROVIDERS
) -> PolicyQuality:
    """KL(full ‖ policy) and top-1 agreement of the candidate's policy decode against the full-context original.

    Args:
        original: the exporter-convention export (fed every token in one call: the full context).
        candidate: the static graph (or set) with ``cache_policy``.
        tokens: held-out token ids (longer than ``max_cache_len``, or nothing is evicted).
        providers: ORT execution providers for both.

    Returns:
        The figures over the positions where the policy evicts (:class:`PolicyQuality`).

    Raises:
        ConfigError: ``tokens`` do not pass ``max_cache_len`` (no evicting position to measure).
    """
    host, decoder = _policy_host(candidate)
    try:
        got = np.stack([x for x, _ in host.feed(tokens)])
    finally:
        decoder.close()  # type: ignore[attr-defined]
    M = host.contract.max_cache_len
    if len(tokens) <= M:
        raise ConfigError(f"policy quality: {len(tokens)} held-out tokens never pass max_cache_len {M}")
    with ExporterDecoder(open_session(original, providers=providers)) as full:
        want = np.stack([x for x, _ in full.feed(list(tokens))])
    p, q = _log_softmax(want[M:]), _log_softmax(got[M:])
    kl = (np.exp(p) * (p - q)).sum(-1)
    return PolicyQuality(
        positions=len(tokens),
        evicting_positions=len(tokens) - M,
        mean_kl=float(kl.mean()),
        top1_agreement=float((want[M:].argmax(-1) == got[M:].argmax(-1)).mean()),
    )


def evaluate_policy_accuracy(
    original: str | Path,
    candidate: str | Path,
    tokens: Sequence[int],
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    max_mean_kl: float | None = None,
    min_top1_agreement: float | None = None,
    max_ppl_ratio: float | None = None,
) -> AccuracyReport | None:
    """``verify.accuracy`` of a ``cache_policy`` candidate: the usual figures, and what the policy costs.

    With ``M`` the candidate's largest ``max_cache_len``: the first ``M`` held-out tokens give the figures and
    thresholds of :func:`~onnxdeploy.runner.accuracy.evaluate_accuracy` (nothing is evicted there, so they measure
    the transformation alone); every token gives :func:`policy_quality` (KL(full ‖ policy) and top-1 over the
    positions at or past ``M``), reported as ``policy_quality`` (not a threshold: the trade is the user's choice).

    Args:
        original: the exporter-convention export.
        candidate: the static graph (or set).
        tokens: held-out token ids (more than ``M`` for a policy figure; at least two).
        providers: ORT execution providers for both.
        max_mean_kl: as :func:`~onnxdeploy.runner.accuracy.evaluate_accuracy`.
        min_top1_agreement: as :func:`~onnxdeploy.runner.accuracy.evaluate_accuracy`.
        max_ppl_ratio: as :func:`~onnxdeploy.runner.accuracy.evaluate_accuracy`.

    Returns:
        The report with ``policy_quality`` set (its figures None when ``tokens`` never pass ``M``), or None when
        the candidate's contract has no ``cache_policy`` (the caller measures it as any candidate).

    Raises:
        ConfigError, ModelLoadError, ContractError, DecodeRunError: as :func:`evaluate_accuracy` and
            :func:`policy_quality`.
    """
    contract = read_contract(read_header(candidate), source=str(candidate))
    if contract is None or contract.cache_policy is None:
        return None
    M = max([contract.max_cache_len, *(e.max_cache_len for e in contract.graph_set)])
    tokens = [int(t) for t in tokens]
    report = evaluate_accuracy(
        original,
        candidate,
        tokens[:M],
        providers=providers,
        max_mean_kl=max_mean_kl,
        min_top1_agreement=min_top1_agreement,
        max_ppl_ratio=max_ppl_ratio,
    )
    policy = contract.cache_policy
    figures = PolicyQualityFigures(
        sinks=policy.sinks, recent=policy.recent, max_cache_len=M, tokens=len(tokens), evicting_positions=0
    )
    if len(tokens) > M:
        quality = policy_quality(original, candidate, tokens, providers=providers)
        figures = figures.model_copy(
            update={
                "evicting_positions": quality.evicting_positions,
                "mean_kl": quality.mean_kl,
                "top1_agreement": quality.top1_agreement,
            }
        )
    return report.model_copy(update={"policy_quality": figures})


class PolicyDecoder:
    """A :class:`SinkRecentHost` behind the runner's decoder interface, for ``verify`` past ``max_cache_len``.

    Args:
        decoder: the opened candidate (a step-1 graph, or a set whose largest step-1 graph the host drives);
            closed by :meth:`close`.

    Raises:
        ContractError: as :class:`SinkRecentHost`.
    """

    def __init__(self, decoder: ContractDecoder | GraphSetDecoder):
        if isinstance(decoder, GraphSetDecoder):
            largest = max(c for _, s, c in decoder.graphs() if s == 1)
            step = decoder.member(1, largest)
        else:
            step = decoder
        self._decoder = decoder
        self.host = SinkRecentHost(step)
        self.source = step.source
        self._records_from = 0

    @property
    def position(self) -> int:
        """The next token's position."""
        return self.host.position

    @property
    def model_session(self):  # noqa: ANN201 (ModelSession; the graph's)
        """The step graph's session."""
        return self.host.step.model_session

    @property
    def call_records(self) -> list:
        """Every call since the last reset (the step graph's records)."""
        return self.host.step.call_records[self._records_from :]

    @property
    def call_latencies_ms(self) -> list[float]:
        """Wall time of every call since the last reset, in ms."""
        return [c.ms for c in self.call_records]

    @property
    def fallbacks(self) -> list[str]:
        """Requested execution providers that are not active."""
        return list(self.model_session.fallbacks)

    def reset(self) -> None:
        """Empty cache; the next token is position 0."""
        self.host.reset()
        self._records_from = len(self.host.step.call_records)

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray, float]]:
        """Feed ``tokens`` one per call (:meth:`SinkRecentHost.feed`)."""
        return self.host.feed(tokens)

    def close(self) -> None:
        """Close the candidate."""
        self._decoder.close()

    def __enter__(self) -> PolicyDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
