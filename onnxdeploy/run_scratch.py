"""Temporary folders a run owns, named after its process, and those of runs that died removed by the next run.

A run that ends (also by an error, SIGINT or SIGTERM) removes its temporary folders itself; one killed with
SIGKILL (or by the OOM killer, or a power cut) cannot. Each such folder therefore carries its owner in its name,
``<prefix>p<pid>-<host>-<random>``, and the next run removes those whose owner is no longer alive on this host:

* the staging folder inside ``output_dir`` (``.onnxdeploy-p…``, :func:`onnxdeploy.model_io.stage_artifacts`)
  and inside the pass cache's folder;
* the run's temporary root in the system temp folder (``onnxdeploy-run-p…``, :func:`run_temp_root`), under
  which every other temporary folder of the run (the passes' scratch folder, probe models, session copies, SDK
  builds) is made.

A folder another host made (an output folder on a network share) or one without an owner in its name (an
older version's) is left alone: its owner's liveness cannot be known from here. A PID reused by another
process keeps the folder until that process ends (never removes a live run's folder).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["RUN_TEMP_PREFIX", "STAGING_PREFIX", "host_name", "owner_tag", "remove_own", "remove_stale", "run_temp_root"]

STAGING_PREFIX = ".onnxdeploy-"
"""Prefix of a staging folder (in ``output_dir`` or the pass cache), before :func:`owner_tag`."""

RUN_TEMP_PREFIX = "onnxdeploy-run-"
"""Prefix of a run's temporary root in the system temp folder, before :func:`owner_tag`."""

_RANDOM = r"[a-z0-9_]+"
"""``tempfile.mkdtemp``'s random suffix: lower-case letters, digits and ``_`` (no ``-``)."""


def host_name() -> str:
    """This host's name with every character but letters, digits and ``.`` replaced by ``_`` (no ``-``)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "localhost"


def owner_tag() -> str:
    """``p<pid>-<host>-``: what goes between a temporary folder's prefix and ``mkdtemp``'s random suffix."""
    return f"p{os.getpid()}-{host_name()}-"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def remove_stale(folder: Path, prefix: str) -> list[Path]:
    """Remove the folders ``<prefix>p<pid>-<host>-<random>`` in ``folder`` whose process is gone from this host.

    Args:
        folder: where to look (``output_dir``, the pass cache, the system temp folder); missing: nothing done.
        prefix: :data:`STAGING_PREFIX` or :data:`RUN_TEMP_PREFIX`.

    Returns:
        The folders removed. One that cannot be removed (permissions, a race with another run) is skipped.
    """
    return _remove_owned(folder, prefix, lambda pid: pid != os.getpid() and not _alive(pid))


def remove_own(folder: Path, prefix: str) -> list[Path]:
    """Remove this process's folders ``<prefix>p<pid>-<host>-<random>`` in ``folder`` (an interrupted run's cleanup).

    A signal can land after ``mkdtemp`` made a staging folder and before its caller holds the path (inside
    ``mkdtemp`` itself, or before the assignment); the run's cleanup then finds the folder by its owner tag.

    Args:
        folder: where to look (``output_dir``); missing: nothing done.
        prefix: :data:`STAGING_PREFIX` or :data:`RUN_TEMP_PREFIX`.

    Returns:
        The folders removed.
    """
    return _remove_owned(folder, prefix, lambda pid: pid == os.getpid())


def _remove_owned(folder: Path, prefix: str, remove: Callable[[int], bool]) -> list[Path]:
    """Remove the folders ``<prefix>p<pid>-<this host>-<random>`` in ``folder`` for which ``remove(pid)`` holds."""
    pattern = re.compile(re.escape(prefix) + r"p(\d+)-([A-Za-z0-9._]+)-" + _RANDOM)
    host = host_name()
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or match[2] != host or not entry.is_dir(follow_symlinks=False):
            continue
        if not remove(int(match[1])):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed


@contextlib.contextmanager
def run_temp_root() -> Iterator[Path]:
    """Make ``$TMPDIR/onnxdeploy-run-p<pid>-<host>-*`` the temp folder of ``tempfile`` while the block runs.

    Every ``tempfile.mkdtemp``/``TemporaryDirectory`` without ``dir`` made during the run (passes, runner, SDK
    stage) lands inside it, so one folder named after this process holds them all. Stale roots of dead runs are
    removed first; this one is removed at the end whatever happens, and ``tempfile.tempdir`` restored.

    Yields:
        The root folder.
    """
    system = Path(tempfile.gettempdir())
    remove_stale(system, RUN_TEMP_PREFIX)
    root = Path(tempfile.mkdtemp(prefix=RUN_TEMP_PREFIX + owner_tag(), dir=system))
    before = tempfile.tempdir
    tempfile.tempdir = str(root)
    try:
        yield root
    finally:
        tempfile.tempdir = before
        shutil.rmtree(root, ignore_errors=True)
