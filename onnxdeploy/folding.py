"""Constant folding of shape arithmetic once every input dim is static (onnxsim, no fusions)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import onnx
import onnxsim

__all__ = ["fold_constants", "remove_unused_initializers"]


@contextlib.contextmanager
def _quiet_native_output() -> Iterator[None]:
    """Discard C-level writes to fd 1 and fd 2 during folding.

    onnxsim prints per-node "failed to run ... skip" notes when a node cannot be folded (the node simply
    stays in the graph, and the static_shapes check reports anything left dynamic); on stdout they would
    corrupt ``--json`` output. Errors still arrive as exceptions.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in saved:
            os.dup2(devnull, fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def remove_unused_initializers(model: onnx.ModelProto) -> int:
    """Drop dead nodes (outputs nobody reads), then initializers no node reads, in place.

    Returns:
        How many initializers were dropped.
    """
    outputs = {o.name for o in model.graph.output}
    while True:
        read = {i for n in model.graph.node for i in n.input} | outputs
        live = [n for n in model.graph.node if any(o in read for o in n.output if o)]
        if len(live) == len(model.graph.node):
            break
        del model.graph.node[:]
        model.graph.node.extend(live)
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    keep = [t for t in model.graph.initializer if t.name in used]
    dropped = len(model.graph.initializer) - len(keep)
    if dropped:
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
        inputs = [i for i in model.graph.input if i.name in used or i.name not in {t.name for t in keep}]
        del model.graph.input[:]
        model.graph.input.extend(inputs)
    return dropped


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constant subgraphs (Shape/Gather/Range/... on static dims) and drop dead nodes and initializers.

    Uses ``onnxsim.simplify`` with its graph optimizations (fusions) off, so the folded graph computes
    the same arithmetic as the input, only with constants precomputed. onnxsim runs shape inference.

    Args:
        model: a model whose graph inputs all have static shapes.

    Returns:
        The folded model (a new object).

    Raises:
        RuntimeError: onnxsim failed (its message names the node).
    """
    with _quiet_native_output():
        folded, _ = onnxsim.simplify(model, check_n=0, perform_optimization=False)
    remove_unused_initializers(folded)
    # onnxsim records its own bookkeeping (removed nodes, versions) in metadata_props; it is not ours to ship.
    kept = [p for p in folded.metadata_props if not p.key.startswith("onnxsim")]
    del folded.metadata_props[:]
    folded.metadata_props.extend(kept)
    return folded
