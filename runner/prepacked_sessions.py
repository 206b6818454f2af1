"""ORT sessions that share one prepacked copy of their weights: the C API's PrepackedWeightsContainer, via ctypes.

Why: ORT's CPU MatMul needs its constant weight prepacked to run M > 1 rows fast (README, "Continuous batching"),
and each session prepacks a private copy, so the continuous-batching host's decode graph and prefill graph held
two (1068 MiB peak RSS for the 125M export against the 737 MiB goal). ORT shares prepacked weights between sessions
only through a ``PrepackedWeightsContainer`` passed to ``CreateSessionWithPrepackedWeightsContainer``, and only for
initializers the caller added with ``AddInitializer`` (onnxruntime ``session_state.cc``,
``PrepackConstantInitializedTensors``: "Caching pre-packed weights is limited to shared initializers associated with
the CPU EP"; the key is the op type and a hash of the packed bytes). onnxruntime's Python bindings expose neither the
container nor that call, so this module opens sessions through the C API of the ``libonnxruntime.so`` that ships
inside the ``onnxruntime`` wheel (``onnxruntime/capi/``), by ctypes:

* the function table is ``OrtGetApiBase()->GetApi(16)`` (ORT 1.16's ``OrtApi``; the table only grows, so 1.32
  serves it); each entry used is at ``8 × index`` bytes, the index its position in ``struct OrtApi``
  (``include/onnxruntime/core/session/onnxruntime_c_api.h``): :data:`_OFFSETS`;
* every external initializer of a graph is an ``OrtValue`` over this process's one read-only ``mmap`` of its data
  file (``CreateTensorWithDataAsOrtValue``, no copy) given to the session with ``AddInitializer``, and every session
  of a :class:`SharedPrepacking` is created with its one container: the first session packs each MatMul weight, the
  others find it there (the decode graph and the prefill graphs of a set read the same weights);
* prepacking reads the mapped weights, so their file pages become resident while the packed copies are written:
  the float weights twice over, once as file pages and once packed (the load of the 125M export's B = 4 set peaked
  at 1012 MiB, 436 MiB of it file pages). So while :meth:`SharedPrepacking.open` creates a session, a thread drops
  the maps' pages every ``drop_interval_s`` (1 ms) with ``madvise(MADV_DONTNEED)`` (:meth:`drop_mapped_pages`;
  ORT's ``CreateSession`` runs without the GIL): a page is resident from the moment prepacking reads it to the
  next drop. A read-only file mapping: a page read again is faulted back from the file (the page cache), so nothing
  can change what a session computes.

Measured on the 125M export's B = 4 set (``benchmarks/batching.py``, README "Continuous batching"): peak RSS while
serving the trace 632 MiB against 1068 MiB for the Python sessions, the same tokens, the same tokens/s; the load
peaks at 664 MiB with the pages dropped while loading (1012 MiB dropped only after it; 702 and 724 MiB with drops
every 10 and 50 ms; the load took 0.85 s against 0.82 s; 2026-12-02 18:45 UTC).

A :class:`PrepackedSession` offers the part of ``onnxruntime.InferenceSession`` the decoders use (``get_inputs``,
``get_outputs``, ``get_providers``, ``run``), so :func:`~onnxdeploy.runner.graph_set.open_graph_set` drives it
through its ``opener`` (no IOBinding: each call's outputs are written into arrays allocated for it). CPU only;
float32/float16/int64 tensors only.
"""

from __future__ import annotations

import ctypes as C
import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

from onnxdeploy.errors import ModelLoadError
from onnxdeploy.runner.session import ModelSession, read_header

__all__ = ["PrepackedSession", "SharedPrepacking"]

