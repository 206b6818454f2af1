"""A graph set's ORT sessions share one read-only map of the set's weights file (runner/shared_weights.py).

Counted in ``/proc/self/maps`` (Linux): with sharing the set's six sessions leave one mapping of
``model.onnx.data``; opened with ORT's own mappings (``share_weights=False``) each session adds its own. Decoding
is unchanged: the shared and unshared sets give bit-identical logits.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from onnxdeploy.runner.graph_set import open_graph_set
from onnxdeploy.runner.session import open_session
from tests.runner.test_graph_set import _write_set

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")

FIXTURE = "llama_gqa_optimum"
PROMPT = [1, 17, 42, 99, 7, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 2, 4, 6]


@pytest.fixture(scope="module")
def primary(tmp_path_factory) -> Path:
    """A six-graph set (steps 1, 4, 16 × caches 32, 128) of the fixture, one weights file."""
    path, _ = _write_set(
        FIXTURE, tmp_path_factory.mktemp("shared") / "out", step_lens=[1, 4, 16], max_cache_lens=[32, 128]
    )
    return path


def _mappings(data: Path) -> int:
    """Distinct mmap regions of ``data`` in this process (one per ``mmap`` call, by start address)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return len({line.split()[0] for line in lines if line.endswith(str(data))})


def _decode(decoder) -> list[np.ndarray]:
    logits = [row for row, _ in decoder.feed(PROMPT) if row is not None]
    token = int(np.argmax(logits[-1]))
    for _ in range(6):
        (row, _), *_ = decoder.feed([token])
        logits.append(row)
        token = int(np.argmax(row))
    return logits


def test_a_graph_sets_sessions_hold_one_mapping_of_the_weights_and_decode_unchanged(primary: Path) -> None:
    data = primary.parent / "model.onnx.data"
    gc.collect()
    assert _mappings(data) == 0
    with open_graph_set(primary) as shared:
        assert len(shared.sessions()) == 6
        assert all(s.shared_weights for s in shared.sessions())
        assert _mappings(data) == 1
        shared_logits = _decode(shared)
    gc.collect()
    assert _mappings(data) == 0  # unmapped with the last session

    # the same graphs each opened with ORT's own mappings: one mapping (at least) per session
    def own(path: Path):
        return open_session(path, share_weights=False)

    with open_graph_set(primary, opened=own(primary), opener=own) as unshared:
        assert not any(s.shared_weights for s in unshared.sessions())
        assert _mappings(data) >= 6
        unshared_logits = _decode(unshared)
    assert len(shared_logits) == len(unshared_logits)
    for a, b in zip(shared_logits, unshared_logits, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_primary_opened_alone_shares_its_sets_map(primary: Path) -> None:
    """``open_session`` on a graph-set member shares by default, so ``open_decoder``'s primary joins its siblings."""
    data = primary.parent / "model.onnx.data"
    first = open_session(primary)
    try:
        assert first.shared_weights
        with open_graph_set(primary, opened=first) as decoder:
            first = None
            assert _mappings(data) == 1
            assert all(s.shared_weights for s in decoder.sessions())
    finally:
        if first is not None:
            first.close()


def test_prepacking_sessions_leave_the_weights_to_ort(primary: Path) -> None:
    """Prepacking on (asked, as for quantized weights): ORT loads the weights itself; the runner shares none."""
    session = open_session(primary, config_entries={"session.disable_prepacking": "0"})
    try:
        assert session.settings is not None and session.settings.prepacking
        assert not session.shared_weights
    finally:
        session.close()
