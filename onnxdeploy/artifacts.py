"""A run's artifacts: the graphs it writes, the scratch writer for new weights, and atomic text files.

These are the core's: the pipeline builds an :class:`ArtifactSet` from the loaded model, every pass maps one
set to the next (:mod:`onnxdeploy.passes`), the pass cache stores and serves them, and the writer stages them
(:func:`onnxdeploy.model_io.stage_artifacts`). :class:`ScratchWriter` keeps the new weights a pass computes
(quantized, fused) on disk instead of in memory; :func:`write_text_atomic` writes the reports.
:class:`EarlierOutputs` reads what an earlier run wrote into the output folder (its ``report.json``), so a run
removes the graphs and data files of that run its own output does not replace (an output folder never mixes runs).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import numpy as np
import onnx_ir as ir

from onnxdeploy.contract import DecodeContract, read_contract
from onnxdeploy.errors import OutputError, PreconditionError
from onnxdeploy.mapped_tensor import RangeMappedTensor
from onnxdeploy.model_io import WeightsPolicy, default_file_mode, sha256_file

__all__ = [
    "Artifact",
    "ArtifactSet",
    "EarlierOutputs",
    "ScratchWriter",
    "graph_file_name",
    "header_only",
    "write_text_atomic",
]


@dataclass
class Artifact:
    """One graph of the run's output.

    Attributes:
        name: its output file name (``model.onnx``; prefill buckets get their own names).
        model: the in-memory graph; its initializers may be shared with the other artifacts.
    """

    name: str
    model: ir.Model


def header_only(model: ir.Model) -> ir.Model:
    """``model`` without its nodes and initializers; nothing of the original is referenced.

    Kept: the graph's inputs and outputs (name, dtype, shape), the model's metadata (the decode contract),
    opsets and IR version: what a run still needs of its graphs once they are written (the report: contract,
    each file's I/O). The graphs themselves are dropped before ONNX Runtime opens its sessions, so their Python
    objects leave the heap (measured ~48 MiB of SmolLM2's fast-chain run, four graphs and the input).
    """

    def copy(value: ir.Value) -> ir.Value:
        return ir.Value(name=value.name, shape=value.shape, type=value.type)

    graph = model.graph
    return ir.Model(
        ir.Graph(
            [copy(v) for v in graph.inputs],
            [copy(v) for v in graph.outputs],
            nodes=[],
            opset_imports=dict(graph.opset_imports),
            name=graph.name,
        ),
        ir_version=model.ir_version,
        producer_name=model.producer_name,
        producer_version=model.producer_version,
        domain=model.domain,
        model_version=model.model_version,
        metadata_props=dict(model.metadata_props),
    )


def graph_file_name(primary: str, step_len: int, max_cache_len: int) -> str:
    """File name of a non-primary graph of a set: ``model.onnx`` → ``model.s16.c1024.onnx``.

    Args:
        primary: the primary graph's file name (the pipeline's ``output_name``).
        step_len: S of the graph.
        max_cache_len: L of the graph.
    """
    path = PurePath(primary)
    return f"{path.stem}.s{step_len}.c{max_cache_len}{path.suffix}"


@dataclass
class ArtifactSet:
    """The graphs a run writes, sharing one set of weight tensors, and where the weights go.

    Today's single graph is a set of one. A pass applies to every graph it concerns, and a tensor
    object shared by several graphs is transformed (e.g. quantized) once.

    Attributes:
        artifacts: the graphs, in output order; the first is the primary (decode) graph.
        weights: the writer policy (inline or one shared external data file), set by ``externalize`` and
            ``embed_external_data``.
        input_was_external: the input model kept weights in external data (``auto`` keeps it so).
        notes: things the loader did that the run report should say (e.g. sorted at load).
    """

    artifacts: list[Artifact]
    weights: WeightsPolicy = field(default_factory=WeightsPolicy)
    input_was_external: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def primary(self) -> ir.Model:
        """The first graph (the decode graph)."""
        return self.artifacts[0].model

    def models(self) -> Iterator[ir.Model]:
        """Every graph, in output order."""
        return (a.model for a in self.artifacts)

    def weight_bytes(self) -> int:
        """Bytes of the distinct initializer tensors over all graphs (shared ones counted once)."""
        seen: dict[int, int] = {}
        for model in self.models():
            for value in model.graph.initializers.values():
                if value.const_value is not None:
                    seen[id(value.const_value)] = value.const_value.nbytes
        return sum(seen.values())

    def external(self) -> bool:
        """Whether the writer puts large weights into one external data file.

        ``auto`` with several graphs is external: inline, every graph would carry its own copy of the weights.
        """
        if len(self.artifacts) > 1 and self.weights.mode == "auto":
            return True
        return self.weights.external(self.weight_bytes(), self.input_was_external)

    def with_models(self, models: list[ir.Model]) -> ArtifactSet:
        """A new set with the same names, weights policy and notes, holding ``models`` (one per artifact, in order).

        Raises:
            ValueError: ``models`` does not have one entry per artifact.
        """
        if len(models) != len(self.artifacts):
            raise ValueError(f"expected {len(self.artifacts)} graphs, got {len(models)}")
        return ArtifactSet(
            [Artifact(a.name, m) for a, m in zip(self.artifacts, models, strict=True)],
            weights=self.weights,
            input_was_external=self.input_was_external,
            notes=list(self.notes),
        )

    def contracts(self, pass_name: str) -> Iterator[tuple[Artifact, DecodeContract]]:
        """Every graph with its decode contract, for passes that rewrite static graphs.

        Args:
            pass_name: the pass asking, named in the error.

        Raises:
            PreconditionError: a graph carries no contract (the message says to run ``static_kv`` first).
        """
        for artifact in self.artifacts:
            contract = read_contract(artifact.model, source=artifact.name)
            if contract is None:
                raise PreconditionError(
                    pass_name, f"graph '{artifact.name}' has no decode contract; run static_kv before {pass_name}"
                )
            yield artifact, contract


class ScratchWriter:
    """Writes the new weight tensors a pass makes to one scratch data file and maps them back.

    A pass that computes new weights (quantized, concatenated) over a model of any size must not hold them
    all in memory until the run's writer stages the output: each tensor is appended here as soon as it is
    made (64-byte aligned) and replaced by an :class:`onnx_ir.ExternalTensor` over the file, memory-mapped
    when read. The folder belongs to the pass context's scratch folder, removed with it.

    Args:
        folder: the folder to hold ``weights.bin`` (created).
        inline_bytes: tensors up to this many bytes stay in memory (small scales, zero points).
    """

    def __init__(self, folder: Path, inline_bytes: int = 1024):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "weights.bin"
        self.inline_bytes = inline_bytes
        self.offset = 0
        self.path.write_bytes(b"")

    def tensor(self, array: np.ndarray, dtype: ir.DataType, name: str) -> ir.TensorProtocol:
        """A tensor of ``array`` stored as ``dtype`` (INT4/UINT4 packed two a byte), on disk when large.

        Args:
            array: the values, any shape; converted by :class:`onnx_ir.Tensor` to ``dtype``.
            dtype: the ONNX element type to store.
            name: the tensor's name.

        Returns:
            An in-memory tensor up to ``inline_bytes``, else an external tensor over the scratch file.

        Raises:
            OSError: the scratch file cannot be written (disk full).
        """
        memory = ir.Tensor(array, dtype=dtype, name=name)
        if memory.nbytes <= self.inline_bytes:
            return memory
        data = memory.tobytes()
        start = -(-self.offset // 64) * 64
        with open(self.path, "r+b") as fh:
            fh.seek(start)
            fh.write(data)
        self.offset = start + len(data)
        # An absolute location and no base_dir, as model_io.load_model gives the input's weights: the file is
        # ours, and onnx_ir's containment checks (base_dir set) refuse a data file with a second hard link,
        # which write_for_ort makes while a probe session maps it.
        return RangeMappedTensor(
            str(self.path.resolve()),
            start,
            len(data),
            dtype,
            shape=ir.Shape(array.shape),
            name=name,
            base_dir="",
        )


def _write_temp(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to a new temporary file beside ``path`` and return the temporary path."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, default_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())  # the bytes are on disk before the rename makes them the file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder (fsync'ed) and a rename.

    A reader (or a crash) sees the old file or the whole new one, never part of it.

    Raises:
        OutputError: ``path`` is a folder, or its folder cannot be written (the temporary file is removed).
    """
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a folder")
    try:
        tmp = _write_temp(path, text)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc


_HASHED_UP_TO = 64 << 20
"""Recorded files up to this many bytes are compared by sha256, larger ones (weights) by size only."""


@dataclass(frozen=True)
class EarlierOutputs:
    """The graphs and data files an earlier onnxdeploy run wrote into an output folder, from its ``report.json``.

    Only files that run's ``report.json`` lists under ``files`` with ``role: output`` directly inside the folder
    count (name -> recorded bytes and sha256); nothing else in the folder is ever removed.

    Attributes:
        report: the earlier run's ``report.json``.
        files: output file name -> ``(bytes, sha256)`` as recorded.
    """

    report: Path
    files: dict[str, tuple[int, str]]

    @classmethod
    def read(cls, out_dir: Path) -> EarlierOutputs | None:
        """The record of the run that last wrote ``out_dir``; None when there is no ``report.json``.

        Raises:
            OutputError: ``report.json`` exists but is not an onnxdeploy run report (unreadable JSON, or no
                ``files``/``onnxdeploy_version``): which files an earlier run left cannot be told, so the run
                refuses rather than leave or remove them (the message says what to do).
        """
        path = out_dir / "report.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            records = data["files"] if "onnxdeploy_version" in data else None
            files = {
                Path(r["path"]).name: (int(r["bytes"]), str(r["sha256"]))
                for r in records
                if r.get("role") == "output" and Path(r["path"]).parent.resolve() == out_dir.resolve()
            }
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OutputError(
                f"{path} is not a readable onnxdeploy run report ({exc.__class__.__name__}), so which files an earlier "
                "run left in the folder cannot be told; remove that report.json (and any stale graphs) or choose "
                "another output_dir"
            ) from None
        return cls(path, files)

    def changed(self, out_dir: Path) -> list[str]:
        """Recorded files still in ``out_dir`` whose bytes differ from the record (size; sha256 up to 64 MiB)."""
        changed = []
        for name, (size, digest) in sorted(self.files.items()):
            path = out_dir / name
            if not path.is_file():
                continue
            actual = path.stat().st_size
            if actual != size or (size <= _HASHED_UP_TO and sha256_file(path) != digest):
                changed.append(name)
        return changed

    def stale(self, out_dir: Path, written: list[str]) -> list[str]:
        """Recorded files still in ``out_dir`` that this run's output (``written``: file names) does not replace."""
        return sorted(n for n in self.files if n not in written and (out_dir / n).is_file())

    def refuse_changed(self, out_dir: Path, keep: set[str]) -> None:
        """Refuse a folder whose earlier outputs were changed since that run wrote them (they may be a user's now).

        Args:
            out_dir: the output folder.
            keep: names this run replaces whatever they hold (its primary graph and data file).

        Raises:
            OutputError: a recorded file other than ``keep`` changed (names it and the record).
        """
        changed = [n for n in self.changed(out_dir) if n not in keep]
        if changed:
            raise OutputError(
                f"output_dir {out_dir}: {', '.join(changed)} changed since the onnxdeploy run recorded in "
                f"{self.report} wrote them, so this run will not remove or replace them; move them away or choose "
                "another output_dir"
            )
