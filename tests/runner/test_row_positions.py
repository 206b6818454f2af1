"""``static_kv {batch: B, row_positions: true}``: every batch row writes and masks at its own positions.

A row's logits and its own buffers must be equal to the bit whatever the other rows do: fed other tokens at other
positions over other cache contents, idle (fed token 0 at their next position), or holding NaN in every slot. Checked
on every graph of a set (step lengths 1 and 4, cache lengths 16 and 32), for every layout (``kv_layout``) × every
``cache_write``, and on the sliding-window, GPT-2 and float16 fixtures. (That each row decodes what the original
export does: tests/runner/test_batching.py.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxdeploy.contract import read_contract
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.kv_layout import KVLayoutConfig, KVLayoutPass
from onnxdeploy.passes.mask_rewrite import MaskRewritePass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner.graph_set import GraphSetDecoder, open_graph_set
from onnxdeploy.runner.host import StepInputs, allocate_buffers
from onnxdeploy.runner.session import read_header
from tests.conftest import fixture_entry

B = 3
STEP_LENS = [1, 4]
CACHE_LENS = [16, 32]


def build_row_set(
    name: str, folder: Path, *, layout: str = "BHSD", cache_write: str = "scatter_elements", **extra
) -> Path:
    """static_kv (row_positions) + mask_rewrite (+ kv_layout) on fixture ``name``, written to ``folder``."""
    config = {"batch": B, "row_positions": True, "step_lens": STEP_LENS, "max_cache_lens": CACHE_LENS, **extra}
    if cache_write != "scatter_elements":
        config["cache_write"] = cache_write
    ctx = make_pass_context()
    artifacts = StaticKVCachePass(StaticKVConfig(**config))(load_model(fixture_entry(name)["model_path"]).model, ctx)
    artifacts = MaskRewritePass()(artifacts.artifacts, ctx).artifacts
    if layout != "BHSD":
        artifacts = KVLayoutPass(KVLayoutConfig(layout=layout))(artifacts, ctx).artifacts
    folder.mkdir(parents=True)
    stage_artifacts(
        [(a.name, a.model) for a in artifacts.artifacts], folder, external=artifacts.external(), data_name="m.onnx.data"
    ).commit()
    return folder / "model.onnx"


def _random_buffers(contract, rng: np.random.Generator, fill: float | None = None) -> dict[str, np.ndarray]:
    buffers = allocate_buffers(contract)
    for array in buffers.values():
        array[...] = fill if fill is not None else rng.standard_normal(array.shape)
    return buffers


def _row(buffers: dict[str, np.ndarray], row: int) -> dict[str, np.ndarray]:
    return {k: v[row].copy() for k, v in buffers.items()}


def check_rows_independent(decoder: GraphSetDecoder, vocab: int) -> int:
    """For every graph of the set, row 1's logits and buffers are bit-equal across what the other rows do.

    Returns:
        The number of graphs checked.
    """
    rng = np.random.default_rng(0)
    checked = 0
    for _, S, L in decoder.graphs():
        member = decoder.member(S, L)
        c = member.contract
        assert c.row_positions and c.batch == B and c.contract_version >= 4
        assert c.cache_position_shape() == (B, S)
        position = L - S - 1  # row 1 near the end of its cache: the other rows' positions are all below
        base = _random_buffers(c, rng)
        chunk = rng.integers(1, vocab, size=S).tolist()
        outcomes = []
        other = rng.integers(1, vocab, size=S).tolist()
        scenarios: list[tuple[str, bool, StepInputs]] = [  # (kind, other rows NaN, inputs)
            ("active", False, StepInputs.rows(c, [other, chunk, chunk[:1]], [0, position, 3])),
            ("idle", False, StepInputs.rows(c, [[0], chunk, [0]], [5, position, 0])),
            ("nan", True, StepInputs.rows(c, [[7] * S, chunk, [1, 2][: min(S, 2)]], [2, position, 1])),
        ]
        for kind, nan, inputs in scenarios:
            start = base
            if nan:  # other rows hold NaN in every slot; row 1 the same contents as before
                start = _random_buffers(c, rng, fill=np.nan)
                for k in start:
                    start[k][1] = base[k][1]
            buffers = {k: v.copy() for k, v in start.items()}
            logits, _ = member.call(buffers, inputs)
            outcomes.append((kind, logits[1].copy(), _row(buffers, 1)))
            assert np.isfinite(logits[1]).all(), (kind, member.source)
        _, want_logits, want_rows = outcomes[0]
        for kind, got_logits, got_rows in outcomes[1:]:
            assert np.array_equal(got_logits, want_logits), (kind, member.source)
            for k, v in want_rows.items():
                assert np.array_equal(got_rows[k], v), (kind, member.source, k)
        checked += 1
    return checked


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rows")


@pytest.mark.parametrize("layout", ["BHSD", "BSH2D", "BHDS_K"])
@pytest.mark.parametrize("cache_write", ["scatter_elements", "scatter_nd", "where", "host"])
def test_rows_are_independent_every_layout_and_cache_write(folder, layout, cache_write) -> None:
    name = "llama_gqa_optimum"
    primary = build_row_set(name, folder / f"{layout}-{cache_write}", layout=layout, cache_write=cache_write)
    contract = read_contract(read_header(primary))
    assert contract is not None and contract.kv_layout == layout and contract.mask == "cache_position"
    with open_graph_set(primary) as decoder:
        assert check_rows_independent(decoder, fixture_entry(name)["config"]["vocab"]) == 4


@pytest.mark.parametrize("name", ["mistral_sw_optimum", "gpt2_optimum", "llama_gqa_fp16"])
def test_rows_are_independent_other_fixtures(folder, name) -> None:
    primary = build_row_set(name, folder / name)
    with open_graph_set(primary) as decoder:
        assert check_rows_independent(decoder, fixture_entry(name)["config"]["vocab"]) == 4
