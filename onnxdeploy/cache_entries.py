"""A pass-cache entry on disk: its folder locks, its size, its checksums, its weights shared with the previous entry.

:mod:`onnxdeploy.pass_cache` keys, stores and serves entries; this module holds what it does to their folders and
files: ``flock`` a folder (shared while a run reads an entry, exclusive to evict it), what the entries hold on disk (a
file hard-linked into several counted once), a data file replaced by a hard link to the previous entry's when the
bytes are the same, and every file checked against ``checksums.json`` before a hit is served.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from onnxdeploy.model_io import sha256_file

__all__ = [
    "CHECKSUMS",
    "ENTRY_JSON",
    "WEIGHTS",
    "CorruptEntry",
    "disk_usage",
    "drop_entry",
    "flock_folder",
    "hold_entry",
    "link_if_same",
    "same_bytes",
    "verify_entry",
]

ENTRY_JSON = "entry.json"
"""The file of an entry naming its artifacts, reports and findings."""

CHECKSUMS = "checksums.json"
"""The file of an entry listing each of its files' size and sha256."""

WEIGHTS = "weights.data"
"""The one weights file an entry's graphs share."""


class CorruptEntry(Exception):
    """An entry's file is missing or differs from the size or sha256 stored with it."""


def flock_folder(folder: Path, mode: int) -> int | None:
    """Open ``folder`` and ``flock`` it with ``mode`` (``fcntl.LOCK_SH``/``LOCK_EX``, maybe ``| LOCK_NB``).

    Returns:
        The descriptor (closing it releases the lock), or None when the folder is gone or, with ``LOCK_NB``,
        another holder has a conflicting lock.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def hold_entry(entry: Path) -> int | None:
    """A shared lock on ``entry`` (waits only while an evictor removes it), or None when it is gone.

    The lock is on the folder that was opened; if that folder was removed (and another stored under the same
    name) while this waited, the lock protects nothing: None then.
    """
    fd = flock_folder(entry, fcntl.LOCK_SH)
    if fd is None:
        return None
    try:
        locked, current = os.fstat(fd), os.stat(entry)
        same = (locked.st_dev, locked.st_ino) == (current.st_dev, current.st_ino)
    except FileNotFoundError:
        same = False
    if same and (entry / ENTRY_JSON).is_file():
        return fd
    os.close(fd)
    return None


def drop_entry(entry: Path, fd: int) -> bool:
    """Remove ``entry`` unless another run holds it (``fd``: this run's lock on it, closed here); True if removed."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        shutil.rmtree(entry, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def disk_usage(folder: Path) -> tuple[int, list[tuple[float, int, Path]]]:
    """What the cache's entries hold on disk, a file hard-linked into several entries counted once.

    Returns:
        ``(bytes, entries)``: the entries' bytes, and per entry ``(mtime, bytes only it holds, folder)``, least
        recently used first (removing an entry frees the files no other entry links).
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    entries = []
    for entry in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):  # another reader may drop an entry while this looks
            if not (entry.is_dir() and (entry / ENTRY_JSON).is_file()):
                continue
            own = 0
            for path in entry.iterdir():
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
                if st.st_nlink == 1:
                    own += st.st_size
            entries.append((entry.stat().st_mtime, own, entry))
    return total, sorted(entries, key=lambda e: e[0])


def same_bytes(a: Path, b: Path, chunk_bytes: int = 8 << 20) -> bool:
    """Whether two files hold the same bytes (compared in ``chunk_bytes`` chunks)."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while chunk := fa.read(chunk_bytes):
            if chunk != fb.read(chunk_bytes):
                return False
    return True


def link_if_same(previous: Path | None, staged: Path, digest: dict[str, Any]) -> bool:
    """Replace the ``staged`` data file by a hard link to ``previous``'s when they hold the same bytes.

    A pass that leaves every weight as it is (``grouped_attention``, ``kv_layout``, ``pin_opset``, …) then adds
    no copy of the weights to the cache. The stored digest selects the candidate; the bytes decide (the
    previous file may have been damaged since it was stored). Another run evicting ``previous`` meanwhile
    leaves the staged copy in place.
    """
    if previous is None:
        return False
    source = previous / WEIGHTS
    try:
        stored = json.loads((previous / CHECKSUMS).read_text(encoding="utf-8"))["files"].get(WEIGHTS)
        if stored != digest or not same_bytes(source, staged):
            return False
    except (OSError, ValueError, KeyError):
        return False
    link = staged.with_name(staged.name + ".link")
    try:
        os.link(source, link)
        os.replace(link, staged)
    except OSError:
        link.unlink(missing_ok=True)
        return False
    return True


def verify_entry(entry: Path) -> None:
    """Check every file ``checksums.json`` lists: present, its size, then its sha256 (smallest files first).

    Raises:
        CorruptEntry: a file is missing or differs (names the file), or an artifact ``entry.json`` names is not
            covered by the checksums.
        OSError, ValueError, KeyError: ``checksums.json`` is missing or not what :meth:`PassCache.store` writes.
    """
    files: dict[str, dict[str, Any]] = json.loads((entry / CHECKSUMS).read_text(encoding="utf-8"))["files"]
    for name, want in files.items():
        try:
            size = (entry / name).stat().st_size
        except FileNotFoundError:
            raise CorruptEntry(f"{name}: missing") from None
        if size != want["bytes"]:
            raise CorruptEntry(f"{name}: {size} bytes, {want['bytes']} stored")
    for name, want in sorted(files.items(), key=lambda item: item[1]["bytes"]):
        if sha256_file(entry / name) != want["sha256"]:
            raise CorruptEntry(f"{name}: sha256 differs from the one stored")
    listed = json.loads((entry / ENTRY_JSON).read_text(encoding="utf-8"))["artifacts"]
    unchecked = [name for name in (ENTRY_JSON, *listed) if name not in files]
    if unchecked:
        raise CorruptEntry(f"no checksum for {', '.join(unchecked)}")
