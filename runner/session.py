"""ONNX Runtime sessions for verification: by path, weights mapped not copied, deterministic options.

Models of any size (docs/ARCHITECTURE.md, "Models of any size"): a session is opened **by path** after
:func:`onnxdeploy.model_io.read_model_header` has checked the file and every external-data reference,
with weights memory-mapped (56 MB instead of 2.15 GB after load for a 1 GiB float weight). A model whose data
file resolves somewhere other than
``folder/location`` (a Hugging Face cache: ``snapshots/<rev>/model.onnx_data`` symlinked into ``blobs/``,
which ORT 1.32 refuses) is opened through a scratch copy written by
:func:`onnxdeploy.model_io.write_for_ort` (hard links where possible), removed when the session closes. So is
a model with its weights inline (one ``.onnx``, as optimum writes every model under 2 GB): by path ORT would parse
the file and copy every weight (3.3x a 1 GB model's bytes); the scratch copy's header references the weights'
byte ranges in a hard link of the ``.onnx`` itself, which ORT maps (ORT 1.32 maps unaligned offsets).

**Session options follow the graph** (:func:`graph_weights`, :func:`session_settings`; README, "Sessions"): ORT's
weight prepacking (``session.disable_prepacking``) is **off for float weights**, which then stay mapped from the
file (prepacking makes a private packed copy at load; measured on one decode graph of the 125M export of
``benchmarks/int4_speed.py``: peak RSS 491 MiB against 450 MiB, the static step no faster), and **on for quantized
ones** (``com.microsoft::MatMulNBits``, or an integer weight behind a ``DequantizeLinear`` feeding a MatMul/Gemm,
which ORT fuses into ``MatMulNBits``): without prepacking ``MatMulNBits`` dequantizes its whole weight to fp32 on
every call (ORT 1.32 ``matmul_nbits.cc``: no packed B, so ``ComputeBUnpacked``), measured at 12x the float
original's step on that export and a higher peak (236 MiB against 153 MiB with the packed copy). The
``accuracy_level`` the session computes at is reported with it (:class:`onnxdeploy.report.SessionSettings`);
``session.qdq_matmulnbits_accuracy_level`` in ``config_entries`` sets it for the ``MatMulNBits`` ORT fuses
from ``DequantizeLinear`` + ``MatMul`` (ORT's own meaning of the key) **and** for the graph's own
``MatMulNBits`` nodes (the runner opens a scratch copy with their ``accuracy_level`` attribute set, weights
hard-linked), so one key decides the compute of every quantized MatMul.

ORT silently falls back to ``CPUExecutionProvider`` when a requested execution provider (EP) is not
available; :func:`open_session` compares what was asked with ``session.get_providers()`` and
reports every requested EP that is not active.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxdeploy import model_io
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError, ContractError, ModelLoadError
from onnxdeploy.graph import ort_numpy_dtype
from onnxdeploy.report import SessionSettings
from onnxdeploy.runner import shared_weights, tied_weights

__all__ = [
    "ACCURACY_LEVEL_KEY",
    "DEFAULT_PROVIDERS",
    "ORT_FUSED_ACCURACY_LEVEL",
    "PREPACKING_KEY",
    "GraphWeights",
    "ModelSession",
    "graph_weights",
    "numpy_dtype",
    "open_session",
    "read_header",
    "session_options",
    "session_settings",
]

DEFAULT_PROVIDERS: tuple[str, ...] = ("CPUExecutionProvider",)

PREPACKING_KEY = "session.disable_prepacking"
"""ORT session config key: "1" turns weight prepacking off, "0" on (onnxruntime_session_options_config_keys.h)."""
ACCURACY_LEVEL_KEY = "session.qdq_matmulnbits_accuracy_level"
"""ORT session config key: accuracy_level of the MatMulNBits ORT fuses from DequantizeLinear + MatMul; the runner
applies it to the graph's own MatMulNBits nodes too (module docstring)."""
ORT_FUSED_ACCURACY_LEVEL = 4
"""ORT's accuracy_level for a fused DequantizeLinear + MatMul when :data:`ACCURACY_LEVEL_KEY` is not set
(onnxruntime_session_options_config_keys.h, 1.32: "If not provided, default is 4")."""

