"""What the machine can give a run: the memory available to this process (container limit or host).

Used to refuse, before any work, a configuration whose buffers cannot fit (e.g. ``static_kv`` with a
``max_cache_len`` of 10^8 slots), instead of growing until the kernel kills the process.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
from pathlib import Path

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "SYSTEM_ALLOCATOR_COMMANDS",
    "available_memory_bytes",
    "exec_with_system_allocator",
    "fixed_mmap_threshold",
    "format_bytes",
    "peak_rss_bytes",
    "process_age_s",
    "release_free_heap",
    "rss_bytes",
    "run_clock_start",
]

_CGROUP_V2_MAX = Path("/sys/fs/cgroup/memory.max")
_CGROUP_V1_LIMIT = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
_MEMINFO = Path("/proc/meminfo")
_NO_LIMIT = 1 << 60  # cgroup v1 reports "unlimited" as a huge number (PAGE_COUNTER_MAX pages)


MMAP_THRESHOLD_BYTES = 128 << 10
"""glibc's default ``M_MMAP_THRESHOLD`` (128 KiB): allocations at least this large get their own ``mmap``."""

_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def fixed_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold, so every freed block of ``threshold`` bytes or more goes back to the kernel.

    glibc raises the threshold each time a mmapped block is freed (up to 32 MiB on 64-bit), after which such
    blocks come from the heap and stay resident once freed, fragmented between smaller live objects
    (``mallopt(3)``, "M_MMAP_THRESHOLD": setting it disables the dynamic adjustment). A run frees many such
    blocks (protobuf headers, numpy temporaries, ONNX Runtime's per-run activations): measured on SmolLM2-135M's
    fast chain, the peak RSS of ``onnxdeploy run`` fell from 949 to 912 MiB with the threshold pinned
    (``MALLOC_MMAP_THRESHOLD_=131072``, same run otherwise). The console command calls this at start; a library
    caller's process is left as it is.

    Returns:
        True when set; False where the C library has no ``mallopt`` (musl, macOS) or refuses.
    """
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: libc's (find_library would run ldconfig or gcc)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError, TypeError):
        return False


SYSTEM_ALLOCATOR_COMMANDS = frozenset({"run", "verify"})
"""The console commands that run with the C allocator for Python objects (:func:`exec_with_system_allocator`)."""


def exec_with_system_allocator(command: str | None) -> None:
    """Re-run this interpreter with ``PYTHONMALLOC=malloc`` for a heavy ``command``; return only when it is not.

    Python's small-object allocator keeps memory in 1 MiB arenas that go back to the kernel only when every object
    in them is freed; the passes make and free millions of small graph objects, and the few that survive pin the
    arenas: measured on SmolLM2-135M's fast chain (``benchmarks/real.py --only memory``), ~70 MiB stayed resident
    through verification, which no ``malloc_trim`` reaches. With ``PYTHONMALLOC=malloc`` (Python docs, "Command line
    and environment", ``PYTHONMALLOC``) those objects live in the C heap, whose free pages
    :func:`release_free_heap` gives back: the run's peak fell from 897-900 to 837-841 MiB (same run otherwise).
    The variable must be set before the interpreter starts, so the process ``exec``s itself with the same
    command line (``sys.orig_argv``; same PID, so the run's clock, :func:`run_clock_start`, still starts at the
    process's start). Nothing happens when ``PYTHONMALLOC`` is already set (the user's choice, or the re-run),
    off Linux, or for another command.

    Args:
        command: the CLI's first argument (the subcommand), or None.

    Raises:
        OSError: ``exec`` failed (the interpreter cannot be run again).
    """
    if command not in SYSTEM_ALLOCATOR_COMMANDS or "PYTHONMALLOC" in os.environ or not sys.platform.startswith("linux"):
        return
    if not sys.executable or not getattr(sys, "orig_argv", None):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "PYTHONMALLOC": "malloc"})


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the kernel (glibc ``malloc_trim(0)``; ``malloc_trim(3)``).

    Memory freed by ``free`` stays in the process's heap until the top of the heap is free; ``malloc_trim(0)``
    also returns every whole free page inside it (glibc >= 2.8). Verification calls it where a phase's freed
    memory would otherwise stay resident through the next phase's peak: before the original's session opens (the
    passes' graphs were freed) and after it closes (its session was freed), so the candidate's sessions start from
    a heap without them. Objects Python's own small-object allocator holds are not in the C heap unless the
    interpreter runs with ``PYTHONMALLOC=malloc``.

    Returns:
        True when memory was released; False when none was, or the C library has no ``malloc_trim`` (musl, macOS).
    """
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError, TypeError):
        return False


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_limit_bytes() -> int | None:
    """The container's memory limit in bytes (cgroup v2 ``memory.max``, else v1), or None when unlimited."""
    for path in (_CGROUP_V2_MAX, _CGROUP_V1_LIMIT):
        text = _read(path)
        if text is None or text == "max":
            continue
        try:
            limit = int(text)
        except ValueError:
            continue
        if 0 < limit < _NO_LIMIT:
            return limit
    return None


def _mem_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where the kernel does not report it."""
    text = _read(_MEMINFO)
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            try:
                return int(parts[1]) * 1024  # reported in kB
            except (IndexError, ValueError):
                return None
    return None


def available_memory_bytes() -> int | None:
    """Memory this process may still use, in bytes: the smaller of the container limit and ``MemAvailable``.

    The container limit is cgroup v2 ``/sys/fs/cgroup/memory.max`` or cgroup v1
    ``/sys/fs/cgroup/memory/memory.limit_in_bytes`` (absent or "max": no limit); ``MemAvailable`` is the
    host's estimate of memory available without swapping (``/proc/meminfo``). Both are upper bounds, so
    the smaller one is returned.

    Returns:
        Bytes, or None when neither is known (e.g. not Linux).
    """
    known = [b for b in (_cgroup_limit_bytes(), _mem_available_bytes()) if b is not None]
    return min(known) if known else None


def format_bytes(n: float) -> str:
    """Human-readable size with binary units, e.g. ``1.5 GiB`` (bytes → B/KiB/MiB/GiB/TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (``getrusage`` ``ru_maxrss``: KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """Resident set size of this process now, in bytes (``/proc/self/statm``; the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``: its start time in clock ticks after boot), else None.

    A run's wall time counts from here, so the interpreter's start and the imports before the pipeline runs are
    in it too. Resolution: one clock tick (10 ms on Linux).
    """
    stat, uptime = _read(Path("/proc/self/stat")), _read(Path("/proc/uptime"))
    if stat is None or uptime is None:
        return None
    try:
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime (fields counted after the name)
        return max(0.0, float(uptime.split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (IndexError, ValueError, OSError):
        return None


#: The longest an interpreter may plausibly take from its process's start to importing onnxdeploy (s). Past it, the
#: process was started by something else and exec'd python later (``bash -c "pip install … && exec onnxdeploy …"``
#: keeps the shell's PID and start time), and the clock starts at the import instead.
EXEC_SLACK_S = 3.0


def run_clock_start(imported_at: float) -> float:
    """Where a CLI run's wall clock starts, as a ``time.perf_counter()`` value (s).

    The process's start (:func:`process_age_s`), so the interpreter's start and the imports are counted, unless
    that lies more than :data:`EXEC_SLACK_S` before ``imported_at`` (the package's first import): then an exec
    reused an older process and ``imported_at`` is the start. Without ``/proc``, ``imported_at``.

    Args:
        imported_at: ``time.perf_counter()`` at the package's first import (:data:`onnxdeploy.IMPORTED_AT`).
    """
    age = process_age_s()
    if age is None:
        return imported_at
    started = time.perf_counter() - age
    return started if imported_at - started <= EXEC_SLACK_S else imported_at
