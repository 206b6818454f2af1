"""ONNX's own backend node tests as conformance cases, regenerated from the installed onnx wheel.

The onnx wheel ships the case scripts (``onnx/backend/test/case/node/*.py``) but no data: running
``onnx.backend.test.case.node.collect_testcases()`` executes them, which builds each test's model and draws its
inputs and expected outputs as onnx's own generator does. Nothing is vendored: the cases are generated at test
time and cached (pickled) under ``$ONNXDEPLOY_CACHE`` (default ``~/.cache/onnxdeploy``), keyed by the onnx
version, so a second load takes a fraction of the ~15 s a collection takes on 2 cores.

Used by the conformance tests (``tests/conformance/``) and ``benchmarks/conformance.py``.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

NONDETERMINISTIC = (
    "test_bernoulli",
    "test_random",
    "test_dropout_default_mask",
    "test_training_dropout",
)
"""Name prefixes of node tests whose outputs are random draws (Random*, Bernoulli, training-mode Dropout):
excluded, since no converted model can be compared with their expected outputs."""


@dataclass(frozen=True)
class NodeCase:
    """One ONNX backend node test: a single-node model with one or more input/output data sets.

    Attributes:
        name: onnx's test name, e.g. ``test_pad_constant_axes``.
        model: the test's model (``onnx.ModelProto``) at the opset its case script declares.
        data_sets: ``[(inputs, outputs)]``, each a list of numpy arrays (or lists / None for sequence and
            optional values) in the graph's input / output order.
        rtol: relative tolerance onnx's backend runner compares outputs with.
        atol: absolute tolerance onnx's backend runner compares outputs with.
    """

    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list, list]]
    rtol: float
    atol: float

    @property
    def opset(self) -> int | None:
        """The model's ``ai.onnx`` opset (the default domain's version); None if it imports no ``ai.onnx``."""
        return next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")), None)

    @property
    def op_type(self) -> str:
        """The op type of the test's node (the graph's first node)."""
        return self.model.graph.node[0].op_type


def _cache_path() -> Path:
    """Where the pickled cases of the installed onnx version live."""
    root = Path(os.environ.get("ONNXDEPLOY_CACHE", Path.home() / ".cache" / "onnxdeploy"))
    return root / f"node-cases-onnx-{onnx.__version__}.pkl"


def load_node_cases() -> list[NodeCase]:
    """All deterministic node tests of the installed onnx wheel, from the cache or freshly generated.

    Returns:
        The cases, sorted by name (1,884 less the nondeterministic ones for onnx 1.23.2).

    Raises:
        ImportError: if the installed onnx has no ``onnx.backend.test.case.node`` (a wheel without case scripts).
    """
    path = _cache_path()
    if path.exists():
        try:
            return pickle.loads(path.read_bytes())
        except Exception:  # a cache written by another numpy/onnx build: regenerate
            pass
    from onnx.backend.test.case.node import collect_testcases

    np.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = collect_testcases(None)
    cases = sorted(
        (
            NodeCase(t.name, t.model, [(list(i), list(o)) for i, o in t.data_sets], float(t.rtol), float(t.atol))
            for t in raw
            if t.model is not None and not t.name.startswith(NONDETERMINISTIC)
        ),
        key=lambda c: c.name,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(pickle.dumps(cases))
    os.replace(tmp, path)
    return cases
