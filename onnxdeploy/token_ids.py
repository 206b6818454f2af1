"""Token id files: calibration data for passes and held-out text for the runner's accuracy figures.

onnxdeploy has no tokenizer: a file holds token ids already. The format follows the suffix:

* ``.npy``: an integer array, 1-D (one sequence) or 2-D (one sequence per row);
* ``.json``: a list of ids or a list of lists;
* anything else: text of whitespace-separated decimal ids (one sequence).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from onnxdeploy.errors import ConfigError

__all__ = ["load_token_ids"]


def load_token_ids(path: str | Path, max_tokens: int, *, vocab: int | None = None) -> list[list[int]]:
    """Read token id sequences from ``path``, keeping the first ``max_tokens`` ids in file order.

    Args:
        path: the file (format by suffix, see the module docstring).
        max_tokens: ids kept at most over all sequences (the last sequence kept may be cut).
        vocab: when given, every id must be below it.

    Returns:
        Sequences of int ids (none empty).

    Raises:
        ConfigError: the file is missing or unreadable, not in its format, empty, or holds an id that is
            negative or outside ``vocab`` (names the file).
    """
    p = Path(path)
    try:
        if p.suffix == ".npy":
            array = np.load(p, allow_pickle=False)
            if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"expected a 1-D or 2-D integer array, got {array.dtype} {list(array.shape)}")
            rows = [array.tolist()] if array.ndim == 1 else array.tolist()
        elif p.suffix == ".json":
            data = json.loads(p.read_text(encoding="utf-8"))
            rows = [data] if data and all(isinstance(t, int) for t in data) else data
            if not isinstance(rows, list) or not all(
                isinstance(r, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in r) for r in rows
            ):
                raise ValueError("expected a list of ids or a list of lists of ids")
        else:
            rows = [[int(t) for t in p.read_text(encoding="utf-8").split()]]
    except FileNotFoundError:
        raise ConfigError(f"token ids file not found: {p}") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not a token ids file: {exc}") from None
    out: list[list[int]] = []
    left = max_tokens
    for row in rows:
        if left <= 0:
            break
        row = [int(t) for t in row[:left]]
        if row:
            out.append(row)
            left -= len(row)
    if not out:
        raise ConfigError(f"{p}: holds no token ids")
    flat = [t for row in out for t in row]
    if min(flat) < 0 or (vocab is not None and max(flat) >= vocab):
        bad = min(flat) if min(flat) < 0 else max(flat)
        raise ConfigError(f"{p}: token id {bad} is outside the vocabulary 0..{(vocab or 1) - 1}")
    return out
