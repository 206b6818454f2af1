"""``split``'s K from a size limit: ``max_part_bytes`` or the target's ``context_bytes`` (``parts: auto``).

The limit is checked before any pass on the export's own weights (``export_layer_weights``, a lower bound of the
static graph's, checked here on every fixture); the chosen K decodes as the export on ONNX Runtime; bad configs
exit 2 before any pass and write nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from onnxdeploy.checks import CheckContext
from onnxdeploy.checks.target_tensors import TargetTensorsCheck
from onnxdeploy.config import load_pipeline
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError
from onnxdeploy.matrices import Matrix, get_target
from onnxdeploy.model_io import load_model, stage_artifacts
from onnxdeploy.pass_context import make_pass_context, target_defaults
from onnxdeploy.passes._context import TargetDefaults
from onnxdeploy.passes._layer_cuts import export_layer_weights, find_layer_cuts
from onnxdeploy.passes.mask_rewrite import MaskRewritePass
from onnxdeploy.passes.split import SplitConfig, SplitPass, share_layers
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner import verify
from tests.conftest import ALL_FIXTURE_NAMES, BF16_FIXTURE_NAMES, fixture_entry

TRAINED = "llama_bytes_torchscript"  # 4 layers: segments of 919300, 788228, 788228, 919812 weight bytes (static)


def _static(name: str, max_cache_len: int = 24):
    artifacts = StaticKVCachePass(StaticKVConfig(max_cache_len=max_cache_len))(
        load_model(fixture_entry(name)["model_path"]).model, make_pass_context()
    ).artifacts
    return MaskRewritePass()(artifacts, make_pass_context()).artifacts


def _segment_bytes(artifacts) -> list[int]:
    contract = read_contract(artifacts.primary)
    cuts = find_layer_cuts(artifacts.primary.graph, contract, who="test")
    return [
        sum(b for _, b in cuts.segment_weights(artifacts.primary.graph, i).values())
        for i in range(len(cuts.layer_pasts))
    ]


@pytest.mark.parametrize("name", [n for n in [*ALL_FIXTURE_NAMES, *BF16_FIXTURE_NAMES] if n != "llama_gqa_genai"])
def test_the_exports_layer_weights_are_a_lower_bound_of_the_static_graphs(name: str) -> None:
    """What the check before any pass counts on the export: every layer, at most the static graph's, within 1.1%."""
    exported = export_layer_weights(load_model(fixture_entry(name)["model_path"]).model, who="split")
    assert exported is not None
    static = _segment_bytes(_static(name))
    got = [sum(layer.values()) for layer in exported]
    assert len(got) == len(static)
    assert all(0.989 * s <= g <= s for g, s in zip(got, static, strict=True)), (got, static)


def test_genai_has_no_cut_on_the_export_either() -> None:
    """The check before any pass leaves such a graph to the pass, which refuses it naming the boundary."""
    assert export_layer_weights(load_model(fixture_entry("llama_gqa_genai")["model_path"]).model, who="split") is None


def test_a_limit_shares_the_fewest_parts_evenly() -> None:
    """K from the greedy count, the layers then balanced over K (a greedy fill would leave 300 | 100)."""
    layers = [{1: 100}, {2: 100}, {3: 100}, {4: 100}]
    assert share_layers(layers, parts=None, max_bytes=300) == [0, 2]
    assert share_layers(layers, parts=None, max_bytes=400) == [0]  # fits whole
    with pytest.raises(ConfigError, match=r"parts: auto: x's context_bytes 50: layer 0's weights alone are 100"):
        share_layers(layers, parts=None, max_bytes=50, limit_name="parts: auto: x's context_bytes 50")


def _split_with(name: str, folder: Path, config: dict, context) -> tuple[Path, object]:
    result = SplitPass(SplitConfig(**config))(_static(name, 48), context)
    folder.mkdir(parents=True)
    stage_artifacts(
        [(a.name, a.model) for a in result.artifacts.artifacts], folder, external=True, data_name="model.onnx.data"
    ).commit()
    return folder / "model.onnx", result.report


def test_parts_auto_takes_the_fewest_parts_the_targets_context_holds_and_decodes_as_the_export(tmp_path: Path) -> None:
    """A context limit of 1.8 MB on the trained 4-layer model: 3.4 MB of weights need 2 parts, cut in the middle."""
    context = make_pass_context()
    context.target, context.target_defaults = "ort-qnn", TargetDefaults("ort-qnn", context_bytes=1_800_000)
    primary, report = _split_with(TRAINED, tmp_path / "out", {"parts": "auto"}, context)
    assert [p["num_layers"] for p in report.details["parts"]] == [2, 2]
    assert report.details["part_limit"] == {
        "bytes": 1_800_000,
        "from": "parts: auto: ort-qnn's context_bytes 1800000 (matrices/ort-qnn.yaml)",
        "source": "",
        "parts": 2,
    }
    assert all(p["weight_bytes"] <= 1_800_000 for p in report.details["parts"])
    prompt = np.random.default_rng(0).integers(1, 256, size=8).tolist()
    outcome = verify(fixture_entry(TRAINED)["model_path"], primary, prompt=prompt, steps=20)
    assert outcome.passed, outcome.failures
    assert all(m.top1_agreement == 1.0 for m in outcome.modes.values())


