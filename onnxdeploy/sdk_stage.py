"""The device SDK build stage of a run (``sdk: auto | build | off``), after the checks, and its calibration dataset.

For ``target: rknn-rk3588`` every graph the run wrote is built with RKNN-Toolkit2 2.5.0 in its own environment
(:mod:`onnxdeploy.sdk`), and each built graph is written beside it as ``<graph stem>.rknn`` (an output of the run,
renamed into place with the ONNX graphs, which stay as they are). ``report.json`` → ``sdk`` records the mode, the
build (fp16, or ``w8a8`` from a calibration dataset) and per graph the verdict, the ``.rknn`` file, and per node
where the SDK placed it (NPU/CPU, :func:`onnxdeploy.sdk.beside_matrix`) beside the matrix's prediction. A graph
the SDK cannot build fails the run (exit 1) with the SDK's reason. With ``sdk.quantization.hybrid_min_cosine``
(default 0.98) each graph's fp16 tensors are chosen from per-layer error by the worker
(``onnxdeploy/_rknn_worker.py``: the SDK's ``accuracy_analysis``, then ``hybrid_quantization_step1/2``); the choice
is ``graphs[].hybrid`` (:attr:`onnxdeploy.sdk.SdkReport.hybrid`), laid out by :mod:`onnxdeploy.sdk_report`.

Modes: ``auto`` (default) builds where the SDK environment exists and adds a note where it does not; ``build``
refuses a missing environment at config load (exit 2); ``off`` skips the stage. Other targets have no SDK stage.

**Calibration dataset.** The NPU's own quantization (``sdk.quantization``: RKNN ``w8a8``) calibrates weights and
activations on samples of every model input. :func:`calibration_samples` makes them through the decode contract:
the ``calibration`` token ids are fed to the graph on ONNX Runtime as a host decodes (``step_len`` tokens a call,
``cache_position`` and the cache buffers as the previous calls left them — not zeros), and the feeds of spread-out
calls are kept. :func:`write_calibration_dataset` writes them in RKNN-Toolkit2's dataset format: a text file with
one sample per line, each line the ``.npy`` paths of the model's inputs in graph-input order separated by spaces
(RKNN-Toolkit2 User Guide 2.x, ``rknn.build(dataset=...)``: "each line of the dataset file holds one input set;
multi-input models list one file per input on the line, separated by spaces").
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from onnxdeploy.artifacts import ArtifactSet
from onnxdeploy.config import PipelineConfig, SdkQuantization
from onnxdeploy.contract import read_contract
from onnxdeploy.errors import ContractError, ModelLoadError
from onnxdeploy.model_io import StagedArtifacts
from onnxdeploy.report import Finding, RuntimeComparison
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.runtimes import compare_on_runtime
from onnxdeploy.runner.session import open_session
from onnxdeploy.runner.thresholds import LogitThresholds, runtime_thresholds
from onnxdeploy.sdk import RknnBuild, beside_matrix, rknn_build_reports, rknn_env, rknn_python

__all__ = [
    "SDK_TARGET",
    "SdkBuilt",
    "calibration_samples",
    "read_calibration_dataset",
    "rknn_build_for",
    "sdk_stage",
    "other_runtimes",
    "write_calibration_dataset",
]

SDK_TARGET = "rknn-rk3588"
"""The one target with an SDK build stage (RKNN-Toolkit2 2.5.0, ``target_platform`` rk3588)."""

Say = Callable[[str], None]


@dataclass(kw_only=True)
class SdkBuilt:
    """The SDK stage's result: ``report.json`` → ``sdk`` (None: the target has no SDK stage) and its failures."""

    report: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)


class _Recorder:
    """An ORT session that keeps a copy of every feed before running it (the decode contract's real inputs)."""

    def __init__(self, session, sink: list[dict[str, np.ndarray]]) -> None:
        self._session = session
        self._sink = sink

    def run(self, names, feeds):
        """Record ``feeds`` (copied), then run them."""
        self._sink.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return self._session.run(names, feeds)

    def __getattr__(self, name: str):
        return getattr(self._session, name)


