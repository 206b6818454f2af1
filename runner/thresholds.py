"""Logit thresholds for reduced-precision candidates: absolute, relative, cosine and top-1, per runtime and per graph.

A float32 tolerance (``max_abs_logit_diff: 1e-4``) cannot judge an fp16 device fairly: RKNN-Toolkit2's simulator
(an fp16 build for rk3588) differs from the original on ONNX Runtime by 0.042 in max-abs logit and an fp16 KV cache
by 0.014, both with 100% top-1 (issue 19). So besides ``max_abs_logit_diff`` a comparison may bound

- ``max_rel_logit_diff``: per position, ``max_v |a_v - b_v| / max(max_v |a_v|, REL_FLOOR)`` (the error relative
  to the largest reference logit of that position; dimensionless). Element-wise relative error (``max_rel_logit_diff``
  of :class:`~onnxdeploy.report.StepRecord`) explodes on logits near zero, so it is not what is bounded here;
- ``min_cosine_similarity``: the **mean** over positions of the cosine similarity of the logit rows (float64);
- ``min_top1_agreement``: the fraction of positions whose argmax agrees.

Every bound is optional (None: not checked). Defaults by the precision the candidate runs in
(:func:`default_thresholds`): ``fp32`` keeps the ``verify`` section's bounds; ``fp16`` (an unquantized RKNN
build, OpenVINO with an f16 hint) is judged by mean cosine ≥ 0.9999 and top-1 ≥ 99% (issue 19's defaults; no
absolute bound); ``int8`` device builds (RKNN ``w8a8``) get no logit bound: they are judged by the held-out
accuracy figures (mean KL, top-1, perplexity ratio; ``sdk.quantization``'s thresholds).

The figures are computed over every compared position and over the positions each graph of a set computed
(``by_graph``): a set passes only when every graph does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

import numpy as np

from onnxdeploy.errors import ConfigError

__all__ = [
    "FP16_DEFAULTS",
    "INT8_DEFAULTS",
    "Judgement",
    "REL_FLOOR",
    "LogitFigures",
    "LogitThresholds",
    "Precision",
    "default_thresholds",
    "judge_positions",
    "mode_bounds_failures",
    "runtime_thresholds",
    "logit_figures",
    "relative_logit_diff",
]

Precision = Literal["fp32", "fp16", "int8"]

REL_FLOOR = 1e-6
"""Floor of the largest reference logit in :func:`relative_logit_diff` (an all-zero row)."""


@dataclass(frozen=True)
class LogitThresholds:
    """The bounds one comparison is held to (None: not checked); see the module docstring for each figure.

    Attributes:
        max_abs_logit_diff: largest max-abs logit difference at any position (logit units).
        max_rel_logit_diff: largest :func:`relative_logit_diff` at any position (dimensionless).
        min_cosine_similarity: smallest mean cosine similarity over the positions (-1..1).
        min_top1_agreement: smallest fraction of positions whose top-1 agrees (0..1).
        basis: where the bounds come from (``fp32`` / ``fp16`` / ``int8`` defaults, or ``configured``).
    """

    max_abs_logit_diff: float | None = None
    max_rel_logit_diff: float | None = None
    min_cosine_similarity: float | None = None
    min_top1_agreement: float | None = None
    basis: str = "configured"

    def __post_init__(self) -> None:
        for name in ("max_abs_logit_diff", "max_rel_logit_diff"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        for name, low in (("min_cosine_similarity", -1.0), ("min_top1_agreement", 0.0)):
            value = getattr(self, name)
            if value is not None and not low <= value <= 1:
                raise ConfigError(f"{name} must be within {low:g}..1, got {value}")

    def with_overrides(self, overrides: Mapping[str, float | None]) -> LogitThresholds:
        """These bounds with every non-None entry of ``overrides`` (same field names) put in their place.

        Raises:
            ConfigError: an unknown field name or a bound out of range.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(given) - {f for f in asdict(self) if f != "basis"})
        if unknown:
            raise ConfigError(f"unknown threshold(s) {unknown}")
        if not given:
            return self
        basis = f"{self.basis} + configured" if self.basis != "configured" else "configured"
        return replace(self, **given, basis=basis)

    def as_dict(self) -> dict[str, float | str | None]:
        """The bounds as report JSON (``thresholds`` of a runtime comparison)."""
        return asdict(self)


FP16_DEFAULTS = LogitThresholds(min_cosine_similarity=0.9999, min_top1_agreement=0.99, basis="fp16 defaults")
"""Issue 19: an fp16 build passes with mean cosine ≥ 0.9999 and top-1 ≥ 99%, whatever its absolute error."""

