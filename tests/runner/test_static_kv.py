"""The contract loop on real exports made static by ``onnxdeploy.passes.static_kv``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from onnxdeploy.errors import CacheOverflowError, PreconditionError
from onnxdeploy.model_io import load_model, write_for_ort
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import ContractDecoder, open_decoder, verify
from tests.conftest import FIXTURE_NAMES, fixture_entry


def _make_static(entry: dict, target: Path, *, max_cache_len: int, cache_update: str) -> Path:
    config = StaticKVConfig(max_cache_len=max_cache_len, cache_update=cache_update)
    static = StaticKVCachePass(config)(load_model(entry["model_path"]).model, make_pass_context()).artifacts.primary
    return write_for_ort(static, target.parent, target.name)


@pytest.mark.parametrize("cache_update", ["full_buffer", "new_token_only"])
def test_static_model_verifies_against_its_original_with_an_exactly_full_cache(
    any_fixture: dict, cache_update: str, tmp_path: Path
) -> None:
    expect = any_fixture["expect"]
    reference = np.load(any_fixture["reference_path"])
    positions = reference["logits"].shape[0]
    if cache_update == "new_token_only" and not expect.new_token_only:
        with pytest.raises(PreconditionError, match=f"{expect.cache_op} .* outputs the whole buffer"):
            _make_static(any_fixture, tmp_path / "static.onnx", max_cache_len=positions, cache_update=cache_update)
        return
    static = _make_static(any_fixture, tmp_path / "static.onnx", max_cache_len=positions, cache_update=cache_update)
    report = verify(
        any_fixture["model_path"],
        static,
        prompt=reference["prompt"].tolist(),
        steps=len(reference["tokens"]),
        max_abs_logit_diff=expect.tol(1e-4),
    )
    assert report.passed, [m.failures for m in report.modes.values()]
    for result in report.modes.values():
        assert result.first_divergent_step is None and result.positions == positions


def test_static_model_refuses_the_token_after_a_full_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = fixture_entry(FIXTURE_NAMES[0])
    reference = np.load(entry["reference_path"])
    static = _make_static(entry, tmp_path / "static.onnx", max_cache_len=8, cache_update="full_buffer")
    decoder = open_decoder(static)
    assert isinstance(decoder, ContractDecoder)
    outputs = decoder.feed(reference["prompt"].tolist() + reference["tokens"][:2].tolist())
    np.testing.assert_allclose(np.stack([o for o, _ in outputs]), reference["logits"][:8], atol=1e-4)

    calls: list[int] = []
    monkeypatch.setattr(ort.InferenceSession, "run", lambda *args, **kwargs: calls.append(1))
    with pytest.raises(CacheOverflowError):
        decoder.feed([int(reference["tokens"][2])])
    assert calls == []
