"""Model files written: the staged shared-weights writer, atomic commit, and copies ONNX Runtime opens by path.

Split from :mod:`onnxdeploy.model_io` (which reads models and re-exports everything here, so callers keep one
import): reading checks what comes in, this module decides where the bytes of what goes out land.

* :func:`stage_artifacts` writes one or more graphs that share **one** external weights file under a
  temporary folder inside the output folder (locations are the final, relative names); ``commit`` renames
  them into place, ``discard`` removes them (also on SIGINT). Inline graphs are streamed
  (:func:`onnxdeploy.inline_weights.write_streamed`): each large tensor's bytes go from its source (a mapped
  file: copied file to file) into the ``.onnx``, never as a protobuf copy in memory.
* :func:`write_for_ort` writes an in-memory model where ONNX Runtime can open it by path: its unchanged
  weights are referenced through hard links to the files they map (an input's data file, or an inline
  ``.onnx`` itself, whose tensors :func:`onnxdeploy.model_io.load_model` maps in place), never copied.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir

from onnxdeploy.errors import OutputError
from onnxdeploy.inline_weights import (
    PROTOBUF_LIMIT_BYTES,
    STAND_IN_THRESHOLD_BYTES,
    stream_stand_in,
    streamed_size,
    write_streamed,
)
from onnxdeploy.run_scratch import STAGING_PREFIX, owner_tag

__all__ = [
    "StagedArtifacts",
    "WeightsPolicy",
    "default_file_mode",
    "stage_artifacts",
    "write_for_ort",
]


def default_file_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the current umask (mkstemp gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@dataclass(frozen=True)
class WeightsPolicy:
    """Where the writer puts initializers: inline in each ``.onnx`` or in one shared external data file.

    Attributes:
        mode: ``auto`` (external when the input kept weights externally or weights exceed
            ``auto_external_above_bytes``), ``external`` or ``inline`` (set by the ``externalize`` and
            ``embed_external_data`` passes). Above the 2 GiB protobuf limit weights are always external.
        size_threshold_bytes: an initializer larger than this goes to the data file when external.
        auto_external_above_bytes: ``auto`` goes external above this many weight bytes (1 GiB).
    """

    mode: str = "auto"
    size_threshold_bytes: int = 1024
    auto_external_above_bytes: int = 2**30

    def external(self, total_weight_bytes: int, input_was_external: bool) -> bool:
        """Whether weights go to an external data file for a set holding ``total_weight_bytes`` (bytes)."""
        if total_weight_bytes > PROTOBUF_LIMIT_BYTES:
            return True
        if self.mode == "auto":
            return input_was_external or total_weight_bytes > self.auto_external_above_bytes
        return self.mode == "external"


@dataclass
class StagedArtifacts:
    """Files written under a temporary folder inside the output folder, renamed into place by :meth:`commit`.

    Attributes:
        out_dir: the output folder.
        staging: the temporary folder (``out_dir/.onnxdeploy-*``).
        files: file names in ``staging``, in the order they will be renamed (data before graphs).
        data_file: the shared external data file's name, or None when every weight is inline.
        weights_files: graph file name → the data file its external weights were written to (a graph whose
            weights are all inline is absent); ``split {weights: per_part}`` gives each part index its own.
    """

    out_dir: Path
    staging: Path
    files: list[str] = field(default_factory=list)
    data_file: str | None = None
    weights_files: dict[str, str] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        """The staged path of ``name`` (valid until :meth:`commit` or :meth:`discard`)."""
        return self.staging / name

    def add_text(self, name: str, text: str) -> Path:
        """Stage a text file (UTF-8), e.g. a report; it is renamed with the rest."""
        dest = self.staging / name
        with open(dest, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(dest, default_file_mode())
        self.files.append(name)
        return dest

    def commit(self) -> list[Path]:
        """Rename every staged file into ``out_dir`` (data first, so a graph never points at a missing file).

        Returns:
            The final paths.

        Raises:
            OutputError: a rename failed. On that or any interruption (SIGINT) the files already moved are
                removed with the staging folder, so no mix of new and old outputs is left.
        """
        final = []
        try:
            for name in self.files:
                dest = self.out_dir / name
                os.replace(self.staging / name, dest)
                final.append(dest)
        except BaseException as exc:
            for dest in final:
                dest.unlink(missing_ok=True)
            self.discard()
            if isinstance(exc, OSError):
                raise OutputError(f"cannot move the outputs into {self.out_dir}: {exc.strerror or exc}") from exc
            raise
        self.discard()
        return final

    def discard(self) -> None:
        """Remove the staging folder and whatever is still in it."""
        shutil.rmtree(self.staging, ignore_errors=True)


def _serialize_with(model: ir.Model, swaps: dict[int, ir.TensorProtocol]) -> onnx.ModelProto:
    """Serialize ``model`` with tensors replaced by ``swaps`` (id(tensor) -> replacement); model unchanged."""
    changed: list[tuple[ir.Value, ir.TensorProtocol]] = []
    try:
        for graph in model.graphs():
            for value in graph.initializers.values():
                tensor = value.const_value
                if tensor is not None and id(tensor) in swaps:
                    changed.append((value, tensor))
                    value.const_value = swaps[id(tensor)]
        return ir.serde.serialize_model(model)
    finally:
        for value, tensor in changed:
            value.const_value = tensor


def _inline_swaps(model: ir.Model, external: dict[int, ir.TensorProtocol]) -> tuple[dict, list[ir.TensorProtocol]]:
    """How ``model``'s tensors not already written to a data file (``external``) go inline.

    A main-graph initializer above :data:`STAND_IN_THRESHOLD_BYTES` becomes a stream stand-in (its bytes copied
    into the ``.onnx`` as it is written); a smaller one, or one of a subgraph, still mapping a data file is read
    into memory (serialized as it is, it would stay a reference to the input: an absolute location outside the
    output folder).

    Returns:
        (``external`` plus these swaps: id(tensor) -> replacement, the tensors the stand-ins index).
    """
    swaps = dict(external)
    streamed: list[ir.TensorProtocol] = []
    for graph in model.graphs():
        for value in graph.initializers.values():
            t = value.const_value
            if t is None or id(t) in swaps:
                continue
            if graph is model.graph and t.nbytes > STAND_IN_THRESHOLD_BYTES:
                swaps[id(t)] = stream_stand_in(t, len(streamed))
                streamed.append(t)
            elif isinstance(t, ir.ExternalTensor):
                swaps[id(t)] = ir.Tensor(t.numpy(), dtype=t.dtype, name=t.name)
    return swaps, streamed


def _write_model(model: ir.Model, external: dict[int, ir.TensorProtocol], dest: Path) -> None:
    """Write ``model`` to ``dest`` (fsynced, the umask's mode): ``external`` tensors by reference, the rest inline.

    Raises:
        OutputError: the file would exceed the 2 GiB protobuf limit (nothing is written then).
        OSError: writing failed.
    """
    swaps, streamed = _inline_swaps(model, external)
    proto = _serialize_with(model, swaps)
    size = streamed_size(proto)
    if size > PROTOBUF_LIMIT_BYTES:
        raise OutputError(
            f"{dest.name} would be {size} bytes, over the 2 GiB protobuf limit; keep weights in external data "
            "(the externalize pass)"
        )
    with open(dest, "wb") as fh:
        write_streamed(proto, streamed, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(dest, default_file_mode())


_INTEGER_DTYPES = frozenset(
    {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.BOOL}
)


def _reads_external(model: ir.Model, external: dict[int, ir.TensorProtocol]) -> bool:
    """Whether one of ``model``'s initializers is among ``external`` (the tensors written to its data file)."""
    return any(id(v.const_value) in external for g in model.graphs() for v in g.initializers.values())


def _stays_inline(tensor: ir.TensorProtocol) -> bool:
    """Small integer tensors (shapes, axes, indices: at most 1 KiB) stay inline whatever the threshold.

    ONNX Runtime reads such operands while it builds the session (shape inference of Reshape, Unsqueeze, …)
    and cannot take them from external data ("Cannot parse data from external tensors", ORT 1.32).
    """
    return tensor.dtype in _INTEGER_DTYPES and tensor.nbytes <= STAND_IN_THRESHOLD_BYTES


def stage_artifacts(
    graphs: Sequence[tuple[str, ir.Model]],
    out_dir: Path,
    *,
    external: bool,
    data_name: str,
    size_threshold_bytes: int = 1024,
    data_names: Mapping[str, str] | None = None,
) -> StagedArtifacts:
    """Write graphs that may share weights into a staging folder inside ``out_dir``.

    ``data_names`` sends a graph's external weights to a data file of its own instead (``split {weights:
    per_part}``: one file per part); a tensor graphs of two files read is written into both.

    With ``external``, every initializer above ``size_threshold_bytes`` (but small integer ones, see
    :func:`_stays_inline`) goes to **one** new data file ``data_name`` (a tensor object shared by several
    graphs is written once; each graph references it by the relative ``location`` ``data_name``, its final
    name). The data file is written fresh, never appended to. Tensors stream one at a time (mapped ones in chunks).

    Args:
        graphs: ``(file name, model)`` pairs, e.g. ``[("model.onnx", decode)]``.
        out_dir: the existing output folder; the staging folder is made inside it (same filesystem, so the
            final renames are atomic).
        external: write large initializers to ``data_name``; else inline in each graph.
        data_name: file name of the shared data file.
        size_threshold_bytes: initializers above this go external.
        data_names: graph file name → its data file name, for graphs that do not use ``data_name``.

    Returns:
        The staged set; call :meth:`StagedArtifacts.commit` or :meth:`StagedArtifacts.discard`.

    Raises:
        OutputError: a graph is over the protobuf limit inline, or the folder cannot be written.
    """
    try:
        # the owner in the name: a run killed by SIGKILL leaves it, the next run removes it (run_scratch.py)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX + owner_tag(), dir=out_dir))
    except OSError as exc:
        raise OutputError(f"cannot write to output_dir {out_dir}: {exc.strerror or exc}") from exc
    staged = StagedArtifacts(out_dir=out_dir, staging=staging)
    try:
        files = {name: (data_names or {}).get(name, data_name) for name, _ in graphs}
        swaps: dict[str, dict[int, ir.TensorProtocol]] = {file: {} for file in files.values()}
        if external:
            for file in dict.fromkeys(files.values()):
                tensors: list[ir.TensorProtocol] = []
                seen: set[int] = set()
                for _, model in (g for g in graphs if files[g[0]] == file):
                    for graph in model.graphs():
                        for value in graph.initializers.values():
                            t = value.const_value
                            if (
                                t is not None
                                and t.nbytes > size_threshold_bytes
                                and not _stays_inline(t)
                                and id(t) not in seen
                            ):
                                seen.add(id(t))
                                tensors.append(t)
                if tensors:
                    written = ir.external_data.convert_tensors_to_external(tensors, str(staging), file)
                    swaps[file] = {id(t): w for t, w in zip(tensors, written, strict=True)}
                    os.chmod(staging / file, default_file_mode())
                    staged.files.append(file)
                    if file == data_name or staged.data_file is None:
                        staged.data_file = file
        for name, model in graphs:  # everything else inline; large main-graph tensors streamed
            _write_model(model, swaps[files[name]], staging / name)
            staged.files.append(name)
        staged.weights_files = {n: files[n] for n, m in graphs if _reads_external(m, swaps[files[n]])}
        # The written external tensors map the staged file: drop them before anything renames it.
        for t in (t for per_file in swaps.values() for t in per_file.values()):
            if isinstance(t, ir.ExternalTensor):
                t.release()
    except BaseException as exc:
        staged.discard()
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write the outputs to {out_dir}: {exc.strerror or exc}") from exc
        raise
    return staged


def _link_or_none(target: str, link: Path) -> str | None:
    """Hard-link ``target`` as ``link`` and return the link's name; None when they are on different filesystems.

    A hard link, not a symlink: ONNX Runtime (1.32) resolves symlinks and refuses data outside the model's folder.
    """
    try:
        os.link(target, link)
    except OSError:
        return None
    return link.name


def write_for_ort(model: ir.Model, folder: str | os.PathLike[str], name: str = "model.onnx") -> Path:
    """Write ``model`` into ``folder`` so ONNX Runtime can open it by path, without copying mapped weights.

    ORT refuses absolute, ``..`` and symlinked locations leaving the model's folder, and copies initializers
    handed to it from memory, so each input data file the model's external tensors map is hard-linked into
    ``folder`` and referenced by a relative location; other initializers above 1 KiB (and mapped ones on
    another filesystem) are streamed to a data file in ``folder``.

    Args:
        model: the in-memory model (unchanged).
        folder: an existing scratch folder the caller removes later.
        name: file name of the graph.

    Returns:
        The path of the written ``.onnx``.
    """
    out = Path(folder)
    links: dict[str, str | None] = {}
    swaps: dict[int, ir.TensorProtocol] = {}
    in_memory: list[ir.TensorProtocol] = []
    for graph in model.graphs():
        for value in graph.initializers.values():
            t = value.const_value
            if isinstance(t, ir.ExternalTensor):
                target = os.path.realpath(t.path)
                if target not in links:
                    links[target] = _link_or_none(target, out / f"weights-{len(links)}.bin")
                if links[target] is None:
                    in_memory.append(t)  # another filesystem: streamed into the scratch data file
                    continue
                swaps[id(t)] = ir.ExternalTensor(
                    location=links[target],
                    offset=t.offset,
                    length=t.length,
                    dtype=t.dtype,
                    shape=t.shape,
                    name=t.name,
                    base_dir=str(out),
                )
            elif t is not None and t.nbytes > STAND_IN_THRESHOLD_BYTES:
                in_memory.append(t)
    if in_memory:
        written = ir.external_data.convert_tensors_to_external(in_memory, str(out), f"{name}.data")
        swaps.update({id(t): w for t, w in zip(in_memory, written, strict=True)})
    dest = out / name
    _write_model(model, swaps, dest)
    for t in swaps.values():
        if isinstance(t, ir.ExternalTensor):
            t.release()
    return dest
