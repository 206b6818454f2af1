"""The real pretrained decoder (SmolLM2-135M-Instruct, ``fixtures/_export_real.py``): text in, text out, and the
fast chain verifying on it (issue 15). Skipped when the exports are not built (the ``real_model`` fixture names the
command); CI does not build them (README "Real model": ~50 min here and ~1.2 GB downloaded per cold run).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.runner import greedy_decode
from onnxdeploy.text import load_codec

pytest.importorskip("tokenizers")
PROMPT_TEXT = "The capital of France is Paris. The capital of Germany is"
CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]
CHAT_IDS += [8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4521, 47, 2, 198, 1, 520, 9531, 198]
"""transformers 5.24's ``apply_chat_template([{"role": "user", "content": "What is the capital of Germany?"}],
add_generation_prompt=True)`` on hf/ (run once in the real-torch venv)."""
FAST_CHAIN = [
    {"static_kv": {"step_lens": [1, 16], "max_cache_lens": [128, 512]}},
    {"mask_rewrite": {}},
    {"grouped_attention": {}},
    {"fuse_matmuls": {}},
]


@pytest.mark.parametrize("export", ["optimum", "dynamo"])
def test_each_export_says_berlin_through_its_own_tokenizer(real_model, export):
    folder = real_model / export
    codec = load_codec(folder, key="k")
    reference = json.loads((real_model / "hf" / "reference.json").read_text())
    ids = codec.prompt_ids(PROMPT_TEXT, chat=False, key="k")
    assert ids == reference["prompt"]  # tokenizers reads tokenizer.json as transformers encoded it
    assert codec.stop_token_ids == (2,)  # <|im_end|>, generation_config.json
    chat = codec.prompt_ids("What is the capital of Germany?", chat=True, key="k")
    assert chat == CHAT_IDS  # the system turn the template adds, the user turn, the assistant's turn opened
    tokens, _ = greedy_decode(str(folder / "model.onnx"), ids, 4)
    assert tokens.tolist() == reference["tokens"][:4]
    assert codec.decode(tokens.tolist()).startswith(" Berlin.")


def test_the_fast_chain_verifies_and_shows_its_text(real_model, tmp_path):
    model = real_model / "optimum" / "model.onnx"
    cfg = {
        "model": str(model),
        "output_dir": str(tmp_path / "out"),
        "passes": FAST_CHAIN,
        "cache": None,
        "verify": {"prompt_text": PROMPT_TEXT, "steps": 8},
    }
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    outcome = run_pipeline(load_pipeline(tmp_path / "pipeline.yaml"))
    report = outcome.report
    assert outcome.exit_code == 0, report.failures
    assert report.verify is not None and len(report.graphs) == 4  # 2 step lengths x 2 cache lengths
    reference = np.load(real_model / "hf" / "reference.npz")
    assert report.verify.prompt == reference["prompt"].tolist()
    gen = report.verify.generations
    assert gen is not None and gen.tokenizer == str(model.parent / "tokenizer.json")
    assert gen.original.text.startswith(" Berlin.") and gen.candidate is not None
    assert gen.candidate.text == gen.original.text and gen.first_differing_token is None
