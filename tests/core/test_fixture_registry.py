"""The fixture registry: three real exports from at least two exporters, files matching their sha256."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx

from tests.conftest import REGISTRY, REPO


def test_registry_has_three_fixtures_from_two_exporters():
    assert len(REGISTRY) >= 3
    assert len({e["exporter"] for e in REGISTRY}) >= 2
    assert {"LlamaForCausalLM", "GPT2LMHeadModel"} <= {e["architecture"] for e in REGISTRY}


def test_fixture_files_match_their_sha256_and_size_limit():
    for entry in REGISTRY:
        model = REPO / entry["path"]
        reference = REPO / entry["reference"]
        assert hashlib.sha256(model.read_bytes()).hexdigest() == entry["sha256"], entry["name"]
        assert hashlib.sha256(reference.read_bytes()).hexdigest() == entry["reference_sha256"], entry["name"]
        # Random-init fixtures stay small; trained ones (fixtures/README.md) may use up to 6 MB.
        limit = 6e6 if "trained" in entry.get("tags", []) else 1.5 * 2**20
        assert model.stat().st_size < limit, entry["name"]


def test_registry_io_matches_the_models():
    for entry in REGISTRY:
        model = onnx.load(REPO / entry["path"])
        assert [i.name for i in model.graph.input] == [i["name"] for i in entry["inputs"]], entry["name"]
        assert [o.name for o in model.graph.output] == [o["name"] for o in entry["outputs"]], entry["name"]
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        assert opset == entry["opset"], entry["name"]


def test_trained_fixture_has_its_held_out_text_and_reference():
    trained = [e for e in REGISTRY if "trained" in e.get("tags", [])]
    assert trained, "no trained fixture in the registry"
    for entry in trained:
        text = (REPO / entry["eval_text"]).read_bytes()
        reference = np.load(REPO / entry["reference"])
        positions = len(reference["eval_tokens"])
        assert reference["eval_tokens"].tolist() == list(text[:positions])
        assert reference["eval_logits"].shape == (positions, entry["config"]["vocab"])
        assert entry["training"]["eval_sha256"] == hashlib.sha256(text).hexdigest()
        # Trained means peaked: the PyTorch model predicts the next held-out byte far above chance (1/256).
        assert (reference["eval_logits"][:-1].argmax(-1) == reference["eval_tokens"][1:]).mean() > 0.4
