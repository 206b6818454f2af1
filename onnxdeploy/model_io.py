"""Model files: load, the protobuf limit and external data — the one module callers import them from.

Models of any size (docs/ARCHITECTURE.md, "Models of any size"): weights are never copied or serialised to move a
model between stages, whether the input keeps them in external data or inline in one ``.onnx``.

The module is split by concern: this one reads (header checks, external data, loading, stand-in protos, input
protection); :mod:`onnxdeploy.model_write` writes (staging, atomic commit, copies for ONNX Runtime) and
:mod:`onnxdeploy.inline_weights` owns the protobuf wire format that lets both handle inline weights in place.
Their public names are re-exported here, so callers keep importing from ``onnxdeploy.model_io``.

* :func:`read_model_header` parses the ``.onnx`` file without tensor data and refuses what cannot be a
  usable model (missing, empty, not protobuf, incomplete: no ``graph`` or no ``opset_import``) and every
  unsafe or broken external-data reference **before anything is read**: a ``location`` that is empty,
  absolute or contains ``..``; a folder component that is a symlink leaving the model's folder; a data file
  that is a symlink, except in a Hugging Face cache layout (below); a file that is missing, not a regular
  file (a FIFO is never opened) or shorter than ``offset + length``. Lengths come from the ``length``
  field, or from the shape and dtype where an exporter omits it (torch writes none). Large inline weights are
  not read: they come back as external-data references to the ``.onnx`` itself.
* :func:`load_model` turns the header into an ``onnx_ir.Model`` whose external tensors memory-map the
  data files (or the ``.onnx``'s own byte ranges) on first use (read-only; the input files are never written)
  and sorts an unsorted graph.
* :func:`stand_in_proto` gives the ``ModelProto`` that onnx's checker, shape inference, onnxsim and the
  version converter need, with large initializers stripped to typed stand-ins, so their cost does not
  grow with weight bytes; :func:`proto_round_trip` brings such a proto back with the original weights.
* :func:`stage_artifacts` and :func:`write_for_ort` (from :mod:`onnxdeploy.model_write`) write outputs and the
  copies ONNX Runtime opens by path.

Hugging Face cache layout, decided on purpose: ``models--org--name/snapshots/<rev>/model.onnx_data`` is a
symlink into ``models--org--name/blobs/``. A data file that is a symlink is accepted only when it resolves
inside the model's folder, or when the model's folder is ``…/snapshots/<rev>/`` and the link resolves
into the sibling ``…/blobs/`` folder (what ``huggingface_hub`` writes; ONNX Runtime 1.32 refuses such a link,
so sessions open these models through :func:`write_for_ort`). Any other symlinked data file is refused (exit 2).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import onnx
import onnx_ir as ir
import onnx_ir.passes.common  # noqa: F401  (ir.passes does not import its submodules)
from google.protobuf.message import DecodeError

from onnxdeploy.errors import DuplicateTensorError, ModelLoadError, OutputError
from onnxdeploy.inline_weights import PROTOBUF_LIMIT_BYTES, STAND_IN_THRESHOLD_BYTES, read_header_bytes, tensor_nbytes
from onnxdeploy.model_write import StagedArtifacts, WeightsPolicy, default_file_mode, stage_artifacts, write_for_ort

__all__ = [
    "PROTOBUF_LIMIT_BYTES",
    "STAND_IN_THRESHOLD_BYTES",
    "ExternalFile",
    "LoadedModel",
    "StagedArtifacts",
    "WeightsPolicy",
    "check_external_data",
    "check_not_an_input",
    "default_file_mode",
    "external_location",
    "in_place_tensors",
    "input_files",
    "load_model",
    "proto_round_trip",
    "read_model_header",
    "release_weights",
    "sha256_file",
    "stage_artifacts",
    "stand_in_proto",
    "tensor_nbytes",
    "weight_bytes",
    "write_for_ort",
]

_R = TypeVar("_R")


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


@dataclass
class LoadedModel:
    """A model loaded for the passes.

    Attributes:
        path: the ``.onnx`` file.
        model: the in-memory model; external tensors map the input's data files read-only (and large inline
            ones the ``.onnx`` itself).
        external_files: the data files it references (empty when every weight is inline).
        sorted_at_load: a human-readable note when the graph was out of topological order and was sorted.
        inline_in_place: how many inline initializers map their bytes of the ``.onnx`` itself (not copied).
    """

    path: Path
    model: ir.Model
    external_files: list[ExternalFile]
    sorted_at_load: str | None = None
    inline_in_place: int = 0


# ---------------------------------------------------------------------------------------------- reading


def _parse_header(path: Path) -> onnx.ModelProto:
    """The file's ``ModelProto`` without its large weights' bytes (``inline_weights.read_header_bytes``).

    Inline initializers above :data:`STAND_IN_THRESHOLD_BYTES` become external-data references to the file itself.
    Bytes the wire-format walk cannot read are parsed by protobuf (format pinned: onnx would otherwise guess
    JSON/text from a ``.json``/``.txt`` extension), which raises its own error.
    """
    read = read_header_bytes(path, STAND_IN_THRESHOLD_BYTES)
    if read is not None:
        return onnx.ModelProto.FromString(read[0])
    return onnx.load(str(path), format="protobuf", load_external_data=False)


def read_model_header(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Parse an ``.onnx`` file without tensor data and check its external-data references.

    Weights stored inline are not read either: each main-graph initializer whose ``raw_data`` has more than
    :data:`STAND_IN_THRESHOLD_BYTES` bytes comes back as an external-data reference to the ``.onnx`` itself
    (``location`` its own file name, ``offset`` where the bytes start in it), so a 1 GB single-file model costs
    what its graph costs (:mod:`onnxdeploy.inline_weights`). Such references are checked like any other but are
    not listed as data files (:func:`check_external_data`).

    Args:
        path: the ``.onnx`` file.

    Returns:
        The ``ModelProto`` with external and large inline tensors as references (no weight bytes read).

    Raises:
        ModelLoadError: the file is missing, a folder, empty, not an ONNX protobuf, incomplete (no
            ``graph`` or no ``opset_import``, e.g. truncated), or an external-data reference is unsafe or
            broken (see :func:`check_external_data`). The message names the file and, where it applies,
            the tensor and the data file.
    """
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelLoadError(f"{p} is a folder; expected an .onnx model file")
    if not p.is_file():
        raise ModelLoadError(f"{p} is not a regular file; expected an .onnx model file")
    if p.stat().st_size == 0:
        raise ModelLoadError(f"model file is empty: {p}")
    try:
        proto = _parse_header(p)
    except DecodeError as exc:
        raise ModelLoadError(f"{p} is not an ONNX model (protobuf decode failed: {exc})") from exc
    except Exception as exc:  # onnx/protobuf raise several unrelated types
        raise ModelLoadError(f"cannot read ONNX model {p}: {exc}") from exc
    missing = [
        name
        for name, absent in (("graph", not proto.HasField("graph")), ("opset_import", not proto.opset_import))
        if absent
    ]
    if missing:
        raise ModelLoadError(
            f"{p} is an incomplete ONNX model: no {' and no '.join(missing)} (a truncated or partly written file?)"
        )
    check_external_data(proto, p)
    return proto


