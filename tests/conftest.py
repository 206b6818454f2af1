"""Shared test helpers: the fixture registry and small model builders.

Fixtures are real exports committed under ``fixtures/`` (see ``fixtures/registry.json``); tests
never need torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REGISTRY = json.loads((REPO / "fixtures" / "registry.json").read_text())
# Fixtures whose graphs the general per-fixture tests do not describe: a cache inside an attention op
# (genai GroupQueryAttention), opset-23 Attention, float16. tests/passes/test_attention_ops.py covers them
# (static_kv + mask_rewrite, 8 + 64 positions, both modes) and test_fixture_registry.py checks their files.
SPECIAL_TAGS = frozenset({"attention_op", "opset23", "fp16"})
FIXTURE_NAMES = [e["name"] for e in REGISTRY if not SPECIAL_TAGS & set(e.get("tags", []))]
PROMPT = [1, 17, 42, 99, 7, 3]


@pytest.fixture(autouse=True)
def _private_pass_cache(tmp_path_factory, monkeypatch) -> None:
    """Each test gets its own empty pass cache (no test is served what another stored, nothing lands in ~/.cache)."""
    monkeypatch.setenv("ONNXDEPLOY_CACHE_DIR", str(tmp_path_factory.mktemp("pass-cache")))


def fixture_entry(name: str) -> dict:
    """Return the registry entry named ``name`` with absolute ``model_path`` and ``reference_path``."""
    entry = next(e for e in REGISTRY if e["name"] == name)
    return {**entry, "model_path": REPO / entry["path"], "reference_path": REPO / entry["reference"]}


@pytest.fixture(params=FIXTURE_NAMES)
def any_fixture(request) -> dict:
    """Each registered fixture in turn."""
    return fixture_entry(request.param)
