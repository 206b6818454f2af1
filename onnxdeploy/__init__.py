"""onnxdeploy: make an ONNX LLM decoder static for edge NPUs and prove it decodes the same.

The import package maps four top-level folders as subpackages (see pyproject.toml):
``onnxdeploy.passes`` (graph rewrites), ``onnxdeploy.checks`` (findings), ``onnxdeploy.runner``
(step-by-step verification on ONNX Runtime) and ``onnxdeploy.matrices`` (target compatibility data).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("onnxdeploy")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
