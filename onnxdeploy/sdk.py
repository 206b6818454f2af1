"""Device SDKs in their own virtual environments, driven as subprocesses: today RKNN-Toolkit2 2.5.0 (RK3588).

RKNN-Toolkit2 pins numpy <= 1.26.4, onnx <= 1.18 and torch <= 2.4 (its wheel's ``Requires-Dist``), so it cannot
live in onnxdeploy's environment. :func:`install_rknn` creates ``<sdk home>/rknn-toolkit2-2.5.0`` (a venv with
``pip install rknn-toolkit2==2.5.0``: ~5.6 GB with torch's CUDA wheels, about 3 minutes here);
``onnxdeploy sdk install rknn`` calls it. The SDK home is ``$ONNXDEPLOY_SDK_HOME``, else
``~/.cache/onnxdeploy/sdk``.

Two uses, both through ``onnxdeploy/_rknn_worker.py`` run by the SDK environment's Python:

- :func:`rknn_build_report`: build the model for ``rk3588`` (fp16) and read the SDK's own verdict per node from
  its verbose build log: the final op table (``Target`` NPU or CPU per op of the compiled graph), the
  "No lowering found for: NODE, node type = OP" lines (ops with no NPU lowering, run as CPU custom ops) and
  the ``fuse_ops`` rules that removed or rewrote nodes (e.g. ``convert_neg_to_mul``);
- the simulator (``init_runtime()`` with no device) for ``verify.runtimes: [rknn-sim]``: the worker's ``serve``
  mode, started by :func:`rknn_worker_command`; the session the decoders drive over it is
  :class:`onnxdeploy.runner.runtimes.RKNNSimSession`, beside the OpenVINO one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from onnxdeploy.errors import ConfigError, ModelLoadError

__all__ = [
    "QUANTIZED_ALGORITHMS",
    "QUANTIZED_DTYPES",
    "RKNN_PACKAGE",
    "RknnBuild",
    "SdkNodeVerdict",
    "SdkReport",
    "install_rknn",
    "rknn_build_report",
    "rknn_build_reports",
    "rknn_env",
    "rknn_python",
    "rknn_worker_command",
    "build_timeout",
    "sdk_home",
]

RKNN_PACKAGE = "rknn-toolkit2==2.5.0"
"""The SDK release the environment installs (its cp311 x86-64 wheel is on PyPI)."""

_WORKER = Path(__file__).with_name("_rknn_worker.py")
_WORKER_MARKER = "onnxdeploy-rknn-worker: model"  # the worker's stderr line before each build (``builds``)
_TIMEOUT_S = 600
"""Seconds a build may take per model, unless ``$ONNXDEPLOY_SDK_TIMEOUT_S`` says otherwise (:func:`build_timeout`)."""


def build_timeout() -> float:
    """Seconds one model's RKNN build may take: ``$ONNXDEPLOY_SDK_TIMEOUT_S``, else 600.

    A fixture builds in 1-40 s (w8a8 with the per-layer analysis the longest); SmolLM2-135M's fp16 build took
    more than 600 s of wall time on this 2-core machine under load (3 CPU-minutes), hence the override.

    Raises:
        ConfigError: the variable is not a positive number.
    """
    text = os.environ.get("ONNXDEPLOY_SDK_TIMEOUT_S")
    if not text:
        return float(_TIMEOUT_S)
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ConfigError(f"ONNXDEPLOY_SDK_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return value


QUANTIZED_DTYPES: tuple[str, ...] = ("w8a8", "w16a16i_dfp")
"""``rknn.config(quantized_dtype=...)`` values RKNN-Toolkit2 2.5.0 accepts for ``rk3588`` (it refuses ``w8a16``
and ``w4a16`` there; read off the 2.5.0 wheel's ``rknn.config`` check, issue 19)."""

QUANTIZED_ALGORITHMS: tuple[str, ...] = ("normal", "mmse", "kl_divergence", "gdq")
"""``rknn.config(quantized_algorithm=...)`` values of RKNN-Toolkit2 2.5.0."""


@dataclass(frozen=True)
class RknnBuild:
    """How the worker builds a model: fp16 (no quantization) or the NPU's own integer quantization.

    Attributes:
        quantized_dtype: None (fp16 build, ``do_quantization=False``) or one of :data:`QUANTIZED_DTYPES`.
        quantized_algorithm: one of :data:`QUANTIZED_ALGORITHMS` (used when quantizing).
        dataset: the calibration dataset file (one sample per line: one ``.npy`` path per model input, in input
            order, separated by spaces; :func:`onnxdeploy.sdk_stage.write_calibration_dataset`); required when
            quantizing.
        float_layers: ONNX node names kept in fp16 by hybrid quantization (``hybrid_quantization_step1/2``:
            their entries move to the ``custom_quantize_layers`` of the SDK's ``.quantization.cfg`` as
            ``float16``); empty: plain quantization.
        export: where the worker writes the built ``.rknn`` (``rknn.export_rknn``), or None.
        auto_hybrid: the SDK picks the fp16 layers itself from per-layer error (``rknn.build(auto_hybrid=True)``:
            a layer whose quantized output's cosine to the float one falls below ``auto_hybrid_cos_thresh`` is kept
            in fp16; RKNN-Toolkit2 2.5.0 ``rknn.config``/``rknn.build`` docstrings).
        auto_hybrid_cos: that threshold (``rknn.config(auto_hybrid_cos_thresh=...)``, SDK default 0.98).
        hybrid_min_cosine: None, or onnxdeploy's own choice of fp16 layers from per-layer error: the worker builds
            plainly, runs ``accuracy_analysis`` on ``hybrid_samples`` dataset lines, and keeps in float16 every
            tensor whose single-layer cosine (quantized vs float, the layer fed float inputs) falls below this,
            with the single-input chain feeding it (the rotary ``Sin``/``Cos`` need their angle in float too),
            then builds with ``hybrid_quantization_step1/2`` (``onnxdeploy/_rknn_worker.py``).
        hybrid_samples: dataset lines that analysis runs on (spread over the file).
    """

    quantized_dtype: str | None = None
    quantized_algorithm: str = "normal"
    dataset: str | None = None
    float_layers: tuple[str, ...] = ()
    export: str | None = None
    auto_hybrid: bool = False
    auto_hybrid_cos: float = 0.98
    hybrid_min_cosine: float | None = None
    hybrid_samples: int = 3

    def __post_init__(self) -> None:
        if self.quantized_dtype is not None and self.quantized_dtype not in QUANTIZED_DTYPES:
            raise ConfigError(f"quantized_dtype must be one of {list(QUANTIZED_DTYPES)}, got {self.quantized_dtype!r}")
        if self.quantized_algorithm not in QUANTIZED_ALGORITHMS:
            raise ConfigError(
                f"quantized_algorithm must be one of {list(QUANTIZED_ALGORITHMS)}, got {self.quantized_algorithm!r}"
            )
        if self.quantized_dtype is not None and not self.dataset:
            raise ConfigError(f"a {self.quantized_dtype} build needs a calibration dataset file")

    @property
    def precision(self) -> str:
        """``fp16`` for an unquantized build, ``int8`` for ``w8a8``, ``int16`` for ``w16a16i_dfp``."""
        return {None: "fp16", "w8a8": "int8", "w16a16i_dfp": "int16"}[self.quantized_dtype]

    def label(self) -> str:
        """One line for reports: ``fp16`` or ``w8a8 (normal, 3 layers fp16)``."""
        if self.quantized_dtype is None:
            return "fp16 (RKNN build without quantization)"
        hybrid = f", {len(self.float_layers)} layers fp16 (hybrid)" if self.float_layers else ""
        if self.auto_hybrid:
            hybrid = f", auto hybrid (layers below cosine {self.auto_hybrid_cos:g} kept fp16)"
        if self.hybrid_min_cosine is not None:
            hybrid += f", hybrid: layers below single-layer cosine {self.hybrid_min_cosine:g} fp16"
        return f"{self.quantized_dtype} ({self.quantized_algorithm}{hybrid})"

    def to_json(self) -> str:
        """The options as the worker reads them (``--options JSON``)."""
        return json.dumps(
            {
                "quantized_dtype": self.quantized_dtype,
                "quantized_algorithm": self.quantized_algorithm,
                "dataset": self.dataset,
                "float_layers": list(self.float_layers),
                "export": self.export,
                "auto_hybrid": self.auto_hybrid,
                "auto_hybrid_cos": self.auto_hybrid_cos,
                "hybrid_min_cosine": self.hybrid_min_cosine,
                "hybrid_samples": self.hybrid_samples,
            }
        )


def sdk_home() -> Path:
    """Folder holding the SDK environments: ``$ONNXDEPLOY_SDK_HOME`` or ``~/.cache/onnxdeploy/sdk``."""
    return Path(os.environ.get("ONNXDEPLOY_SDK_HOME") or Path.home() / ".cache" / "onnxdeploy" / "sdk")


def rknn_env() -> Path:
    """The RKNN-Toolkit2 environment's folder (it may not exist)."""
    return sdk_home() / "rknn-toolkit2-2.5.0"


def rknn_python() -> Path | None:
    """The SDK environment's Python when the environment exists and has ``rknn.api``, else None.

    Finds the module without importing it (importing pulls in torch: ~3 s); the worker reports a broken install.
    """
    python = rknn_env() / "bin" / "python"
    if not python.is_file():
        return None
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec('rknn.api') is None)"
    probe = subprocess.run([str(python), "-I", "-c", find], capture_output=True, timeout=120, check=False)
    return python if probe.returncode == 0 else None


