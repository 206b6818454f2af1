"""ONNX Runtime sessions for verification: by path, weights mapped not copied, deterministic options.

Models of any size (docs/ARCHITECTURE.md, "Models of any size"): a session is opened **by path** after
:func:`onnxdeploy.model_io.read_model_header` has checked the file and every external-data reference,
with prepacking off so ORT memory-maps external weights instead of copying them (56 MB instead of
2.15 GB after load for a 1 GiB weight). A model whose data file resolves somewhere other than
``folder/location`` (a Hugging Face cache: ``snapshots/<rev>/model.onnx_data`` symlinked into ``blobs/``,
which ORT 1.32 refuses) is opened through a scratch copy written by
:func:`onnxdeploy.model_io.write_for_ort` (hard links where possible), removed when the session closes. So is
a model with its weights inline (one ``.onnx``, as optimum writes every model under 2 GB): by path ORT would parse
the file and copy every weight (3.3x a 1 GB model's bytes); the scratch copy's header references the weights'
byte ranges in a hard link of the ``.onnx`` itself, which ORT maps (ORT 1.32 maps unaligned offsets).

ORT silently falls back to ``CPUExecutionProvider`` when a requested execution provider (EP) is not
available; :func:`open_session` compares what was asked with ``session.get_providers()`` and
reports every requested EP that is not active.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import numpy as np
import onnx
import onnxruntime as ort

from onnxdeploy import model_io
from onnxdeploy.errors import ConfigError, ContractError, ModelLoadError
from onnxdeploy.graph import ort_numpy_dtype

__all__ = ["DEFAULT_PROVIDERS", "ModelSession", "numpy_dtype", "open_session", "read_header", "session_options"]

DEFAULT_PROVIDERS: tuple[str, ...] = ("CPUExecutionProvider",)


@dataclass
class ModelSession:
    """An ORT session together with the graph it runs and the EPs it really uses.

    Close it (:meth:`close`, or use it as a context manager) to release ORT's memory and any scratch copy.

    Attributes:
        path: the model file, as given.
        model: the model header: graph structure and metadata, initializers above
            :data:`onnxdeploy.model_io.STAND_IN_THRESHOLD_BYTES` bytes without data (never hand it to ORT).
        session: the ORT inference session; None once closed.
        providers_requested: EPs asked for, in priority order.
        providers_active: EPs the session reports (``session.get_providers()``).
        fallbacks: one human-readable line per requested EP that is not active.
        scratch: the folder ORT opened a rewritten copy from (Hugging Face cache layout), else None;
            removed by :meth:`close`.
        config_entries: the session config entries asked for on top of :func:`session_options`' own (the
            siblings of a graph set open with the same ones).
        threads: intra-op threads the session was opened with.
    """

    path: str
    model: onnx.ModelProto
    session: ort.InferenceSession | None
    providers_requested: tuple[str, ...]
    providers_active: tuple[str, ...]
    fallbacks: list[str] = field(default_factory=list)
    scratch: Path | None = None
    config_entries: dict[str, str] = field(default_factory=dict)
    threads: int = 1

    def _live(self) -> ort.InferenceSession:
        if self.session is None:
            raise ModelLoadError(f"{self.path}: the session is closed")
        return self.session

    def input_types(self) -> dict[str, tuple[list[int | str | None], str]]:
        """Return the session inputs (initializers excluded) as ``name -> (shape, ORT type string)``.

        Returns:
            Shapes list static dims as ``int`` and symbolic ones as ``str`` or ``None``.

        Raises:
            ModelLoadError: the session is closed.
        """
        return {arg.name: (list(arg.shape), arg.type) for arg in self._live().get_inputs()}

    def output_names(self) -> list[str]:
        """Return the session's output names in graph order.

        Raises:
            ModelLoadError: the session is closed.
        """
        return [arg.name for arg in self._live().get_outputs()]

    def close(self) -> None:
        """Drop the session and remove the scratch copy, if any. Safe to call twice.

        A runtime's stand-in session that owns resources (``RKNNSimSession``: a worker process and its folder)
        is closed through its own ``close``; ORT's session has none and is released with the last reference.
        """
        session, self.session = self.session, None
        if hasattr(session, "close"):
            session.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def __enter__(self) -> ModelSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def numpy_dtype(ort_type: str, *, tensor: str) -> np.dtype:
    """Map an ORT type string such as ``tensor(float16)`` to a numpy dtype (:data:`onnxdeploy.graph.ORT_NUMPY_TYPES`).

    Args:
        ort_type: the type string from ``session.get_inputs()[i].type``.
        tensor: the tensor name, for the error message.

    Returns:
        The numpy dtype.

    Raises:
        ContractError: the element type has no numpy equivalent the runner feeds (e.g. bfloat16).
    """
    dtype = ort_numpy_dtype(ort_type)
    if dtype is None:
        raise ContractError(f"'{tensor}' has element type {ort_type}, which the runner cannot feed")
    return dtype


def session_options(config_entries: Mapping[str, str] | None = None, *, threads: int = 1) -> ort.SessionOptions:
    """Build the ORT session options used for every verification run.

    One intra-op and one inter-op thread, sequential execution and deterministic compute, so two runs of
    the same model give bit-identical logits and latencies are comparable; no thread spinning (idle
    sessions in one process distort timings); no prepacking, so external weights stay memory-mapped
    instead of being copied into ORT's own buffers.

    Args:
        config_entries: further session config entries, or overrides of these (e.g.
            ``session.qdq_matmulnbits_accuracy_level``, ``session.disable_prepacking``).
        threads: intra-op threads (1 for verification; benchmarks may use every core).

    Returns:
        A fresh ``onnxruntime.SessionOptions``.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.use_deterministic_compute = True
    options.log_severity_level = 3
    entries = {"session.disable_prepacking": "1", "session.intra_op.allow_spinning": "0", **(config_entries or {})}
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    return options


