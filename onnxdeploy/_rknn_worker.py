"""RKNN-Toolkit2 worker: runs inside the SDK's own virtual environment, never imported by onnxdeploy itself.

The SDK pins numpy <= 1.26.4, onnx <= 1.18 and torch <= 2.4, so it cannot share onnxdeploy's environment;
:mod:`onnxdeploy.sdk` starts this file with the SDK environment's Python (``python _rknn_worker.py MODE MODEL
PLATFORM``). It imports only the standard library, numpy and ``rknn.api``.

Everything the SDK prints (its verbose build log included) goes to stderr; the protocol uses the original
stdout, one JSON object per line:

- ``build``: ``python _rknn_worker.py build MODEL PLATFORM [OPTIONS]``: load the ONNX model, build it for
  ``PLATFORM``, print ``{"ok": bool, "seconds": float, "error": str}`` and exit. The per-node verdicts are in the
  build log. ``OPTIONS`` is the JSON of :class:`onnxdeploy.sdk.RknnBuild` (default: fp16, no quantization):
  ``quantized_dtype`` (``w8a8`` / ``w16a16i_dfp``: ``rknn.config(quantized_dtype=...)`` and
  ``rknn.build(do_quantization=True, dataset=...)``), ``quantized_algorithm``, ``dataset``, ``float_layers``
  (hybrid quantization: ``hybrid_quantization_step1`` writes the SDK's ``.quantization.cfg``, these layers are
  set to ``float16`` in its ``custom_quantize_layers``, ``hybrid_quantization_step2`` builds) and ``export``
  (``rknn.export_rknn`` path).
- ``builds``: ``python _rknn_worker.py builds PLATFORM [--options JSON-LIST] MODEL [MODEL ...]``: ``build`` for
  each model in one process (the SDK's import costs ~3 s), one JSON line per model; before each build the line
  ``onnxdeploy-rknn-worker: model I`` goes to stderr, so the caller can cut the log per model.
- ``serve``: ``python _rknn_worker.py serve MODEL PLATFORM [OPTIONS]``: build, start the simulator
  (``init_runtime()`` with no target), print ``{"ok": ...}``, then for
  each request line ``{"inputs": npz, "outputs": npz}`` run one inference on the input file's arrays ``in0``, ``in1``,
  ... (graph-input order) and write the outputs (graph-output order) as ``out0``, ``out1``, ...;
  reply ``{"ok": true}`` or ``{"ok": false, "error": ...}``. Ends at end of input.
"""

import json
import os
import re
import sys
import time


def _protocol_stream():
    """Keep the real stdout for the protocol and send everything else (the SDK's prints) to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


MARKER = "onnxdeploy-rknn-worker: model"


def _flush_all():
    """Flush Python's and the C library's buffered output streams.

    The SDK's native code prints "No lowering found" through C stdio, which buffers a pipe until exit: unflushed,
    it would land after the next model's marker.
    """
    import ctypes

    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)


def _options(text):
    """The build options (``RknnBuild`` JSON), defaults filled in."""
    options = {"quantized_dtype": None, "quantized_algorithm": "normal", "dataset": None, "float_layers": []}
    options.update(auto_hybrid=False, auto_hybrid_cos=0.98, hybrid_min_cosine=None, hybrid_samples=3)
    options.update(json.loads(text) if text else {})
    return options


_ANALYSIS_ROW = re.compile(r"^\[(\S+)\]\s+(\S+)\s+([\d.]+)\s*\|\s*[\d.]+\s+([\d.]+)\s*\|\s*[\d.]+")
"""A row of ``accuracy_analysis``'s ``error_analysis.txt``: ``[Op] tensor  entire-cos | euc  single-cos | euc``."""

_WEIGHTED_OPS = {"Conv", "Gather", "exMatMul", "MatMul", "Gemm"}
"""SDK ops not taken in as siblings of a float chain (a weighted layer re-quantizing its input costs little)."""


def _layer_errors(rknn, dataset, samples):
    """Per SDK tensor, the smallest single-layer cosine (quantized vs float) over ``samples`` dataset lines.

    RKNN-Toolkit2's ``accuracy_analysis(inputs=...)`` runs one sample on the float graph and on the quantized
    simulator and writes ``snapshot/error_analysis.txt``: per layer the ``entire`` error (accumulated from the
    inputs) and the ``single`` one (the layer fed the float values of its inputs, quantized), each as cosine and
    euclidean distance (2.5.0's header text). The single cosine isolates what quantizing that layer costs.
    """
    with open(dataset) as f:
        lines = [line.split() for line in f.read().splitlines() if line.strip()]
    picks = sorted({round(i * (len(lines) - 1) / max(1, samples - 1)) for i in range(samples)}) if lines else []
    worst = {}
    for k in picks:
        folder = f"snapshot{k}"
        if rknn.accuracy_analysis(inputs=lines[k], output_dir=folder) != 0:
            raise RuntimeError(f"accuracy_analysis failed on dataset line {k + 1}")
        with open(os.path.join(folder, "error_analysis.txt")) as f:
            for row in f:
                m = _ANALYSIS_ROW.match(row)
                if m and m[1] != "Input":
                    worst[m[2]] = min(worst.get(m[2], 1.0), float(m[4]))
    return worst


