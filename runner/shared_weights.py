"""One read-only memory map per weights file, shared by every ORT session that reads it (a graph set's graphs).

Why: ORT maps each external-data tensor itself, once per session. The graphs of a set (``static_kv
{step_lens, max_cache_lens}``) share one data file, so with four sessions open the same file pages are mapped
four times: the kernel keeps them once (PSS 1.72x the model's bytes on ``benchmarks/scale.py``'s 1 GB fast
chain) but RSS counts them once per mapping (4.3x). Here the runner maps each data file **once** per process
(``mmap`` ``ACCESS_READ``), wraps every external initializer's byte range as a numpy view and an ``OrtValue``
(``OrtValue.ortvalue_from_numpy``: on CPU the value points at the numpy buffer, no copy) and hands it to the
session with ``SessionOptions.add_initializer``, which ORT uses instead of deserialising the initializer from
the model (onnxruntime_c_api.h, ``AddInitializer``: "useful when you want to share the same initializer across
sessions ... Lifetime of 'val' and the underlying initializer buffer must be managed by the user ... and it must
outlive the session object"). ``tests/runner/test_shared_weights.py`` checks that a set's six sessions leave one
mapping of ``model.onnx.data`` in ``/proc/self/maps`` and decode bit-identically; ``benchmarks/scale.py``
measured the 1 GB fast chain at 1.27x RSS (4.29x before), its step-1 latency unchanged (ORT 1.32, CPU EP).

Lifetime: every map is held by the sessions that use it (:class:`WeightMaps` is attached to the Python
``InferenceSession`` object, after its native session, so it is released after it); the registry keeps only
weak references, so a file is unmapped once its last session is gone. Files are keyed by device, inode, size and
mtime: a hard link (the scratch copy of an inline ``.onnx``, a relevelled header) shares its original's map, and
a rewritten file (outputs are replaced atomically: a new inode) gets a new one.

Only for CPU sessions without prepacking (float weights, :func:`onnxdeploy.runner.session.session_settings`):
with prepacking ORT packs its own copy and releases the loaded tensor, which a user buffer would keep resident.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from onnxdeploy.errors import ModelLoadError

__all__ = ["MappedFile", "WeightMaps", "attach", "share_initializers"]

_REGISTRY: weakref.WeakValueDictionary[tuple[int, int, int, int], MappedFile] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


class MappedFile:
    """One read-only ``mmap`` of a weights file and the initializer values over its byte ranges.

    Args:
        path: the data file (a hard link of it maps the same inode).

    Raises:
        OSError: the file cannot be opened or mapped.
    """

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._values: dict[tuple[int, int, int, tuple[int, ...]], ort.OrtValue] = {}

    def value(self, offset: int, length: int, data_type: int, dims: tuple[int, ...]) -> ort.OrtValue:
        """The ``OrtValue`` over bytes ``[offset, offset + length)`` as a tensor of ``data_type`` and ``dims``.

        Args:
            offset: byte offset in the file (ONNX ``external_data`` ``offset``).
            length: byte length (``external_data`` ``length``).
            data_type: ``onnx.TensorProto`` element type (numeric types numpy has; not 4-bit or bfloat16).
            dims: the tensor's dims.

        Returns:
            One value per distinct range and type, reused by every session of the process.

        Raises:
            ValueError: the type has no numpy dtype, or ``length`` is not the tensor's byte size.
        """
        key = (offset, length, data_type, dims)
        found = self._values.get(key)
        if found is None:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))
            count = int(np.prod(dims, dtype=np.int64))
            if count * dtype.itemsize != length or offset + length > len(self._map):
                raise ValueError(f"{self.path}: range {offset}+{length} is not a {dtype} tensor of dims {dims}")
            array = np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(dims)
            found = self._values[key] = ort.OrtValue.ortvalue_from_numpy(array)
        return found


class WeightMaps:
    """The maps one session's shared initializers live in; kept alive as long as that session.

    Attributes:
        files: the mapped files, by resolved path.
        names: initializer names handed to the session.
    """

    def __init__(self) -> None:
        self.files: dict[Path, MappedFile] = {}
        self.names: list[str] = []


_SHAREABLE = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.INT16,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.INT32,
        onnx.TensorProto.UINT32,
        onnx.TensorProto.INT64,
        onnx.TensorProto.UINT64,
        onnx.TensorProto.BOOL,
    }
)
"""Element types whose bytes numpy views as ORT stores them (4-bit, bfloat16 and float8 stay ORT-loaded)."""


def _mapped(path: Path) -> MappedFile:
    """The process's one map of ``path``'s inode (made on first use)."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _LOCK:
        found = _REGISTRY.get(key)
        if found is None:
            found = _REGISTRY[key] = MappedFile(path)
        return found


def share_initializers(options: ort.SessionOptions, header: onnx.ModelProto, model_path: str | Path) -> WeightMaps:
    """Add every external initializer of ``header`` to ``options`` as a value over the process's one map of its file.

    Args:
        options: the session options the session will be created with (``add_initializer`` per tensor).
        header: the model file's header (``onnx.load(load_external_data=False)``): its external-data references
            are the ones ORT would load; inline tensors are left to ORT.
        model_path: the ``.onnx`` file ORT opens (locations are relative to its folder).

    Returns:
        The maps used; keep them alive as long as the session (:func:`attach`).

    Raises:
        ModelLoadError: a data file cannot be mapped or a range does not fit its tensor (names file and tensor).
    """
    maps = WeightMaps()
    folder = Path(model_path).parent
    inputs = {value.name for value in header.graph.input}  # an overridable initializer stays ORT's
    for tensor in header.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL or tensor.data_type not in _SHAREABLE:
            continue
        if tensor.name in inputs:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        path = Path(os.path.realpath(folder / info["location"]))
        try:
            mapped = maps.files.get(path) or _mapped(path)
            maps.files[path] = mapped
            value = mapped.value(int(info.get("offset", 0)), int(info["length"]), tensor.data_type, tuple(tensor.dims))
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{model_path}: cannot map initializer '{tensor.name}' from {path}: {exc}") from exc
        options.add_initializer(tensor.name, value)
        maps.names.append(tensor.name)
    return maps


def attach(session: ort.InferenceSession, maps: WeightMaps) -> None:
    """Keep ``maps`` alive as long as ``session``: set after its native session, so freed after it."""
    session._onnxdeploy_weight_maps = maps  # noqa: SLF001 (ORT's Python session object takes attributes)
