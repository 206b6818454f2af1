"""The fixture registry: three real exports from at least two exporters, files matching their sha256."""

from __future__ import annotations

import hashlib

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
        assert model.stat().st_size < 1.5 * 2**20, entry["name"]


def test_registry_io_matches_the_models():
    for entry in REGISTRY:
        model = onnx.load(REPO / entry["path"])
        assert [i.name for i in model.graph.input] == [i["name"] for i in entry["inputs"]], entry["name"]
        assert [o.name for o in model.graph.output] == [o["name"] for o in entry["outputs"]], entry["name"]
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        assert opset == entry["opset"], entry["name"]
