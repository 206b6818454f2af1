"""Verify a row-positions set under continuous batching against each request's batch-1 decode of the original.

A trace is read from a YAML file (:func:`read_trace`), either listed request by request or drawn by
:func:`~onnxdeploy.runner.batching.poisson_trace`::

    # listed: prompt token ids, or a prompt length (ids drawn from ``seed``, 1..vocab-1)
    vocab: 512
    seed: 0
    requests:
      - {prompt_len: 5, max_new_tokens: 12, arrival: 0}
      - {prompt: [1, 17, 42], max_new_tokens: 6, arrival: 3, stop_token: 2}

    # or drawn
    poisson: {count: 16, prompt_lens: [4, 48], new_tokens: [8, 64], mean_gap: 2, seed: 0, vocab: 32000}

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

from onnxdeploy.errors import ConfigError
from onnxdeploy.runner.batching import BatchingHost, Policy, Request, poisson_trace
from onnxdeploy.runner.graph_set import open_graph_set

__all__ = ["BatchVerification", "read_trace", "verify_batching"]


def read_trace(path: str | Path) -> list[Request]:
    """The requests of a trace file (module docstring).

    Raises:
        ConfigError: the file cannot be read or parsed, or a request lacks a key or has a bad value (names the
            file and the request's index).
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the trace: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a trace is a mapping with 'requests' or 'poisson'")
    try:
        if "poisson" in data:
            p = data["poisson"]
            return poisson_trace(
                int(p["count"]), tuple(p["prompt_lens"]), tuple(p["new_tokens"]), float(p["mean_gap"]),
                seed=int(p["seed"]), vocab=int(p["vocab"]),
            )  # fmt: skip
        rng = np.random.default_rng(int(data.get("seed", 0)))
        requests = []
        for i, r in enumerate(data["requests"]):
            prompt = r.get("prompt")
            if prompt is None:
                prompt = rng.integers(1, int(data["vocab"]), size=int(r["prompt_len"])).tolist()
            requests.append(
                Request(
                    id=i,
                    prompt=tuple(int(t) for t in prompt),
                    max_new_tokens=int(r["max_new_tokens"]),
                    arrival=int(r.get("arrival", 0)),
                    stop_token=r.get("stop_token"),
                )  # fmt: skip
            )
        return requests
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: bad trace entry: {exc!r}") from exc


@dataclass(frozen=True)
class BatchVerification:
    """Per request: ``(id, tokens equal, max abs logit diff, top-1 agreement)``; and whether all passed."""

    requests: list[tuple[int, bool, float, float]]
    max_abs_logit_diff: float

    @property
    def passed(self) -> bool:
        """Every request's tokens equal, its logits within the tolerance and top-1 100%."""
        return all(ok and diff <= self.max_abs_logit_diff and top1 == 1.0 for _, ok, diff, top1 in self.requests)


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
        ContractError: the candidate is not a row-positions set with batch-1 prefill graphs.
    """
    from onnxdeploy.runner.verify import greedy_decode  # noqa: PLC0415  (verify imports the decoders)

    with open_graph_set(candidate) as decoder:
        run = BatchingHost(decoder, keep_logits=True, idle_rows=idle_rows).run(requests, policy=policy)
    rows = []
    for f in run.finished:
        tokens, logits = greedy_decode(original, list(f.request.prompt), f.request.max_new_tokens)
        p, n = len(f.request.prompt), len(f.tokens)
        want = logits[p - 1 : p - 1 + n]
        got = np.stack(f.logits)
        top1 = float((got.argmax(axis=1) == want.argmax(axis=1)).mean())
        rows.append((f.request.id, f.tokens == tokens[:n].tolist(), float(np.abs(got - want).max()), top1))
    return BatchVerification(rows, max_abs_logit_diff)