_INTEGER_WEIGHTS = frozenset(
    int(getattr(onnx.TensorProto, name))
    for name in ("INT2", "UINT2", "INT4", "UINT4", "INT8", "UINT8")
    if hasattr(onnx.TensorProto, name)
)
_MATMULS = ("MatMul", "Gemm")


@dataclass(frozen=True)
class GraphWeights:
    """A graph's MatMul weights as ORT's CPU EP runs them, read off its header (no weight bytes read).

    Attributes:
        matmulnbits: the ``accuracy_level`` attribute of every ``com.microsoft::MatMulNBits`` node (0 when
            absent: unset), in graph order.
        dequantized: ``DequantizeLinear`` nodes whose input is an integer initializer (int2/int4/int8, signed or
            not) and whose output a ``MatMul``/``Gemm`` reads: ORT fuses them into ``MatMulNBits`` (a
            ``DequantizeLinear`` read only by an embedding ``Gather`` does not count).
        float_matmul_bytes: bytes of float initializers a ``MatMul``/``Gemm`` reads directly (what prepacking
            would copy).
    """

    matmulnbits: tuple[int, ...] = ()
    dequantized: int = 0
    float_matmul_bytes: int = 0

    @property
    def quantized(self) -> bool:
        """Whether some MatMul weight is quantized (MatMulNBits, or fused by ORT from a DequantizeLinear)."""
        return bool(self.matmulnbits or self.dequantized)


def graph_weights(header: onnx.ModelProto) -> GraphWeights:
    """Read which MatMul weights of a model are quantized (see :class:`GraphWeights`); main graph only.

    Args:
        header: the model (weights not needed: dtypes and dims are read).

    Returns:
        The counts.
    """
    graph = header.graph
    initializers = {t.name: t for t in graph.initializer}
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    levels, dequantized, float_bytes = [], 0, 0
    for node in graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
            levels.append(int(level))
        elif node.op_type == "DequantizeLinear" and node.input:
            weight = initializers.get(node.input[0])
            read_by = {op for out in node.output for op in readers.get(out, [])}
            if weight is not None and weight.data_type in _INTEGER_WEIGHTS and read_by & set(_MATMULS):
                dequantized += 1
        elif node.op_type in _MATMULS:
            for name in node.input[1:2]:
                weight = initializers.get(name)
                if weight is not None and weight.data_type not in _INTEGER_WEIGHTS:
                    float_bytes += model_io.tensor_nbytes(weight)
    return GraphWeights(tuple(levels), dequantized, float_bytes)


def session_settings(weights: GraphWeights, config_entries: Mapping[str, str] | None = None) -> SessionSettings:
    """Decide prepacking and the accuracy level a graph's session computes at (module docstring).

    Args:
        weights: the graph's weights (:func:`graph_weights`).
        config_entries: entries asked for on top: an explicit :data:`PREPACKING_KEY` wins over the rule;
            :data:`ACCURACY_LEVEL_KEY` sets every quantized MatMul's level.

    Returns:
        The settings; ``accuracy_level`` lists the distinct levels (empty for float weights).

    Raises:
        ConfigError: :data:`ACCURACY_LEVEL_KEY` is not an integer 0..4.
    """
    entries = dict(config_entries or {})
    asked = entries.get(PREPACKING_KEY)
    level = _asked_level(entries)
    levels: set[int] = set()
    if weights.matmulnbits:
        levels |= {level} if level is not None else set(weights.matmulnbits)
    if weights.dequantized:
        levels.add(level if level is not None else ORT_FUSED_ACCURACY_LEVEL)
    if asked is not None:
        prepacking, reason = asked != "1", f"{PREPACKING_KEY}={asked} asked for"
    elif weights.quantized:
        prepacking = True
        reason = (
            f"{len(weights.matmulnbits)} MatMulNBits, {weights.dequantized} DequantizeLinear -> MatMul: "
            "ORT dequantizes them on every call without prepacking"
        )
        if weights.float_matmul_bytes:
            reason += f"; {weights.float_matmul_bytes / 1e6:.1f} MB of float MatMul weights are prepacked too"
    else:
        prepacking, reason = False, "float weights: kept mapped (prepacking makes a private copy at load)"
    return SessionSettings(
        weights="quantized" if weights.quantized else "float",
        prepacking=prepacking,
        accuracy_level=sorted(levels),
        reason=reason,
    )