def test_max_part_bytes_takes_three_parts_where_two_do_not_fit(tmp_path: Path) -> None:
    primary, report = _split_with(TRAINED, tmp_path / "out", {"max_part_bytes": 1_600_000}, make_pass_context())
    assert [p["num_layers"] for p in report.details["parts"]] == [1, 2, 1]  # two layers with an end segment do not fit
    assert all(p["weight_bytes"] <= 1_600_000 for p in report.details["parts"])
    prompt = np.random.default_rng(1).integers(1, 256, size=8).tolist()
    outcome = verify(fixture_entry(TRAINED)["model_path"], primary, prompt=prompt, steps=20)
    assert outcome.passed, outcome.failures


def test_the_ort_qnn_matrix_states_the_htp_context_limit_with_its_source() -> None:
    defaults = target_defaults("ort-qnn")
    assert defaults is not None and defaults.context_bytes == 4_000_000_000
    assert "executorch" in defaults.context_source and "4 GB per-context limit" in defaults.context_source
    assert target_defaults("ort-cpu").context_bytes is None


def _pipeline(tmp_path: Path, split: dict, **extra) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
                "output_dir": str(tmp_path / "out"),
                "passes": [{"static_kv": {"max_cache_len": 16}}, {"split": split}],
                "verify": {"prompt": [1, 2, 3], "steps": 4},
                **extra,
            }
        )
    )
    return path


def test_a_model_the_targets_context_holds_is_kept_whole(tmp_path: Path) -> None:
    """``parts: auto`` on ort-qnn (4 GB) with a 0.6 MB model: one part, the graph written whole and verified."""
    outcome = run_pipeline(load_pipeline(_pipeline(tmp_path, {"parts": "auto"}, target="ort-qnn")))
    assert outcome.exit_code in (0, 1), outcome.report.failures  # 1: ort-qnn's target checks may flag ops
    assert outcome.report.verify is not None and outcome.report.verify.passed
    assert sorted(p.name for p in (tmp_path / "out").glob("*.onnx")) == ["model.onnx"]
    split = next(p for p in outcome.report.passes if p.name == "split")
    assert any("not split" in c and "4000000000" in c for c in split.changes)


@pytest.mark.parametrize(
    ("split", "extra", "message"),
    [
        ({"max_part_bytes": 200_000}, {}, r"max_part_bytes=200000: layer 0's weights alone are 278784 bytes"),
        ({"parts": "auto"}, {}, r"parts: auto .* the pipeline has no 'target'"),
        ({"parts": "auto"}, {"target": "ort-cpu"}, r"matrices/ort-cpu.yaml states no context_bytes limit"),
        ({"parts": 1}, {}, r"parts=1: give 2 or more"),
    ],
)
def test_a_limit_no_part_can_meet_exits_2_before_any_pass_and_writes_nothing(
    tmp_path: Path, split: dict, extra: dict, message: str
) -> None:
    """The fresh user's case first: one layer (with the embedding) above max_part_bytes."""
    with pytest.raises(ConfigError, match=message) as err:
        run_pipeline(load_pipeline(_pipeline(tmp_path, split, **extra)))
    assert err.value.exit_code == 2
    assert "passes[1].split" in str(err.value) or "split" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_target_check_charges_a_graph_above_the_context_and_passes_each_part(tmp_path: Path, monkeypatch) -> None:
    """``OD526`` on the whole export's 0.56 MB at a 400 kB context; each of its two parts (~0.28 MB) fits."""
    base = get_target("ort-qnn").model_dump(mode="json")
    limit = {**base["limits"][0], "value": 400_000}
    monkeypatch.setattr(
        "onnxdeploy.checks.target_tensors.get_target", lambda _name: Matrix.model_validate({**base, "limits": [limit]})
    )

    def od526(path: Path) -> list[str]:
        header = onnx.load(str(path), load_external_data=False)
        return [
            f.message for f in TargetTensorsCheck().run(header, CheckContext(target="ort-qnn")) if f.code == "OD526"
        ]

    name = "llama_gqa_optimum"
    whole = od526(Path(fixture_entry(name)["model_path"]))
    assert len(whole) == 1 and "above ort-qnn's context_bytes 400000" in whole[0]
    primary, _ = _split_with(name, tmp_path / "out", {"parts": 2}, make_pass_context())
    assert od526(primary) == [] and od526(primary.with_name("model.part1.onnx")) == []