API_VERSION = 16
"""The ``OrtApi`` version asked for: 1.16's table holds every entry used here."""
_OFFSETS = {
    "GetErrorMessage": 2, "CreateEnv": 3, "Run": 9, "CreateSessionOptions": 10, "SetSessionExecutionMode": 13,
    "SetIntraOpNumThreads": 24, "SetInterOpNumThreads": 25, "CreateTensorWithDataAsOrtValue": 49,
    "CreateCpuMemoryInfo": 69, "ReleaseStatus": 93, "ReleaseSession": 95, "ReleaseValue": 96,
    "ReleaseSessionOptions": 100, "AddSessionConfigEntry": 130, "AddInitializer": 150,
    "CreatePrepackedWeightsContainer": 166, "CreateSessionWithPrepackedWeightsContainer": 168,
}  # fmt: skip
"""Index of each entry in ``struct OrtApi`` (onnxruntime_c_api.h; the byte offset is 8 × index)."""
_P = C.c_void_p
_SIGNATURES: dict[str, tuple[object, tuple[object, ...]]] = {
    "GetErrorMessage": (C.c_char_p, (_P,)),
    "CreateEnv": (_P, (C.c_int, C.c_char_p, C.POINTER(_P))),
    "Run": (_P, (_P, _P, C.POINTER(C.c_char_p), C.POINTER(_P), C.c_size_t, C.POINTER(C.c_char_p), C.c_size_t,
                 C.POINTER(_P))),
    "CreateSessionOptions": (_P, (C.POINTER(_P),)),
    "SetSessionExecutionMode": (_P, (_P, C.c_int)),
    "SetIntraOpNumThreads": (_P, (_P, C.c_int)),
    "SetInterOpNumThreads": (_P, (_P, C.c_int)),
    "CreateTensorWithDataAsOrtValue": (_P, (_P, _P, C.c_size_t, C.POINTER(C.c_int64), C.c_size_t, C.c_int,
                                            C.POINTER(_P))),
    "CreateCpuMemoryInfo": (_P, (C.c_int, C.c_int, C.POINTER(_P))),
    "ReleaseStatus": (None, (_P,)),
    "ReleaseSession": (None, (_P,)),
    "ReleaseValue": (None, (_P,)),
    "ReleaseSessionOptions": (None, (_P,)),
    "AddSessionConfigEntry": (_P, (_P, C.c_char_p, C.c_char_p)),
    "AddInitializer": (_P, (_P, C.c_char_p, _P)),
    "CreatePrepackedWeightsContainer": (_P, (C.POINTER(_P),)),
    "CreateSessionWithPrepackedWeightsContainer": (_P, (_P, C.c_char_p, _P, _P, C.POINTER(_P))),
}  # fmt: skip
_ELEMENT = {np.dtype(np.float32): 1, np.dtype(np.int64): 7, np.dtype(np.float16): 10}
_TYPE_NAME = {1: "float", 7: "int64", 10: "float16"}


class _Api:
    """The C API's functions by name, from the wheel's ``libonnxruntime.so`` (module docstring)."""

    def __init__(self) -> None:
        folder = Path(onnxruntime.__file__).parent / "capi"
        libs = sorted(folder.glob("libonnxruntime.so*"))
        if not libs:
            raise ModelLoadError(f"{folder}: no libonnxruntime.so in the onnxruntime wheel (the C API is needed)")
        lib = C.CDLL(str(libs[0]))

        class ApiBase(C.Structure):
            _fields_ = [("GetApi", C.CFUNCTYPE(_P, C.c_uint32)), ("GetVersionString", C.CFUNCTYPE(C.c_char_p))]

        lib.OrtGetApiBase.restype = C.POINTER(ApiBase)
        table = lib.OrtGetApiBase().contents.GetApi(API_VERSION)
        if not table:
            raise ModelLoadError(f"{libs[0]}: no OrtApi version {API_VERSION}")
        for name, index in _OFFSETS.items():
            restype, args = _SIGNATURES[name]
            address = C.cast(table + 8 * index, C.POINTER(_P)).contents.value
            setattr(self, name, C.CFUNCTYPE(restype, *args)(address))

    def check(self, status: int | None, what: str) -> None:
        """Raise ModelLoadError with ORT's message when ``status`` is not OK (then release it)."""
        if status:
            message = self.GetErrorMessage(status).decode(errors="replace")  # type: ignore[attr-defined]
            self.ReleaseStatus(status)  # type: ignore[attr-defined]
            raise ModelLoadError(f"{what}: {message}")


