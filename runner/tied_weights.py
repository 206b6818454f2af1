"""A tied embedding that ONNX Runtime would transpose into a private copy in every session, stored transposed once.

Why: a decoder with tied embeddings (SmolLM2, every optimum export of ``tie_word_embeddings``) reads one
``(V, H)`` initializer ``W`` twice: ``Gather(W, input_ids)`` for the embedding and ``Transpose(W)`` for the LM
head's ``MatMul``. ORT's constant folding turns ``Transpose(W)`` into a new ``(H, V)`` tensor in the session's own
memory (anonymous, not mapped): measured on SmolLM2-135M's optimum export (V 49152, H 576: 108 MiB), each session
grew by ~120 MiB anonymous RSS when created, so a graph set's four sessions held four copies beside the mapped
``W`` (the verify phase peaked at 2.7x the model's bytes; the weights are 1x).

What the runner does instead (its sessions only; the graph written to the output folder is unchanged): ``W^T`` is
written **once per process** to a scratch data file (:func:`transposed_file`, column blocks: at most
:data:`BLOCK_BYTES` of it in memory), and the session's header (a scratch copy, data files hard-linked) reads
``W^T`` only: the ``Transpose`` is removed and its consumers read ``W^T``; each ``Gather(W, ids, axis=0)`` becomes
``Transpose(Gather(W^T, ids, axis=1), perm=[1, ..., r, 0])`` (``r`` = rank of ``ids``), the same values (both are
copies). ``W`` itself is then not read by any session, so only its transpose is resident, mapped and shared
by every session of the process (:mod:`onnxdeploy.runner.shared_weights`): the weights count once. The LM head's
``MatMul`` gets the very matrix ORT's folding would have made, so logits are bit-identical
(``tests/runner/test_tied_weights.py``).

Sources: ORT 1.32 ``constant_folding.cc`` (a node whose inputs are all constant initializers is computed at
session creation and replaced by a new initializer owned by the session); ONNX ``Gather`` (output shape
``data.shape[:axis] + indices.shape + data.shape[axis+1:]``) and ``Transpose`` (``perm`` defaults to reversed).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxdeploy import model_io
from onnxdeploy.mapped_tensor import RangeMappedTensor

__all__ = ["BLOCK_BYTES", "MIN_BYTES", "TiedWeight", "find_tied", "transposed_file", "untie_header", "untied_copy"]

MIN_BYTES = 1 << 20
"""Tied weights below this many bytes are left to ORT (its folded copy is small)."""

BLOCK_BYTES = 16 << 20
"""At most this many bytes of ``W^T`` are in memory while it is written."""

_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE})
_CACHE: dict[tuple[int, int, int, int, int], Path] = {}
_LOCK = threading.Lock()
_FOLDER: list[Path] = []


@dataclass(frozen=True)
class TiedWeight:
    """An external ``(V, H)`` initializer read only by ``Transpose`` (perm [1, 0]) and ``Gather`` (axis 0) nodes.

    Attributes:
        name: the initializer.
        transposes: indices in ``graph.node`` of the ``Transpose`` nodes reading it.
        gathers: (node index, rank of its indices) of the ``Gather`` nodes reading it.
    """

    name: str
    transposes: tuple[int, ...]
    gathers: tuple[tuple[int, int], ...]


def _attr(node: onnx.NodeProto, name: str, default):
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else onnx.helper.get_attribute_value(found)


def _ranks(header: onnx.ModelProto, names: set[str]) -> dict[str, int]:
    """Ranks of ``names`` known from the graph's inputs and ``value_info``, else from onnx's shape inference.

    Inference runs on the header (no weight is read: initializers carry their dims) only when a name is not
    annotated; a model it cannot infer leaves that name out.
    """

    def known(graph: onnx.GraphProto) -> dict[str, int]:
        return {
            v.name: len(v.type.tensor_type.shape.dim)
            for v in [*graph.input, *graph.value_info]
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
        }

    ranks = known(header.graph)
    if names <= ranks.keys():
        return ranks
    try:
        inferred = onnx.shape_inference.infer_shapes(header, strict_mode=False)
    except Exception:  # noqa: BLE001  (onnx raises several types for graphs it cannot infer)
        return ranks
    return {**known(inferred.graph), **ranks}


def find_tied(header: onnx.ModelProto) -> list[TiedWeight]:
    """The main graph's tied weights this module rewrites (see the module docstring); none is changed.

    A candidate: a 2-D external float initializer of at least :data:`MIN_BYTES`, not a graph input or output,
    every reader of which is a default-domain ``Transpose`` with perm [1, 0] (or none) or ``Gather`` with axis 0
    reading it as data, at least one of each, the ``Gather`` indices' rank known (a graph input, ``value_info``
    or onnx's shape inference), no ``Transpose`` output a graph output.
    """
    graph = header.graph
    inits = {
        t.name: t
        for t in graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL and len(t.dims) == 2 and t.data_type in _FLOATS
    }
    outputs = {v.name for v in graph.output}
    blocked = {v.name for v in graph.input} | outputs
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            if name in inits:
                readers.setdefault(name, []).append(i)
    if not any(graph.node[i].op_type == "Transpose" for nodes in readers.values() for i in nodes):
        return []
    indices = {graph.node[i].input[1] for nodes in readers.values() for i in nodes if graph.node[i].op_type == "Gather"}
    ranks = _ranks(header, indices)
    found = []
    for name, nodes in readers.items():
        tensor = inits[name]
        if name in blocked or (model_io.tensor_nbytes(tensor) or 0) < MIN_BYTES:
            continue
        transposes, gathers, ok = [], [], True
        for i in nodes:
            node = graph.node[i]
            plain = node.domain in ("", "ai.onnx") and list(node.input).count(name) == 1
            if plain and node.op_type == "Transpose" and list(_attr(node, "perm", [1, 0])) == [1, 0]:
                ok &= node.output[0] not in outputs
                transposes.append(i)
            elif plain and node.op_type == "Gather" and node.input[0] == name and _attr(node, "axis", 0) == 0:
                ok &= node.input[1] in ranks
                gathers.append((i, ranks.get(node.input[1], 0)))
            else:
                ok = False
        if ok and transposes and gathers:
            found.append(TiedWeight(name, tuple(transposes), tuple(gathers)))
    return found


def _folder() -> Path:
    """This process's folder of transposed copies (removed at exit)."""
    if not _FOLDER:
        folder = Path(tempfile.mkdtemp(prefix="onnxdeploy-tied-"))
        atexit.register(shutil.rmtree, folder, True)
        _FOLDER.append(folder)
    return _FOLDER[0]