def external_location(tensor: onnx.TensorProto) -> str | None:
    """Return the ``location`` of a tensor stored as external data, or ``None`` if it is stored inline.

    Source: ONNX IR spec, "External Tensor Data" (``data_location == EXTERNAL``, ``external_data`` keys).
    A tensor marked external without a ``location`` key yields ``""``.
    """
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return _external_info(tensor).get("location", "")


_EXTERNAL_DATA_KEYS = frozenset({"location", "offset", "length", "checksum", "basepath"})
"""Keys of ``TensorProto.external_data`` (ONNX IR spec, "External Tensor Data"; ``basepath`` is onnx's own)."""


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _iter_external(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every external tensor of a graph and its subgraphs (initializers and Constant values)."""
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_location == onnx.TensorProto.EXTERNAL:
                yield attr.t
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from _iter_external(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _iter_external(g)


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
    return [f for f in _data_files(proto, model_path) if f.path != own]


def in_place_tensors(proto: onnx.ModelProto, model_path: str | os.PathLike[str]) -> int:
    """How many of ``proto``'s tensors reference bytes of the ``.onnx`` ``model_path`` itself (inline weights).

    ``proto`` is a header from :func:`read_model_header`; ONNX Runtime, given the file by path, would parse and
    copy those weights, so the runner opens such a model through :func:`write_for_ort` (hard links) instead.

    Raises:
        ModelLoadError: as :func:`check_external_data`.
    """
    own = Path(os.path.realpath(model_path))
    return sum(f.tensors for f in _data_files(proto, model_path) if f.path == own)


def _data_files(proto: onnx.ModelProto, model_path: str | os.PathLike[str]) -> list[ExternalFile]:
    """:func:`check_external_data`'s checks; every file, the ``.onnx`` itself too when inline tensors reference it."""
    model = Path(model_path)
    folder = model.parent
    files: dict[str, dict] = {}
    for tensor in _iter_external(proto.graph):
        info = _external_info(tensor)
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


def _unsorted_node(graph: ir.Graph) -> ir.Node | None:
    """The first node reading a value produced later in the main graph (None when sorted)."""
    seen: set[int] = set()
    for node in graph:
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer.graph is graph and id(producer) not in seen:
                return node
        seen.add(id(node))
    return None


def _refuse_duplicate_producers(graph: onnx.GraphProto, model: Path) -> None:
    """Refuse a main graph where two nodes (or a node and a graph input/initializer) define one tensor.

    Raises:
        ModelLoadError: naming the tensor and both definitions (the graph is not in SSA form).
    """
    defined: dict[str, str] = {v.name: "graph input" for v in graph.input}
    defined.update({t.name: "initializer" for t in graph.initializer})
    for i, node in enumerate(graph.node):
        label = f"node '{node.name}' ({node.op_type})" if node.name else f"node #{i} ({node.op_type})"
        for out in node.output:
            if not out:
                continue
            if out in defined:
                raise DuplicateTensorError(
                    f"{model}: tensor '{out}' is defined twice, by {defined[out]} and by {label}; an ONNX graph "
                    "gives every tensor one producer; rename one of them (`onnxdeploy check` lists every duplicate)"
                )
            defined[out] = label


def _refuse_cycle(graph: onnx.GraphProto, model: Path) -> None:
    """Refuse a main graph whose nodes read each other in a cycle (no order can run it).

    Raises:
        ModelLoadError: naming the nodes of one cycle, in data-flow order.
    """
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    state = [0] * len(graph.node)  # 0 unseen, 1 on the current path, 2 done

    def label(i: int) -> str:
        node = graph.node[i]
        return f"'{node.name}' ({node.op_type})" if node.name else f"#{i} ({node.op_type})"

    for start in range(len(graph.node)):
        if state[start]:
            continue
        path, stack = [start], [iter([producer[v] for v in graph.node[start].input if v in producer])]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state[nxt] == 1:
                cycle = path[path.index(nxt) :][::-1]
                raise ModelLoadError(
                    f"{model}: the graph has a cycle: node {' -> '.join(label(i) for i in cycle)} -> {label(cycle[0])} "
                    "(each reads the next one's output); an ONNX graph must be acyclic: re-export the model"
                )
            elif state[nxt] == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter([producer[v] for v in graph.node[nxt].input if v in producer]))


