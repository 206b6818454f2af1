"""Verification runtimes besides ONNX Runtime (OpenVINO, the RKNN simulator), and which ORT provider ran each node.

``verify.runtimes: [onnxruntime, openvino]`` decodes the candidate on every runtime named and compares each
runtime's logits with the **original on ONNX Runtime** (teacher-forced on the original's greedy tokens), so a user
learns whether another vendor's ONNX front end reads the static graph the same way. OpenVINO reads ONNX
directly (``openvino.Core().read_model``) and is compiled for ``CPU`` with ``INFERENCE_PRECISION_HINT: f32``:
OpenVINO's CPU plugin otherwise computes in bf16 on CPUs with AMX or AVX-512 BF16 and in f16 on ARM
(OpenVINO docs, "Precision Control"), which would hide a graph error behind a precision one.

``rknn-sim`` builds the candidate with RKNN-Toolkit2 (fp16, rk3588) in the SDK's own environment and runs its
simulator in a worker process (:mod:`onnxdeploy.sdk`); :class:`RKNNSimSession` puts it behind the same session
interface.

A runtime that is not installed is refused (``ConfigError``) with the list of those that are; OpenVINO is an
optional extra (``pip install -e '.[openvino]'``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ConfigError, ModelLoadError
from onnxdeploy.graph import ort_numpy_dtype
from onnxdeploy.report import RuntimeComparison
from onnxdeploy.runner.accuracy import accuracy_figures, teacher_forced_logits
from onnxdeploy.runner.coverage import GraphCoverage, drive_every_graph
from onnxdeploy.runner.decoder import Decoder, make_decoder, open_decoder
from onnxdeploy.runner.graph_set import GraphSetDecoder, Remainder, open_graph_set
from onnxdeploy.runner.session import DEFAULT_PROVIDERS, ModelSession, read_header, session_options
from onnxdeploy.runner.thresholds import Judgement, LogitThresholds, judge_positions
from onnxdeploy.sdk import RknnBuild, rknn_python, rknn_worker_command

__all__ = [
    "OPENVINO_CONFIG",
    "RUNTIMES",
    "OpenVINOSession",
    "RKNNSimSession",
    "accuracy_on_runtime",
    "check_runtimes",
    "compare_on_runtime",
    "installed_runtimes",
    "node_providers",
    "open_openvino_session",
    "open_rknn_sim_session",
    "open_runtime_decoder",
    "runtime_opener",
]

Runtime = Literal["onnxruntime", "openvino", "rknn-sim"]
RUNTIMES: tuple[str, ...] = ("onnxruntime", "openvino", "rknn-sim")
"""Runtime names ``verify.runtimes`` takes."""

OPENVINO_CONFIG: dict[str, str] = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "1"}
"""Compile options of the OpenVINO runtime: f32 compute (no bf16/f16 downcast), one thread (like the ORT runs)."""


def installed_runtimes() -> list[str]:
    """The runtimes of :data:`RUNTIMES` whose Python package is importable here (rknn-sim: its SDK environment)."""
    return [
        name
        for name in RUNTIMES
        if (rknn_python() is not None if name == "rknn-sim" else importlib.util.find_spec(name) is not None)
    ]


def check_runtimes(names: Sequence[str]) -> None:
    """Refuse a runtime that is unknown or not installed.

    Raises:
        ConfigError: names the runtime and lists the installed ones (and how to install OpenVINO).
    """
    installed = installed_runtimes()
    for name in names:
        if name not in RUNTIMES:
            raise ConfigError(f"unknown runtime '{name}'; known runtimes: {', '.join(RUNTIMES)}")
        if name not in installed:
            raise ConfigError(
                f"runtime '{name}' is not installed; installed runtimes: {', '.join(installed)} "
                "(OpenVINO: pip install -e '.[openvino]'; rknn-sim: onnxdeploy sdk install rknn)"
            )


_OV_TYPES = {
    "f32": "tensor(float)",
    "f16": "tensor(float16)",
    "f64": "tensor(double)",
    "i64": "tensor(int64)",
    "i32": "tensor(int32)",
    "boolean": "tensor(bool)",
}


@dataclass
class _Arg:
    """An input/output description shaped like ORT's ``NodeArg`` (``name``, ``shape``, ``type``)."""

    name: str
    shape: list[int | None]
    type: str