def install_rknn(*, python: str | None = None, log=print) -> Path:
    """Create the RKNN-Toolkit2 environment (venv + ``pip install rknn-toolkit2==2.5.0``) and return its Python.

    Args:
        python: the interpreter that creates the venv; default: this one's base interpreter (the wheel is
            cp311 only, so it must be Python 3.11).
        log: called with progress lines.

    Raises:
        ConfigError: the interpreter is not Python 3.11, or venv/pip fails (the message carries pip's last lines).
    """
    base = python or getattr(sys, "_base_executable", sys.executable)
    version = subprocess.run([base, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
    if version.stdout.strip() != "(3, 11)":
        raise ConfigError(f"{base} is Python {version.stdout.strip()}; {RKNN_PACKAGE} ships a cp311 wheel only")
    env = rknn_env()
    steps = [
        [base, "-m", "venv", str(env)],
        [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", RKNN_PACKAGE],
    ]
    for cmd in steps:
        log(f"$ {' '.join(cmd)}")
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-10:])
            raise ConfigError(f"creating the RKNN environment failed at `{' '.join(cmd)}`:\n{tail}")
        log(f"  done in {time.perf_counter() - start:.0f} s")
    found = rknn_python()
    if found is None:
        raise ConfigError(f"{env}: rknn.api does not import after installing {RKNN_PACKAGE}")
    return found


def _require_python() -> Path:
    python = rknn_python()
    if python is None:
        raise ConfigError(
            f"the RKNN-Toolkit2 environment is not installed ({rknn_env()}); run `onnxdeploy sdk install rknn`"
        )
    return python


def rknn_worker_command(mode: str, *args: str) -> list[str]:
    """The command that runs ``_rknn_worker.py MODE ARGS...`` with the SDK environment's Python (isolated mode).

    Args:
        mode: ``build``, ``builds`` or ``serve`` (the worker's module docstring).
        args: the mode's arguments (model paths, target platform).

    Raises:
        ConfigError: the SDK environment is not installed.
    """
    return [str(_require_python()), "-I", str(_WORKER), mode, *args]


@dataclass
class SdkNodeVerdict:
    """The SDK's verdict on one node of the ONNX graph.

    Attributes:
        node: ONNX node name.
        op: ONNX op type.
        verdict: ``npu``, ``cpu`` (placed on the CPU in the compiled graph), ``no_npu_lowering`` (the SDK says
            "No lowering found" and runs it as a CPU custom op), ``rewritten`` (a ``fuse_ops`` rule removed it
            or replaced it by other ops; ``rule`` names it) or ``folded`` (not in the compiled graph and
            not named by a rule: constant-folded or merged).
        rule: the SDK rule that rewrote the node, when one did.
    """

    node: str
    op: str
    verdict: str
    rule: str = ""


@dataclass
class SdkReport:
    """What RKNN-Toolkit2 made of a model: build outcome, time, and a verdict per ONNX node."""

    sdk: str
    target_platform: str
    built: bool
    seconds: float
    error: str = ""
    nodes: list[SdkNodeVerdict] = field(default_factory=list)
    hybrid: dict = field(default_factory=dict)
    """Hybrid quantization's choice: ``float_layers`` (SDK tensors built float16) and, when chosen from per-layer
    error, ``layer_errors`` (``min_cosine``, ``samples``, ``layers``, ``sensitive``, ``worst``: [tensor, cosine])."""

    def by_verdict(self, verdict: str) -> list[SdkNodeVerdict]:
        """The nodes with ``verdict``."""
        return [n for n in self.nodes if n.verdict == verdict]


_TABLE_ROW = re.compile(r"^D RKNN: \[[^]]*\]\s+\d+\s+(\w+)\s+\w+\s+(NPU|CPU)\s+.*\s(\S+)\s*$")
_NO_LOWERING = re.compile(r"No lowering found for: (.+?), node type = (\w+)")
_FUSE = re.compile(r"^D\s+(\w+): remove node = \[([^]]*)\]")


def parse_build_log(log: str, graph_nodes: list[tuple[str, str]]) -> list[SdkNodeVerdict]:
    """Per-node verdicts from an RKNN-Toolkit2 verbose build log.

    Args:
        log: the SDK's build output (``RKNN(verbose=True)``).
        graph_nodes: ``(name, op_type)`` of every node of the ONNX graph, in order.

    Returns:
        One :class:`SdkNodeVerdict` per graph node (see its ``verdict``).
    """
    placed: dict[str, str] = {}
    for line in log.splitlines():
        row = _TABLE_ROW.match(line)
        if row:
            full_name = row.group(3)
            placed[full_name.split(":", 1)[1] if ":" in full_name else full_name] = row.group(2).lower()
    no_lowering = {m.group(1) for m in _NO_LOWERING.finditer(log)}
    rules: dict[str, str] = {}
    for line in log.splitlines():
        fuse = _FUSE.match(line)
        if fuse:
            for name in re.findall(r"'([^']*)'", fuse.group(2)):
                rules.setdefault(name, fuse.group(1))
    verdicts = []
    for name, op in graph_nodes:
        if name in no_lowering:
            verdicts.append(SdkNodeVerdict(name, op, "no_npu_lowering"))
        elif name in placed:
            verdicts.append(SdkNodeVerdict(name, op, placed[name], rules.get(name, "")))
        elif name in rules:
            verdicts.append(SdkNodeVerdict(name, op, "rewritten", rules[name]))
        else:
            verdicts.append(SdkNodeVerdict(name, op, "folded"))
    return verdicts


def rknn_build_report(model: str | Path, *, target_platform: str = "rk3588") -> SdkReport:
    """Build ``model`` with RKNN-Toolkit2 (fp16) in its environment and return the SDK's verdict per node.

    Raises:
        ConfigError: the SDK environment is not installed.
        ModelLoadError: the worker did not answer (crashed or timed out).
    """
    return rknn_build_reports([model], target_platform=target_platform)[0]


def rknn_build_reports(
    models: Sequence[str | Path], *, target_platform: str = "rk3588", builds: Sequence[RknnBuild] | None = None
) -> list[SdkReport]:
    """Build each model with RKNN-Toolkit2 in one worker process; one :class:`SdkReport` per model.

    ``builds`` gives each model's :class:`RknnBuild` (quantization, dataset, ``.rknn`` export path); default fp16.

    One process for all: importing the SDK (torch, onnxruntime) takes ~3 s, a fixture's build ~1-2.5 s. A model
    the SDK refuses or raises on is a report with ``built`` false and the SDK's error, not an exception.

    Raises:
        ConfigError: the SDK environment is not installed.
        ModelLoadError: the worker did not answer for every model (crashed or timed out).
    """
    import onnx

    options = ["--options", "[" + ", ".join(b.to_json() for b in builds) + "]"] if builds else []
    command = rknn_worker_command("builds", target_platform, *options, *(str(Path(m).resolve()) for m in models))
    graphs = [[(n.name, n.op_type) for n in onnx.load(str(m), load_external_data=False).graph.node] for m in models]
    # the SDK dumps check*.onnx into its working folder: give it a temporary one, never the user's
    with tempfile.TemporaryDirectory(prefix="onnxdeploy-rknn-build-") as workdir:
        timeout = build_timeout() * max(1, len(models))
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, cwd=workdir)
        except subprocess.TimeoutExpired:
            raise ModelLoadError(
                f"{models[0]}: RKNN-Toolkit2 did not build {len(models)} model(s) within {timeout:.0f} s "
                "(set ONNXDEPLOY_SDK_TIMEOUT_S, seconds per model, for a large model)"
            ) from None
    try:
        results = [json.loads(line) for line in done.stdout.strip().splitlines()]
    except json.JSONDecodeError:
        results = []
    if len(results) != len(models):
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise ModelLoadError(
            f"{models[len(results)] if len(results) < len(models) else models[0]}: the RKNN worker gave "
            f"{len(results)} of {len(models)} results (exit {done.returncode}):\n{tail}"
        )
    logs = re.split(rf"(?m)^{_WORKER_MARKER} \d+$", done.stderr)[1:]
    return [
        SdkReport(
            sdk=RKNN_PACKAGE.replace("==", " "),
            target_platform=target_platform,
            built=bool(result["ok"]),
            seconds=round(float(result["seconds"]), 3),
            error=result.get("error", ""),
            nodes=parse_build_log(log, nodes) if result["ok"] else [],
            hybrid={k: result[k] for k in ("float_layers", "layer_errors") if k in result},
        )
        for result, log, nodes in zip(results, logs, graphs, strict=True)
    ]