def calibration_samples(
    graph: str | Path, token_ids: Sequence[Sequence[int]], max_samples: int
) -> list[dict[str, np.ndarray]]:
    """Feeds of one static graph's calls on the calibration tokens, driven through its decode contract.

    Each sequence is cut into pieces of at most ``max_cache_len`` tokens (a whole number of ``step_len``
    chunks); each piece is decoded from position 0 on ONNX Runtime CPU, ``step_len`` tokens per call, so every
    call's ``cache_position`` and cache buffers are those of a real decode. ``max_samples`` calls are kept, spread
    evenly over all calls made.

    Args:
        graph: a static graph carrying a decode contract (one graph of a set is driven alone).
        token_ids: calibration sequences (token ids within the vocabulary).
        max_samples: calls kept at most.

    Returns:
        One ``{input name: array}`` per kept call (dtypes and shapes as the graph's inputs).

    Raises:
        ContractError: the graph has no contract, or the tokens fill no call.
        ModelLoadError / DecodeRunError: ORT cannot open or run the graph.
    """
    session = open_session(graph)
    contract = read_contract(session.model, source=str(graph))
    if contract is None:
        session.close()
        raise ContractError(f"{graph}: no decode contract; the calibration dataset is fed through it")
    calls: list[dict[str, np.ndarray]] = []
    session.session = _Recorder(session.session, calls)
    piece = contract.max_cache_len // contract.step_len * contract.step_len
    with ContractDecoder(session, contract) as decoder:
        for sequence in token_ids:
            for start in range(0, len(sequence) - contract.step_len + 1, piece):
                chunk = list(sequence[start : start + piece])
                decoder.reset()
                decoder.feed(chunk[: len(chunk) // contract.step_len * contract.step_len])
    if not calls:
        raise ContractError(
            f"{graph}: the calibration tokens fill no call of this step_len {contract.step_len} graph; "
            "give more calibration tokens"
        )
    keep = np.unique(np.linspace(0, len(calls) - 1, num=min(max_samples, len(calls))).round().astype(int))
    return [calls[i] for i in keep]


def write_calibration_dataset(
    samples: Sequence[dict[str, np.ndarray]], input_names: Sequence[str], folder: Path
) -> Path:
    """Write samples as RKNN-Toolkit2's dataset: ``dataset.txt`` of ``.npy`` paths (module docstring).

    Args:
        samples: one ``{input name: array}`` per sample.
        input_names: the graph's inputs in graph-input order (the order the SDK reads the paths in).
        folder: where ``dataset.txt`` and ``s{i}_in{j}.npy`` go (made if needed).

    Returns:
        The dataset file.

    Raises:
        ContractError: a sample lacks one of ``input_names``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, sample in enumerate(samples):
        missing = [n for n in input_names if n not in sample]
        if missing:
            raise ContractError(f"calibration sample {i} lacks input(s) {missing}")
        paths = []
        for j, name in enumerate(input_names):
            path = folder / f"s{i}_in{j}.npy"
            np.save(path, sample[name])
            paths.append(str(path.resolve()))
        lines.append(" ".join(paths))
    dataset = folder / "dataset.txt"
    dataset.write_text("\n".join(lines) + "\n")
    return dataset


def read_calibration_dataset(dataset: Path) -> list[list[np.ndarray]]:
    """Read a dataset file back: per line, the arrays of its ``.npy`` paths in order (what the SDK reads)."""
    return [[np.load(p) for p in line.split()] for line in dataset.read_text().splitlines() if line.strip()]


def rknn_build_for(
    graph: Path, quantization: SdkQuantization | None, calibration: Sequence[Sequence[int]], scratch: Path
) -> RknnBuild:
    """The RKNN build of one graph: fp16, or ``quantization`` with a dataset made from ``calibration``.

    Raises:
        ContractError: quantization without a contract graph, or calibration tokens that fill no call.
    """
    if quantization is None:
        return RknnBuild()
    import onnx  # noqa: PLC0415

    samples = calibration_samples(graph, calibration, quantization.max_samples)
    header = onnx.load(str(graph), load_external_data=False)
    initializers = {t.name for t in header.graph.initializer}
    names = [v.name for v in header.graph.input if v.name not in initializers]
    dataset = write_calibration_dataset(samples, names, scratch / f"{graph.stem}-dataset")
    return RknnBuild(
        quantized_dtype=quantization.dtype,
        quantized_algorithm=quantization.algorithm,
        dataset=str(dataset),
        float_layers=tuple(quantization.float_layers),
        auto_hybrid=quantization.auto_hybrid,
        auto_hybrid_cos=quantization.auto_hybrid_cos,
        hybrid_min_cosine=quantization.hybrid_min_cosine,
        hybrid_samples=quantization.hybrid_samples,
    )


def _graph_findings(findings: Sequence[Finding], name: str, several: bool) -> list[Finding]:
    """The target findings of one graph of the set (checks prefix each message with its graph's name)."""
    return [f for f in findings if not several or f.message.startswith(f"{name}: ")]


def sdk_stage(
    config: PipelineConfig,
    staged: StagedArtifacts,
    artifacts: ArtifactSet,
    findings: Sequence[Finding],
    calibration: Sequence[Sequence[int]],
    say: Say,
) -> SdkBuilt:
    """Build every staged graph with the target's SDK; the ``.rknn`` files join the staged outputs.

    Args:
        config: the pipeline (``sdk``, ``target``).
        staged: the staging folder holding the graphs (the ``.rknn`` files are added to it).
        artifacts: the graph set (names in order, primary first).
        findings: the checks' findings (the target check's are set beside the SDK's verdicts).
        calibration: the ``calibration`` token ids (for ``sdk.quantization``).
        say: progress lines.

    Returns:
        The stage's report and failures (a graph the SDK cannot build is a failure naming the SDK's reason).

    Raises:
        ContractError: quantization on graphs the calibration tokens cannot drive.
        ModelLoadError: the SDK worker did not answer.
    """
    mode = config.sdk.mode
    if config.target != SDK_TARGET:
        return SdkBuilt()
    base: dict[str, Any] = {"mode": mode, "sdk": "rknn-toolkit2 2.5.0", "target_platform": "rk3588"}
    if mode == "off":
        return SdkBuilt(report={**base, "ran": False, "note": "sdk: off"})
    if rknn_python() is None:
        note = f"sdk: auto: the RKNN-Toolkit2 environment is not installed ({rknn_env()}); no .rknn built"
        say(note)
        return SdkBuilt(report={**base, "ran": False, "note": note + " (onnxdeploy sdk install rknn)"})
    names = [a.name for a in artifacts.artifacts]
    with tempfile.TemporaryDirectory(prefix="onnxdeploy-sdk-") as scratch:
        builds = []
        for name in names:
            build = rknn_build_for(staged.path(name), config.sdk.quantization, calibration, Path(scratch))
            rknn_name = f"{Path(name).stem}.rknn"
            builds.append((rknn_name, replace(build, export=str(staged.path(rknn_name)))))
        say(f"sdk: building {len(names)} graph(s) with RKNN-Toolkit2 2.5.0 ({builds[0][1].label()})")
        reports = rknn_build_reports([staged.path(n) for n in names], builds=[b for _, b in builds])
    graphs, failures = [], []
    for name, (rknn_name, build), report in zip(names, builds, reports, strict=True):
        beside = beside_matrix(report, _graph_findings(findings, name, len(names) > 1))
        built = report.built and staged.path(rknn_name).is_file()
        if built:
            staged.files.append(rknn_name)
        else:
            failures.append(f"sdk: {name}: RKNN-Toolkit2 cannot build it ({build.label()}): {report.error}")
        placed = [n["sdk"] for n in beside["nodes"]]
        graphs.append(
            {
                "graph": name,
                "rknn": rknn_name if built else None,
                "build": build.label(),
                "npu_nodes": placed.count("npu"),
                "cpu_nodes": placed.count("cpu") + placed.count("no_npu_lowering"),
                **beside,
                "built": built,
            }
        )
    if not reports:
        raise ModelLoadError("sdk: the RKNN worker built nothing")
    return SdkBuilt(report={**base, "ran": True, "build": builds[0][1].label(), "graphs": graphs}, failures=failures)


def other_runtimes(
    config: PipelineConfig,
    candidate: Path,
    held_out: Sequence[int] | None,
    calibration: Sequence[Sequence[int]],
    say: Say,
) -> list[RuntimeComparison]:
    """``verify.runtimes`` other than onnxruntime: every graph of the candidate on each, against the original on ORT.

    Each runtime is held to its precision's bounds (:func:`onnxdeploy.runner.thresholds.runtime_thresholds`) with
    its entry's own on top: OpenVINO (f32) to the ``verify`` section's; ``rknn-sim`` built as the ``sdk`` section
    says: fp16 (mean cosine ≥ 0.9999, top-1 ≥ 99%) or ``sdk.quantization`` (``w8a8`` from each graph's own
    calibration dataset), then judged by the held-out figures of ``verify.accuracy``'s tokens on the simulator
    against ``sdk.quantization``'s ``max_mean_kl`` / ``min_top1_agreement`` / ``max_ppl_ratio``.
    """
    v = config.verify
    assert v is not None
    fp32 = LogitThresholds(
        max_abs_logit_diff=v.max_abs_logit_diff,
        max_rel_logit_diff=v.max_rel_logit_diff,
        min_cosine_similarity=v.min_cosine_similarity,
        min_top1_agreement=v.min_top1_agreement,
    )
    quantization = config.sdk.quantization
    reports = []
    with tempfile.TemporaryDirectory(prefix="onnxdeploy-sdk-verify-") as scratch:
        for spec in v.runtimes:
            if spec.name == "onnxruntime":
                continue
            quantized = spec.name == "rknn-sim" and quantization is not None
            precision = "fp32" if spec.name != "rknn-sim" else "int8" if quantized else "fp16"
            build = None
            if quantized:

                def build(path: Path, q=quantization) -> RknnBuild:
                    return rknn_build_for(path, q, calibration, Path(scratch))

            say(f"verify on {spec.name}: every graph against the original on ONNX Runtime ({precision})")
            reports.append(
                compare_on_runtime(
                    str(config.model),
                    str(candidate),
                    spec.name,
                    prompt=list(v.prompt),
                    steps=v.steps,
                    thresholds=runtime_thresholds(precision, fp32, spec.bounds()),
                    remainder=v.remainder,
                    build=build,
                    held_out=held_out if quantized else None,
                    accuracy_bounds=_accuracy_bounds(quantization) if quantized else None,
                )
            )
    return reports


def _accuracy_bounds(q: SdkQuantization | None) -> dict[str, float | None]:
    """``sdk.quantization``'s held-out bounds by name."""
    assert q is not None
    return {"max_mean_kl": q.max_mean_kl, "min_top1_agreement": q.min_top1_agreement, "max_ppl_ratio": q.max_ppl_ratio}