def _refuse_unknown_versions(proto: onnx.ModelProto, model: Path) -> None:
    """Refuse an IR version or ai.onnx opset newer than the installed onnx knows, before a tool says it at length.

    Raises:
        ModelLoadError: naming the version found, the newest known one and what to do.
    """
    ir_max = onnx.IR_VERSION
    opset_max = onnx.defs.onnx_opset_version()
    opset = max((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if proto.ir_version > ir_max:
        raise ModelLoadError(
            f"{model}: IR version {proto.ir_version} is newer than the installed onnx {onnx.__version__} knows "
            f"(up to {ir_max}); upgrade onnx and onnxruntime, or re-export with an older exporter"
        )
    if opset > opset_max:
        raise ModelLoadError(
            f"{model}: ai.onnx opset {opset} is newer than the installed onnx {onnx.__version__} knows (up to "
            f"{opset_max}); upgrade onnx and onnxruntime, or re-export with opset <= {opset_max}"
        )


def load_model(path: str | os.PathLike[str]) -> LoadedModel:
    """Load a model for the passes: graph in memory, external weights memory-mapped on first use.

    External tensors are re-pointed at the data files :func:`check_external_data` resolved (so onnx_ir's
    own containment and hard-link refusals, made for untrusted locations, do not apply twice: the
    Hugging Face layout is accepted here on purpose). Large inline initializers map their byte ranges of the
    ``.onnx`` itself the same way (:func:`read_model_header`): nothing of a single-file model's weights is
    copied, and every later stage handles them by reference as it does external data. A graph out of
    topological order is sorted (onnx_ir's ``TopologicalSortPass``) and ``sorted_at_load`` says which node was
    out of order.

    Args:
        path: the ``.onnx`` file (never written).

    Returns:
        The loaded model.

    Raises:
        ModelLoadError: as for :func:`read_model_header`, an IR version or ai.onnx opset newer than the installed
            onnx knows, a cycle, or onnx_ir cannot represent the graph.
        DuplicateTensorError: a tensor with two producers.
    """
    p = Path(path)
    proto = read_model_header(p)
    every = _data_files(proto, p)
    resolved = {f.location: f.path for f in every}
    own = Path(os.path.realpath(p))
    files = [f for f in every if f.path != own]
    _refuse_unknown_versions(proto, p)
    _refuse_duplicate_producers(proto.graph, p)
    _refuse_cycle(proto.graph, p)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as exc:  # onnx_ir raises ValueError/TypeError for malformed graphs
        raise ModelLoadError(f"{p}: cannot read the graph: {type(exc).__name__}: {exc}") from exc
    del proto
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                value.const_value = ir.ExternalTensor(
                    location=str(resolved[str(tensor.location)]),
                    offset=tensor.offset,
                    length=tensor.length if tensor.length is not None else tensor.nbytes,
                    dtype=tensor.dtype,
                    shape=tensor.shape,
                    name=tensor.name,
                    doc_string=tensor.doc_string,
                    metadata_props=dict(tensor.metadata_props),
                    base_dir="",
                )
    note = None
    late = _unsorted_node(model.graph)
    if late is not None:
        ir.passes.common.TopologicalSortPass()(model)
        note = (
            f"the graph was out of topological order (node '{late.name}' ({late.op_type}) read a later output); "
            "sorted at load"
        )
    in_place = sum(f.tensors for f in every if f.path == own)
    return LoadedModel(path=p, model=model, external_files=files, sorted_at_load=note, inline_in_place=in_place)


def weight_bytes(model: ir.Model) -> int:
    """Total bytes of the main graph's initializers (external ones by their length; nothing is read)."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def release_weights(model: ir.Model) -> None:
    """Unmap every memory-mapped external tensor of ``model`` (they map again if read later)."""
    for graph in model.graphs():
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                value.const_value.release()


# ------------------------------------------------------------------------------------- stand-in protos


@contextlib.contextmanager
def _stripped(model: ir.Model, threshold: int, as_inputs: bool) -> Iterator[dict[str, ir.TensorProtocol]]:
    """Temporarily strip initializers above ``threshold`` bytes from the main graph; restore on exit.

    ``as_inputs``: stripped weights become typed graph inputs (onnxsim and the version converter then treat
    them as unknown data and never fold or copy them). Otherwise they stay initializers whose data is an
    external reference to nothing (checks see the graph exactly as saved, without the bytes).
    """
    graph = model.graph
    stripped: dict[str, ir.TensorProtocol] = {}
    values = [v for v in graph.initializers.values() if v.const_value is not None and v.const_value.nbytes > threshold]
    n_inputs = len(graph.inputs)
    order = list(graph.initializers.values())
    for value in values:
        tensor = value.const_value
        assert value.name is not None and tensor is not None
        stripped[value.name] = tensor
        value.shape = value.shape or tensor.shape
        value.dtype = value.dtype or tensor.dtype
        if as_inputs:
            graph.initializers.pop(value.name)
            value.const_value = None
            if value not in graph.inputs:
                graph.inputs.append(value)
        else:
            value.const_value = ir.ExternalTensor(
                location="onnxdeploy-stand-in",
                offset=0,
                length=tensor.nbytes,
                dtype=tensor.dtype,
                shape=tensor.shape,
                name=value.name,
            )
    # Small initializers stay in the proto; ones kept in a data file are read (at most `threshold` bytes each)
    # so the proto holds no external reference (with an absolute location) a tool would have to resolve.
    small = [
        v
        for v in graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor) and v.name not in stripped
    ]
    mapped = [v.const_value for v in small]
    for value, tensor in zip(small, mapped, strict=True):
        value.const_value = ir.Tensor(tensor.numpy(), name=value.name)  # type: ignore[union-attr]
    try:
        yield stripped
    finally:
        for value, tensor in zip(small, mapped, strict=True):
            value.const_value = tensor
        for value in values:
            value.const_value = stripped[value.name]  # type: ignore[index]
        if as_inputs:  # re-add in the original order, so serialising the model gives the same bytes as before
            graph.initializers.clear()
            for value in order:
                graph.initializers.add(value)
        kept = list(graph.inputs)[:n_inputs]
        graph.inputs.clear()
        graph.inputs.extend(kept)


def stand_in_proto(
    model: ir.Model, *, threshold: int = STAND_IN_THRESHOLD_BYTES, as_inputs: bool = False
) -> onnx.ModelProto:
    """A ``ModelProto`` of ``model`` whose initializers above ``threshold`` bytes carry no data.

    By default the stripped initializers stay initializers with their dtype and dims and an external-data
    reference to a file that does not exist, so shape inference and graph checks see the graph as it will
    be saved; with ``as_inputs`` they become typed graph inputs instead (what onnx's checker accepts, since
    it looks for external files). Either way the cost does not grow with weight bytes and ``model`` is
    unchanged afterwards.

    Args:
        model: the in-memory model.
        threshold: bytes above which an initializer is stripped.
        as_inputs: strip to typed graph inputs instead of data-less initializers.

    Returns:
        A new ``ModelProto`` (never hand it to ONNX Runtime: the stand-ins have no data).
    """
    with _stripped(model, threshold, as_inputs=as_inputs):
        return ir.serde.serialize_model(model)


def proto_round_trip(
    model: ir.Model,
    transform: Callable[[onnx.ModelProto], onnx.ModelProto],
    *,
    threshold: int = STAND_IN_THRESHOLD_BYTES,
) -> ir.Model:
    """Run a ``ModelProto -> ModelProto`` tool (onnxsim, the version converter) without the weights.

    Initializers above ``threshold`` bytes are handed to ``transform`` as typed graph inputs (so it can
    neither fold nor copy them); in the model it returns they become initializers again, holding the very
    same tensor objects (memory-mapped weights stay mapped, nothing is copied). Smaller initializers kept in
    an external data file are handed over inline (and come back as in-memory copies). ``model`` is unchanged.

    Args:
        model: the in-memory model.
        transform: the tool; it must keep graph input names.
        threshold: bytes above which an initializer is stripped.

    Returns:
        A new ``ir.Model``: ``transform``'s result with the original weights re-attached.

    Raises:
        Whatever ``transform`` raises.
    """
    with _stripped(model, threshold, as_inputs=True) as stripped:
        proto = ir.serde.serialize_model(model)
        weights = dict(stripped)
    result = transform(proto)
    del proto
    out = ir.serde.deserialize_model(result)
    graph = out.graph
    for value in list(graph.inputs):
        if value.name in weights:
            graph.inputs.remove(value)
            value.const_value = weights[value.name]
            graph.initializers.add(value)
    return out


# ----------------------------------------------------------------------------------- input protection


def input_files(path: str | os.PathLike[str]) -> set[Path]:
    """Return the resolved paths of a model file and of every external-data file it references.

    Reads the graph only (no tensor data); locations are not validated here. Unreadable models yield
    just their own path.
    """
    p = Path(path).resolve()
    folder = Path(path).absolute().parent  # locations are relative to the folder named, not to a link's target
    files = {p}
    try:
        proto = _parse_header(p)
    except Exception:  # the caller reports load errors; here only the file set matters
        return files
    for tensor in _iter_external(proto.graph):
        loc = _external_info(tensor).get("location")
        if loc and not os.path.isabs(loc):
            try:
                files.add((folder / loc).resolve())
            except (OSError, RuntimeError, ValueError):  # NUL byte, symlink loop: the loader refuses it by name
                continue
    return files


def check_not_an_input(dest: str | os.PathLike[str], inputs: set[Path], what: str) -> None:
    """Raise :class:`~onnxdeploy.errors.OutputError` when writing ``dest`` would overwrite one of ``inputs``.

    Args:
        dest: the file about to be written.
        inputs: resolved paths of input files (models, their external data, the pipeline file).
        what: how to name ``dest`` in the message (e.g. ``--report``).
    """
    target = Path(dest).resolve()
    if target in inputs:
        raise OutputError(f"{what} {target} is an input file; inputs are never overwritten")


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 8 << 20) -> str:
    """The sha256 hex digest of a file's bytes, read in ``chunk_bytes`` chunks (memory stays flat for any size).

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