def _asked_level(entries: Mapping[str, str]) -> int | None:
    """The :data:`ACCURACY_LEVEL_KEY` asked for, or None (ConfigError when not an integer 0..4)."""
    value = entries.get(ACCURACY_LEVEL_KEY)
    if value is None:
        return None
    if value.strip() not in {"0", "1", "2", "3", "4"}:
        raise ConfigError(f"{ACCURACY_LEVEL_KEY} must be an integer 0..4 (MatMulNBits accuracy_level), got {value!r}")
    return int(value)


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
        settings: prepacking and the accuracy level decided from the graph (:func:`session_settings`); None for a
            stand-in session of another runtime.
        shared_weights: whether the external weights are values over the process's one map of their file
            (``open_session(share_weights=True)``), not ORT's own per-session mappings.
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
    settings: SessionSettings | None = None
    shared_weights: bool = False
    _scratch_cleanup: weakref.finalize | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # a session never closed (an API caller's, or one dropped by an exception) still removes its scratch copy
        # when it is collected or the interpreter exits
        if self.scratch is not None:
            self._scratch_cleanup = weakref.finalize(self, shutil.rmtree, str(self.scratch), True)

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
        if self._scratch_cleanup is not None:
            self._scratch_cleanup()  # rmtree once, then the finalizer is dead
        elif self.scratch is not None:
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
    sessions in one process distort timings); no prepacking unless ``config_entries`` turn it on (as
    :func:`open_session` does for a graph with quantized weights), so float weights stay memory-mapped
    instead of being copied into ORT's own buffers; no CPU memory arena (``enable_cpu_mem_arena``): each
    session's arena kept the high-water mark of its activations for the session's life, measured ~65 MiB over
    SmolLM2-135M's four-graph set (verify peak 1071 -> 1007 MiB), the static step's p50 unchanged without it
    (1.002x on its s1.c128 and s16.c512 graphs, 40 interleaved rounds each, ORT 1.32 CPU).

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
    options.enable_cpu_mem_arena = False
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
    share_weights: bool | None = None,
) -> ModelSession:
    """Check a model file, then open it by path in an ORT session on the given EP list.

    The session's prepacking follows the graph's weights and :data:`ACCURACY_LEVEL_KEY` reaches its own
    ``MatMulNBits`` nodes too (module docstring; :attr:`ModelSession.settings` says what was decided).

    Args:
        path: the ``.onnx`` file; external data is resolved relative to its folder.
        providers: EP names in priority order, e.g. ``("CUDAExecutionProvider", "CPUExecutionProvider")``.
        scratch_root: where to make the scratch folder for a model ORT cannot map in place (Hugging Face
            cache layout, weights inline); the system temp folder by default. On the data files' filesystem the copy is
            hard links (no bytes copied); elsewhere the weights are streamed into it.
        config_entries: further ORT session config entries (see :func:`session_options`); an explicit
            :data:`PREPACKING_KEY` overrides the graph's rule.
        threads: intra-op threads (see :func:`session_options`).
        share_weights: external weights as values over the process's one map of each data file, on CPU without
            prepacking (:mod:`onnxdeploy.runner.shared_weights`); None: when the contract lists a graph set.

    Returns:
        The open session (close it, or use it as a context manager) with the header and any EP
        fallbacks. Only whole-session fallbacks are seen; nodes an active EP hands to CPU are not reported.

    Raises:
        ModelLoadError: the file or its external data is refused by
            :func:`onnxdeploy.model_io.read_model_header` (its error, unchanged), or ORT cannot create a
            session for it (the message names the path).
        ConfigError: a provider name ONNX Runtime does not know (``ort.get_all_providers()``), or an
            :data:`ACCURACY_LEVEL_KEY` that is not 0..4.
    """
    source = str(path)
    header = model_io.read_model_header(path)
    # an inline model's weights too: ORT would copy them out of the parsed file; mapped through the link, it does not
    rewrite = _needs_rewrite(header, Path(path)) or model_io.in_place_tensors(header, path) > 0
    header = _drop_inline_weights(header)
    weights = graph_weights(header)
    settings = session_settings(weights, config_entries)
    level = _asked_level(config_entries or {})
    relevel = level if any(own != level for own in weights.matmulnbits) else None
    entries = {PREPACKING_KEY: "0" if settings.prepacking else "1", **(config_entries or {})}
    requested = _known_providers(providers)
    scratch: Path | None = None
    target = source
    tied = bool(tied_weights.find_tied(header))
    try:
        if rewrite or relevel is not None or tied:
            scratch = Path(tempfile.mkdtemp(prefix="onnxdeploy-session-", dir=scratch_root))
        if rewrite or relevel is not None:
            linked = None if rewrite or relevel is None else _relevelled_header(Path(path), scratch, relevel)
            target = linked or _scratch_copy(Path(path), scratch, relevel)
        if tied:  # ORT would fold Transpose(W) into a private copy per session (runner/tied_weights.py)
            target = tied_weights.untied_copy(Path(target), scratch) or target
        share = _in_graph_set(header) if share_weights is None else share_weights
        share = share and not settings.prepacking and set(requested) == {"CPUExecutionProvider"}
        session, shared = _create(target, session_options(entries, threads=threads), requested, share)
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
        f"{source}: requested {p} is not active; running on {', '.join(active)}" for p in requested if p not in active
    ]
    asked = dict(config_entries or {})
    return ModelSession(
        source, header, session, requested, active, fallbacks, scratch, asked, threads, settings, shared
    )