def _float_region(sdk_model, sensitive, quantized):
    """The tensors kept float16 for each sensitive one: itself, the single-input chain feeding it, and its siblings.

    A layer whose output is sensitive to its input's precision (``Sin``/``Cos`` of the rotary angle
    ``position * inv_freq``, an int8 tensor with a step of ~0.6 rad at 160 positions) gains nothing from float16
    while its input stays int8; so the walk goes back through each producer with one quantized activation input
    (constants and integer tensors are not ``quantized``; weights are constants) until a graph input or a producer
    with several activation inputs: optimum's rotary angle is ``MatMul(inv_freq, position)``, whose float position
    input matters as much as the angle. The other single-input consumers of the chain's tensors (``Cos`` beside ``Sin``,
    both of the angle) join it, so none of them re-quantizes a float input. ``sdk_model`` is step 1's ``.model``
    file (an ONNX graph of the SDK's own tensors).
    """
    import onnx

    graph = onnx.load(sdk_model, load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    constants = {t.name for t in graph.initializer}

    def feeds(node):
        return {i for i in node.input if i and i not in constants and i in quantized}

    chosen = []
    for tensor in sensitive:
        chain = []
        while tensor in quantized and tensor not in chosen and tensor not in chain:
            chain.append(tensor)
            node = producer.get(tensor)
            if node is None or len(feeds(node)) != 1:
                break
            tensor = next(iter(feeds(node)))
        inner = set(chain[1:])  # the chain's tensors below the sensitive one
        siblings = [
            o
            for n in graph.node
            if n.op_type not in _WEIGHTED_OPS and len(feeds(n)) == 1 and feeds(n) <= inner
            for o in n.output
            if o in quantized and o not in chain
        ]
        chosen += [t for t in chain + siblings if t not in chosen]
    return chosen


def _hybrid(rknn, model, options, config, sensitive=()):
    """Hybrid quantization: step 1 writes the SDK's model/data/cfg files, the chosen tensors become float16, step 2.

    RKNN-Toolkit2's ``.quantization.cfg`` is YAML whose ``custom_quantize_layers`` maps a tensor name (a key of
    its ``quantize_parameters``) to a dtype; step 2 runs on a fresh ``RKNN`` object (2.5.0 refuses it after
    ``load_onnx``: "Do not call 'load_onnx' before executing 'hybrid_quantization_step2'"). The chosen tensors:
    ``float_layers`` present in this graph, and the float region (:func:`_float_region`) of each ``sensitive``
    tensor (from per-layer error).

    Returns:
        ``(rknn, error, chosen)``: the object that holds the built model, "" or why it failed, the float16 tensors.
    """
    from rknn.api import RKNN

    if rknn.hybrid_quantization_step1(dataset=options["dataset"], proposal=False) != 0:
        return rknn, "hybrid_quantization_step1 failed", []
    stem = os.path.splitext(os.path.basename(model))[0]
    cfg = f"{stem}.quantization.cfg"
    with open(cfg) as f:
        lines = f.read().splitlines()
    known = {line.strip().rstrip(":") for line in lines if line.startswith("    ") and not line.startswith("     ")}
    chosen = [name for name in options["float_layers"] if name in known]  # the graphs of a set differ in names
    chosen += [t for t in _float_region(f"{stem}.model", sensitive, known) if t not in chosen]
    if not chosen:
        if sensitive:
            return rknn, "", []  # every layer within the bound: step 1's plain quantization stands (built below)
        return rknn, f"no float_layers entry is among this graph's quantized tensors: {options['float_layers'][:5]}", []
    print(f"hybrid: float16 for {len(chosen)} tensor(s): {chosen}", file=sys.stderr)
    entries = [f"    {name}: float16" for name in chosen]
    at = next(i for i, line in enumerate(lines) if line.startswith("custom_quantize_layers"))
    lines[at : at + 1] = ["custom_quantize_layers:", *entries]
    with open(cfg, "w") as f:
        f.write("\n".join(lines) + "\n")
    rknn.release()
    rknn = RKNN(verbose=True)
    rknn.config(**config)
    done = rknn.hybrid_quantization_step2(
        model_input=f"{stem}.model", data_input=f"{stem}.data", model_quantization_cfg=cfg
    )
    return rknn, "" if done == 0 else "hybrid_quantization_step2 failed", chosen


def _build(model: str, platform: str, options=None):
    from rknn.api import RKNN

    options = options or _options("")
    quantized = options["quantized_dtype"] is not None
    rknn = RKNN(verbose=True)
    config = {"target_platform": platform}
    if quantized:
        config.update(quantized_dtype=options["quantized_dtype"], quantized_algorithm=options["quantized_algorithm"])
        if options["auto_hybrid"]:
            config["auto_hybrid_cos_thresh"] = options["auto_hybrid_cos"]
    start = time.perf_counter()
    hybrid = {}
    try:  # the SDK raises on some graphs (e.g. an ORT session it opens on a contrib-op model) instead of returning
        rknn.config(**config)
        if rknn.load_onnx(model=model) != 0:
            return rknn, {"ok": False, "seconds": time.perf_counter() - start, "error": "load_onnx failed"}
        sensitive = []
        if quantized and options["hybrid_min_cosine"] is not None:
            rknn, sensitive, analysis = _sensitive_layers(rknn, model, options, config)
            hybrid["layer_errors"] = analysis
        if quantized and (options["float_layers"] or sensitive):
            rknn, error, chosen = _hybrid(rknn, model, options, config, sensitive)
            hybrid["float_layers"] = chosen
            if not error and not chosen and rknn.build(do_quantization=True, dataset=options["dataset"]) != 0:
                error = "build failed"
        elif rknn.build(do_quantization=quantized, dataset=options["dataset"], auto_hybrid=options["auto_hybrid"]) != 0:
            error = "build failed"
        else:
            error = ""
        if not error and options.get("export") and rknn.export_rknn(options["export"]) != 0:
            error = f"export_rknn {options['export']} failed"
        if error:
            return rknn, {"ok": False, "seconds": time.perf_counter() - start, "error": error, **hybrid}
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        error = f"{type(exc).__name__}: {exc}".strip().splitlines()[-1][:500]
        return rknn, {"ok": False, "seconds": time.perf_counter() - start, "error": error, **hybrid}
    return rknn, {"ok": True, "seconds": time.perf_counter() - start, "error": "", **hybrid}


def _sensitive_layers(rknn, model, options, config):
    """Build plainly, measure per-layer error, and return a fresh loaded ``RKNN``, the sensitive tensors, a summary.

    Sensitive: single-layer cosine below ``hybrid_min_cosine`` on any of ``hybrid_samples`` dataset lines
    (:func:`_layer_errors`), worst first. The summary (report JSON) is the bound, the samples and the ten worst.
    """
    from rknn.api import RKNN

    if rknn.build(do_quantization=True, dataset=options["dataset"]) != 0:
        raise RuntimeError("build failed (plain quantization before the per-layer analysis)")
    errors = _layer_errors(rknn, options["dataset"], options["hybrid_samples"])
    rknn.release()
    rknn = RKNN(verbose=True)
    rknn.config(**config)
    if rknn.load_onnx(model=model) != 0:
        raise RuntimeError("load_onnx failed")
    bound = options["hybrid_min_cosine"]
    sensitive = sorted((t for t, c in errors.items() if c < bound), key=errors.get)
    worst = sorted(errors, key=errors.get)[:10]
    analysis = {
        "min_cosine": bound,
        "samples": options["hybrid_samples"],
        "layers": len(errors),
        "sensitive": sensitive,
        "worst": [[t, round(errors[t], 6)] for t in worst],
    }
    return rknn, sensitive, analysis


def main() -> int:
    """Run the worker (see the module docstring); exit 0 when the build (and the simulator) started."""
    proto = _protocol_stream()
    if sys.argv[1] == "builds":
        platform, models = sys.argv[2], sys.argv[3:]
        options = [_options("")] * len(models)
        if models and models[0] == "--options":  # one JSON list: the options of each model
            options, models = [_options(json.dumps(o)) for o in json.loads(models[1])], models[2:]
        for i, model in enumerate(models):
            print(f"{MARKER} {i}", file=sys.stderr, flush=True)
            rknn, result = _build(model, platform, options[i])
            rknn.release()
            _flush_all()
            proto.write(json.dumps(result) + "\n")
        return 0
    mode, model, platform = sys.argv[1:4]
    rknn, result = _build(model, platform, _options(sys.argv[4] if len(sys.argv) > 4 else ""))
    if mode == "build" or not result["ok"]:
        proto.write(json.dumps(result) + "\n")
        return 0 if result["ok"] else 1
    import numpy as np

    if rknn.init_runtime() != 0:
        proto.write(json.dumps({"ok": False, "seconds": result["seconds"], "error": "init_runtime failed"}) + "\n")
        return 1
    proto.write(json.dumps(result) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            with np.load(request["inputs"]) as data:
                feeds = [data[f"in{i}"] for i in range(len(data.files))]
            outputs = rknn.inference(inputs=feeds, data_format=["nchw"] * len(feeds))
            np.savez(request["outputs"], **{f"out{i}": np.asarray(o) for i, o in enumerate(outputs)})
            proto.write(json.dumps({"ok": True}) + "\n")
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which raises
            proto.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
    rknn.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