class OpenVINOSession:
    """An OpenVINO compiled model behind the part of ``onnxruntime.InferenceSession`` the decoders use.

    ``get_inputs``/``get_outputs`` describe the ports, ``run(output_names, feeds)`` infers on one request and
    returns numpy arrays in the order asked.

    Raises (from the constructor):
        ModelLoadError: OpenVINO cannot read or compile the model; the message carries OpenVINO's own text,
            which names the ONNX op it could not convert.
    """

    def __init__(self, path: str | Path, *, device: str = "CPU", names: Sequence[str] = ()) -> None:
        import openvino as ov

        core = ov.Core()
        try:
            model = core.read_model(str(path))
            self._compiled = core.compile_model(model, device, OPENVINO_CONFIG)
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError subclasses with the op named
            raise ModelLoadError(f"{path}: OpenVINO ({device}) cannot compile the model: {exc}") from exc
        self._request = self._compiled.create_infer_request()
        self._names = set(names)  # a port can carry several tensor names: prefer the ONNX graph's
        self.device = device
        hint = self._compiled.get_property("INFERENCE_PRECISION_HINT")
        self.precision = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)

    def _args(self, ports) -> list[_Arg]:
        args = []
        for port in ports:
            name = next((n for n in sorted(port.get_names()) if n in self._names), port.get_any_name())
            shape = [d.get_length() if d.is_static else None for d in port.get_partial_shape()]
            args.append(_Arg(name, shape, _OV_TYPES.get(port.get_element_type().get_type_name(), "?")))
        return args

    def get_inputs(self) -> list[_Arg]:
        """The model inputs (ORT ``NodeArg``-like)."""
        return self._args(self._compiled.inputs)

    def get_outputs(self) -> list[_Arg]:
        """The model outputs (ORT ``NodeArg``-like)."""
        return self._args(self._compiled.outputs)

    def get_providers(self) -> list[str]:
        """``["openvino:CPU"]``: the runtime and device, where ORT lists its execution providers."""
        return [f"openvino:{self.device}"]

    def run(self, output_names: Sequence[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Infer once and return the named outputs (all when None) as numpy arrays."""
        results = self._request.infer(feeds)
        names = list(output_names) if output_names else [o.name for o in self.get_outputs()]
        return [np.array(results[self._compiled.output(name)]) for name in names]


class RKNNSimSession:
    """The RKNN-Toolkit2 simulator behind the session interface the decoders use.

    The build is fp16 by default, or the NPU's own quantization (``build``: :class:`onnxdeploy.sdk.RknnBuild`,
    e.g. ``w8a8`` from a calibration dataset, with hybrid fp16 layers).

    The model is built and the simulator started once in a worker process of the SDK environment; each
    ``run`` sends the feeds through a temporary ``.npz`` file and reads the outputs back.

    Raises (from the constructor):
        ConfigError: the SDK environment is not installed.
        ModelLoadError: the SDK cannot build the model or start the simulator.
    """

    def __init__(
        self, path: str | Path, header, *, target_platform: str = "rk3588", build: RknnBuild | None = None
    ) -> None:
        from onnx import helper

        build = build or RknnBuild()
        command = rknn_worker_command("serve", str(Path(path).resolve()), target_platform, build.to_json())
        self._inputs = [self._arg(v, helper) for v in header.graph.input]
        self._outputs = [self._arg(v, helper) for v in header.graph.output]
        self._dir = Path(tempfile.mkdtemp(prefix="onnxdeploy-rknn-"))
        try:
            self._log = (self._dir / "worker.log").open("w")
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                cwd=self._dir,  # the SDK dumps check*.onnx into its working folder
            )
            ready = self._reply()
        except BaseException:  # the worker could not start or answered garbage: leave no process or folder behind
            if hasattr(self, "_proc"):
                self._proc.kill()
                self._proc.wait()
            if hasattr(self, "_log"):
                self._log.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        if not ready.get("ok"):
            self.close()
            raise ModelLoadError(f"{path}: RKNN-Toolkit2 cannot build/simulate the model: {ready.get('error')}")
        self.build_seconds = float(ready["seconds"])
        self.precision = build.label()

    @staticmethod
    def _arg(value, helper) -> _Arg:
        t = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        return _Arg(value.name, dims, f"tensor({helper.tensor_dtype_to_string(t.elem_type).split('.')[-1].lower()})")

    def _reply(self) -> dict:
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line:
            self._log.flush()
            tail = "\n".join((self._dir / "worker.log").read_text().strip().splitlines()[-5:])
            return {"ok": False, "error": f"the RKNN worker exited:\n{tail}"}
        return json.loads(line)

    def get_inputs(self) -> list[_Arg]:
        """The model inputs (ORT ``NodeArg``-like)."""
        return self._inputs

    def get_outputs(self) -> list[_Arg]:
        """The model outputs (ORT ``NodeArg``-like)."""
        return self._outputs

    def get_providers(self) -> list[str]:
        """``["rknn-sim:rk3588"]``: the runtime, where ORT lists its execution providers."""
        return ["rknn-sim:rk3588"]

    def run(self, output_names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run one inference on the simulator and return the named outputs (all when None).

        Raises:
            ModelLoadError: the simulator failed (its error text is in the message).
        """
        src, dst = self._dir / "in.npz", self._dir / "out.npz"
        np.savez(src, **{f"in{i}": np.asarray(feeds[a.name]) for i, a in enumerate(self._inputs)})
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"inputs": str(src), "outputs": str(dst)}) + "\n")
        self._proc.stdin.flush()
        reply = self._reply()
        if not reply.get("ok"):
            raise ModelLoadError(f"RKNN simulator run failed: {reply.get('error')}")
        with np.load(dst) as data:
            outputs = {a.name: data[f"out{i}"] for i, a in enumerate(self._outputs)}
        names = list(output_names) if output_names else [a.name for a in self._outputs]
        return [outputs[n] for n in names]

    def close(self) -> None:
        """Stop the worker and remove its temporary folder (with the SDK's dumps). Safe to call twice."""
        if self._proc.poll() is None:
            if self._proc.stdin:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def open_openvino_session(path: str | Path, *, device: str = "CPU") -> ModelSession:
    """Read the header, then compile the model on OpenVINO; the decoders drive it like an ORT session.

    Raises:
        ConfigError: OpenVINO is not installed.
        ModelLoadError: the file is refused (:func:`~onnxdeploy.runner.session.read_header`) or OpenVINO
            cannot compile it.
    """
    check_runtimes(["openvino"])
    header = read_header(path)
    names = [v.name for v in (*header.graph.input, *header.graph.output)]
    session = OpenVINOSession(path, device=device, names=names)
    active = tuple(session.get_providers())
    return ModelSession(str(path), header, session, active, active)  # type: ignore[arg-type]


