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
FIXTURE_NAMES = [e["name"] for e in REGISTRY]
PROMPT = [1, 17, 42, 99, 7, 3]


def fixture_entry(name: str) -> dict:
    """Return the registry entry named ``name`` with absolute ``model_path`` and ``reference_path``."""
    entry = next(e for e in REGISTRY if e["name"] == name)
    return {**entry, "model_path": REPO / entry["path"], "reference_path": REPO / entry["reference"]}


@pytest.fixture(params=FIXTURE_NAMES)
def any_fixture(request) -> dict:
    """Each registered fixture in turn."""
    return fixture_entry(request.param)