def _drop_inline_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Replace the data of inline initializers above the stand-in threshold by a reference to nothing.

    The header then costs what its graph costs, not its weights (ORT reads them from the file). The
    stand-ins keep dtype and dims, as :func:`onnxdeploy.model_io.stand_in_proto` writes them.
    """
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            continue
        nbytes = model_io.tensor_nbytes(tensor)
        if nbytes <= model_io.STAND_IN_THRESHOLD_BYTES:
            continue
        for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            tensor.ClearField(name)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", "onnxdeploy-stand-in"), ("offset", "0"), ("length", str(nbytes))):
            tensor.external_data.add(key=key, value=value)
    return proto


def read_header(path: str | Path) -> onnx.ModelProto:
    """Read and check a model file without its weights: what the runner inspects before any session.

    Args:
        path: the ``.onnx`` file.

    Returns:
        The header (see :attr:`ModelSession.model`).

    Raises:
        ModelLoadError: from :func:`onnxdeploy.model_io.read_model_header`, unchanged: the file is missing,
            not an ONNX model, truncated, or an external-data location is absolute, contains ``..``, is a
            symlink leaving the model's folder (other than a Hugging Face cache), missing or short.
    """
    return _drop_inline_weights(model_io.read_model_header(path))


def _needs_rewrite(header: onnx.ModelProto, path: Path) -> bool:
    """Whether some data file resolves elsewhere than ``folder/location`` (ORT refuses such links)."""
    folder = Path(os.path.realpath(path.parent))
    for data in model_io.check_external_data(header, path):
        if os.path.normpath(folder / data.location.replace("\\", "/")) != os.path.normpath(data.path):
            return True
    return False


def open_session(
    path: str | Path,
    *,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    scratch_root: str | Path | None = None,
    config_entries: Mapping[str, str] | None = None,
    threads: int = 1,
) -> ModelSession:
    """Check a model file, then open it by path in an ORT session on the given EP list.

    Args:
        path: the ``.onnx`` file; external data is resolved relative to its folder.
        providers: EP names in priority order, e.g. ``("CUDAExecutionProvider", "CPUExecutionProvider")``.
        scratch_root: where to make the scratch folder for a model ORT cannot map in place (Hugging Face
            cache layout, weights inline); the system temp folder by default. On the data files' filesystem the copy is
            hard links (no bytes copied); elsewhere the weights are streamed into it.
        config_entries: further ORT session config entries (see :func:`session_options`).
        threads: intra-op threads (see :func:`session_options`).

    Returns:
        The open session (close it, or use it as a context manager) with the header and any EP
        fallbacks. Only whole-session fallbacks are seen; nodes an active EP hands to CPU are not reported.

    Raises:
        ModelLoadError: the file or its external data is refused by
            :func:`onnxdeploy.model_io.read_model_header` (its error, unchanged), or ORT cannot create a
            session for it (the message names the path).
        ConfigError: a provider name ONNX Runtime does not know (``ort.get_all_providers()``).
    """
    source = str(path)
    header = model_io.read_model_header(path)
    # an inline model's weights too: ORT would copy them out of the parsed file; mapped through the link, it does not
    rewrite = _needs_rewrite(header, Path(path)) or model_io.in_place_tensors(header, path) > 0
    header = _drop_inline_weights(header)
    requested = tuple(providers)
    known = ort.get_all_providers()
    unknown = [name for name in requested if name not in known]
    if unknown:
        raise ConfigError(f"unknown execution provider(s) {unknown}; ONNX Runtime knows {known}")
    scratch: Path | None = None
    target = source
    try:
        if rewrite:
            scratch = Path(tempfile.mkdtemp(prefix="onnxdeploy-session-", dir=scratch_root))
            loaded = model_io.load_model(path)
            target = str(model_io.write_for_ort(loaded.model, scratch))
            model_io.release_weights(loaded.model)
            del loaded
        with warnings.catch_warnings():
            # ORT warns and falls back when an EP is unavailable; the fallback is reported below.
            warnings.simplefilter("ignore")
            options = session_options(config_entries, threads=threads)
            session = ort.InferenceSession(target, sess_options=options, providers=list(requested))
    except BaseException as exc:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if isinstance(exc, ModelLoadError | KeyboardInterrupt | SystemExit):
            raise
        if isinstance(exc, OSError):
            raise ModelLoadError(f"{source}: cannot prepare the model for ONNX Runtime: {exc}") from exc
        raise ModelLoadError(f"{source}: ONNX Runtime cannot load the model: {exc}") from exc
    active = tuple(session.get_providers())
    fallbacks = [
        f"{source}: requested {name} is not active; running on {', '.join(active)}"
        for name in requested
        if name not in active
    ]
    return ModelSession(
        source, header, session, requested, active, fallbacks, scratch, dict(config_entries or {}), threads
    )
