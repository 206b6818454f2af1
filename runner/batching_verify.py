"""Verify a row-positions set under continuous batching against each request's batch-1 decode of the original.

A trace (:class:`~onnxdeploy.batching_trace.TraceSpec`; a file read by :func:`read_trace`, or ``verify.batching``'s
inline keys, both turned into requests by :func:`trace_requests`) is listed request by request or drawn by
:func:`~onnxdeploy.runner.batching.poisson_trace`::

    # listed: prompt token ids, or a prompt length (ids drawn from ``seed``, 1..vocab-1)
    vocab: 512
    seed: 0
    requests:
      - {prompt_len: 5, max_new_tokens: 12, arrival: 0}
      - {prompt: [1, 17, 42], max_new_tokens: 6, arrival: 3, stop_token: 2}

    # or drawn
    poisson: {count: 16, prompt_lens: [4, 48], new_tokens: [8, 64], mean_gap: 2, seed: 0, vocab: 32000}

``vocab`` may be left out when the caller knows the model's (the pipeline passes its logits' vocabulary).

:func:`verify_batching` serves the trace with :class:`~onnxdeploy.runner.batching.BatchingHost` on the candidate
and decodes each request alone and greedily on the original (:func:`~onnxdeploy.runner.verify.greedy_decode`):
the tokens must be equal and the logits each token was chosen from within ``max_abs_logit_diff`` (top-1 100%).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import ValidationError

from onnxdeploy.batching_trace import TraceSpec
from onnxdeploy.config_errors import format_validation_error
from onnxdeploy.errors import ConfigError
from onnxdeploy.runner.batching import BatchingHost, Policy, Request, poisson_trace
from onnxdeploy.runner.graph_set import open_graph_set

__all__ = ["BatchVerification", "RequestCheck", "read_trace", "trace_requests", "verify_batching"]


def trace_requests(spec: TraceSpec, *, vocab: int | None = None, where: str = "trace") -> list[Request]:
    """The requests of a validated trace (module docstring), ids ``0..n-1`` in the order given.

    Args:
        spec: the trace (``requests`` or ``poisson``).
        vocab: the vocabulary prompt ids are drawn from when the trace gives none (the model's).
        where: what to name in an error (the file, or ``key 'verify.batching'``).

    Raises:
        ConfigError: neither ``requests`` nor ``poisson``; ids to draw and no vocabulary known; a prompt id or a
            stop token outside the vocabulary (names the request's index).
    """
    if spec.poisson is not None:
        p = spec.poisson
        size = p.vocab if p.vocab is not None else vocab
        if size is None:
            raise ConfigError(f"{where}: poisson.vocab is needed to draw prompt ids (the model's is not known)")
        return poisson_trace(p.count, p.prompt_lens, p.new_tokens, p.mean_gap, seed=p.seed, vocab=size)
    if spec.requests is None:
        raise ConfigError(f"{where}: a trace lists requests or draws them (poisson)")
    size = spec.vocab if spec.vocab is not None else vocab
    limit = vocab if vocab is not None else size  # ids the model takes: its own vocabulary when known
    rng = np.random.default_rng(spec.seed)
    requests = []
    for i, r in enumerate(spec.requests):
        if r.prompt is not None:
            prompt = tuple(r.prompt)
        elif size is None:
            raise ConfigError(f"{where}: requests[{i}].prompt_len: vocab is needed to draw its ids")
        else:
            prompt = tuple(rng.integers(1, size, size=r.prompt_len).tolist())
        worst = max((*prompt, r.stop_token or 0))
        if limit is not None and worst >= limit:
            key = "stop_token" if worst == r.stop_token and worst not in prompt else "prompt"
            raise ConfigError(
                f"{where}: requests[{i}].{key}: token id {worst} is outside the vocabulary 0..{limit - 1}"
            )
        requests.append(Request(i, prompt, r.max_new_tokens, stop_token=r.stop_token, arrival=r.arrival))
    return requests


def read_trace(path: str | Path, *, vocab: int | None = None) -> list[Request]:
    """The requests of a trace file (module docstring; the schema :class:`~onnxdeploy.batching_trace.TraceSpec`).

    Args:
        path: the YAML file.
        vocab: the vocabulary to draw prompt ids from when the file gives none.

    Raises:
        ConfigError: the file cannot be read or parsed, or a request lacks a key or has a bad value (names the
            file and the key, e.g. ``requests[0]``).
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the trace: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a trace is a mapping with 'requests' or 'poisson'")
    try:
        spec = TraceSpec.model_validate(data)
    except ValidationError as exc:
        said = format_validation_error(exc, data=data, model=TraceSpec)
        raise ConfigError(f"{path}: bad trace entry: {said}") from None
    return trace_requests(spec, vocab=vocab, where=str(path))


@dataclass(frozen=True)
class RequestCheck:
    """One request served by the host, against its own batch-1 greedy decode of the original.

    Attributes:
        id: the request's id; prompt_len: its prompt tokens; new_tokens: the tokens the host generated.
        equal_tokens: how many of them, from the first, equal the original's greedy tokens.
        max_abs_logit_diff: largest |candidate - original| over the generated positions' float32 logits.
        top1: the fraction of generated positions whose argmax agrees.
        row: the decode row it ran in; admitted / finished: host decode steps (README, "Continuous batching").
    """

    id: int
    prompt_len: int
    new_tokens: int
    equal_tokens: int
    max_abs_logit_diff: float
    top1: float
    row: int
    admitted: int
    finished: int

    def passed(self, tolerance: float) -> bool:
        """Every token equal, the logits within ``tolerance`` and top-1 100%."""
        return self.equal_tokens == self.new_tokens and self.max_abs_logit_diff <= tolerance and self.top1 == 1.0


@dataclass(frozen=True)
class BatchVerification:
    """Every request's :class:`RequestCheck`, the tolerance, the set's batch and the decode calls the host made."""

    requests: list[RequestCheck]
    max_abs_logit_diff: float
    batch: int = 1
    steps: int = 0
    prefill: str = "graphs"

    @property
    def passed(self) -> bool:
        """Every request's tokens equal, its logits within the tolerance and top-1 100%."""
        return all(r.passed(self.max_abs_logit_diff) for r in self.requests)


def verify_batching(
    original: str | Path,
    candidate: str | Path,
    requests: Sequence[Request],
    *,
    max_abs_logit_diff: float = 1e-4,
    policy: Policy = "continuous",
    idle_rows: Collection[int] = (),
) -> BatchVerification:
    """Serve ``requests`` on ``candidate``'s set and compare each with its batch-1 greedy decode of ``original``.

    Raises:
        ConfigError: a request the set cannot serve.
        ContractError: the candidate is not a row-positions set (its prompts go through batch-1 prefill graphs if it
            has them, else through the decode graph's rows: :class:`BatchingHost`).
    """
    from onnxdeploy.runner.verify import greedy_decode  # noqa: PLC0415  (verify imports the decoders)

    with open_graph_set(candidate) as decoder:
        host = BatchingHost(decoder, keep_logits=True, idle_rows=idle_rows)
        run = host.run(requests, policy=policy)
    checks = []
    for f in run.finished:
        tokens, logits = greedy_decode(original, list(f.request.prompt), f.request.max_new_tokens)
        p, n = len(f.request.prompt), len(f.tokens)
        want = logits[p - 1 : p - 1 + n]
        got = np.stack(f.logits)
        same = np.asarray(f.tokens) == tokens[:n]
        equal = int(n if same.all() else np.argmin(same))
        top1 = float((got.argmax(axis=1) == want.argmax(axis=1)).mean())
        diff = float(np.abs(got - want).max())
        checks.append(RequestCheck(f.request.id, p, n, equal, diff, top1, f.row, f.admitted, f.finished))
    return BatchVerification(checks, max_abs_logit_diff, batch=host.batch, steps=run.steps, prefill=host.prefill_mode)
