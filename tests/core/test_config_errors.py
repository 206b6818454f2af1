"""Config errors in the pipeline file's own words (config_errors.py); the pass listing's types (pass_listing.py).

Each bad file is refused by ``load_pipeline`` (no model read, no pass run) with the key path the user wrote, a
plain sentence without pydantic's wording, and "did you mean" for a near miss.
"""

from __future__ import annotations

import re

import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from onnxdeploy.config import load_pipeline
from onnxdeploy.errors import ConfigError
from onnxdeploy.pass_listing import config_rows, yaml_type
from onnxdeploy.passes import CATALOG
from tests.conftest import fixture_entry

MODEL = str(fixture_entry("llama_gqa_optimum")["model_path"])
STATIC = {"static_kv": {"max_cache_len": 64}}

PYDANTIC = re.compile(r"Input should|Value error|instance of|Field required|\.\d+[.']|Extra inputs")
"""pydantic's own wording and its ``rules.0`` locations: none may reach the user."""


@pytest.mark.parametrize(
    ("cfg", "says"),
    [
        (
            {"passes": [STATIC, {"pin_opset": {"opset": 17}}, {"quantize_weights": {"rules": [{"bits": 3}]}}]},
            "key 'passes[2].quantize_weights.rules[0].bits': must be 4, 8 or 'float', got 3",
        ),
        (
            {"passes": [{"quantize_weights": {"rules": [3]}}]},
            "key 'passes[0].quantize_weights.rules[0]': must be a mapping of keys (key: value), got 3",
        ),
        (
            {"passes": [{"quantize_weights": {"budget": 3}}]},
            "key 'passes[0].quantize_weights.budget': must be a mapping of keys (key: value), got 3",
        ),
        ({"output_name": "a/b.onnx"}, "key 'output_name': must be a plain file name (no folder part), e.g. model.onnx"),
        ({"verify": {"prompt": [1, "a"]}}, "key 'verify.prompt[1]': must be an integer, got 'a'"),
        ({"check_after_each_pass": "yes please"}, "'check_after_each_pass': must be true or false, got 'yes please'"),
        ({"passes": [{"static_kv": {"max_cache_len": -1}}]}, "must be greater than or equal to 1, got -1"),
        (
            {"passes": [{"static_kv": {"max_cach_len": 64}}]},
            "key 'passes[0].static_kv.max_cach_len': unknown key; did you mean 'max_cache_len' or 'max_cache_lens'?",
        ),
        (
            {"passes": [{"quantize_weights": {"rules": [{"bitz": 4}]}}]},
            "key 'passes[0].quantize_weights.rules[0].bitz': unknown key; did you mean 'bits'?",
        ),
        (
            {"passes": [{"quantize_weights": {"budget": {"max_mean_kll": 0.1}}}]},
            "budget.max_mean_kll': unknown key; did you mean 'max_mean_kl'?",
        ),
        ({"verfy": {"steps": 3}}, "key 'verfy': unknown key; did you mean 'verify'?"),
        (
            {"passes": [{"static_kv": {"max_cache_len": 64, "kv_layout": {"layout": "BSH2D"}}}]},
            "static_kv.kv_layout': unknown key; 'kv_layout' is a pass of its own: list it in passes as '- kv_layout:",
        ),
        ({"verify": {"accuracy": {"max_mean_kll": 1}}}, "'verify.accuracy.max_mean_kll': unknown key; did you mean"),
        ({"verify": {"runtimes": ["openvinoo"]}}, "got 'openvinoo'; did you mean 'openvino'?"),
        ({"sdk": {"mode": "bulid"}}, "key 'sdk.mode': must be 'auto', 'build' or 'off', got 'bulid'; did you mean"),
        ({"passes": [{"static_kvv": {}}]}, "unknown pass 'static_kvv'; known passes: "),
        ({"passes": [{"static_kvv": {}}]}, "; did you mean 'static_kv'?"),
        ({"checks": ["checkr"]}, "unknown check 'checkr'; known checks: "),
        ({"verify": {"providers": ["CPUExecutionProvder"]}}, "; did you mean 'CPUExecutionProvider'?"),
        ({"target": "ort-cpuu"}, "; did you mean 'ort-cpu'?"),
    ],
)
def test_a_bad_key_is_named_as_written_in_a_plain_sentence(tmp_path, cfg, says):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, **cfg}))
    with pytest.raises(ConfigError) as info:
        load_pipeline(path)
    message = str(info.value)
    assert says in message, message
    assert not PYDANTIC.search(message), message
    assert message.count(str(path)) == 1, message


def test_a_far_miss_gets_no_suggestion(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "cache": {"folder": "x"}}))
    with pytest.raises(ConfigError, match=r"key 'cache.folder': unknown key$"):
        load_pipeline(path)


def test_the_pass_listing_names_types_as_yaml_and_expands_nested_mappings():
    rows = {r["name"]: r for r in config_rows(CATALOG["quantize_weights"].config_model)}
    assert rows["budget"]["type"] == "mapping | null"
    assert rows["rules"]["type"] == "list of mappings"
    assert rows["rules[].bits"]["type"] == "4 | 8 | float | null"
    assert rows["budget.max_mean_kl"]["type"] == "float | null" and rows["budget.max_mean_kl"]["description"]
    assert rows["exclude"]["type"] == "list of string"
    assert yaml_type(CATALOG["kv_layout"].config_model.model_fields["layout"].annotation) == "BHSD | BSH2D | BHDS_K"
    every = [r for info in CATALOG.values() for r in config_rows(info.config_model)]
    assert not [r for r in every if "onnxdeploy" in r["type"] or "None" in r["type"] or r["type"] == "list"]
    listed = CliRunner().invoke(app, ["passes"], terminal_width=250)
    assert listed.exit_code == 0 and "budget.max_mean_kl" in listed.stdout and "onnxdeploy." not in listed.stdout