_MATRIX_ERROR_CODES = ("OD510", "OD511", "OD512", "OD513", "OD514")


def beside_matrix(report: SdkReport, findings) -> dict:
    """The SDK's verdict per node beside the matrix's (from the ``target_ops`` findings), as report JSON.

    The matrix predicts whether the target takes an op and whether it has an accelerator lowering; the SDK's
    build log says what it did with each node. They agree on a node when:

    - the matrix rejects it (an error code) and the SDK has no NPU lowering for it (a CPU custom op);
    - the matrix says ``cpu_fallback`` (OD515) and the SDK runs it on the CPU (either way);
    - the matrix accepts it for the accelerator and the SDK converted it: on the NPU, rewritten by a rule,
      folded, or placed on the CPU although it has a lowering. That last case is the compiler's partitioning
      (e.g. the int64 position arithmetic and the embedding Gather before the NPU graph), which a per-op
      matrix does not predict: such nodes are listed in ``cpu_placed``, not as disagreements.

    Args:
        report: the SDK build report.
        findings: the findings of the target checks on the same model.

    Returns:
        ``{"sdk", "target_platform", "built", "seconds", "error", "nodes": [{"node", "op", "sdk", "rule",
        "matrix"}], "disagreements": [...], "cpu_placed": [...]}``: ``matrix`` is ``supported``,
        ``cpu_fallback`` (OD515) or the error code the matrix gave; ``disagreements`` lists the nodes the matrix
        rejects but the SDK converts, and the nodes the matrix accepts (or calls CPU-only) against the SDK's
        lowering; ``cpu_placed`` the nodes the matrix accepts that the SDK lowered but placed on the CPU.
    """
    matrix: dict[str, str] = {}
    for f in findings:
        if f.code in _MATRIX_ERROR_CODES or f.code == "OD515":
            for node in f.nodes:
                matrix.setdefault(node, "cpu_fallback" if f.code == "OD515" else f.code)
    nodes, disagreements, cpu_placed = [], [], []
    for n in report.nodes:
        verdict = matrix.get(n.node, "supported")
        nodes.append({"node": n.node, "op": n.op, "sdk": n.verdict, "rule": n.rule, "matrix": verdict})
        line = f"{n.node} ({n.op}): matrix {verdict}, SDK {n.verdict}" + (f" ({n.rule})" if n.rule else "")
        if verdict in _MATRIX_ERROR_CODES:
            if n.verdict != "no_npu_lowering":
                disagreements.append(line)
        elif verdict == "cpu_fallback":
            if n.verdict not in ("cpu", "no_npu_lowering"):
                disagreements.append(line)
        elif n.verdict == "no_npu_lowering":
            disagreements.append(line)
        elif n.verdict == "cpu":
            cpu_placed.append(line)
    return {
        "sdk": report.sdk,
        "target_platform": report.target_platform,
        "built": report.built,
        "seconds": report.seconds,
        "error": report.error,
        "nodes": nodes,
        "disagreements": disagreements,
        "cpu_placed": cpu_placed,
        **({"hybrid": report.hybrid} if report.hybrid else {}),
    }
