"""``verify.accuracy`` decodes fast and gives today's token-by-token figures (issue 15, Deliver 4).

The original is teacher-forced in one call (empty past, every token, logits at every position); a graph set
whose buckets return every position (``prefill_logits: all``) goes through its buckets; a quantized candidate's
sessions prepack its weights. Each is checked against the slow way it replaces: one token per call with
prepacking off (the runner's sessions before issue 15), on real ORT sessions of the ``llama_gqa_optimum``
fixture and sets made from it by the passes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes.mask_rewrite import MaskRewritePass
from onnxdeploy.passes.quantize_weights import QuantizeWeightsConfig, QuantizeWeightsPass
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.report import AccuracyReport
from onnxdeploy.runner.accuracy import (
    WEIGHT_ONLY_ENTRIES,
    accuracy_figures,
    evaluate_accuracy,
    teacher_forced,
    teacher_forced_logits,
)
from onnxdeploy.runner.decoder import make_decoder
from onnxdeploy.runner.session import ACCURACY_LEVEL_KEY, PREPACKING_KEY, open_session
from tests.conftest import fixture_entry

NAME = "llama_gqa_optimum"
ORIGINAL = fixture_entry(NAME)["model_path"]
VOCAB = fixture_entry(NAME)["config"]["vocab"]
TOKENS = np.random.default_rng(3).integers(1, VOCAB, size=40).tolist()  # crosses the 32-slot cache into the 64 one
SET = {"step_lens": [1, 4], "max_cache_lens": [32, 64]}
OLD_WEIGHT_ONLY = {PREPACKING_KEY: "1", ACCURACY_LEVEL_KEY: "0"}
"""The weight-only session before issue 15: prepacking off (MatMulNBits dequantized to fp32 on every call)."""


def token_by_token(path: Path, tokens: list[int], entries: dict[str, str] | None = None) -> np.ndarray:
    """Today's slow reference: one token per call through the model's decode loop."""
    with make_decoder(open_session(path, config_entries=entries)) as decoder:
        return np.stack([logits for t in tokens for logits, _ in decoder.feed([t])])


def write_set(folder: Path, *, quantize: dict | None = None, **static) -> Path:
    """static_kv + mask_rewrite (+ quantize_weights) on the fixture, written as the pipeline does."""
    context = make_pass_context(scratch_dir=folder / "scratch")
    artifacts = StaticKVCachePass(StaticKVConfig(**static))(load_model(ORIGINAL).model, context).artifacts
    artifacts = MaskRewritePass()(artifacts, context).artifacts
    if quantize is not None:
        artifacts = QuantizeWeightsPass(QuantizeWeightsConfig(**quantize))(artifacts, context).artifacts
    out = folder / "out"
    out.mkdir(parents=True)
    graphs = [(a.name, a.model) for a in artifacts.artifacts]
    stage_artifacts(graphs, out, external=artifacts.external(), data_name="model.onnx.data").commit()
    return out / "model.onnx"


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return token_by_token(ORIGINAL, TOKENS)


@pytest.fixture(scope="module")
def all_logits_set(tmp_path_factory) -> Path:
    return write_set(tmp_path_factory.mktemp("all"), prefill_logits="all", **SET)


@pytest.fixture(scope="module", params=["qdq", "matmulnbits"])
def int4_set(request, tmp_path_factory) -> Path:
    quantize = {"bits": 4, "block_size": 32, "format": request.param}
    return write_set(tmp_path_factory.mktemp(f"int4-{request.param}"), quantize=quantize, **SET)


@pytest.fixture(scope="module")
def int4_report(int4_set: Path) -> AccuracyReport:
    return evaluate_accuracy(ORIGINAL, int4_set, TOKENS)


def count_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count ``InferenceSession.run`` calls (one list item per call)."""
    calls: list[int] = []
    run = ort.InferenceSession.run

    def counted(self, *args, **kwargs):
        calls.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run", counted)
    return calls


def test_the_original_is_teacher_forced_in_one_call_with_the_token_by_token_logits(
    reference: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_runs(monkeypatch)
    logits, settings = teacher_forced(ORIGINAL, TOKENS)
    assert len(calls) == 1
    assert logits.shape == (len(TOKENS), VOCAB)
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)
    assert settings is not None and settings.weights == "float" and not settings.prepacking


