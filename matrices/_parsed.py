"""Matrix data files parsed once per content: the YAML's data kept as JSON in the user's cache folder.

PyYAML builds a Python object per scalar even with libyaml's parser: the ten matrix files (~360 KB, most of it
``ort-cpu.yaml``'s op list) take ~0.4 s of CPU to load, which made ``onnxdeploy matrix list`` miss issue 20's
1.0 s start-up goal, while ``json.loads`` of the same data takes ~16 ms. The data is keyed by the sha256 of the
file's text, so an edited file is parsed again; the schema validates the data either way (the cache holds no
validated model). Where the folder cannot be written the YAML is parsed every time.

Folder: ``$XDG_CACHE_HOME/onnxdeploy/matrices``, else ``~/.cache/onnxdeploy/matrices``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

__all__ = ["cache_folder", "load_yaml"]


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/onnxdeploy/matrices``, else ``~/.cache/onnxdeploy/matrices``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onnxdeploy" / "matrices"


def _iso(value: object) -> str:
    if isinstance(value, datetime.date):  # YAML dates (sources' `read`): the schema reads them back from ISO text
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} has no JSON form")


def load_yaml(text: str, loader: type[yaml.SafeLoader] | Any) -> Any:
    """The data of the YAML ``text`` (a matrix file's), from the cache when this text was parsed before.

    Args:
        text: the file's text.
        loader: the safe loader to parse it with on a miss (``yaml.CSafeLoader`` where libyaml is installed).

    Returns:
        The data as ``yaml.load`` gives it, except that dates come back as ISO strings from the cache.

    Raises:
        yaml.YAMLError: the text is not YAML (never cached).
    """
    path = cache_folder() / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    data = yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader)
    try:
        payload = json.dumps(data, default=_iso)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8") as f:
            temp = Path(f.name)
            f.write(payload)
        try:
            os.replace(temp, path)  # atomic: a reader sees the whole file or none
        finally:
            temp.unlink(missing_ok=True)
    except (OSError, TypeError, ValueError):
        pass
    return data
