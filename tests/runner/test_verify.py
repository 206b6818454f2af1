from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxdeploy.errors import CacheOverflowError, ConfigError
from onnxdeploy.runner import greedy_decode, verify
from tests.conftest import fixture_entry
from tests.runner.tiny_decoder import TINY_PROMPT


def corrupt_mlp_weight(source: Path, target: Path, factor: float = 1.05) -> str:
    """Write a copy of ``source`` whose first MLP MatMul/Gemm weight is scaled by ``factor``.

    The weight is found from node names where the exporter keeps the module path (e.g.
    ``/model/layers.0/mlp/gate_proj/MatMul``); the dynamo exporter drops it, so the fallback is the first
    of the largest MatMul/Gemm weights outside the LM head (the MLP projections in these decoders).
    """
    model = onnx.load(str(source))
    initializers = {init.name: init for init in model.graph.initializer}
    weighted = [
        node
        for node in model.graph.node
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in initializers
    ]
    by_name = [node.input[1] for node in weighted if "mlp" in node.name]
    body = [node.input[1] for node in weighted if "logits" not in node.output]
    size = {name: int(np.prod(initializers[name].dims)) for name in body}
    largest = [name for name in body if size[name] == max(size.values())]
    name = (by_name or largest)[0]
    weight = numpy_helper.to_array(initializers[name])
    scaled = (weight * weight.dtype.type(factor)).astype(weight.dtype)  # float16 weights stay float16
    initializers[name].CopyFrom(numpy_helper.from_array(scaled, name))
    onnx.save(model, str(target))
    return name


# -- tiny decoder (built in tests/runner/tiny_decoder.py) --------------------------------------------


def test_verify_a_model_against_itself(tiny_dir: Path) -> None:
    seen: dict[str, list[tuple[int, int]]] = {}
    report = verify(
        tiny_dir / "exporter.onnx",
        tiny_dir / "exporter.onnx",
        prompt=TINY_PROMPT,
        steps=10,
        progress=lambda mode, done, total: seen.setdefault(mode, []).append((done, total)),
    )
    assert report.passed, report.modes
    assert list(report.modes) == ["teacher_forced", "free_running"]
    for result in report.modes.values():
        assert result.passed and result.failures == []
        assert result.positions == len(TINY_PROMPT) + 10 == len(result.steps)
        assert result.max_abs_logit_diff == 0.0 and result.first_divergent_step is None
        assert result.top1_agreement == 1.0 and result.mean_cosine_similarity == pytest.approx(1.0)
        assert [s.phase for s in result.steps].count("prompt") == len(TINY_PROMPT)
        assert result.latency_ms.p50 > 0 and result.reference_latency_ms.p50 > 0
    # Prefill is one call, then one per generated token: progress per call, ending at the total.
    assert set(seen) == {"reference", "teacher_forced", "free_running"}
    assert all(calls == [(6, 16), *((n, 16) for n in range(7, 17))] for calls in seen.values())
    assert report.provider_fallbacks == [] and report.providers == ["CPUExecutionProvider"]


@pytest.mark.parametrize("variant", ["full_buffer", "new_token_only"])
def test_verify_static_contract_model_against_its_exporter_original(tiny_dir: Path, variant: str) -> None:
    report = verify(tiny_dir / "exporter.onnx", tiny_dir / f"{variant}.onnx", prompt=TINY_PROMPT, steps=10)
    assert report.passed, [m.failures for m in report.modes.values()]
    assert all(m.max_abs_logit_diff < 1e-5 for m in report.modes.values())
    # The token fed at a generated position is the original's greedy choice in both modes here.
    tokens, _ = greedy_decode(tiny_dir / "exporter.onnx", TINY_PROMPT, 10)
    steps = report.modes["teacher_forced"].steps
    assert [s.token_in for s in steps] == TINY_PROMPT + tokens.tolist()


def test_verify_catches_a_corrupted_weight(tiny_dir: Path, tmp_path: Path) -> None:
    corrupted = tmp_path / "corrupted.onnx"
    assert corrupt_mlp_weight(tiny_dir / "exporter.onnx", corrupted) == "layers.0.mlp.fc.weight"
    report = verify(tiny_dir / "exporter.onnx", corrupted, prompt=TINY_PROMPT, steps=10, modes=["teacher_forced"])
    result = report.modes["teacher_forced"]
    assert not report.passed and not result.passed
    assert result.first_divergent_step == 0
    assert result.failures and "max_abs_logit_diff=0.0001" in result.failures[0]


def test_verify_reports_provider_fallback(tiny_dir: Path) -> None:
    report = verify(
        tiny_dir / "exporter.onnx",
        tiny_dir / "full_buffer.onnx",
        prompt=TINY_PROMPT,
        steps=2,
        modes=["free_running"],
        providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
    )
    assert report.passed and list(report.modes) == ["free_running"]
    assert len(report.provider_fallbacks) == 2
    assert all("CUDAExecutionProvider" in line for line in report.provider_fallbacks)


def test_verify_refuses_a_cache_too_short_before_decoding(tiny_dir: Path) -> None:
    # short.onnx has max_cache_len 8: 6 prompt + 3 steps does not fit.
    with pytest.raises(CacheOverflowError, match="max_cache_len=8"):
        verify(tiny_dir / "exporter.onnx", tiny_dir / "short.onnx", prompt=TINY_PROMPT, steps=3)
    assert verify(tiny_dir / "exporter.onnx", tiny_dir / "short.onnx", prompt=TINY_PROMPT, steps=2).passed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"modes": ["beam"]}, "modes"),
        ({"modes": []}, "modes"),
        ({"prompt": []}, "prompt"),
        ({"steps": -1}, "steps"),
    ],
)
def test_verify_refuses_bad_settings(tiny_dir: Path, kwargs: dict, message: str) -> None:
    settings = {"prompt": TINY_PROMPT, "steps": 2, **kwargs}
    with pytest.raises(ConfigError, match=message):
        verify(tiny_dir / "exporter.onnx", tiny_dir / "exporter.onnx", **settings)


