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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from onnxdeploy.errors import ConfigError, ModelLoadError
from onnxdeploy.graph import ort_numpy_dtype
from onnxdeploy.report import RuntimeComparison
from onnxdeploy.runner.decoder import make_decoder, open_decoder
from onnxdeploy.runner.session import DEFAULT_PROVIDERS, ModelSession, read_header, session_options
from onnxdeploy.sdk import rknn_python, rknn_worker_command

__all__ = [
    "OPENVINO_CONFIG",
    "RUNTIMES",
    "OpenVINOSession",
    "RKNNSimSession",
    "check_runtimes",
    "compare_on_runtime",
    "installed_runtimes",
    "node_providers",
    "open_openvino_session",
    "open_rknn_sim_session",
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
    """The RKNN-Toolkit2 simulator (fp16 build for ``rk3588``) behind the session interface the decoders use.

    The model is built and the simulator started once in a worker process of the SDK environment; each
    ``run`` sends the feeds through a temporary ``.npz`` file and reads the outputs back.

    Raises (from the constructor):
        ConfigError: the SDK environment is not installed.
        ModelLoadError: the SDK cannot build the model or start the simulator.
    """

    def __init__(self, path: str | Path, header, *, target_platform: str = "rk3588") -> None:
        from onnx import helper

        command = rknn_worker_command("serve", str(Path(path).resolve()), target_platform)
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
        self.precision = "fp16 (RKNN build without quantization)"

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


def open_rknn_sim_session(path: str | Path) -> ModelSession:
    """Build the model with RKNN-Toolkit2 (fp16, rk3588) and start its simulator; the decoders drive it.

    Raises:
        ConfigError: the SDK environment is not installed.
        ModelLoadError: the file is refused (:func:`~onnxdeploy.runner.session.read_header`) or the SDK
            cannot build or simulate it.
    """
    check_runtimes(["rknn-sim"])
    header = read_header(path)
    session = RKNNSimSession(path, header)
    active = tuple(session.get_providers())
    return ModelSession(str(path), header, session, active, active)  # type: ignore[arg-type]


def _greedy_reference(original: str, prompt: Sequence[int], steps: int) -> tuple[list[int], np.ndarray]:
    """The original's greedy decode on ORT CPU: the tokens fed at each position and the logits there."""
    with open_decoder(original, providers=DEFAULT_PROVIDERS) as decoder:
        decoder.reset()
        outputs = decoder.feed(list(prompt))
        tokens = list(prompt)
        for _ in range(steps):
            token = int(np.argmax(outputs[-1][0]))
            outputs += decoder.feed([token])
            tokens.append(token)
    return tokens, np.stack([logits for logits, _ in outputs])


def compare_on_runtime(
    original: str,
    candidate: str,
    runtime: str,
    *,
    prompt: Sequence[int],
    steps: int,
    max_abs_logit_diff: float,
) -> RuntimeComparison:
    """Decode ``candidate`` on ``runtime``, teacher-forced on the original's greedy tokens, and compare logits.

    Args:
        original: the original model (decoded on ONNX Runtime CPU).
        candidate: the transformed model.
        runtime: ``onnxruntime``, ``openvino`` or ``rknn-sim``.
        prompt: prompt token ids.
        steps: greedy tokens after the prompt.
        max_abs_logit_diff: tolerance; the comparison passes when every position is within it and top-1 agrees.

    Returns:
        The comparison; ``refused`` says why when the runtime cannot compile the candidate (not an exception).

    Raises:
        ConfigError: the runtime is unknown or not installed.
    """
    check_runtimes([runtime])
    tokens, reference = _greedy_reference(original, prompt, steps)
    try:
        session = {"openvino": open_openvino_session, "rknn-sim": open_rknn_sim_session}.get(
            runtime, lambda _path: None
        )(candidate)
    except ModelLoadError as exc:
        device = "rk3588 simulator" if runtime == "rknn-sim" else "CPU"
        return RuntimeComparison(
            runtime=runtime,
            device=device,
            passed=False,
            refused=str(exc),
            max_abs_logit_diff_allowed=max_abs_logit_diff,
        )
    precision = getattr(session.session, "precision", "") if session is not None else ""
    decoder = None
    try:  # closing the decoder or, if it was never made, the session stops rknn-sim's worker and removes its folder
        decoder = make_decoder(session) if session is not None else open_decoder(candidate)
        decoder.reset()
        outputs = decoder.feed(tokens[: len(prompt)])
        for token in tokens[len(prompt) :]:
            outputs += decoder.feed([token])
        device = ", ".join(decoder.model_session.providers_active)
    finally:
        if decoder is not None:
            decoder.close()
        if session is not None:
            session.close()
    logits = np.stack([out for out, _ in outputs])
    diffs = np.abs(logits.astype(np.float64) - reference.astype(np.float64)).reshape(len(tokens), -1).max(axis=1)
    agree = logits.reshape(len(tokens), -1).argmax(axis=1) == reference.reshape(len(tokens), -1).argmax(axis=1)
    bad = np.flatnonzero(~agree | (diffs > max_abs_logit_diff))
    return RuntimeComparison(
        runtime=runtime,
        device=device,
        precision=precision,
        passed=not bad.size,
        positions=len(tokens),
        top1_agreement=float(agree.mean()),
        max_abs_logit_diff=float(diffs.max()),
        max_abs_logit_diff_allowed=max_abs_logit_diff,
        first_divergent_step=int(bad[0]) if bad.size else None,
    )


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
