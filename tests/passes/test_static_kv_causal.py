"""static_kv refuses an ``is_causal`` Attention-23 it cannot keep exact (q_len != kv_len), naming the node."""

from __future__ import annotations

import onnx
import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.errors import PreconditionError
from onnxdeploy.pipeline import run_pipeline
from tests.conftest import fixture_entry


def _causal_copy(tmp_path):
    """llama_gqa_dynamo23 with is_causal=1 on its Attention nodes (Q: S positions, K/V: past + S)."""
    model = onnx.load(str(fixture_entry("llama_gqa_dynamo23")["model_path"]))
    for node in model.graph.node:
        if node.op_type == "Attention":
            for attr in node.attribute:
                if attr.name == "is_causal":
                    attr.i = 1
    path = tmp_path / "causal.onnx"
    onnx.save(model, str(path))
    return path


def test_is_causal_attention_with_a_cache_is_refused_before_any_pass_naming_the_node(tmp_path):
    cfg = {
        "model": str(_causal_copy(tmp_path)),
        "output_dir": str(tmp_path / "out"),
        "passes": [{"static_kv": {"max_cache_len": 16}}],
        "verify": None,
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(PreconditionError) as err:
        run_pipeline(load_pipeline(tmp_path / "p.yaml"))
    message = str(err.value)
    assert "static_kv" in message and "'node_scaled_dot_product_attention' has is_causal=1" in message, message
    assert "upper left" in message and "attn_mask" in message
    assert not (tmp_path / "out").exists()


def test_the_exporters_explicit_mask_form_is_not_refused(tmp_path):
    cfg = {
        "model": str(fixture_entry("llama_gqa_dynamo23")["model_path"]),
        "output_dir": str(tmp_path / "out"),
        "passes": [{"static_kv": {"max_cache_len": 16}}],
        "verify": None,
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    assert run_pipeline(load_pipeline(tmp_path / "p.yaml")).exit_code == 0
