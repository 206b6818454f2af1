"""The ``cache`` section of a pipeline: where the pass cache lives and how it keys and bounds its entries.

Apart from :mod:`onnxdeploy.pass_cache` (which imports onnx, onnx_ir, onnxruntime and onnxsim to key and serve
entries) so that the pipeline file validates without them: a bad key is refused before anything heavy is imported.
``pass_cache`` re-exports both names.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool

__all__ = ["CacheConfig", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$ONNXDEPLOY_CACHE_DIR``, else ``$XDG_CACHE_HOME/onnxdeploy/passes``, else ``~/.cache/onnxdeploy/passes``."""
    env = os.environ.get("ONNXDEPLOY_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onnxdeploy" / "passes"


class CacheConfig(BaseModel):
    """The ``cache`` section of a pipeline (``cache: null`` or CLI ``--no-cache`` turns the cache off)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dir: Path | None = Field(
        None,
        strict=False,
        description="Cache folder (relative to the pipeline file); default $ONNXDEPLOY_CACHE_DIR, else "
        "$XDG_CACHE_HOME/onnxdeploy/passes or ~/.cache/onnxdeploy/passes. CLI: --cache-dir.",
    )
    full_hash: StrictBool = Field(
        False,
        description="Key the input by the sha256 of every model and data file instead of their size and mtime "
        "(plus the graph's hash either way); reads every weight byte once per run.",
    )
    max_bytes: int = Field(
        8 * 2**30,
        ge=0,
        description="Bytes the cache folder holds at most; least recently used entries are removed after each "
        "store, and an entry larger than this is not stored.",
    )

    def folder(self) -> Path:
        """The cache folder: ``dir`` or :func:`default_cache_dir`."""
        return self.dir if self.dir is not None else default_cache_dir()
