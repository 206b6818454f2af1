"""Which window the exporter's mask applies, read from the graph and confirmed by running it.

The candidates are integer constants the exporter compares query positions against
(:func:`window_candidates`). :func:`choose_windows` then computes the old mask and each candidate
:class:`~onnxdeploy.passes._position_mask.PositionMaskBuilder` mask on ONNX Runtime for every chunk start
(sampled above 384 starts) with the contract's ``attention_mask`` (and random padding bits with padding), and
keeps, per attention site, the first candidate that selects exactly the slots the old mask selected. A mask
that is not a plain 0 / large-negative mask (a bias such as ALiBi) or that no candidate reproduces is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import DecodeContract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import const_array, node_label, upstream_nodes
from onnxdeploy.passes._attention_sites import AttentionSite
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._position_mask import PositionMaskBuilder
from onnxdeploy.passes._probe import open_probe, pruned_copy

__all__ = ["choose_windows", "window_candidates"]

_MASKED_BELOW = -1.0e4  # an additive mask value this negative hides its slot (exp underflows to 0)
_MAX_PROBE_STARTS = 384
_PROBE_SEED = 0
_COMPARE_OPS = frozenset({"Greater", "Less", "GreaterOrEqual", "LessOrEqual"})


def window_candidates(mask: ir.Value) -> list[int]:
    """Windows the exporter's mask may compare against: integer scalar constants near a comparison.

    A constant ``c`` read by a comparison, or by a Sub/Add whose output a comparison reads, in the mask's
    upstream subgraph yields the candidates ``|c|`` and ``|c| + 1`` (``p - j < w`` and ``p - j <= w - 1``
    are both common). Running decides which one, if any, is the window.

    Args:
        mask: the exporter's mask operand.

    Returns:
        Positive candidates, ascending.
    """
    found: set[int] = set()
    depth = len(mask.graph) if mask.graph is not None else 0  # the whole upstream subgraph
    for node in upstream_nodes(mask, depth):
        feeds_compare = node.op_type in _COMPARE_OPS or (
            node.op_type in ("Sub", "Add") and any(u.node.op_type in _COMPARE_OPS for u in node.outputs[0].uses())
        )
        if not feeds_compare:
            continue
        for operand in node.inputs:
            arr = const_array(operand)
            if arr is None or arr.size != 1 or not np.issubdtype(arr.dtype, np.integer):
                continue
            c = abs(int(arr.reshape(-1)[0]))
            if c >= 1:
                found |= {c, c + 1}
    return sorted(found)


@contextlib.contextmanager
def _probe_session(model: ir.Model, outputs: list[ir.Value], context: PassContext, who: str) -> Iterator[Any]:
    """An ORT session on a copy of ``model`` pruned to what computes ``outputs`` (position arithmetic only).

    The copy shares ``model``'s tensors; :func:`onnxdeploy.model_io.write_for_ort` links rather than copies any
    large one (an export may keep a precomputed causal mask buffer as an initializer). A bfloat16 copy is made
    its float32 shadow (:func:`onnxdeploy.graph.float32_shadow_graph`): ORT's CPU EP has no bfloat16 kernels,
    and the shadow gives the same 0 / lowest pattern.

    Raises:
        PreconditionError: ONNX Runtime cannot load the probe.
    """
    probe = pruned_copy(model, [str(v.name) for v in outputs])
    with open_probe(probe, context, who=who, what="the mask probe") as opened:
        yield opened.session


def _probe_starts(S: int, L: int) -> list[int]:
    """Chunk starts ``p0`` (positions ``p0 .. p0 + S - 1``) the probe runs: all of them up to 384, else a sample."""
    starts = list(range(0, L - S + 1))
    if len(starts) <= _MAX_PROBE_STARTS:
        return starts
    third = _MAX_PROBE_STARTS // 3
    middle = np.linspace(third, len(starts) - third - 1, third).round().astype(int).tolist()
    return sorted(set(starts[:third] + [starts[i] for i in middle] + starts[-third:]))


def _old_visible(site: AttentionSite, value: np.ndarray, who: str, source: str) -> np.ndarray:
    """The slots the exporter's mask leaves visible, as bool (any broadcastable shape)."""
    if site.kind == "where_true":
        return value.astype(bool)
    if site.kind == "where_false":
        return ~value.astype(bool)
    as_float = value.astype(np.float64)
    visible = as_float == 0
    if not np.all(visible | (as_float <= _MASKED_BELOW)):
        odd = as_float[~visible & (as_float > _MASKED_BELOW)].reshape(-1)[:3]
        raise PreconditionError(
            who,
            f"{source}: the mask added before Softmax {node_label(site.softmax)} holds values other than 0 and a "
            f"large negative (e.g. {odd.tolist()}): a position bias such as ALiBi, which mask_rewrite does not rebuild",
        )
    return visible


