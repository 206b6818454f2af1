"""onnxdeploy: make an ONNX LLM decoder static for edge NPUs and prove it decodes the same.

The import package maps four top-level folders as subpackages (see pyproject.toml):
``onnxdeploy.passes`` (graph rewrites), ``onnxdeploy.checks`` (findings), ``onnxdeploy.runner``
(step-by-step verification on ONNX Runtime) and ``onnxdeploy.matrices`` (target compatibility data).
"""

import time

__all__ = ["IMPORTED_AT", "__version__"]

#: ``time.perf_counter()`` when this package was first imported: where a CLI run's clock starts when the process
#: start is not this interpreter's (see :func:`onnxdeploy.resources.run_clock_start`).
IMPORTED_AT = time.perf_counter()


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed metadata on first use (importlib.metadata costs ~30 ms to import)."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        value = version("onnxdeploy")
    except PackageNotFoundError:  # running from a source tree without install
        value = "0.0.0+unknown"
    globals()["__version__"] = value
    return value
