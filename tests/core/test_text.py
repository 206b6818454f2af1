"""Text in, text out (onnxdeploy/text.py, text_report.py): the tokenizer a folder declares, prompts and held-out text
as text, both models' generations decoded in every report, and the bad inputs refused before any pass.

The committed fixture with a tokenizer is the trained byte-level ``llama_bytes`` (``fixtures/llama_bytes/
tokenizer.json``, written by ``fixtures/_byte_tokenizer.py``: id = byte, exact for its vocabulary).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from onnxdeploy.config import load_pipeline
from onnxdeploy.errors import ConfigError
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.render import render_markdown
from onnxdeploy.report import ModeResult, StepRecord, VerifyReport
from onnxdeploy.text import generations, load_codec
from onnxdeploy.text_report import generations_html, generations_markdown
from tests.conftest import REPO, fixture_entry

pytest.importorskip("tokenizers")
ENTRY = fixture_entry("llama_bytes_torchscript")
MODEL = ENTRY["model_path"]
TOKENIZER = REPO / "fixtures" / "llama_bytes" / "tokenizer.json"
EVAL_TXT = REPO / ENTRY["eval_text"]
PROMPT = "    return "
"""The trained fixture continues it with ``self.__class__.__name__`` (greedy, 30 bytes checked once here)."""


def test_the_byte_tokenizer_is_the_fixtures_vocabulary():
    codec = load_codec(TOKENIZER.parent, key="k")
    text = EVAL_TXT.read_text(encoding="utf-8")
    ids = codec.encode(text)
    assert ids == list(text.encode("utf-8")) and codec.decode(ids) == text
    assert ids[:256] == np.load(ENTRY["reference_path"])["eval_tokens"].tolist()
    assert codec.vocab_size() == 256 and codec.stop_token_ids == () and codec.chat_template is None


def _folder(tmp_path: Path, **files: object) -> Path:
    """A tokenizer folder: the byte tokenizer plus the given JSON (dict) or text (str) files."""
    shutil.copyfile(TOKENIZER, tmp_path / "tokenizer.json")
    for name, content in files.items():
        name = name.replace("__", ".")
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return tmp_path


TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def test_the_chat_template_and_stop_tokens_the_folder_declares(tmp_path):
    folder = _folder(
        tmp_path,
        tokenizer_config__json={"chat_template": TEMPLATE, "eos_token": "\n"},
        generation_config__json={"eos_token_id": [10, 0]},
        config__json={"eos_token_id": 3},
    )
    codec = load_codec(folder, key="k")
    assert codec.stop_token_ids == (10, 0)  # generation_config.json first
    assert codec.render_chat("hi", key="k") == "<user>hi\n<a>"
    assert codec.prompt_ids("hi", chat=True, key="k") == list(b"<user>hi\n<a>")
    (folder / "generation_config.json").unlink()
    (folder / "chat_template.jinja").write_text("[{{ messages[0].content }}]")  # the file wins over the key
    codec = load_codec(folder / "tokenizer.json", key="k")
    assert codec.stop_token_ids == (3,) and codec.prompt_ids("hi", chat=True, key="k") == list(b"[hi]")


def _report(prompt: list[int], original: list[int], candidate: list[int]) -> VerifyReport:
    """Free-running rows: the top-1 of each model at position p is its generated token p - len(prompt) + 1."""
    start = len(prompt) - 1
    rows = [
        StepRecord.model_construct(position=start + i, top1_reference=o, top1_candidate=c)
        for i, (o, c) in enumerate(zip(original, candidate, strict=True))
    ]
    rows = [StepRecord.model_construct(position=p, top1_reference=0, top1_candidate=0) for p in range(start)] + rows
    mode = ModeResult.model_construct(mode="free_running", steps=rows)
    return VerifyReport.model_construct(prompt=prompt, modes={"free_running": mode})


def test_generations_mark_the_first_differing_token_and_end_at_a_stop_token(tmp_path):
    codec = load_codec(_folder(tmp_path, config__json={"eos_token_id": 10}), key="k")
    prompt = list(b"x = ")
    # "café\n" + more against "cafè": the first difference is the second byte of a two-byte character.
    gen = generations(_report(prompt, list("café\nzzz".encode()), list("cafè!!zz".encode())), codec, prompt_text="x = ")
    assert gen.original.text == "café" and gen.original.stopped and gen.original.tokens[-1] == 10
    assert gen.candidate is not None and gen.candidate.text == "cafè!!zz" and not gen.candidate.stopped
    assert gen.first_differing_token == 4  # bytes c a f 0xC3 | 0xA9 vs 0xA8
    o, c = gen.original, gen.candidate
    assert o.text[o.mark_start : o.mark_end] == "é" and c.text[c.mark_start : c.mark_end] == "è"
    md = "\n".join(generations_markdown(gen))
    assert "| caf**⟦é⟧** [stop] | caf**⟦è⟧**!!zz […] |" in md and "generated token 4" in md
    html = "\n".join(generations_html(gen))
    assert "caf<mark>é</mark>" in html and "caf<mark>è</mark>!!zz" in html
    same = generations(_report(prompt, list(b"abc"), list(b"abc")), codec)
    assert same.first_differing_token is None and same.original.mark_start is None and same.prompt_text == "x = "


def _pipeline(tmp_path: Path, verify: dict, max_cache_len: int = 64) -> Path:
    cfg = {
        "model": str(MODEL),
        "output_dir": str(tmp_path / "out"),
        "passes": [{"static_kv": {"max_cache_len": max_cache_len}}],
        "cache": None,
        "verify": verify,
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_run_with_text_in_shows_text_out(tmp_path):
    verify = {
        "prompt_text": PROMPT,
        "tokenizer": str(TOKENIZER.parent),
        "steps": 11,  # + the token after the last step: 12 generated
        "accuracy": {"text_file": str(EVAL_TXT), "max_tokens": 24},
    }
    outcome = run_pipeline(load_pipeline(_pipeline(tmp_path, verify)))
    report = outcome.report
    assert outcome.exit_code == 0, report.failures
    assert report.verify is not None and report.verify.prompt == list(PROMPT.encode())
    gen = report.verify.generations
    assert gen is not None and gen.prompt_text == PROMPT and gen.tokenizer == str(TOKENIZER)
    assert gen.original.text == "self.__class" and gen.candidate is not None and gen.candidate.text == gen.original.text
    assert gen.first_differing_token is None
    assert report.accuracy is not None and report.accuracy.tokens == 24
    inputs = {Path(f.path).name for f in report.files if f.role == "input"}
    assert {"tokenizer.json", "eval.txt"} <= inputs
    out = tmp_path / "out"
    saved = json.loads((out / "report.json").read_text())
    assert saved["verify"]["generations"]["original"]["text"] == "self.__class"
    assert "## Generations" in (out / "report.md").read_text() and "| self.\\_\\_class […] |" in render_markdown(report)
    assert 'id="generations"' in (out / "report.html").read_text()


def test_verify_command_takes_a_prompt_text(tmp_path):
    result = CliRunner().invoke(
        app,
        ["verify", str(MODEL), str(MODEL), "--prompt-text", PROMPT, "--tokenizer", str(TOKENIZER), "-n", "4", "--json"],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["prompt"] == list(PROMPT.encode()) and payload["generations"]["original"]["text"] == "self."


@pytest.mark.parametrize(
    ("verify", "max_cache_len", "key", "says"),
    [
        ({"prompt_text": PROMPT}, 64, "verify.prompt_text", "no tokenizer found (folder"),
        ({"prompt_text": PROMPT, "tokenizer": "nowhere/tokenizer.json"}, 64, "verify.tokenizer", "file not found"),
        (
            {"prompt_text": "x" * 20, "tokenizer": str(TOKENIZER), "steps": 8},
            16,
            "passes[0].static_kv",
            "shorten verify.prompt_text",
        ),
        ({"prompt": [1, 2], "prompt_text": PROMPT, "tokenizer": str(TOKENIZER)}, 64, "verify.prompt_text", "not both"),
        (
            {"tokenizer": str(TOKENIZER), "accuracy": {"text_file": "missing.txt"}},
            64,
            "verify.accuracy.text_file",
            "not found",
        ),
        (
            {"prompt_text": PROMPT, "tokenizer": str(TOKENIZER), "chat_template": True},
            64,
            "verify.prompt_text",
            "no chat template",
        ),
        (
            {"accuracy": {"text_file": str(EVAL_TXT), "token_ids_file": str(EVAL_TXT)}},
            64,
            "verify.accuracy",
            "exactly one",
        ),
    ],
    ids=[
        "no-tokenizer",
        "tokenizer-missing",
        "longer-than-cache",
        "ids-and-text",
        "text-file-missing",
        "no-template",
        "two-sources",
    ],
)
def test_bad_text_input_exits_2_naming_the_key(tmp_path, verify, max_cache_len, key, says):
    result = CliRunner().invoke(app, ["run", str(_pipeline(tmp_path, verify, max_cache_len))])
    assert result.exit_code == 2, result.output
    assert f"'{key}" in result.output and says in result.output, result.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError):
        load_pipeline(tmp_path / "pipeline.yaml")
