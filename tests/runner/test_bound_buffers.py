"""Bound cache buffers (ORT IOBinding, past and present on one buffer) decode exactly like numpy feeds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError, ContractError
from onnxdeploy.runner import open_decoder
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.session import open_session
from tests.runner.tiny_decoder import TINY_PROMPT, build_tiny_decoder

TOKENS = [*TINY_PROMPT, 4, 8, 15, 16, 23, 2, 7, 1]


def _decoder(path: Path, *, bind: bool) -> ContractDecoder:
    model_session = open_session(path)
    return ContractDecoder(model_session, read_contract(model_session.model), bind_buffers=bind)


def test_bound_buffers_give_the_logits_and_buffers_of_numpy_feeds(tiny_dir: Path) -> None:
    with (
        _decoder(tiny_dir / "full_buffer.onnx", bind=False) as fed,
        _decoder(tiny_dir / "full_buffer.onnx", bind=True) as bound,
    ):
        assert bound.binds_buffers and not fed.binds_buffers
        want, got = fed.feed(TOKENS), bound.feed(TOKENS)
        for (a, _), (b, _) in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b)
        for name, buffer in fed.cache_buffers().items():
            np.testing.assert_array_equal(buffer, bound.cache_buffers()[name])
        assert np.abs(next(iter(bound.cache_buffers().values()))[:, :, len(TOKENS) - 1]).sum() > 0
        bound.reset()  # fresh zeroed buffers are bound again on the next call
        np.testing.assert_array_equal(bound.feed(TOKENS[:3])[-1][0], want[2][0])


def test_binding_is_refused_when_it_changes_the_results(tmp_path: Path) -> None:
    """A node that reads the past after the in-place write sees the new slot: the check must catch it."""
    proto = build_tiny_decoder("full_buffer", max_cache_len=16)
    graph = proto.graph
    for node in graph.node:
        node.output[:] = ["logits_raw" if o == "logits" else o for o in node.output]
    graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), "late_zero"))
    graph.node.extend(
        [
            helper.make_node("Mul", ["present.0.key", "late_zero"], ["after_write"]),
            helper.make_node("Add", ["past_key_values.0.key", "after_write"], ["past_read_late"]),
            helper.make_node("ReduceSum", ["past_read_late"], ["past_sum"], keepdims=0),
            helper.make_node("Add", ["logits_raw", "past_sum"], ["logits"]),
        ]
    )
    path = tmp_path / "late_read.onnx"
    onnx.save(proto, str(path))
    with _decoder(path, bind=False) as fed:
        assert len(fed.feed(TINY_PROMPT)) == len(TINY_PROMPT)  # fine with numpy feeds
    with pytest.raises(ContractError, match="binding past and present to one buffer changes 'logits'"):
        _decoder(path, bind=True)


def test_binding_needs_full_buffer_and_a_contract(tiny_dir: Path) -> None:
    with pytest.raises(ContractError, match="need cache_update full_buffer"):
        _decoder(tiny_dir / "new_token_only.onnx", bind=True)
    with pytest.raises(ConfigError, match="bind_buffers needs a decode contract"):
        open_decoder(tiny_dir / "exporter.onnx", bind_buffers=True)
