from __future__ import annotations

from pathlib import Path

import pytest

from tests.runner.tiny_decoder import save_tiny_decoder


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny decoder in every variant, same weights (seed 0), written once per session."""
    root = tmp_path_factory.mktemp("tiny")
    save_tiny_decoder(root / "exporter.onnx")
    save_tiny_decoder(root / "full_buffer.onnx", "full_buffer")
    save_tiny_decoder(root / "new_token_only.onnx", "new_token_only")
    save_tiny_decoder(root / "step2.onnx", "full_buffer", step_len=2)
    save_tiny_decoder(root / "short.onnx", "full_buffer", max_cache_len=8)
    return root
