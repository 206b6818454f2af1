"""Shared graph helpers: loading, atomic saving, histograms, sizes and dims of ONNX models."""

from __future__ import annotations

import collections
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from onnxdeploy.errors import ModelLoadError, OutputError

__all__ = [
    "load_model",
    "save_model_atomic",
    "op_histogram",
    "initializer_bytes",
    "tensor_dims",
    "io_dims",
    "opset_imports",
    "PROTOBUF_LIMIT_BYTES",
    "default_file_mode",
    "input_files",
    "check_not_an_input",
]

PROTOBUF_LIMIT_BYTES = 2**31 - 1
"""Largest serialized ModelProto protobuf accepts (2 GiB - 1 byte); larger models need external data."""


def load_model(path: str | os.PathLike[str], *, load_external_data: bool = True) -> onnx.ModelProto:
    """Load an ONNX model from ``path``.

    Args:
        path: the ``.onnx`` file.
        load_external_data: also read tensors stored in external data files.

    Returns:
        The parsed model (a fresh object; the file is never written).

    Raises:
        ModelLoadError: the file is missing, not a file, or not a valid ONNX protobuf.
    """
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelLoadError(f"model path is not a file: {p}")
    if p.stat().st_size == 0:
        raise ModelLoadError(f"model file is empty: {p}")
    try:
        # format pinned: onnx would otherwise guess JSON/text from a .json/.txt extension
        model = onnx.load(str(p), format="protobuf", load_external_data=load_external_data)
    except DecodeError as exc:
        raise ModelLoadError(f"{p} is not an ONNX model (protobuf decode failed: {exc})") from exc
    except Exception as exc:  # onnx raises ValidationError/OSError/... for external data problems
        raise ModelLoadError(f"cannot load ONNX model {p}: {exc}") from exc
    if not model.graph.node and not model.graph.output:
        raise ModelLoadError(f"{p} is not an ONNX model (no graph in the file)")
    return model


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` to ``path`` atomically: a temporary file in the same folder, then rename.

    A failure at any point leaves no new file at ``path`` and removes the temporary file.

    Args:
        model: the model; must serialize under the 2 GiB protobuf limit.
        path: destination ``.onnx`` path; its folder is created if missing.

    Returns:
        The destination path.

    Raises:
        ModelLoadError: the model is over the protobuf limit (use external data).
        OSError: the folder is not writable.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    size = model.ByteSize()
    if size > PROTOBUF_LIMIT_BYTES:
        raise ModelLoadError(
            f"model is {size} bytes, over the 2 GiB protobuf limit; it cannot be saved as one file {dest}"
        )
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        os.chmod(tmp, default_file_mode())
        with os.fdopen(fd, "wb") as fh:
            fh.write(model.SerializeToString())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def input_files(path: str | os.PathLike[str]) -> set[Path]:
    """Return the resolved paths of a model file and of every external-data file it references.

    Reads the graph only (no tensor data). Unreadable models yield just their own path.
    """
    p = Path(path).resolve()
    files = {p}
    try:
        model = onnx.load(str(p), format="protobuf", load_external_data=False)
    except Exception:  # the caller reports load errors; here only the file set matters
        return files
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in init.external_data if e.key == "location"), None)
            if loc:
                files.add((p.parent / loc).resolve())
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


def default_file_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the current umask (mkstemp gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Count nodes of the main graph by op type (``domain::Op`` for non-default domains).

    Returns:
        Mapping op type -> count, sorted by op type.
    """
    counts: collections.Counter[str] = collections.Counter()
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[key] += 1
    return dict(sorted(counts.items()))


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Return the total size in bytes of the graph's initializers (raw data, external data included).

    External tensors count by their ``length`` entry when present.
    """
    total = 0
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            total += int(info.get("length", 0))
            continue
        if init.raw_data:
            total += len(init.raw_data)
        else:
            total += onnx.numpy_helper.to_array(init).nbytes
    return total


def tensor_dims(value_info: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """Return the dims of a tensor value info: int for static, str for symbolic, None for unknown.

    Returns:
        The dims, or ``None`` when the rank is unknown (no shape).
    """
    ttype = value_info.type.tensor_type
    if not ttype.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def io_dims(values: Iterable[onnx.ValueInfoProto]) -> dict[str, list[int | str | None] | None]:
    """Map each value info's name to its dims (see :func:`tensor_dims`)."""
    return {v.name: tensor_dims(v) for v in values}


def opset_imports(model: onnx.ModelProto) -> dict[str, int]:
    """Return opset version per domain (``ai.onnx`` for the default domain)."""
    return {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