def _known_providers(providers: Sequence[str]) -> tuple[str, ...]:
    """``providers`` as a tuple (ConfigError naming any ONNX Runtime does not know: ``ort.get_all_providers()``)."""
    known = ort.get_all_providers()
    unknown = [name for name in providers if name not in known]
    if unknown:
        raise ConfigError(f"unknown execution provider(s) {unknown}; ONNX Runtime knows {known}")
    return tuple(providers)


def _create(
    target: str, options: ort.SessionOptions, providers: Sequence[str], share: bool
) -> tuple[ort.InferenceSession, bool]:
    """Create the ORT session on ``target``; with ``share``, its external weights over the process's maps.

    Returns:
        The session and whether some weight is shared (:func:`onnxdeploy.runner.shared_weights.share_initializers`).
    """
    maps = None
    if share:
        maps = shared_weights.share_initializers(options, onnx.load(target, load_external_data=False), target)
    with warnings.catch_warnings():
        # ORT warns and falls back when an EP is unavailable; the fallback is reported by open_session.
        warnings.simplefilter("ignore")
        session = ort.InferenceSession(target, sess_options=options, providers=list(providers))
    if maps is not None:
        shared_weights.attach(session, maps)
    return session, maps is not None and bool(maps.names)


def _in_graph_set(header: onnx.ModelProto) -> bool:
    """Whether the header's decode contract lists a graph set of several graphs (an invalid contract: False)."""
    try:
        contract = read_contract(header)
    except ContractError:
        return False  # reported by the decoder that reads it
    return contract is not None and len(contract.graph_set) > 1


def _relevelled_header(path: Path, scratch: Path, accuracy_level: int) -> str | None:
    """The graph file alone with every MatMulNBits at ``accuracy_level``, beside hard links of its data files.

    The fast way (no graph deserialised, no weight read); None when a data file is on another filesystem (the
    caller then writes the copy through :func:`_scratch_copy`, which streams such weights).
    """
    proto = onnx.load(str(path), load_external_data=False)
    if not model_io.link_external_data(proto, path, scratch):
        return None
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("accuracy_level", accuracy_level)])
    target = scratch / path.name
    onnx.save(proto, str(target))
    return str(target)


def _scratch_copy(path: Path, scratch: Path, accuracy_level: int | None) -> str:
    """Write ``path`` into ``scratch`` for ORT (data hard-linked), every MatMulNBits at ``accuracy_level`` if given."""
    loaded = model_io.load_model(path)
    if accuracy_level is not None:
        for graph in loaded.model.graphs():
            for node in graph:
                if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
                    node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", accuracy_level)
    target = str(model_io.write_for_ort(loaded.model, scratch, name=path.name))
    model_io.release_weights(loaded.model)
    return target
