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
    options.update(auto_hybrid=False, auto_hybrid_cos=0.98)
    options.update(json.loads(text) if text else {})
    return options


def _hybrid(rknn, model, options, config):
    """Hybrid quantization: step 1 writes the SDK's model/data/cfg files, the named tensors become float16, step 2.

    RKNN-Toolkit2's ``.quantization.cfg`` is YAML whose ``custom_quantize_layers`` maps a tensor name (a key of
    its ``quantize_parameters``) to a dtype; step 2 runs on a fresh ``RKNN`` object (2.5.0 refuses it after
    ``load_onnx``: "Do not call 'load_onnx' before executing 'hybrid_quantization_step2'").

    Returns:
        ``(rknn, error)``: the object that holds the built model, and "" or why it failed.
    """
    from rknn.api import RKNN

    if rknn.hybrid_quantization_step1(dataset=options["dataset"], proposal=False) != 0:
        return rknn, "hybrid_quantization_step1 failed"
    stem = os.path.splitext(os.path.basename(model))[0]
    cfg = f"{stem}.quantization.cfg"
    with open(cfg) as f:
        lines = f.read().splitlines()
    known = {line.strip().rstrip(":") for line in lines if line.startswith("    ") and not line.startswith("     ")}
    chosen = [name for name in options["float_layers"] if name in known]  # the graphs of a set differ in names
    if not chosen:
        return rknn, f"no float_layers entry is among this graph's quantized tensors: {options['float_layers'][:5]}"
    print(f"hybrid: float16 for {len(chosen)} of {len(options['float_layers'])} float_layers", file=sys.stderr)
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
    return rknn, "" if done == 0 else "hybrid_quantization_step2 failed"


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
    try:  # the SDK raises on some graphs (e.g. an ORT session it opens on a contrib-op model) instead of returning
        rknn.config(**config)
        if rknn.load_onnx(model=model) != 0:
            return rknn, {"ok": False, "seconds": time.perf_counter() - start, "error": "load_onnx failed"}
        if quantized and options["float_layers"]:
            rknn, error = _hybrid(rknn, model, options, config)
        elif rknn.build(do_quantization=quantized, dataset=options["dataset"], auto_hybrid=options["auto_hybrid"]) != 0:
            error = "build failed"
        else:
            error = ""
        if not error and options.get("export") and rknn.export_rknn(options["export"]) != 0:
            error = f"export_rknn {options['export']} failed"
        if error:
            return rknn, {"ok": False, "seconds": time.perf_counter() - start, "error": error}
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        error = f"{type(exc).__name__}: {exc}".strip().splitlines()[-1][:500]
        return rknn, {"ok": False, "seconds": time.perf_counter() - start, "error": error}
    return rknn, {"ok": True, "seconds": time.perf_counter() - start, "error": ""}


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