class _WindowProbe:
    """One probe run of the old masks and the candidate masks, narrowing each site's candidates as it goes.

    Args:
        sites: the attention sites.
        candidates: per site, the windows to try (None: causal), graph constants first.
        builder: the builder of the candidate masks (their values are probe outputs).
        contract: the graph's contract (step_len, max_cache_len, batch, input names).
        source: the graph named in errors.
        who: the pass named in errors.
    """

    def __init__(
        self,
        sites: list[AttentionSite],
        candidates: list[list[int | None]],
        builder: PositionMaskBuilder,
        contract: DecodeContract,
        source: str,
        who: str,
    ):
        self.sites, self.candidates, self.builder = sites, candidates, builder
        self.contract, self.source, self.who = contract, source, who
        self.todo = [i for i, site in enumerate(sites) if site.old_mask is not None]
        self.agree: dict[int, set[int | None]] = {i: set(candidates[i]) for i in self.todo}

    def outputs(self) -> list[ir.Value]:
        """The values the probe computes: every old mask and every candidate mask, each once."""
        outputs: dict[str, ir.Value] = {}
        for i, site in enumerate(self.sites):
            if site.old_mask is not None:
                outputs[str(site.old_mask.name)] = site.old_mask
            for w in self.candidates[i]:
                value = self.builder.visible(w, len(site.scores_shape))
                outputs[str(value.name)] = value
        return list(outputs.values())

    def check_inputs(self, fed: set[str]) -> None:
        """Refuse a mask that reads a graph input other than the positions and the attention mask."""
        names = self.contract.inputs
        known = {names.cache_position, names.attention_mask, names.position_ids}
        unknown = sorted(fed - {n for n in known if n})
        if unknown:
            raise PreconditionError(
                self.who, f"{self.source}: the exporter's mask reads input(s) {unknown}, not only positions"
            )

    def feeds(self, fed: set[str], p0: int, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
        """The probe's inputs for the chunk at ``p0`` with this ``attention_mask`` (B, L)."""
        S, B = self.contract.step_len, self.contract.batch
        positions = np.arange(p0, p0 + S, dtype=np.int64)
        feeds: dict[str, np.ndarray] = {}
        for role, array in (
            ("cache_position", np.broadcast_to(positions, self.contract.cache_position_shape()).copy()),
            ("attention_mask", attention_mask),
            ("position_ids", np.broadcast_to(positions, (B, S)).copy()),
        ):
            name = getattr(self.contract.inputs, role)
            if name in fed:
                feeds[name] = array
        padding = self.builder.attention_mask
        if padding is not None and str(padding.name) in fed:
            feeds[str(padding.name)] = attention_mask
        return feeds

    def narrow(self, got: dict[str, np.ndarray], p0: int) -> None:
        """Drop the candidates whose mask differs from the old one at chunk ``p0``.

        Raises:
            PreconditionError: a site has no candidate left (names the query and the slots it sees).
        """
        S, L = self.contract.step_len, self.contract.max_cache_len
        for i in self.todo:
            site = self.sites[i]
            shape = site.scores_shape
            old = np.broadcast_to(_old_visible(site, got[str(site.old_mask.name)], self.who, self.source), shape)
            for w in list(self.agree[i]):
                new = np.broadcast_to(got[str(self.builder.visible(w, len(shape)).name)], shape)
                if np.array_equal(old, new):
                    continue
                self.agree[i].discard(w)
                if not self.agree[i]:
                    row = np.argwhere((old != new).reshape(-1, S, L).any(axis=2))[0]
                    seen = np.flatnonzero(old.reshape(-1, S, L)[row[0], row[1]]).tolist()
                    raise PreconditionError(
                        self.who,
                        f"{self.source}: the exporter's mask before Softmax {node_label(site.softmax)} lets the "
                        f"query at position {p0 + row[1]} see slots {seen[:12]}{'…' if len(seen) > 12 else ''}: "
                        "it selects slots no causal or sliding-window mask from cache_position reproduces "
                        f"(windows tried: {self.candidates[i]}); refusing rather than changing what attention sees",
                    )

    def chosen(self) -> list[int | None]:
        """Per site, the first candidate still agreeing (graph constants before None); None without an old mask."""
        agree = self.agree
        return [
            next(w for w in self.candidates[i] if w in agree[i]) if i in agree else None for i in range(len(self.sites))
        ]


def choose_windows(
    model: ir.Model,
    sites: list[AttentionSite],
    builder: PositionMaskBuilder,
    contract: DecodeContract,
    *,
    padding: bool,
    context: PassContext,
    source: str,
    who: str,
) -> list[int | None]:
    """Run the old masks and the candidates at every chunk start; per site, the first candidate that agrees.

    The candidate masks are built into ``model``'s graph (the probe computes them); those not chosen are left
    dead for the caller to remove.

    Args:
        model: the graph, its sites found and its builder made.
        sites: the attention sites (:func:`~onnxdeploy.passes._attention_sites.find_attention_sites`).
        builder: builds each candidate mask.
        contract: the graph's contract.
        padding: also probe with random padding bits in ``attention_mask``.
        context: the pass context (the probe's session).
        source: the graph named in errors.
        who: the pass named in errors.

    Returns:
        Per site, its window in slots, or None for causal (also for a site without an exporter mask).

    Raises:
        PreconditionError: the old mask reads an input other than cache_position / attention_mask /
            position_ids, is not a 0 / large-negative mask, or no candidate agrees with it.
    """
    candidates = [[*(window_candidates(s.old_mask) if s.old_mask is not None else []), None] for s in sites]
    probe = _WindowProbe(sites, candidates, builder, contract, source, who)
    outputs = probe.outputs()
    if not probe.todo:
        return probe.chosen()
    S, L, B = contract.step_len, contract.max_cache_len, contract.batch
    rng = np.random.default_rng(_PROBE_SEED)
    with _probe_session(model, outputs, context, who) as sess:
        fed = {arg.name for arg in sess.get_inputs()}
        probe.check_inputs(fed)
        names = [str(v.name) for v in outputs]
        for p0 in _probe_starts(S, L):
            contract_mask = np.zeros((B, L), dtype=np.int64)
            contract_mask[:, : p0 + S] = 1
            masks = [contract_mask]
            if padding:
                masks.append(contract_mask * rng.integers(0, 2, size=(B, L), dtype=np.int64))
            for am in masks:
                got = dict(zip(names, sess.run(names, probe.feeds(fed, p0, am)), strict=True))
                probe.narrow(got, p0)
    return probe.chosen()
