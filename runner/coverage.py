"""Verification drives every graph of a set, or says which one it could not drive (``verify`` → ``graphs_driven``).

The modes feed the prompt and the steps as a host would (:meth:`GraphSetDecoder.plan`), so they use only the
graphs that the prompt's length and the decode's length call for: a short prompt uses no long bucket, a short
decode no large cache. Each graph the modes did not use is then driven apart, teacher-forced on the tokens the
original decoded: the positions before its chunk go through the plan, then one call of that graph runs (its
``step_len`` tokens, placed as late as its cache and the tokens allow, so a large-cache graph continues from a
smaller one's buffers; fewer tokens, padded, when there are fewer than its ``step_len``), and its logits are
compared with the original's at the same positions. A graph that cannot be driven on these tokens (a bucket
longer than them whose contract declares no padding) fails the verification, as does one whose logits differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnxdeploy.runner.decoder import Decoder
from onnxdeploy.runner.graph_set import GraphSetDecoder

__all__ = ["GraphCoverage", "drive_every_graph"]


@dataclass
class GraphCoverage:
    """Which graphs verification drove.

    Attributes:
        calls: compared calls per graph file (the modes' and the one apart), every graph of a set listed (0: not
            driven).
        apart: the graphs the modes did not use, driven apart.
        failures: one line per graph not driven, or driven apart with logits outside the tolerance.
        rows: ``(position, graph file, reference (V,), candidate (V,))`` of every position compared apart, for a
            caller that judges them with other bounds too (:func:`onnxdeploy.runner.thresholds.judge_positions`).
    """

    calls: dict[str, int]
    apart: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    rows: list[tuple[int, str, np.ndarray, np.ndarray]] = field(default_factory=list)


def drive_every_graph(
    decoder: Decoder,
    tokens: Sequence[int],
    reference: Sequence[np.ndarray | None],
    driven: Mapping[str, int],
    max_abs_logit_diff: float,
) -> GraphCoverage:
    """Drive each graph of a set that the modes did not use, and compare its logits with the original's.

    Args:
        decoder: the candidate's decoder (a lone graph has nothing more to drive).
        tokens: the tokens fed at each position (the original's greedy decode), ``len(prompt) + steps``.
        reference: the original's logits float32 ``(V,)`` at each position (None where it computed none).
        driven: calls per graph file the modes made.
        max_abs_logit_diff: the largest max-abs logit difference allowed at a position.

    Returns:
        The coverage; its ``failures`` say which graph was not driven or did not match.

    Raises:
        DecodeRunError: ONNX Runtime failed.
    """
    if not isinstance(decoder, GraphSetDecoder):
        return GraphCoverage(dict(driven))
    coverage = GraphCoverage({name: driven.get(name, 0) for name, _, _ in decoder.graphs()})
    for name, step, cache in decoder.graphs():
        if driven.get(name):
            continue
        label = f"graph {name} (step_len {step}, max_cache_len {cache})"
        real = min(step, len(tokens))
        start = max(0, min(cache - step, len(tokens) - real))
        if not decoder.can_take(step, real) or start + step > cache:
            coverage.failures.append(
                f"{label} was not driven: the prompt and steps give {len(tokens)} positions, fewer than its "
                "step_len, and its contract declares no padding; use a longer prompt or more steps"
            )
            continue
        coverage.calls[name] = 1
        coverage.apart.append(name)
        failure, rows = _drive_apart(decoder, (step, cache), tokens, (start, real), reference, max_abs_logit_diff)
        coverage.rows += [(position, name, want, got) for position, want, got in rows]
        if failure is not None:
            coverage.failures.append(f"{label}: {failure}")
    return coverage


def _drive_apart(
    decoder: GraphSetDecoder,
    graph: tuple[int, int],
    tokens: Sequence[int],
    span: tuple[int, int],
    reference: Sequence[np.ndarray | None],
    max_abs_logit_diff: float,
) -> tuple[str | None, list[tuple[int, np.ndarray, np.ndarray]]]:
    """Feed ``tokens`` up to ``span``'s start through the plan, then its tokens in one call of ``graph``.

    Args:
        decoder: the set.
        graph: ``(step_len, max_cache_len)`` of the graph to drive.
        tokens: the tokens at every position.
        span: ``(start, real tokens)`` of the call.
        reference: the original's logits at every position.
        max_abs_logit_diff: the tolerance.

    Returns:
        Why the call's logits do not match the original's (None when they do), and the compared
        ``(position, reference, candidate)`` rows.
    """
    start, real = span
    decoder.reset()
    decoder.feed(tokens[:start])
    outputs = decoder.feed_through(tokens[start : start + real], *graph)
    rows = [
        (start + i, want, logits)
        for i, ((logits, _), want) in enumerate(zip(outputs, reference[start : start + real], strict=True))
        if logits is not None and want is not None
    ]
    diffs = [float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) for _, want, got in rows]
    where = f"positions {start}..{start + real - 1} (driven apart from the modes)"
    if not diffs:
        return f"no position of {where} has logits from both models to compare", rows
    if max(diffs) > max_abs_logit_diff:
        return f"max abs logit diff {max(diffs):.3g} at {where} exceeds {max_abs_logit_diff:g}", rows
    return None, rows
