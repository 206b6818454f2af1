"""External-data references of an ONNX model: what they point to, checked before a byte is read.

Source: ONNX IR spec, "External Tensor Data" (``data_location == EXTERNAL``; ``external_data`` keys ``location``,
``offset``, ``length``, ``checksum``, and onnx's own ``basepath``). Every location is validated as a string and
every file by ``stat`` only: a ``location`` that is empty, absolute or contains ``..``; a folder component that is
a symlink leaving the model's folder; a data file that is a symlink (except in a Hugging Face cache layout, below);
a file that is missing, not a regular file (a FIFO is never opened) or shorter than ``offset + length``. Lengths
come from the ``length`` field, or from the shape and dtype where an exporter omits it (torch writes none).

Hugging Face cache layout, decided on purpose: ``models--org--name/snapshots/<rev>/model.onnx_data`` is a
symlink into ``models--org--name/blobs/``. A data file that is a symlink is accepted only when it resolves
inside the model's folder, or when the model's folder is ``…/snapshots/<rev>/`` and the link resolves
into the sibling ``…/blobs/`` folder (what ``huggingface_hub`` writes; ONNX Runtime 1.32 refuses such a link,
so sessions open these models through :func:`write_for_ort`). Any other symlinked data file is refused (exit 2).

:mod:`onnxdeploy.model_io` re-exports the public names (callers import them from there).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx

from onnxdeploy.errors import ModelLoadError
from onnxdeploy.inline_weights import tensor_nbytes

__all__ = [
    "ExternalFile",
    "check_external_data",
    "data_files",
    "external_info",
    "external_location",
    "in_place_tensors",
    "iter_external",
    "link_external_data",
]


@dataclass(frozen=True)
class ExternalFile:
    """One external-data file a model references.

    Attributes:
        location: the ``location`` string as written in the model (relative to the model's folder).
        path: the resolved path of the data (symlinks followed).
        tensors: how many initializers live in it.
        bytes_needed: the end of the furthest tensor (``offset + length``), in bytes.
        size: the file's size in bytes.
    """

    location: str
    path: Path
    tensors: int
    bytes_needed: int
    size: int


def external_location(tensor: onnx.TensorProto) -> str | None:
    """Return the ``location`` of a tensor stored as external data, or ``None`` if it is stored inline.

    Source: ONNX IR spec, "External Tensor Data" (``data_location == EXTERNAL``, ``external_data`` keys).
    A tensor marked external without a ``location`` key yields ``""``.
    """
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return external_info(tensor).get("location", "")


_EXTERNAL_DATA_KEYS = frozenset({"location", "offset", "length", "checksum", "basepath"})
"""Keys of ``TensorProto.external_data`` (ONNX IR spec, "External Tensor Data"; ``basepath`` is onnx's own)."""


def external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    """A tensor's ``external_data`` entries as a dict (``location``, ``offset``, ``length``, …; strings)."""
    return {e.key: e.value for e in tensor.external_data}


def iter_external(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every external tensor of a graph and its subgraphs (initializers and Constant values)."""
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_location == onnx.TensorProto.EXTERNAL:
                yield attr.t
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_external(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_external(g)


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _allowed_link_roots(folder: Path) -> list[str]:
    """Where a symlinked data file may resolve to: the model's folder, and a Hugging Face cache's blobs/."""
    roots = [os.path.realpath(folder)]
    real = Path(os.path.realpath(folder))
    if real.parent.name == "snapshots":
        roots.append(str(real.parent.parent / "blobs"))
    return roots


def _resolve_location(location: str, folder: Path, tensor: str, model: Path) -> Path:
    """Check one ``location`` and return the data file's resolved path (nothing is opened)."""
    where = f"{model}: tensor '{tensor}' external data location '{location}'"
    if not location or "\x00" in location:
        raise ModelLoadError(f"{where} is empty or malformed")
    normalised = location.replace("\\", "/")
    if os.path.isabs(location) or normalised.startswith("/") or (len(location) > 1 and location[1] == ":"):
        raise ModelLoadError(f"{where} is an absolute path; locations must be relative to the model's folder")
    if ".." in normalised.split("/"):
        raise ModelLoadError(f"{where} contains '..'; data outside the model's folder is refused")
    if "\\" in location:
        raise ModelLoadError(f"{where} uses '\\' as a separator, which ONNX Runtime does not read on POSIX; use '/'")
    if normalised.endswith("/") or normalised.split("/")[-1] in ("", "."):
        raise ModelLoadError(f"{where} names a folder, not a data file")
    candidate = folder / normalised
    folder_real = os.path.realpath(folder)
    parent_real = os.path.realpath(candidate.parent)
    if not _within(parent_real, folder_real):
        raise ModelLoadError(f"{where} goes through a symlinked folder to {parent_real}, outside {folder_real}")
    try:
        link = os.lstat(candidate)
    except FileNotFoundError:
        raise ModelLoadError(f"{where}: data file {candidate} not found") from None
    except OSError as exc:
        raise ModelLoadError(f"{where}: cannot stat {candidate}: {exc.strerror or exc}") from None
    real = os.path.realpath(candidate)
    if stat.S_ISLNK(link.st_mode) and not any(_within(real, root) for root in _allowed_link_roots(folder)):
        raise ModelLoadError(
            f"{where}: {candidate} is a symlink to {real}, outside the model's folder (only links into a Hugging "
            "Face cache's blobs/ folder are followed)"
        )
    try:
        target = os.stat(real)  # stat, never open: a FIFO or device must not block or be read
    except OSError as exc:
        raise ModelLoadError(f"{where}: data file {candidate} is unreadable: {exc.strerror or exc}") from None
    if not stat.S_ISREG(target.st_mode):
        raise ModelLoadError(f"{where}: {candidate} is not a regular file")
    return Path(real)


def check_external_data(proto: onnx.ModelProto, model_path: str | os.PathLike[str]) -> list[ExternalFile]:
    """Check every external-data reference of ``proto`` against the files beside ``model_path``.

    Nothing is opened: locations are validated as strings, files by ``stat`` only.

    Args:
        proto: the model header (from :func:`read_model_header` or ``onnx.load(load_external_data=False)``).
        model_path: the ``.onnx`` file; locations are relative to its folder.

    Returns:
        One entry per data file, in order of first reference; the ``.onnx`` itself is not listed when inline
        tensors reference it (:func:`read_model_header`).

    Raises:
        ModelLoadError: a location is empty, absolute, contains ``..``, passes through a symlinked folder
            leaving the model's folder, or names a symlink resolving outside it (see the module docstring for
            the Hugging Face exception); a file is missing, not a regular file, or shorter than a tensor's
            ``offset + length``; an ``offset``/``length`` is not a non-negative integer; a tensor's
            ``length`` disagrees with its shape and dtype. The message names the tensor and the file.
    """
    own = Path(os.path.realpath(model_path))
    return [f for f in data_files(proto, model_path) if f.path != own]


def in_place_tensors(proto: onnx.ModelProto, model_path: str | os.PathLike[str]) -> int:
    """How many of ``proto``'s tensors reference bytes of the ``.onnx`` ``model_path`` itself (inline weights).

    ``proto`` is a header from :func:`read_model_header`; ONNX Runtime, given the file by path, would parse and
    copy those weights, so the runner opens such a model through :func:`write_for_ort` (hard links) instead.

    Raises:
        ModelLoadError: as :func:`check_external_data`.
    """
    own = Path(os.path.realpath(model_path))
    return sum(f.tensors for f in data_files(proto, model_path) if f.path == own)


def data_files(proto: onnx.ModelProto, model_path: str | os.PathLike[str]) -> list[ExternalFile]:
    """:func:`check_external_data`'s checks; every file, the ``.onnx`` itself too when inline tensors reference it."""
    model = Path(model_path)
    folder = model.parent
    files: dict[str, dict] = {}
    for tensor in iter_external(proto.graph):
        info = external_info(tensor)
        location = info.get("location", "")
        where = f"{model}: tensor '{tensor.name}' (external data '{location}')"
        unknown = sorted(set(info) - _EXTERNAL_DATA_KEYS)
        if unknown:
            raise ModelLoadError(
                f"{where}: unknown external_data key(s) {unknown}; the ONNX spec defines {sorted(_EXTERNAL_DATA_KEYS)}"
            )
        try:
            offset = int(info.get("offset", "0"))
            expected = tensor_nbytes(tensor)
            length = int(info["length"]) if "length" in info else expected
        except ValueError:
            raise ModelLoadError(f"{where}: offset/length are not integers") from None
        if offset < 0 or length < 0:
            raise ModelLoadError(f"{where}: negative offset or length")
        if length is None or (expected is not None and length != expected):
            raise ModelLoadError(f"{where}: length {length} bytes, but dims {list(tensor.dims)} need {expected}")
        entry = files.get(location)
        if entry is None:
            real = _resolve_location(location, folder, tensor.name, model)
            entry = files[location] = {"path": real, "tensors": 0, "needed": 0, "size": real.stat().st_size}
        entry["tensors"] += 1
        if offset + length > entry["size"]:
            raise ModelLoadError(
                f"{where}: needs bytes {offset}..{offset + length} but {entry['path']} holds {entry['size']} bytes "
                "(the data file is short: truncated or from another export)"
            )
        entry["needed"] = max(entry["needed"], offset + length)
    return [
        ExternalFile(location=loc, path=e["path"], tensors=e["tensors"], bytes_needed=e["needed"], size=e["size"])
        for loc, e in files.items()
    ]


def link_external_data(proto: onnx.ModelProto, model_path: str | os.PathLike[str], folder: Path) -> bool:
    """Hard-link every data file ``proto`` reads (beside ``model_path``) into ``folder``, at its location.

    What a scratch copy of a graph needs to read the very same weights without copying them (the runner's
    re-levelled and untied session headers).

    Returns:
        False when a link cannot be made (another filesystem, no permission): the caller copies instead.

    Raises:
        ModelLoadError: a reference is unsafe or its file missing or short (:func:`check_external_data`).
    """
    for data in check_external_data(proto, model_path):
        link = folder / data.location
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(data.path, link)
        except OSError:
            return False
    return True