def test_an_export_whose_input_ids_take_one_token_is_fed_token_by_token(
    reference: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proto = onnx.load(str(ORIGINAL))
    ids = next(i for i in proto.graph.input if i.name == "input_ids")
    ids.type.tensor_type.shape.dim[1].dim_value = 1  # an export made for one token per call
    onnx.save(proto, str(tmp_path / "model.onnx"))
    calls = count_runs(monkeypatch)
    np.testing.assert_allclose(teacher_forced_logits(tmp_path / "model.onnx", TOKENS), reference, atol=1e-4, rtol=0)
    assert len(calls) == len(TOKENS)


def test_a_set_that_returns_every_position_is_fed_through_its_buckets(
    all_logits_set: Path, reference: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_runs(monkeypatch)
    logits = teacher_forced_logits(all_logits_set, TOKENS)
    assert len(calls) == len(TOKENS) // 4  # 40 tokens: ten 4-token bucket calls, not 40 single-token ones
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits, token_by_token(all_logits_set, TOKENS), atol=1e-4, rtol=0)


def test_a_float_candidate_runs_once_and_reports_one_measurement_for_both_settings(
    all_logits_set: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_runs(monkeypatch)
    report = evaluate_accuracy(ORIGINAL, all_logits_set, TOKENS, max_mean_kl=1e-6, min_top1_agreement=1.0)
    assert report.passed, report.failures
    assert report.default_is_weight_only and report.default_optimized == report.weight_only
    assert len(calls) == 1 + len(TOKENS) // 4  # the original once, the candidate once
    session = report.weight_only.session
    assert session is not None and session.weights == "float" and not session.prepacking
    assert session.accuracy_level == []
    assert report.original_session is not None and not report.original_session.prepacking


def test_int4_weight_only_figures_equal_todays_token_by_token_prepacking_off_figures(
    int4_set: Path, int4_report: AccuracyReport, reference: np.ndarray
) -> None:
    report = int4_report
    today = accuracy_figures(reference, token_by_token(int4_set, TOKENS, OLD_WEIGHT_ONLY), TOKENS)
    got = report.weight_only
    assert got.positions == today.positions == len(TOKENS) - 1
    assert got.top1_agreement == today.top1_agreement
    assert got.mean_kl == pytest.approx(today.mean_kl, rel=1e-3, abs=1e-6)
    assert got.ppl_ratio == pytest.approx(today.ppl_ratio, rel=1e-5)
    assert got.mean_kl > 0  # 4-bit weights: there is an error to measure
    assert got.session is not None and got.session.prepacking and got.session.accuracy_level == [0]


def test_int4_default_figures_name_orts_accuracy_level_and_prepacking(int4_report: AccuracyReport) -> None:
    report = int4_report
    default = report.default_optimized.session
    assert default is not None and default.weights == "quantized" and default.prepacking
    if report.default_is_weight_only:  # matmulnbits written at accuracy_level 0: ORT runs its attribute
        assert default.accuracy_level == [0] and report.default_optimized == report.weight_only
    else:  # qdq: ORT fuses DequantizeLinear + MatMul at its default level 4 (int8 activations)
        assert default.accuracy_level == [4]
        assert report.default_optimized.mean_kl != report.weight_only.mean_kl  # another session ran: int8 activations
        assert report.default_optimized.mean_kl < 1e-2


def test_weight_only_entries_reach_the_graphs_own_matmulnbits_nodes(tmp_path: Path) -> None:
    """A set written at accuracy_level 4 is still measured weight-only at 0 (a scratch copy with the attribute set)."""
    level4 = write_set(tmp_path, quantize={"bits": 4, "format": "matmulnbits", "accuracy_level": 4}, **SET)
    fp32 = token_by_token(level4, TOKENS[:8], OLD_WEIGHT_ONLY)
    logits, settings = teacher_forced(level4, TOKENS[:8], config_entries=WEIGHT_ONLY_ENTRIES)
    assert settings is not None and settings.accuracy_level == [0] and settings.prepacking
    np.testing.assert_allclose(logits, fp32, atol=1e-4, rtol=0)
    _, own = teacher_forced(level4, TOKENS[:8])
    assert own is not None and own.accuracy_level == [4]
