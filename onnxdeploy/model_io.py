"""Model files: load, the protobuf limit and external data — the one module callers import them from.

Models of any size (docs/ARCHITECTURE.md, "Models of any size"): weights are never copied or serialised to move a
model between stages, whether the input keeps them in external data or inline in one ``.onnx``.

The modules are split by concern: this one reads (header checks, loading, input protection);
:mod:`onnxdeploy.external_refs` checks external-data references (and documents the Hugging Face cache layout
accepted); :mod:`onnxdeploy.stand_in` makes the weightless protos onnx's tools need; :mod:`onnxdeploy.model_write`
writes (staging, atomic commit, copies for ONNX Runtime) and :mod:`onnxdeploy.inline_weights` owns the protobuf
wire format that lets them handle inline weights in place. Their public names are re-exported here, so callers
keep importing from ``onnxdeploy.model_io``.

* :func:`read_model_header` parses the ``.onnx`` file without tensor data and refuses what cannot be a
  usable model (missing, empty, not protobuf, incomplete: no ``graph`` or no ``opset_import``) and every
  unsafe or broken external-data reference **before anything is read**: a ``location`` that is empty,
  absolute or contains ``..``; a folder component that is a symlink leaving the model's folder; a data file
  that is a symlink, except in a Hugging Face cache layout (:mod:`onnxdeploy.external_refs`); a file that is
  missing, not a regular file (a FIFO is never opened) or shorter than ``offset + length``. Lengths come from the
  ``length`` field, or from the shape and dtype where an exporter omits it (torch writes none). Large inline
  weights are not read: they come back as external-data references to the ``.onnx`` itself.
* :func:`load_model` turns the header into an ``onnx_ir.Model`` whose external tensors memory-map the
  data files (or the ``.onnx``'s own byte ranges) on first use (read-only; the input files are never written)
  and sorts an unsorted graph.
* :func:`stand_in_proto` gives the ``ModelProto`` that onnx's checker, shape inference, onnxsim and the
  version converter need, with large initializers stripped to typed stand-ins, so their cost does not
  grow with weight bytes; :func:`proto_round_trip` brings such a proto back with the original weights.
* :func:`stage_artifacts` and :func:`write_for_ort` (from :mod:`onnxdeploy.model_write`) write outputs and the
  copies ONNX Runtime opens by path.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
import onnx_ir.passes.common  # noqa: F401  (ir.passes does not import its submodules)
from google.protobuf.message import DecodeError

from onnxdeploy.errors import DuplicateTensorError, ModelLoadError, OutputError
from onnxdeploy.external_refs import (
    ExternalFile,
    check_external_data,
    data_files,
    external_info,
    external_location,
    in_place_tensors,
    iter_external,
    link_external_data,
)
from onnxdeploy.inline_weights import PROTOBUF_LIMIT_BYTES, STAND_IN_THRESHOLD_BYTES, read_header_bytes, tensor_nbytes
from onnxdeploy.mapped_tensor import range_mapped
from onnxdeploy.model_write import StagedArtifacts, WeightsPolicy, default_file_mode, stage_artifacts, write_for_ort
from onnxdeploy.stand_in import proto_round_trip, stand_in_proto

__all__ = [
    "PROTOBUF_LIMIT_BYTES",
    "STAND_IN_THRESHOLD_BYTES",
    "ExternalFile",
    "LoadedModel",
    "StagedArtifacts",
    "WeightsPolicy",
    "check_external_data",
    "link_external_data",
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
    Hugging Face layout is accepted here on purpose); each maps only its own byte range when read
    (:class:`~onnxdeploy.mapped_tensor.RangeMappedTensor`). Large inline initializers map their byte ranges of the
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
    every = data_files(proto, p)
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
                value.const_value = range_mapped(tensor, resolved[str(tensor.location)])
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
    for tensor in iter_external(proto.graph):
        loc = external_info(tensor).get("location")
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