class SharedPrepacking:
    """One ORT environment, one prepacked-weights container and one map per data file, for every session it opens.

    Keep it alive while its sessions run (each :class:`PrepackedSession` holds a reference).

    Args:
        drop_interval_s: while :meth:`open` creates a session, drop the maps' resident pages this often (seconds;
            module docstring); None: never while loading (call :meth:`drop_mapped_pages` after).

    Raises:
        ModelLoadError: the wheel has no ``libonnxruntime.so`` or it serves no ``OrtApi`` version 16.
    """

    def __init__(self, *, drop_interval_s: float | None = 0.001) -> None:
        self.drop_interval_s = drop_interval_s
        self.api = _Api()
        self.env, self.memory, self.container = _P(), _P(), _P()
        self.api.check(self.api.CreateEnv(3, b"onnxdeploy", C.byref(self.env)), "CreateEnv")  # type: ignore[attr-defined]
        self.api.check(self.api.CreateCpuMemoryInfo(0, 0, C.byref(self.memory)), "CreateCpuMemoryInfo")  # type: ignore[attr-defined]
        self.api.check(
            self.api.CreatePrepackedWeightsContainer(C.byref(self.container)),  # type: ignore[attr-defined]
            "CreatePrepackedWeightsContainer",
        )
        self.maps: dict[Path, mmap.mmap] = {}
        self._initializers: dict[tuple[str, str, str, str], tuple[np.ndarray, _P]] = {}

    def value(self, array: np.ndarray) -> _P:
        """An ``OrtValue`` over ``array``'s buffer (no copy; release it with ``ReleaseValue``)."""
        shape = (C.c_int64 * array.ndim)(*array.shape)
        out = _P()
        self.api.check(
            self.api.CreateTensorWithDataAsOrtValue(  # type: ignore[attr-defined]
                self.memory, array.ctypes.data, array.nbytes, shape, array.ndim, _ELEMENT[array.dtype], C.byref(out)
            ),
            "CreateTensorWithDataAsOrtValue",
        )
        return out

    def initializer(self, folder: Path, tensor: onnx.TensorProto) -> _P:
        """The shared ``OrtValue`` of an external initializer: a view of the process's one map of its file."""
        e = {x.key: x.value for x in tensor.external_data}
        file = folder / e["location"]
        key = (str(file), e.get("offset", "0"), e["length"], tensor.name)
        if key not in self._initializers:
            if file not in self.maps:
                with open(file, "rb") as fh:
                    self.maps[file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            array = np.frombuffer(
                self.maps[file], dtype=dtype, count=int(e["length"]) // dtype.itemsize, offset=int(key[1])
            ).reshape(tuple(tensor.dims))
            self._initializers[key] = (array, self.value(array))
        return self._initializers[key][1]

    def drop_mapped_pages(self) -> None:
        """``madvise(MADV_DONTNEED)`` every map: the file pages prepacking read leave this process's RSS."""
        for m in list(self.maps.values()):  # a map may be added meanwhile (the loading thread)
            m.madvise(mmap.MADV_DONTNEED)

    @contextmanager
    def _dropping(self) -> Iterator[None]:
        """Drop the maps' pages every ``drop_interval_s`` on a thread while the block runs, and once after it."""
        if self.drop_interval_s is None:
            yield
            return
        done = threading.Event()

        def drop() -> None:
            while not done.wait(self.drop_interval_s):
                self.drop_mapped_pages()

        thread = threading.Thread(target=drop, name="drop-mapped-pages", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.drop_mapped_pages()

    def open(self, path: str | Path, *, threads: int = 1) -> ModelSession:
        """Open ``path`` as a :class:`PrepackedSession` (prepacking on) wrapped like :func:`open_session`'s result.

        Raises:
            ModelLoadError: the file is refused by :func:`~onnxdeploy.runner.session.read_header`, or ORT cannot
                create the session (its message, naming the path).
        """
        header = read_header(path)
        with self._dropping():
            session = PrepackedSession(self, Path(path), threads=threads)
        active = ("CPUExecutionProvider",)
        return ModelSession(str(path), header, session, active, active, threads=threads)  # type: ignore[arg-type]


class PrepackedSession:
    """One graph's session of a :class:`SharedPrepacking` (module docstring), ORT-session-shaped for the decoders.

    Args:
        sharing: the container, environment and maps it shares.
        path: the ``.onnx`` file (external data beside it).
        threads: intra-op threads (inter-op 1, sequential; no spinning), as :func:`session_options`.

    Raises:
        ModelLoadError: ORT cannot create the session (its message).
    """

    def __init__(self, sharing: SharedPrepacking, path: Path, *, threads: int = 1) -> None:
        from onnxdeploy.runner.runtimes import _Arg  # noqa: PLC0415  (the NodeArg stand-in of the other runtimes)

        self.sharing, api = sharing, sharing.api
        header = onnx.load(str(path), load_external_data=False)
        options = _P()
        api.check(api.CreateSessionOptions(C.byref(options)), str(path))  # type: ignore[attr-defined]
        try:
            api.check(api.SetIntraOpNumThreads(options, threads), str(path))  # type: ignore[attr-defined]
            api.check(api.SetInterOpNumThreads(options, 1), str(path))  # type: ignore[attr-defined]
            api.check(api.SetSessionExecutionMode(options, 0), str(path))  # type: ignore[attr-defined]
            for key, value in (("session.disable_prepacking", "0"), ("session.intra_op.allow_spinning", "0")):
                api.check(api.AddSessionConfigEntry(options, key.encode(), value.encode()), str(path))  # type: ignore[attr-defined]
            for t in header.graph.initializer:
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    value = sharing.initializer(path.parent, t)
                    api.check(api.AddInitializer(options, t.name.encode(), value), f"{path}: {t.name}")  # type: ignore[attr-defined]
            self.session = _P()
            api.check(
                api.CreateSessionWithPrepackedWeightsContainer(  # type: ignore[attr-defined]
                    sharing.env, str(path).encode(), options, sharing.container, C.byref(self.session)
                ),
                f"{path}: ONNX Runtime cannot load the model",
            )
        finally:
            api.ReleaseSessionOptions(options)  # type: ignore[attr-defined]
        initializers = {t.name for t in header.graph.initializer}

        def args(values: list[onnx.ValueInfoProto]) -> list[_Arg]:
            tt = [v.type.tensor_type for v in values]
            return [
                _Arg(v.name, [d.dim_value for d in t.shape.dim], f"tensor({_TYPE_NAME[t.elem_type]})")
                for v, t in zip(values, tt, strict=True)
            ]

        self._inputs = args([i for i in header.graph.input if i.name not in initializers])
        self._outputs = args(list(header.graph.output))

    def get_inputs(self) -> list:
        """The graph inputs (initializers excluded), ``name``/``shape``/``type`` as ORT's ``NodeArg``."""
        return self._inputs

    def get_outputs(self) -> list:
        """The graph outputs, as :meth:`get_inputs`."""
        return self._outputs

    def get_providers(self) -> list[str]:
        """Always ``["CPUExecutionProvider"]``."""
        return ["CPUExecutionProvider"]

    def run(self, output_names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One ``OrtApi::Run`` with every input of ``feeds``; returns the asked outputs (all when None), new arrays.

        Raises:
            ModelLoadError: ORT failed (its message).
        """
        api = self.sharing.api
        by_name = {o.name: o for o in self._outputs}
        names = list(output_names or by_name)
        outs = [np.empty(by_name[n].shape, dtype=np.float16 if "16" in by_name[n].type else np.float32) for n in names]
        ins = [np.ascontiguousarray(feeds[i.name]) for i in self._inputs]
        values = [self.sharing.value(a) for a in ins + outs]
        try:
            api.check(
                api.Run(  # type: ignore[attr-defined]
                    self.session, None, (C.c_char_p * len(ins))(*[i.name.encode() for i in self._inputs]),
                    (_P * len(ins))(*values[: len(ins)]), len(ins),
                    (C.c_char_p * len(names))(*[n.encode() for n in names]), len(names),
                    (_P * len(names))(*values[len(ins) :]),
                ),
                "Run",
            )  # fmt: skip
        finally:
            for v in values:
                api.ReleaseValue(v)  # type: ignore[attr-defined]
        return outs

    def __del__(self) -> None:
        session, self.session = getattr(self, "session", None), None
        if session:
            self.sharing.api.ReleaseSession(session)  # type: ignore[attr-defined]