INT8_DEFAULTS = LogitThresholds(basis="int8 defaults: judged by the accuracy figures")
"""Issue 19: an int8 device build (w8a8) is judged by held-out KL / top-1 / perplexity, not by logit bounds."""


def default_thresholds(precision: Precision, fp32: LogitThresholds) -> LogitThresholds:
    """The bounds a candidate running in ``precision`` is held to when its entry sets none of its own.

    Args:
        precision: ``fp32`` (ONNX Runtime, OpenVINO f32), ``fp16`` (an unquantized RKNN build) or ``int8``
            (an RKNN ``w8a8`` build).
        fp32: the ``verify`` section's bounds (used as they are for ``fp32``).

    Returns:
        ``fp32``'s bounds, :data:`FP16_DEFAULTS` or :data:`INT8_DEFAULTS`.
    """
    if precision == "fp16":
        return FP16_DEFAULTS
    if precision == "int8":
        return INT8_DEFAULTS
    return replace(fp32, basis="fp32 (verify section)")


def relative_logit_diff(reference: np.ndarray, candidate: np.ndarray) -> float:
    """``max |a - b| / max(max |a|, REL_FLOOR)`` over one position's vocabulary row (float64).

    Args:
        reference: float ``(V,)`` logits of the original.
        candidate: float ``(V,)`` logits of the candidate.
    """
    ref = reference.astype(np.float64)
    diff = float(np.max(np.abs(ref - candidate.astype(np.float64))))
    return diff / max(float(np.max(np.abs(ref))), REL_FLOOR)


def _cosine(ref: np.ndarray, cand: np.ndarray) -> float:
    norms = float(np.linalg.norm(ref) * np.linalg.norm(cand))
    if norms > 0:
        return float(np.dot(ref, cand) / norms)
    return 1.0 if not ref.any() and not cand.any() else 0.0


@dataclass
class LogitFigures:
    """The figures of a set of compared positions (one graph's, or all of them).

    Attributes:
        positions: positions compared.
        max_abs_logit_diff: largest max-abs logit difference (logit units).
        max_rel_logit_diff: largest :func:`relative_logit_diff`.
        mean_cosine_similarity: mean cosine similarity of the logit rows.
        min_cosine_similarity: smallest cosine similarity at one position.
        top1_agreement: fraction of positions whose top-1 agrees.
        first_divergent_position: first position whose top-1 differs or that breaks the abs/rel bound, or None.
    """

    positions: int
    max_abs_logit_diff: float
    max_rel_logit_diff: float
    mean_cosine_similarity: float
    min_cosine_similarity: float
    top1_agreement: float
    first_divergent_position: int | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        """The figures as report JSON."""
        return asdict(self)


def logit_figures(
    pairs: Sequence[tuple[int, np.ndarray, np.ndarray]], thresholds: LogitThresholds | None = None
) -> LogitFigures:
    """The figures of ``(position, reference (V,), candidate (V,))`` pairs (at least one).

    Args:
        pairs: the compared positions.
        thresholds: decides ``first_divergent_position`` (top-1, and the abs/rel bounds when set).

    Raises:
        ConfigError: no pairs.
    """
    if not pairs:
        raise ConfigError("no positions to compare")
    t = thresholds or LogitThresholds()
    abs_d, rel_d, cos, agree, divergent = [], [], [], [], None
    for position, ref, cand in pairs:
        r, c = ref.astype(np.float64).ravel(), cand.astype(np.float64).ravel()
        a = float(np.max(np.abs(r - c)))
        rel = relative_logit_diff(r, c)
        top1 = int(np.argmax(r)) == int(np.argmax(c))
        abs_d.append(a)
        rel_d.append(rel)
        cos.append(_cosine(r, c))
        agree.append(top1)
        off = (t.max_abs_logit_diff is not None and not a <= t.max_abs_logit_diff) or (
            t.max_rel_logit_diff is not None and not rel <= t.max_rel_logit_diff
        )
        if divergent is None and (off or not top1):
            divergent = position
    return LogitFigures(
        positions=len(pairs),
        max_abs_logit_diff=float(max(abs_d)),
        max_rel_logit_diff=float(max(rel_d)),
        mean_cosine_similarity=float(np.mean(cos)),
        min_cosine_similarity=float(min(cos)),
        top1_agreement=float(np.mean(agree)),
        first_divergent_position=divergent,
    )


