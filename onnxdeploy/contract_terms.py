"""Named choices of the decode contract that configs and matrices name without loading graph code.

:mod:`onnxdeploy.contract` (which imports onnx, onnx_ir and numpy) re-exports them; this module imports nothing,
so the pipeline's pass configs (``passes/_catalog.py``) and the target matrices' schema validate without onnx
(``onnxdeploy passes``, ``matrix list`` and the pipeline's refusals start fast).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["CacheWrite"]

CacheWrite = Literal["scatter_elements", "scatter_nd", "where", "host"]
"""How a static graph writes the call's K/V into its cache buffer at ``cache_position``: ScatterElements, ScatterND,
a select (Equal on a slot-index range, then Where: ops NPU compilers lower where they lack a Scatter), or ``host``:
the graph outputs only the call's K/V (``cache_update: new_token_only``) and the host writes them."""
