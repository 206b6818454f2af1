from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxdeploy.errors import CacheOverflowError, ContractError, ModelLoadError
from onnxdeploy.runner import (
    ContractDecoder,
    Decoder,
    ExporterDecoder,
    exporter_cache_pairs,
    open_decoder,
    open_session,
)
from tests.runner.tiny_decoder import TINY_PROMPT, build_tiny_decoder

TOKENS = TINY_PROMPT + [4, 17, 15, 17, 16, 4]


def _logits(outputs: list[tuple[np.ndarray, float]]) -> np.ndarray:
    return np.stack([logits for logits, _ in outputs])


@pytest.fixture(scope="module")
def exporter_logits(tiny_dir: Path) -> np.ndarray:
    """Reference: the exporter model, prompt as one prefill, then one token per call."""
    decoder = open_decoder(tiny_dir / "exporter.onnx")
    outputs = decoder.feed(TINY_PROMPT)
    for token in TOKENS[len(TINY_PROMPT) :]:
        outputs += decoder.feed([token])
    return _logits(outputs)


@pytest.fixture
def run_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count every InferenceSession.run call."""
    calls: list[int] = []
    original_run = ort.InferenceSession.run

    def counting_run(self, *args, **kwargs):
        calls.append(1)
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run", counting_run)
    return calls


def test_exporter_cache_pairs_follow_layer_order_key_first() -> None:
    pairs = exporter_cache_pairs(build_tiny_decoder(layers=2))
    assert pairs == [
        ("past_key_values.0.key", "present.0.key"),
        ("past_key_values.0.value", "present.0.value"),
        ("past_key_values.1.key", "present.1.key"),
        ("past_key_values.1.value", "present.1.value"),
    ]


def test_exporter_cache_pairs_refuse_a_model_without_cache() -> None:
    model = build_tiny_decoder()
    del model.graph.input[1:5]  # the four past inputs, listed before attention_mask
    with pytest.raises(ContractError, match="past_key_values"):
        exporter_cache_pairs(model)


def test_exporter_cache_pairs_find_a_renamed_cache_by_data_flow(tmp_path: Path, exporter_logits: np.ndarray) -> None:
    model = build_tiny_decoder(layers=2)
    renames = {}
    for i, layer in enumerate((0, 1)):
        for kind in ("key", "value"):
            renames[f"past_key_values.{layer}.{kind}"] = f"cache_in_{kind}_{i}"
            renames[f"present.{layer}.{kind}"] = f"cache_out_{kind}_{i}"
    for value in [*model.graph.input, *model.graph.output]:
        value.name = renames.get(value.name, value.name)
    for node in model.graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
        node.output[:] = [renames.get(name, name) for name in node.output]
    assert exporter_cache_pairs(model) == [
        ("cache_in_key_0", "cache_out_key_0"),
        ("cache_in_value_0", "cache_out_value_0"),
        ("cache_in_key_1", "cache_out_key_1"),
        ("cache_in_value_1", "cache_out_value_1"),
    ]
    onnx.save(model, str(tmp_path / "renamed.onnx"))
    decoder = open_decoder(tmp_path / "renamed.onnx")
    outputs = decoder.feed(TOKENS)
    np.testing.assert_allclose(_logits(outputs), exporter_logits, atol=1e-5)


def test_make_decoder_picks_the_loop_from_the_contract(tiny_dir: Path) -> None:
    exporter = open_decoder(tiny_dir / "exporter.onnx")
    contract = open_decoder(tiny_dir / "full_buffer.onnx")
    assert isinstance(exporter, ExporterDecoder) and isinstance(contract, ContractDecoder)
    assert isinstance(exporter, Decoder) and isinstance(contract, Decoder)


def test_exporter_prefill_equals_token_by_token(tiny_dir: Path, exporter_logits: np.ndarray) -> None:
    decoder = open_decoder(tiny_dir / "exporter.onnx")
    outputs = []
    for token in TOKENS:
        outputs += decoder.feed([token])
    assert decoder.position == len(TOKENS)
    assert len(decoder.call_latencies_ms) == len(TOKENS)
    np.testing.assert_allclose(_logits(outputs), exporter_logits, atol=1e-5)


def test_exporter_prefill_is_one_call_attributed_to_each_position(tiny_dir: Path, run_calls: list[int]) -> None:
    decoder = open_decoder(tiny_dir / "exporter.onnx")
    outputs = decoder.feed(TINY_PROMPT)
    assert len(run_calls) == 1
    assert len(outputs) == len(TINY_PROMPT)
    assert {latency for _, latency in outputs} == set(decoder.call_latencies_ms)
    assert all(logits.shape == (32,) and logits.dtype == np.float32 for logits, _ in outputs)


@pytest.mark.parametrize("variant", ["full_buffer", "new_token_only", "step2"])
def test_contract_decoder_matches_exporter(tiny_dir: Path, exporter_logits: np.ndarray, variant: str) -> None:
    decoder = open_decoder(tiny_dir / f"{variant}.onnx")
    outputs = decoder.feed(TINY_PROMPT)
    for start in range(len(TINY_PROMPT), len(TOKENS), 2):
        outputs += decoder.feed(TOKENS[start : start + 2])
    np.testing.assert_allclose(_logits(outputs), exporter_logits, atol=1e-5)


def test_contract_decoder_reset_starts_over(tiny_dir: Path, exporter_logits: np.ndarray) -> None:
    decoder = open_decoder(tiny_dir / "new_token_only.onnx")
    decoder.feed(TOKENS[::-1])
    decoder.reset()
    assert decoder.position == 0 and decoder.call_latencies_ms == []
    np.testing.assert_allclose(_logits(decoder.feed(TOKENS)), exporter_logits, atol=1e-5)


def test_contract_decoder_refuses_a_partial_step(tiny_dir: Path, run_calls: list[int]) -> None:
    decoder = open_decoder(tiny_dir / "step2.onnx")
    with pytest.raises(ContractError, match="step_len=2"):
        decoder.feed([1, 2, 3])
    assert run_calls == [] and decoder.position == 0


def test_contract_decoder_fills_the_cache_then_refuses_before_running(tiny_dir: Path, run_calls: list[int]) -> None:
    decoder = open_decoder(tiny_dir / "short.onnx")  # max_cache_len 8
    decoder.feed(TINY_PROMPT)
    decoder.feed([4, 17])  # slots 6 and 7: exactly full
    assert decoder.position == 8 and len(run_calls) == 8
    with pytest.raises(CacheOverflowError) as raised:
        decoder.feed([15])
    assert (raised.value.position, raised.value.max_cache_len) == (8, 8)
    assert len(run_calls) == 8 and decoder.position == 8


def test_contract_decoder_refuses_a_feed_crossing_the_end_without_running_any_of_it(
    tiny_dir: Path, run_calls: list[int]
) -> None:
    decoder = open_decoder(tiny_dir / "short.onnx")
    decoder.feed(TINY_PROMPT)
    with pytest.raises(CacheOverflowError, match="position 8 would write past max_cache_len=8"):
        decoder.feed([4, 17, 15])
    assert len(run_calls) == len(TINY_PROMPT) and decoder.position == len(TINY_PROMPT)


def test_contract_decoder_refuses_a_contract_that_disagrees_with_the_graph(tmp_path: Path) -> None:
    model = build_tiny_decoder("full_buffer", max_cache_len=16)
    entry = next(p for p in model.metadata_props if p.key == "onnxdeploy.contract")
    entry.value = entry.value.replace('"max_cache_len":16', '"max_cache_len":32')
    onnx.save(model, str(tmp_path / "bad.onnx"))
    with pytest.raises(ContractError, match="past_key_values.0.key"):
        open_decoder(tmp_path / "bad.onnx")


def test_open_session_reports_provider_fallback(tiny_dir: Path) -> None:
    loaded = open_session(tiny_dir / "exporter.onnx", providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    assert loaded.providers_active == ("CPUExecutionProvider",)
    assert len(loaded.fallbacks) == 1 and "CUDAExecutionProvider" in loaded.fallbacks[0]
    assert open_session(tiny_dir / "exporter.onnx").fallbacks == []


@pytest.mark.parametrize("content", [None, b"not an onnx model"])
def test_open_session_names_the_path_of_a_bad_model(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=str(path)):
        open_session(path)