def _breaks(figures: LogitFigures, t: LogitThresholds) -> list[str]:
    """One phrase per bound ``figures`` break."""
    out = []
    if t.max_abs_logit_diff is not None and not figures.max_abs_logit_diff <= t.max_abs_logit_diff:
        out.append(f"max abs logit diff {figures.max_abs_logit_diff:.3g} > max_abs_logit_diff={t.max_abs_logit_diff:g}")
    if t.max_rel_logit_diff is not None and not figures.max_rel_logit_diff <= t.max_rel_logit_diff:
        out.append(f"max rel logit diff {figures.max_rel_logit_diff:.3g} > max_rel_logit_diff={t.max_rel_logit_diff:g}")
    if t.min_cosine_similarity is not None and not figures.mean_cosine_similarity >= t.min_cosine_similarity:
        out.append(
            f"mean cosine {figures.mean_cosine_similarity:.6f} < min_cosine_similarity={t.min_cosine_similarity:g}"
        )
    if t.min_top1_agreement is not None and not figures.top1_agreement >= t.min_top1_agreement:
        out.append(f"top-1 {figures.top1_agreement:.4f} < min_top1_agreement={t.min_top1_agreement:g}")
    return out


@dataclass
class Judgement:
    """Figures over every compared position and per graph, and the bounds broken (``failures``, one line each)."""

    overall: LogitFigures
    by_graph: dict[str, LogitFigures]
    failures: list[str]

    @property
    def passed(self) -> bool:
        """No bound broken, overall or on any graph."""
        return not self.failures


def judge_positions(
    rows: Iterable[tuple[int, str | None, np.ndarray, np.ndarray]], thresholds: LogitThresholds, *, label: str = ""
) -> Judgement:
    """Judge ``(position, graph file, reference (V,), candidate (V,))`` rows overall and per graph.

    Args:
        rows: the compared positions (at least one); ``graph`` None for a lone model.
        thresholds: the bounds.
        label: prefix of each failure line (e.g. ``rknn-sim``).

    Returns:
        The judgement; a graph's failure line names the graph (``graph model_s16.onnx: ...``).

    Raises:
        ConfigError: no rows.
    """
    rows = list(rows)
    overall = logit_figures([(p, r, c) for p, _, r, c in rows], thresholds)
    graphs = list(dict.fromkeys(g for _, g, _, _ in rows if g))
    by_graph = {g: logit_figures([(p, r, c) for p, gg, r, c in rows if gg == g], thresholds) for g in graphs}
    prefix = f"{label}: " if label else ""
    failures = [f"{prefix}{line}" for line in _breaks(overall, thresholds)]
    if len(by_graph) > 1:
        for g, figures in by_graph.items():
            where = f"{prefix}graph {g} ({figures.positions} positions)"
            failures += [f"{where}: {line}" for line in _breaks(figures, thresholds)]
    return Judgement(overall, by_graph, failures)


def mode_bounds_failures(
    mode: str,
    reference: Sequence[np.ndarray | None],
    candidate: Sequence[np.ndarray | None],
    graphs: Sequence[str | None],
    bounds: LogitThresholds,
) -> list[str]:
    """The relative and cosine bounds of one verify mode (``verify.max_rel_logit_diff``, ``min_cosine_similarity``).

    Args:
        mode: the mode's name (each line starts with it).
        reference: the original's logits float32 ``(V,)`` per position (None where it computed none).
        candidate: the candidate's, likewise.
        graphs: the candidate graph file that computed each position.
        bounds: only ``max_rel_logit_diff`` and ``min_cosine_similarity`` are read (the mode checks the rest).

    Returns:
        One line per bound broken, over all positions and per graph of a set; [] when none is set or none broken.
    """
    only = LogitThresholds(
        max_rel_logit_diff=bounds.max_rel_logit_diff, min_cosine_similarity=bounds.min_cosine_similarity
    )
    if only.max_rel_logit_diff is None and only.min_cosine_similarity is None:
        return []
    rows = [
        (i, graphs[i] if i < len(graphs) else None, r, c)
        for i, (r, c) in enumerate(zip(reference, candidate, strict=False))
        if r is not None and c is not None
    ]
    return judge_positions(rows, only, label=mode).failures if rows else []


def runtime_thresholds(
    precision: Precision, verify_bounds: LogitThresholds, entry: Mapping[str, float | None]
) -> LogitThresholds:
    """The bounds of one ``verify.runtimes`` entry: its precision's defaults, with what the entry sets on top.

    Args:
        precision: what the runtime computes in (``fp32``: ONNX Runtime, OpenVINO f32; ``fp16``: an RKNN build
            without quantization; ``int8``: an RKNN ``w8a8`` build).
        verify_bounds: the ``verify`` section's bounds (the fp32 defaults).
        entry: the entry's own bounds by field name (None: not set).

    Returns:
        :func:`default_thresholds` with ``entry``'s set bounds in their place.
    """
    return default_thresholds(precision, verify_bounds).with_overrides(entry)