# -- exported fixtures (fixtures/registry.json, via tests/conftest.py's any_fixture) -----------------


def test_fixture_reproduces_its_reference(any_fixture: dict) -> None:
    reference = np.load(any_fixture["reference_path"])
    tokens, logits = greedy_decode(any_fixture["model_path"], reference["prompt"].tolist(), len(reference["tokens"]))
    np.testing.assert_array_equal(tokens, reference["tokens"])
    assert logits.shape == reference["logits"].shape
    assert np.abs(logits - reference["logits"]).max() <= any_fixture["expect"].tol(1e-4)  # fp16: 4.9e-4


def test_fixture_verifies_against_itself(any_fixture: dict) -> None:
    reference = np.load(any_fixture["reference_path"])
    path = any_fixture["model_path"]
    report = verify(path, path, prompt=reference["prompt"], steps=len(reference["tokens"]))
    assert report.passed
    for result in report.modes.values():
        assert result.max_abs_logit_diff == 0.0 and result.first_divergent_step is None
        assert result.positions == reference["logits"].shape[0]


def test_fixture_corrupted_copy_fails_verification(any_fixture: dict, tmp_path: Path) -> None:
    reference = np.load(any_fixture["reference_path"])
    corrupted = tmp_path / "model.onnx"
    weight = corrupt_mlp_weight(any_fixture["model_path"], corrupted)
    report = verify(
        any_fixture["model_path"], corrupted, prompt=reference["prompt"].tolist(), steps=len(reference["tokens"])
    )
    assert not report.passed, f"scaling {weight} by 1.05 went unnoticed"
    for result in report.modes.values():
        # 5% on one MLP weight moves every logit, so divergence starts at the first position.
        assert result.first_divergent_step == 0
        assert any("max_abs_logit_diff=0.0001" in failure for failure in result.failures)


# -- export variants: logits under another name, a fixed batch ----------------------------------------


def rename_logits(source: Path, target: Path, name: str = "lm_logits") -> Path:
    """Write a copy of ``source`` whose logits output (and its producer's output) is called ``name``."""
    model = onnx.load(str(source))
    for node in model.graph.node:
        node.output[:] = [name if out == "logits" else out for out in node.output]
        node.input[:] = [name if inp == "logits" else inp for inp in node.input]
    (output,) = [o for o in model.graph.output if o.name == "logits"]
    output.name = name
    onnx.save(model, str(target))
    return target


def fix_batch(source: Path, target: Path, batch: int = 2) -> Path:
    """Write a copy of ``source`` with dim 0 of every graph input/output sharing ``input_ids``' batch symbol set."""
    model = onnx.load(str(source))
    (ids,) = [i for i in model.graph.input if i.name == "input_ids"]
    symbol = ids.type.tensor_type.shape.dim[0].dim_param
    assert symbol, "the fixture's input_ids batch dim is expected to be symbolic"
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].dim_param == symbol:
            dims[0].dim_value = batch
    onnx.save(model, str(target))
    return target


@pytest.mark.parametrize("variant", ["lm_logits", "batch2"])
def test_export_variant_verifies_exactly_against_the_original(variant: str, tmp_path: Path) -> None:
    entry = fixture_entry("llama_gqa_optimum")
    make = rename_logits if variant == "lm_logits" else fix_batch
    candidate = make(entry["model_path"], tmp_path / "model.onnx")
    reference = np.load(entry["reference_path"])
    report = verify(entry["model_path"], candidate, prompt=reference["prompt"].tolist(), steps=8)
    assert report.passed, [m.failures for m in report.modes.values()]
    for result in report.modes.values():
        assert result.max_abs_logit_diff <= 1e-5 and result.top1_agreement == 1.0
        assert result.positions == len(reference["prompt"]) + 8


def test_a_quantized_originals_prompt_goes_one_token_per_call(tmp_path: Path) -> None:
    """MatMulNBits rows depend on the rows per call: the reference feeds a quantized original like a step-1 graph."""
    import yaml  # noqa: PLC0415

    from onnxdeploy.config import load_pipeline  # noqa: PLC0415
    from onnxdeploy.pipeline import run_pipeline  # noqa: PLC0415

    def run(model: Path, out: str, passes: list, verify_cfg) -> Path:
        cfg = {"model": str(model), "output_dir": str(tmp_path / out), "passes": passes, "verify": verify_cfg}
        (tmp_path / f"{out}.yaml").write_text(yaml.safe_dump(cfg))
        assert run_pipeline(load_pipeline(tmp_path / f"{out}.yaml")).exit_code == 0
        return tmp_path / out / "model.onnx"

    quantized = run(fixture_entry("llama_gqa_optimum")["model_path"], "q", [{"quantize_weights": {"bits": 4}}], None)
    static = run(quantized, "s", [{"static_kv": {"max_cache_len": 32}}], None)
    report = verify(quantized, static, prompt=[1, 2, 3, 4, 5], steps=4)
    assert report.passed and report.reference.prompt_per_token
    assert report.original_session is not None and report.original_session.accuracy_level == [0]
    assert report.candidate_session is not None and report.candidate_session.accuracy_level == [0]
    mode = report.modes["teacher_forced"]
    assert mode.reference_prefill is not None and mode.reference_prefill.calls == 5
    float_report = verify(fixture_entry("llama_gqa_optimum")["model_path"], static, prompt=[1, 2, 3], steps=2)
    assert not float_report.reference.prompt_per_token  # a float original's prompt: one call