def transposed_file(tensor: onnx.TensorProto, data_path: Path) -> Path:
    """A file holding ``W^T`` for the external initializer ``tensor`` of ``data_path``: made once per process.

    Args:
        tensor: the ``(V, H)`` initializer (its ``offset`` / ``length`` in ``data_path``).
        data_path: the resolved data file (keyed by device, inode, size, mtime and offset: a hard link shares).

    Returns:
        The file (``(H, V)`` row-major, little-endian, nothing else in it).

    Raises:
        OSError: the scratch folder cannot be written (disk full).
    """
    info = {e.key: e.value for e in tensor.external_data}
    offset = int(info.get("offset", 0))
    st = os.stat(data_path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, offset)
    with _LOCK:
        found = _CACHE.get(key)
        if found is not None and found.exists():
            return found
        rows, cols = (int(d) for d in tensor.dims)
        source = RangeMappedTensor(
            str(data_path), offset, model_io.tensor_nbytes(tensor), ir.DataType(tensor.data_type),
            shape=ir.Shape([rows, cols]), name=tensor.name, base_dir="",
        )  # fmt: skip
        w = source.numpy()
        out = _folder() / f"{len(_CACHE)}-{tensor.name.replace('/', '_')[:80]}.T.bin"
        step = max(1, BLOCK_BYTES // max(1, rows * w.itemsize))
        with open(out, "wb") as fh:
            for start in range(0, cols, step):
                fh.write(np.ascontiguousarray(w[:, start : start + step].T).tobytes())
        del w
        source.release()
        _CACHE[key] = out
        return out


def untie_header(header: onnx.ModelProto, model_path: Path, tied: list[TiedWeight], scratch: Path) -> None:
    """Rewrite ``header`` (in place) to read each tied weight's transpose, linked into ``scratch`` (module docstring).

    Args:
        header: the session's header (``onnx.load(load_external_data=False)`` of ``model_path``).
        model_path: the ``.onnx`` the header came from (data locations are relative to its folder).
        tied: :func:`find_tied` of this header.
        scratch: the folder the rewritten header will be saved in (the transposed files are linked there).

    Raises:
        OSError: a transposed file cannot be written or linked.
    """
    graph = header.graph
    inits = {t.name: t for t in graph.initializer}
    new_nodes: dict[int, list[onnx.NodeProto]] = {}
    for n, weight in enumerate(tied):
        tensor = inits[weight.name]
        info = {e.key: e.value for e in tensor.external_data}
        data = Path(os.path.realpath(model_path.parent / info["location"]))
        source = transposed_file(tensor, data)
        link = scratch / f"tied-{n}.T.bin"
        try:
            os.link(source, link)
        except OSError:
            shutil.copyfile(source, link)
        t_name = f"{weight.name}.onnxdeploy_transposed"
        rows, cols = (int(d) for d in tensor.dims)
        t = onnx.TensorProto(name=t_name, data_type=tensor.data_type, dims=[cols, rows])
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", link.name), ("offset", "0"), ("length", str(model_io.tensor_nbytes(t)))):
            t.external_data.add(key=key, value=value)
        graph.initializer.append(t)
        renamed = {graph.node[i].output[0]: t_name for i in weight.transposes}
        for node in graph.node:
            node.input[:] = [renamed.get(x, x) for x in node.input]
        for i in weight.transposes:
            new_nodes[i] = []
        for i, rank in weight.gathers:
            old = graph.node[i]
            mid = f"{old.output[0]}.onnxdeploy_untied"
            gather = onnx.helper.make_node("Gather", [t_name, old.input[1]], [mid], name=f"{old.name}_untied", axis=1)
            perm = [*range(1, rank + 1), 0]
            back = onnx.helper.make_node("Transpose", [mid], [old.output[0]], name=f"{old.name}_back", perm=perm)
            new_nodes[i] = [gather, back]
    nodes = []
    for i, node in enumerate(graph.node):
        nodes.extend(new_nodes.get(i, [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in {w.name for w in tied}]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def untied_copy(path: Path, scratch: Path) -> str | None:
    """Save ``path``'s header with its tied weights read transposed (:func:`untie_header`) into ``scratch``.

    Args:
        path: the ``.onnx`` ORT would open (the input itself, or a scratch copy already in ``scratch``).
        scratch: the session's scratch folder; the input's data files are hard-linked into it unless ``path`` is
            already there.

    Returns:
        The rewritten ``.onnx`` in ``scratch``; None when nothing is tied, or a data file cannot be hard-linked
        (another filesystem: the caller opens ``path`` as it is).

    Raises:
        OSError: the header or a transposed file cannot be written.
    """
    proto = onnx.load(str(path), load_external_data=False)
    tied = find_tied(proto)
    if not tied:
        return None
    if Path(os.path.realpath(path.parent)) != Path(os.path.realpath(scratch)):
        if not model_io.link_external_data(proto, path, scratch):
            return None
    untie_header(proto, path, tied, scratch)
    target = scratch / path.name
    onnx.save(proto, str(target))
    return str(target)
