"""The per-pass cache: the output of every pass prefix of a pipeline, stored on disk and served on a re-run.

A run of ``passes: [p1, p2, p3]`` stores three entries, the artifact sets after ``p1``, after ``p1, p2`` and
after all three. Each entry's key is a chain: the key of the input (its files and graph) and the versions
of the tools, then one link per pass (its name and config), so a re-run with a changed third pass is served
the first two from the cache and runs only the third. Verification and checks are never cached.

Input key, by default: the size and mtime (ns) of the ``.onnx`` and of every external-data file it reads, plus
the sha256 of the graph without its weights (initializers above 1 KiB stripped to typed stand-ins, so the
cost does not grow with the weights). With ``full_hash`` the sha256 of every file's bytes replaces size and
mtime (a copied or re-downloaded model then still hits; hashing 16 GB takes about a minute).
The chain's first link also holds the versions of onnxdeploy (and a digest of its code), onnx, onnx_ir, onnxsim
and onnxruntime, what the :class:`~onnxdeploy.passes.PassContext` supplies (the target, its matrix file's
``defaults``, the digest of the runner's decode code that calibration runs: :meth:`PassContext.provenance`) and
the calibration tokens' hash.

An entry is a folder ``<cache dir>/<key>/`` holding each graph under its artifact name, one shared
``weights.data`` (written by :func:`onnxdeploy.model_io.stage_artifacts`, every initializer above the small
integer ones), ``entry.json`` (the pass reports so far, the weights policy, the loader's notes) and
``checksums.json`` (size and sha256 of each of those files, hashed right after they are written, while their
pages are still cached). It is written in a staging folder inside the cache folder and renamed into place in
one step, so a reader sees a whole entry or none. Before a hit is served every file's size and sha256 are
checked (sha256 reads the weights once: about 1 s per GiB here, the same order as hashing the run's outputs
for the report, and far below re-running the passes); an entry that fails is a miss, named in the report's
notes, and is removed. A hit is loaded with :func:`onnxdeploy.model_io.load_model` (weights memory-mapped
from the cache, shared tensors shared again across the graphs of a set).

An entry whose ``weights.data`` holds the same bytes as the previous pass's entry's (a pass that moves no weight:
``grouped_attention``, ``kv_layout``, ``pin_opset``, …) gets a hard link to that file instead of a second copy
(it is still written and hashed once, then replaced by the link).

Size: after each store, the least recently used entries (by folder mtime, refreshed on every hit) are removed
until the cache holds at most ``max_bytes`` (a hard-linked file counted once); an entry larger than that alone is
not stored. The cache folder
can be removed at any time (``rm -rf ~/.cache/onnxdeploy/passes``) between runs.

Several runs may share one cache folder at once (CI jobs on one machine). Locks are ``flock`` on the folders
themselves, so no lock file is left behind: a run holds a shared lock on the entry it is served from until it
ends (:meth:`PassCache.close`; its weights are mapped lazily); the rename of a new entry and the eviction that
follows hold an exclusive lock on the cache folder, so two runs never evict at once; eviction takes an entry's
lock exclusively without waiting and skips an entry another run is reading.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import onnxruntime
import onnxsim

from onnxdeploy import __version__
from onnxdeploy.cache_config import CacheConfig, default_cache_dir
from onnxdeploy.cache_entries import (
    CHECKSUMS,
    ENTRY_JSON,
    WEIGHTS,
    CorruptEntry,
    disk_usage,
    drop_entry,
    flock_folder,
    hold_entry,
    link_if_same,
    verify_entry,
)
from onnxdeploy.errors import OnnxDeployError
from onnxdeploy.model_io import (
    LoadedModel,
    StagedArtifacts,
    WeightsPolicy,
    load_model,
    sha256_file,
    stage_artifacts,
    stand_in_proto,
)
from onnxdeploy.passes import Artifact, ArtifactSet
from onnxdeploy.report import Finding, PassReport

__all__ = ["CACHE_FORMAT", "CacheConfig", "CacheHit", "PassCache", "cache_versions", "default_cache_dir"]

CACHE_FORMAT = 2
"""Version of the entry layout; part of every key, so a new layout never reads an old entry (2: checksums)."""


@functools.cache
def code_digest() -> str:
    """sha256 of the source of the modules a pass runs (``onnxdeploy/*.py`` and ``passes/*.py``), in path order.

    The version alone does not change when the code does (an editable install, a fix without a release), and
    a cache keyed by it served a pass's old output after the pass was fixed. Hashing ~50 files takes ~5 ms.
    """
    from onnxdeploy import passes  # noqa: PLC0415  (the mapped passes/ folder)

    h = hashlib.sha256()
    for folder in (Path(__file__).parent, Path(passes.__file__).parent):
        for path in sorted(folder.glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cache_versions() -> dict[str, str]:
    """The tool versions every key holds: onnxdeploy (and its code's digest), onnx, onnx_ir, onnxsim, onnxruntime."""
    return {
        "onnxdeploy": __version__,
        "onnxdeploy_code": code_digest(),
        "onnx": onnx.__version__,
        "onnx_ir": ir.__version__,
        "onnxsim": str(getattr(onnxsim, "__version__", "unknown")),
        "onnxruntime": onnxruntime.__version__,
    }


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def input_key(loaded: LoadedModel, *, full_hash: bool) -> dict[str, Any]:
    """What identifies the input model: its files (size+mtime, or sha256) and its graph's hash.

    Args:
        loaded: the loaded input (its path and the external-data files it reads).
        full_hash: hash every file's bytes instead of taking size and mtime.

    Returns:
        A JSON-able dict (the first link of every key).
    """
    files = [loaded.path.resolve(), *(f.path for f in loaded.external_files)]
    if full_hash:
        described = [{"sha256": sha256_file(p)} for p in files]
    else:
        described = []
        for p in files:
            st = p.stat()
            described.append({"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    graph = hashlib.sha256(stand_in_proto(loaded.model).SerializeToString(deterministic=True)).hexdigest()
    return {"files": described, "graph_sha256": graph}


@dataclass
class CacheHit:
    """A prefix served from the cache: the artifact set after ``passes`` passes and their reports."""

    passes: int
    artifacts: ArtifactSet
    reports: list[PassReport]
    findings: list[Finding]


@dataclass
class PassCache:
    """The cache of one run: the key of every pass prefix, lookup, load and store.

    Build it with :meth:`for_run`. ``keys[i]`` is the key of the artifacts after passes ``0..i``.

    Attributes:
        folder: the cache folder.
        keys: one key per pass, in order.
        max_bytes: the size bound (see the module docstring).
        notes: what went wrong with the cache, for the run report (it never fails a run: a cache it cannot
            write is skipped).
        say: prints a one-line note on the console (the CLI's progress lines, stderr): misses, stores,
            evictions and everything in ``notes``; None prints nothing.
    """

    folder: Path
    keys: list[str]
    max_bytes: int
    notes: list[str] = field(default_factory=list)
    _stored: set[str] = field(default_factory=set)
    _held: list[int] = field(default_factory=list)
    _bad: set[str] = field(default_factory=set)
    say: Callable[[str], None] | None = None

    def _tell(self, message: str, *, report: bool = False) -> None:
        """Print ``message`` (if :attr:`say`) and, with ``report``, keep it in :attr:`notes` too."""
        if report:
            self.notes.append(message)
        if self.say is not None:
            self.say(message)

    @classmethod
    def for_run(
        cls,
        config: CacheConfig,
        loaded: LoadedModel,
        passes: list[tuple[str, dict[str, Any]]],
        *,
        supplied: dict[str, Any],
        calibration: list[list[int]],
    ) -> PassCache:
        """Key every pass prefix of a run.

        Args:
            config: the ``cache`` section.
            loaded: the loaded input model.
            passes: ``(name, config as JSON)`` per pass, in order.
            supplied: what the pass context supplies beyond graph and config
                (:meth:`~onnxdeploy.passes.PassContext.provenance`: the target, its matrix defaults, the digest of
                the runner's decode code that calibration runs).
            calibration: the calibration token ids (passes may read them).
        """
        key = _digest(
            {
                "format": CACHE_FORMAT,
                "input": input_key(loaded, full_hash=config.full_hash),
                "versions": cache_versions(),
                "supplied": supplied,
                "calibration": _digest(calibration),
            }
        )
        keys = []
        for name, cfg in passes:
            key = _digest({"previous": key, "pass": name, "config": cfg})
            keys.append(key)
        return cls(folder=config.folder(), keys=keys, max_bytes=config.max_bytes)

    def lookup(self) -> CacheHit | None:
        """Load the longest cached prefix whose files match their stored size and sha256, or None.

        A broken entry (a file missing, unreadable, or not the bytes that were stored) is a miss: it is removed,
        a note names it and the next shorter prefix is tried.
        """
        for n in range(len(self.keys), 0, -1):
            entry = self.folder / self.keys[n - 1]
            if not (entry / ENTRY_JSON).is_file():
                continue
            fd = hold_entry(entry)
            if fd is None:
                continue  # evicted by another run meanwhile
            try:
                verify_entry(entry)
                hit = self._load(entry, n)
            except (CorruptEntry, OnnxDeployError, OSError, ValueError, KeyError) as exc:
                dropped = drop_entry(entry, fd)
                if not dropped:
                    self._bad.add(entry.name)
                self._tell(
                    f"pass cache: entry {entry} unreadable or corrupted ({exc}); "
                    + ("dropped" if dropped else "kept while another run reads it")
                    + ", its passes run again",
                    report=True,
                )
                continue
            self._held.append(fd)  # its weights are read lazily later in this run: no run may evict it now
            with contextlib.suppress(OSError):
                os.utime(entry)  # recently used: evicted last
            self._stored.add(entry.name)
            return hit
        self._tell(f"pass cache: nothing stored for these {len(self.keys)} pass(es) in {self.folder}; every pass runs")
        return None

    def close(self) -> None:
        """Release the entry this run was served from (other runs may evict it from now on)."""
        for fd in self._held:
            os.close(fd)
        self._held.clear()

    def _load(self, entry: Path, n: int) -> CacheHit:
        meta = json.loads((entry / ENTRY_JSON).read_text(encoding="utf-8"))
        models = [load_model(entry / name).model for name in meta["artifacts"]]
        _share_tensors(models)
        artifacts = ArtifactSet(
            [Artifact(name, m) for name, m in zip(meta["artifacts"], models, strict=True)],
            weights=WeightsPolicy(**meta["weights"]),
            input_was_external=meta["input_was_external"],
            notes=list(meta["notes"]),
        )
        reports = [PassReport.model_validate(r) for r in meta["reports"]]
        findings = [Finding.model_validate(f) for f in meta["findings"]]
        if len(reports) != n:
            raise ValueError(f"{len(reports)} pass reports for a prefix of {n} passes")
        return CacheHit(passes=n, artifacts=artifacts, reports=reports, findings=findings)

    def store(self, n: int, artifacts: ArtifactSet, reports: list[PassReport], findings: list[Finding]) -> str:
        """Store the artifacts after the first ``n`` passes (atomically: staged, then one rename).

        Returns:
            ``stored``, or ``not_stored`` (the reason is appended to :attr:`notes`).
        """
        key = self.keys[n - 1]
        entry = self.folder / key
        if entry.is_dir() and key not in self._bad:
            self._tell(f"pass cache: the artifacts after pass {n} are already stored (another run stored them)")
            return "stored"
        weight_bytes = artifacts.weight_bytes()
        if weight_bytes > self.max_bytes:
            self._tell(
                f"pass cache: the artifacts after pass {n} ({weight_bytes} bytes of weights) exceed cache.max_bytes="
                f"{self.max_bytes}; not stored",
                report=True,
            )
            return "not_stored"
        staged = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            staged = self._stage_entry(key, artifacts, reports, findings)
            sums = {
                name: {"bytes": staged.path(name).stat().st_size, "sha256": sha256_file(staged.path(name))}
                for name in staged.files
            }
            previous = self.folder / self.keys[n - 2] if n >= 2 else None
            linked = WEIGHTS in sums and link_if_same(previous, staged.path(WEIGHTS), sums[WEIGHTS])
            staged.add_text(CHECKSUMS, json.dumps({"files": sums}, indent=1))
            evicted = self._publish(key, staged)
        except (OnnxDeployError, OSError) as exc:
            if staged is not None:
                staged.discard()
            self._tell(f"pass cache: cannot store in {self.folder} ({exc}); the run goes on without it", report=True)
            return "not_stored"
        if evicted is None:
            return "not_stored"
        self._tell_stored(n, sum(f["bytes"] for f in sums.values()), linked, *evicted)
        return "stored"

    def _stage_entry(
        self, key: str, artifacts: ArtifactSet, reports: list[PassReport], findings: list[Finding]
    ) -> StagedArtifacts:
        """Write an entry's graphs, its one ``weights.data`` and ``entry.json`` in a staging folder of the cache."""
        staged = stage_artifacts(
            [(a.name, a.model) for a in artifacts.artifacts],
            self.folder,
            external=True,
            data_name=WEIGHTS,
            size_threshold_bytes=0,
        )
        meta = {
            "key": key,
            "artifacts": [a.name for a in artifacts.artifacts],
            "weights": {
                "mode": artifacts.weights.mode,
                "size_threshold_bytes": artifacts.weights.size_threshold_bytes,
                "auto_external_above_bytes": artifacts.weights.auto_external_above_bytes,
            },
            "input_was_external": artifacts.input_was_external,
            "notes": artifacts.notes,
            "reports": [r.model_dump(mode="json") for r in reports],
            "findings": [f.model_dump(mode="json") for f in findings],
            "created": time.time(),
        }
        try:
            staged.add_text(ENTRY_JSON, json.dumps(meta, indent=1))
        except BaseException:
            staged.discard()
            raise
        return staged

    def _publish(self, key: str, staged: StagedArtifacts) -> tuple[int, int, int] | None:
        """Rename the staged entry into place (cache folder locked), then evict down to ``max_bytes``.

        Returns:
            What :meth:`_evict` returns, or None when the entry was not stored: a corrupted entry of the same
            key is still read by another run (the staged one is discarded, a note says so).
        """
        entry = self.folder / key
        with self._locked():
            if key in self._bad:  # a corrupted entry another run was reading: replace it if it is free now
                fd = flock_folder(entry, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if fd is None and entry.is_dir():
                    staged.discard()
                    self._tell(
                        f"pass cache: {entry} is corrupted and still read by another run; not stored", report=True
                    )
                    return None
                if fd is not None:
                    drop_entry(entry, fd)
                self._bad.discard(key)
            try:
                os.rename(staged.staging, entry)  # one step: a reader sees the whole entry or none
            except OSError:
                if not entry.is_dir():
                    raise
                staged.discard()  # another run stored the same key meanwhile
            self._stored.add(key)
            return self._evict()

    def _tell_stored(self, n: int, stored_bytes: int, linked: bool, removed: int, freed: int, busy: int) -> None:
        """The console lines of a store: its size, the weights link, what was evicted or kept."""
        self._tell(
            f"pass cache: stored the artifacts after pass {n} ({stored_bytes} bytes"
            + (f"; {WEIGHTS} hard-linked to pass {n - 1}'s: the same bytes)" if linked else ")")
        )
        if removed:
            self._tell(
                f"pass cache: evicted {removed} least recently used {'entry' if removed == 1 else 'entries'} "
                f"({freed} bytes) to stay within cache.max_bytes={self.max_bytes}"
            )
        if busy:
            self._tell(
                f"pass cache: {busy} {'entry' if busy == 1 else 'entries'} over cache.max_bytes={self.max_bytes} "
                "kept: another run is reading them"
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the cache folder's exclusive lock: one run at a time renames entries in and evicts."""
        fd = flock_folder(self.folder, fcntl.LOCK_EX)
        if fd is None:
            raise OSError(f"the cache folder {self.folder} vanished")
        try:
            yield
        finally:
            os.close(fd)

    def _evict(self) -> tuple[int, int, int]:
        """Remove least recently used entries until the cache holds at most ``max_bytes`` (cache folder locked).

        Never removed: the entries this run stored or reads, and any entry another run reads (its shared lock
        makes the non-blocking exclusive lock fail).

        Returns:
            ``(entries removed, bytes freed, entries kept because another run reads them)``.
        """
        removed = freed = 0
        busy: set[str] = set()
        while True:
            total, entries = disk_usage(self.folder)
            victims = [(size, e) for _, size, e in entries if e.name not in self._stored and e.name not in busy]
            if total <= self.max_bytes or not victims:
                return removed, freed, len(busy)
            size, victim = victims[0]
            fd = flock_folder(victim, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                if victim.is_dir():  # else a reader dropped it meanwhile: look again
                    busy.add(victim.name)
                continue
            drop_entry(victim, fd)
            removed, freed = removed + 1, freed + size


def _share_tensors(models: list[ir.Model]) -> None:
    """Make initializers that read the same bytes of the same data file one tensor object again.

    The pipeline's writer and passes rely on identity to treat a weight shared by several graphs once.
    """
    first: dict[tuple[str, int, int], ir.TensorProtocol] = {}
    for model in models:
        for graph in model.graphs():
            for value in graph.initializers.values():
                tensor = value.const_value
                if isinstance(tensor, ir.ExternalTensor):
                    where = (str(tensor.path), int(tensor.offset or 0), int(tensor.length or 0))
                    shared = first.setdefault(where, tensor)
                    if shared is not tensor:
                        value.const_value = shared
