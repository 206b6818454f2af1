"""Passes never change the graphs or the tensors they are given (issue 14, item 8).

``clone()`` shares every tensor with the input, by design: a pass must make new tensors, never write into one it
was given; and the input's external weights are mapped read-only. Here every pass of the library runs in a
chain on a real export whose weights are external; after each pass its output graph is edited (nodes, values,
tensors, metadata) and the pass's input is checked byte for byte: the graph without weights, every tensor's bytes,
the metadata.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx_ir as ir
import pytest

from onnxdeploy.artifacts import Artifact, ArtifactSet
from onnxdeploy.model_io import load_model, stand_in_proto
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import get_pass
from tests.conftest import fixture_entry
from tests.core.test_model_io import save_external

CHAIN = [
    ("static_kv", {"max_cache_lens": [32], "step_lens": [1, 4]}),
    ("mask_rewrite", {}),
    ("grouped_attention", {}),
    ("fuse_matmuls", {}),
    ("quantize_weights", {"bits": 4, "block_size": 32, "format": "matmulnbits"}),
    ("kv_layout", {"layout": "BSH2D"}),
    ("externalize", {}),
    ("embed_external_data", {}),
]


def _snapshot(artifacts: ArtifactSet) -> list[tuple[str, str, dict[str, str]]]:
    """Per graph: sha256 of the weightless graph, sha256 of every tensor's bytes, the metadata."""
    out = []
    for artifact in artifacts.artifacts:
        model = artifact.model
        graph = hashlib.sha256(stand_in_proto(model).SerializeToString(deterministic=True)).hexdigest()
        tensors = hashlib.sha256()
        for name, value in sorted(model.graph.initializers.items()):
            tensors.update(name.encode() + b"\0" + value.const_value.tobytes())
        out.append((graph, tensors.hexdigest(), dict(model.metadata_props)))
    return out


def _tensors(artifacts: ArtifactSet) -> list[tuple[ir.TensorProtocol, str]]:
    """Every distinct tensor object of the set with the sha256 of its bytes (kept to re-read after a pass)."""
    seen: dict[int, tuple[ir.TensorProtocol, str]] = {}
    for model in artifacts.models():
        for value in model.graph.initializers.values():
            t = value.const_value
            seen.setdefault(id(t), (t, hashlib.sha256(t.tobytes()).hexdigest()))
    return list(seen.values())


def _vandalise(artifacts: ArtifactSet) -> None:
    """Edit every graph of a pass's output the way a later pass may: tensors replaced, values renamed, nodes gone."""
    for model in artifacts.models():
        graph = model.graph
        for value in graph.initializers.values():
            tensor = value.const_value
            value.const_value = ir.tensor(np.zeros(tensor.shape.numpy(), dtype=np.float32), name=tensor.name)
        for node in list(graph)[len(graph) // 2 :]:
            for out in node.outputs:
                out.name = f"{out.name}/edited"
        model.metadata_props["onnxdeploy.contract"] = "{}"


@pytest.fixture(scope="module")
def external_export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("external")
    return save_external(fixture_entry("llama_gqa_optimum")["model_path"], folder)


def test_every_pass_leaves_its_input_graphs_and_tensors_as_they_were(external_export, tmp_path):
    loaded = load_model(external_export)
    mapped = next(v.const_value for v in loaded.model.graph.initializers.values() if v.const_value.nbytes > 4096)
    assert isinstance(mapped, ir.ExternalTensor) and not mapped.numpy().flags.writeable  # read-only mapping
    artifacts = ArtifactSet([Artifact("model.onnx", loaded.model)], input_was_external=True)
    context = make_pass_context(model_path=external_export, scratch_dir=tmp_path / "scratch")
    for name, cfg in CHAIN:
        cls = get_pass(name)
        config = cls.config_model.model_validate(cfg)
        before, tensors = _snapshot(artifacts), _tensors(artifacts)
        if cls.in_place:  # it edits the graphs it is given, by declaration (replacing tensors), not tensor bytes
            out = cls(config)(artifacts, context).artifacts
        else:
            out = cls(config)(artifacts, context).artifacts
            assert _snapshot(artifacts) == before, f"{name} changed the graphs or tensors it was given"
            _vandalise(cls(config)(artifacts, context).artifacts)  # a second output, edited as a later pass may
            assert _snapshot(artifacts) == before, f"{name}'s output shares graph objects with its input"
        written = [t.name for t, sha in tensors if hashlib.sha256(t.tobytes()).hexdigest() != sha]
        assert not written, f"{name} wrote into tensors it was given: {written[:5]}"
        artifacts = out
    assert len(artifacts.artifacts) == 2  # the decode graph and the 4-token prefill bucket
