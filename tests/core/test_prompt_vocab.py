"""A verify prompt outside the model's vocabulary is refused before any pass, naming its key and, for text, the
tokenizer that encoded it and both vocabulary sizes (a tokenizer that is not the model's is the usual cause)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from tests.conftest import fixture_entry

MODEL = fixture_entry("llama_bytes_torchscript")["model_path"]
"""The trained byte-level decoder: 256 logits."""


def _wide_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer of 1001 tokens: ``hello`` is id 1000, ``w<i>`` id i."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 1000)}, "hello": 1000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def _run(tmp_path: Path, verify: dict) -> tuple[int, str]:
    cfg = {"model": str(MODEL), "output_dir": str(tmp_path / "out"), "cache": None, "verify": {**verify, "steps": 2}}
    cfg["passes"] = [{"static_kv": {"max_cache_len": 64}}]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", str(tmp_path / "p.yaml")])
    return result.exit_code, result.output


def test_a_prompt_text_from_another_models_tokenizer_names_the_tokenizer_and_both_vocabularies(tmp_path):
    tokenizer = _wide_tokenizer(tmp_path)
    code, out = _run(tmp_path, {"prompt_text": "w3 hello w7", "tokenizer": str(tokenizer)})
    assert code == 2, out
    line = " ".join(out.split())  # rich may wrap on a narrow terminal
    assert "key 'verify.prompt_text'" in line and "'verify.prompt'" not in line, line
    assert f"the tokenizer {tokenizer} (1001 tokens) encodes it to id 1000" in line, line
    assert "its logits have 256 entries: ids 0..255" in line and "not this model's" in line, line
    assert line.count("verify") == 2, line  # the key and the fix: no stray "verify:" prefix
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_of_fewer_than_half_the_models_logits_is_refused_though_its_ids_fit(tmp_path):
    """A byte tokenizer (256 ids) on a 512-logit model: every id fits, the text would decode as noise."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 200)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"model": str(fixture_entry("llama_gqa_optimum")["model_path"]), "output_dir": str(tmp_path / "out")}
    cfg |= {"passes": [{"static_kv": {"max_cache_len": 64}}], "cache": None}
    cfg["verify"] = {"prompt_text": "w3 w7", "tokenizer": str(tmp_path / "tokenizer.json"), "steps": 2}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", str(tmp_path / "p.yaml")])
    line = " ".join(result.output.split())
    assert result.exit_code == 2 and "key 'verify.tokenizer'" in line and "has 200 tokens" in line, line
    assert "512 logits" in line and "not this model's" in line and not (tmp_path / "out").exists()


def test_prompt_ids_outside_the_vocabulary_name_the_key_once(tmp_path):
    code, out = _run(tmp_path, {"prompt": [1, 2, 300]})
    assert code == 2, out
    line = " ".join(out.split())
    assert "key 'verify.prompt': token id 300 is outside the vocabulary of the model" in line, line
    assert "verify: " not in line, line
    assert not (tmp_path / "out").exists()


def test_verify_prompt_text_from_another_models_tokenizer_names_it_too(tmp_path):
    tokenizer = _wide_tokenizer(tmp_path)
    args = ["verify", str(MODEL), str(MODEL), "--steps", "1", "--prompt-text", "hello", "--tokenizer", str(tokenizer)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert f"--prompt-text: the tokenizer {tokenizer} (1001 tokens) encodes it to id 1000" in line, line
    assert "its logits have 256 entries" in line and "--tokenizer" in line, line