def open_rknn_sim_session(path: str | Path, build: RknnBuild | None = None) -> ModelSession:
    """Build the model with RKNN-Toolkit2 (rk3588; fp16 unless ``build`` quantizes) and start its simulator.

    Raises:
        ConfigError: the SDK environment is not installed.
        ModelLoadError: the file is refused (:func:`~onnxdeploy.runner.session.read_header`) or the SDK
            cannot build or simulate it.
    """
    check_runtimes(["rknn-sim"])
    header = read_header(path)
    session = RKNNSimSession(path, header, build=build)
    active = tuple(session.get_providers())
    return ModelSession(str(path), header, session, active, active)  # type: ignore[arg-type]


def _greedy_reference(original: str, prompt: Sequence[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """The original's greedy decode on ORT CPU: the tokens fed at each position and the logits there."""
    with open_decoder(original, providers=DEFAULT_PROVIDERS) as decoder:
        decoder.reset()
        outputs = decoder.feed(list(prompt))
        tokens = list(prompt)
        for _ in range(steps):
            token = int(np.argmax(outputs[-1][0]))
            outputs += decoder.feed([token])
            tokens.append(token)
    return tokens, [logits for logits, _ in outputs]


BuildFor = RknnBuild | Callable[[Path], RknnBuild] | None
"""An RKNN build for every graph, or a function giving each graph file its own (a per-graph calibration dataset)."""


def runtime_opener(runtime: str, build: BuildFor = None) -> Callable[[Path], ModelSession] | None:
    """The function that opens one graph file on ``runtime`` (None: ONNX Runtime, opened by the decoders).

    Raises:
        ConfigError: an unknown runtime.
    """
    if runtime == "onnxruntime":
        return None
    if runtime == "openvino":
        return open_openvino_session
    if runtime == "rknn-sim":
        return lambda path: open_rknn_sim_session(path, build(path) if callable(build) else build)
    raise ConfigError(f"unknown runtime '{runtime}'; known runtimes: {', '.join(RUNTIMES)}")


def open_runtime_decoder(
    candidate: str | Path, runtime: str, *, remainder: Remainder = "padded", build: BuildFor = None
) -> Decoder:
    """The candidate's decode loop with every graph on ``runtime``, driven as on ONNX Runtime.

    A graph set (and a ``step_len > 1`` graph, fed in padded chunks) opens through
    :func:`~onnxdeploy.runner.graph_set.open_graph_set` with the runtime's opener for every graph.

    Args:
        candidate: the candidate ``.onnx`` (a set's other graphs beside it).
        runtime: ``onnxruntime``, ``openvino`` or ``rknn-sim``.
        remainder: how a set feeds the prompt tokens left after its largest bucket.
        build: the RKNN build (rknn-sim only; default fp16), or a function giving each graph file its own.

    Raises:
        ConfigError: the runtime is unknown or not installed.
        ModelLoadError: the runtime cannot compile or build a graph (names it).
        ContractError: as :func:`~onnxdeploy.runner.decoder.make_decoder`.
    """
    opener = runtime_opener(runtime, build)
    if opener is None:
        return open_decoder(candidate, remainder=remainder)
    contract = read_contract(read_header(candidate), source=str(candidate))
    if contract is not None and contract.graph_set and (len(contract.graph_set) > 1 or contract.step_len > 1):
        return open_graph_set(candidate, contract, remainder=remainder, opener=opener)
    return make_decoder(opener(Path(candidate)))


@dataclass
class _RuntimeRun:
    """What one decode on a runtime gave: compared rows, the graphs it opened and drove, the device."""

    rows: list[tuple[int, str | None, np.ndarray, np.ndarray]]
    graphs: list[str]
    coverage: GraphCoverage
    device: str
    precision: str


def _decode_on(decoder: Decoder, tokens: list[int], prompt_len: int, reference: list[np.ndarray | None]) -> _RuntimeRun:
    """Teacher-force ``tokens`` through ``decoder`` (the prompt in one feed), then drive any graph left undriven."""
    decoder.reset()
    outputs = decoder.feed(tokens[:prompt_len])
    for token in tokens[prompt_len:]:
        outputs += decoder.feed([token])
    calls = decoder.call_records
    graph_at = [c.graph for c in calls for _ in range(c.tokens)]
    rows = [
        (i, graph_at[i] if i < len(graph_at) else None, want, got)
        for i, ((got, _), want) in enumerate(zip(outputs, reference, strict=True))
        if got is not None and want is not None
    ]
    driven = Counter(c.graph for c in calls)
    coverage = drive_every_graph(decoder, tokens, reference, driven, float("inf"))
    rows += coverage.rows
    session = decoder.model_session
    graphs = [Path(decoder.source).name]
    if isinstance(decoder, GraphSetDecoder):
        graphs = [name for name, _, _ in decoder.graphs()]
    device = ", ".join(session.providers_active)
    return _RuntimeRun(rows, graphs, coverage, device, getattr(session.session, "precision", ""))


def compare_on_runtime(
    original: str,
    candidate: str,
    runtime: str,
    *,
    prompt: Sequence[int],
    steps: int,
    max_abs_logit_diff: float | None = None,
    thresholds: LogitThresholds | None = None,
    remainder: Remainder = "padded",
    build: BuildFor = None,
    held_out: Sequence[int] | None = None,
    accuracy_bounds: Mapping[str, float | None] | None = None,
) -> RuntimeComparison:
    """Decode ``candidate`` on ``runtime``, teacher-forced on the original's greedy tokens, and compare logits.

    A graph set (or a ``step_len > 1`` graph) is driven as on ONNX Runtime: the prompt through its buckets, the
    generated tokens through the step-1 graphs, then each graph the decode did not use driven apart
    (:mod:`onnxdeploy.runner.coverage`); ``graphs_driven`` says which graphs ran, and a graph not driven fails.

    Args:
        original: the original model (decoded on ONNX Runtime CPU).
        candidate: the transformed model.
        runtime: ``onnxruntime``, ``openvino`` or ``rknn-sim``.
        prompt: prompt token ids.
        steps: greedy tokens after the prompt.
        max_abs_logit_diff: shorthand for ``LogitThresholds(max_abs_logit_diff=..., min_top1_agreement=1.0)``
            when ``thresholds`` is None.
        thresholds: the bounds (:mod:`onnxdeploy.runner.thresholds`), judged overall and per graph.
        remainder: how a set feeds the prompt tokens left after its largest bucket.
        build: the RKNN build of every graph (rknn-sim only; default fp16), or a function giving each its own.
        held_out: held-out token ids: teacher-forced through the runtime too (:func:`accuracy_on_runtime`),
            its KL / top-1 / perplexity figures in ``accuracy``.
        accuracy_bounds: ``max_mean_kl``, ``min_top1_agreement``, ``max_ppl_ratio`` (None: not checked) on
            those figures; an int8 build is judged by them.

    Returns:
        The comparison; ``refused`` says why when the runtime cannot compile a graph (not an exception).

    Raises:
        ConfigError: the runtime is unknown or not installed, or neither bound form is given.
        DecodeRunError / ModelLoadError: a runtime failed while decoding.
    """
    check_runtimes([runtime])
    if thresholds is None:
        if max_abs_logit_diff is None:
            raise ConfigError("compare_on_runtime: give max_abs_logit_diff or thresholds")
        thresholds = LogitThresholds(max_abs_logit_diff=max_abs_logit_diff, min_top1_agreement=1.0)
    tokens, reference = _greedy_reference(original, prompt, steps)
    device = "rk3588 simulator" if runtime == "rknn-sim" else "CPU"
    try:
        decoder = open_runtime_decoder(candidate, runtime, remainder=remainder, build=build)
    except ModelLoadError as exc:
        return RuntimeComparison(
            runtime=runtime,
            device=device,
            passed=False,
            refused=str(exc),
            max_abs_logit_diff_allowed=thresholds.max_abs_logit_diff,
            thresholds=thresholds.as_dict(),
        )
    with decoder:  # closing it stops rknn-sim's workers and removes their folders
        run = _decode_on(decoder, tokens, len(prompt), reference)
        accuracy = None
        if held_out is not None:
            accuracy = accuracy_on_runtime(original, decoder, held_out, accuracy_bounds or {})
    judged = judge_positions(run.rows, thresholds)
    failures = [*run.coverage.failures, *judged.failures, *(accuracy["failures"] if accuracy else [])]
    return _comparison(runtime, run, judged, thresholds, accuracy, failures)


def _comparison(
    runtime: str,
    run: _RuntimeRun,
    judged: Judgement,
    thresholds: LogitThresholds,
    accuracy: dict[str, Any] | None,
    failures: list[str],
) -> RuntimeComparison:
    """The report entry of one runtime's comparison (figures overall and per graph, the graphs driven)."""
    overall = judged.overall
    return RuntimeComparison(
        runtime=runtime,
        device=run.device,
        precision=run.precision,
        passed=not failures,
        positions=overall.positions,
        top1_agreement=overall.top1_agreement,
        max_abs_logit_diff=overall.max_abs_logit_diff,
        max_abs_logit_diff_allowed=thresholds.max_abs_logit_diff,
        first_divergent_step=overall.first_divergent_position,
        max_rel_logit_diff=overall.max_rel_logit_diff,
        mean_cosine_similarity=overall.mean_cosine_similarity,
        thresholds=thresholds.as_dict(),
        graphs=run.graphs,
        graphs_driven=run.coverage.calls or {g: 1 for g in run.graphs},
        graphs_driven_apart=run.coverage.apart,
        by_graph={g: f.as_dict() for g, f in judged.by_graph.items()},
        accuracy=accuracy,
        failures=failures,
    )


def accuracy_on_runtime(
    original: str, decoder: Decoder, tokens: Sequence[int], bounds: Mapping[str, float | None]
) -> dict[str, Any]:
    """Teacher-forced held-out figures of a runtime's decoder against the original on ONNX Runtime CPU.

    The original's logits come from :func:`~onnxdeploy.runner.accuracy.teacher_forced_logits`; the candidate is
    fed one token per call when a graph of its set computes only a chunk's last logits, else in one feed.

    Args:
        original: the original model.
        decoder: the candidate's decoder on the runtime (reset here).
        tokens: held-out token ids (at least two; within the largest cache).
        bounds: ``max_mean_kl`` (nats), ``min_top1_agreement``, ``max_ppl_ratio``; None entries are not checked.

    Returns:
        ``{positions, mean_kl, max_kl, top1_agreement, ppl_original, ppl_candidate, ppl_ratio, bounds,
        failures}`` (the per-position KL left out).
    """
    reference = teacher_forced_logits(original, tokens)
    decoder.reset()
    if isinstance(decoder, GraphSetDecoder) and not decoder.every_position_logits:
        outputs = [out for token in tokens for out in decoder.feed([int(token)])]
    else:
        outputs = decoder.feed([int(t) for t in tokens])
    candidate = np.stack([logits for logits, _ in outputs]).astype(np.float32)
    figures = accuracy_figures(reference, candidate, tokens).model_dump(exclude={"kl_per_position"})
    failures = []
    checks = (
        ("max_mean_kl", "mean_kl", 1),
        ("min_top1_agreement", "top1_agreement", -1),
        ("max_ppl_ratio", "ppl_ratio", 1),
    )
    for key, figure, sign in checks:
        bound = bounds.get(key)
        if bound is not None and not sign * figures[figure] <= sign * bound:
            failures.append(f"held-out {figure} {figures[figure]:.4g} breaks {key}={bound:g}")
    return {**figures, "bounds": dict(bounds), "failures": failures}


def node_providers(path: str | Path, providers: Sequence[str] = DEFAULT_PROVIDERS) -> dict[str, Any]:
    """Which ORT execution provider ran each node, from one profiled run on zero-filled inputs.

    Meant for static graphs (a dynamic dim is fed as 1, which an exporter-convention model may refuse).

    ORT's profiler writes one ``Node`` event per kernel run with ``args.provider`` and ``args.op_name``; the
    profile goes to a temporary folder that is removed.

    Returns:
        ``{"nodes": {node name: provider}, "per_provider": {provider: node count}}``.

    Raises:
        ModelLoadError: ORT cannot open the model.
    """
    scratch = Path(tempfile.mkdtemp(prefix="onnxdeploy-profile-"))
    try:
        options = session_options()
        options.enable_profiling = True
        options.profile_file_prefix = str(scratch / "profile")
        try:
            session = ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
        except Exception as exc:  # noqa: BLE001 - ORT raises several types
            raise ModelLoadError(f"{path}: ONNX Runtime cannot load the model: {exc}") from exc
        feeds = {}
        for arg in session.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in arg.shape]
            feeds[arg.name] = np.zeros(shape, dtype=ort_numpy_dtype(arg.type) or np.int64)
        session.run(None, feeds)
        trace = json.loads(Path(session.end_profiling()).read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    nodes: dict[str, str] = {}
    for event in trace:
        args = event.get("args", {})
        if event.get("cat") == "Node" and "provider" in args:
            nodes[event["name"].removesuffix("_kernel_time")] = args["provider"]
    return {"nodes": nodes, "per_provider": dict(Counter(nodes.values()))}
