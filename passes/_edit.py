"""The passes' toolkit for *writing* graphs: initializers, a node builder, names, dead code, copies, folding.

Every pass edits graphs through these helpers, so each concept has one home: an initializer or a ``Constant``
from a numpy array, a node with its output's name, dtype and shape, a fresh name, dead-node removal (onnx_ir's
``RemoveUnusedNodesPass``), a structural copy (``ir.Model.clone()``: new graphs, the same weight tensors), and
onnx shape inference and onnxsim constant folding behind one call each. Reading graphs (constants, labels,
walks, dims, dtypes) is :mod:`onnxdeploy.graph`'s.

Weights are never read or copied here: shape inference and onnxsim see protos whose large initializers are
typed stand-ins (:func:`onnxdeploy.model_io.stand_in_proto`, :func:`onnxdeploy.model_io.proto_round_trip`).
A pass never writes into a tensor it shares with its input (a clone shares all of them): it makes a new tensor
and sets ``value.const_value``.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as ir_common

from onnxdeploy import model_io

__all__ = [
    "add_initializer",
    "clone",
    "constant_node",
    "fold_and_infer",
    "fold_constants",
    "forget_shapes",
    "fresh_name",
    "infer_shapes",
    "make_node",
    "names_in_use",
    "remove_dead_chain",
    "remove_dead_nodes",
    "take_name",
]


def add_initializer(graph: ir.Graph, name: str, array: np.ndarray, *, reuse: bool = False) -> ir.Value:
    """Register an initializer ``name`` holding ``array`` (any shape and dtype) and return its value.

    Args:
        graph: the graph (edited in place).
        name: the initializer's name.
        array: its contents; an ``ml_dtypes`` array (bfloat16, int4) keeps its element type.
        reuse: return an existing initializer of that name instead (a constant shared by several nodes).

    Raises:
        ValueError: ``name`` is already an initializer and ``reuse`` is False (onnx_ir's register refusal).
    """
    if reuse and name in graph.initializers:
        return graph.initializers[name]
    tensor = ir.tensor(array, name=name)
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype))
    value.const_value = tensor
    graph.register_initializer(value)
    return value


def constant_node(name: str, array: np.ndarray) -> ir.Node:
    """A ``Constant`` node (not inserted) whose output ``name`` holds ``array``, typed and shaped.

    For rewrites that must stay inside a node list (opset adapters building a replacement for one node).
    """
    tensor = ir.tensor(array, name=name)
    node = ir.node("Constant", [], attributes={"value": tensor}, name=name)
    node.outputs[0].name = name
    node.outputs[0].dtype = tensor.dtype
    node.outputs[0].shape = ir.Shape(tensor.shape)
    return node


def make_node(
    op: str,
    inputs: Sequence[ir.Value | None],
    *,
    name: str,
    output: str | None = None,
    dtype: ir.DataType | None = None,
    shape: Sequence[int | str | None] | None = None,
    domain: str = "",
    num_outputs: int = 1,
    **attributes: object,
) -> ir.Node:
    """A node (not inserted) named ``name`` whose first output is named, typed and shaped as given.

    Args:
        op: the op type.
        inputs: its inputs (None for an omitted optional input).
        name: the node's name.
        output: the first output's name (default: ``name``).
        dtype: the first output's element type, when known.
        shape: the first output's dims, when known.
        domain: the op's domain (``""`` for ai.onnx, ``com.microsoft`` for ORT's contrib ops).
        num_outputs: how many outputs the node has (the others are named ``{output}:{i}``).
        **attributes: the node's attributes (Python values; onnx_ir converts them).
    """
    node = ir.node(op, list(inputs), attributes or None, domain=domain, name=name, num_outputs=num_outputs)
    stem = output or name
    for i, out in enumerate(node.outputs):
        out.name = stem if i == 0 else f"{stem}:{i}"
    if dtype is not None:
        node.outputs[0].dtype = dtype
    if shape is not None:
        node.outputs[0].shape = ir.Shape(list(shape))
    return node


def names_in_use(graph: ir.Graph) -> set[str]:
    """Every value and node name of the graph's top level (inputs, initializers, node outputs, nodes)."""
    names = {str(v.name) for v in graph.inputs} | set(graph.initializers)
    for node in graph:
        names |= {str(o.name) for o in node.outputs}
        if node.name:
            names.add(node.name)
    return names


def fresh_name(graph: ir.Graph, stem: str, taken: set[str] | None = None) -> str:
    """``stem``, or ``stem_1``, ``stem_2``, … : the first that no value or node of ``graph`` has.

    Args:
        graph: the graph.
        stem: the name wanted.
        taken: names in use (from :func:`names_in_use`), to save the scan when naming many; the result is added.
    """
    used = names_in_use(graph) if taken is None else taken
    name, i = stem, 0
    while name in used:
        i += 1
        name = f"{stem}_{i}"
    used.add(name)
    return name


def take_name(value: ir.Value, name: str) -> None:
    """Give ``value`` the name ``name``, renaming whichever value of its graph held it to ``{name}/replaced``."""
    graph = value.graph
    if graph is not None:
        for v in [*graph.outputs, *(o for node in graph for o in node.outputs)]:
            if v.name == name and v is not value:
                v.name = f"{name}/replaced"
    value.name = name


def remove_dead_nodes(model: ir.Model) -> bool:
    """Remove nodes and initializers nothing reads (onnx_ir's ``RemoveUnusedNodesPass``), in place.

    Graph inputs and outputs are kept. Returns whether anything was removed.
    """
    return ir_common.RemoveUnusedNodesPass()(model).modified


def remove_dead_chain(graph: ir.Graph, value: ir.Value) -> None:
    """Remove ``value``'s producer and its one-input ancestors while nothing else reads them.

    Cheaper than :func:`remove_dead_nodes` when a rewrite orphans one chain of a large graph.
    """
    while value.graph is graph and not value.uses() and not value.is_graph_output():
        node = value.producer()
        if node is None or node.graph is not graph or any(o.uses() or o.is_graph_output() for o in node.outputs):
            return
        inputs = [i for i in node.inputs if i is not None]
        graph.remove(node, safe=True)
        if len(inputs) != 1:
            return
        value = inputs[0]


def clone(model: ir.Model) -> ir.Model:
    """A structural copy of ``model`` (``ir.Model.clone()``): new graphs, nodes, values and types, the same tensors.

    Editing the copy's graph leaves ``model`` untouched; its initializers hold the very tensor objects of
    ``model`` (memory-mapped weights stay mapped, none is copied), so a pass replaces a tensor
    (``value.const_value = new``) and never writes into one. onnx_ir 1.1's cloner hands each new value the
    original's *type object*, and ``Value.dtype = x`` edits that object in place, so a dtype set on the copy
    (the float32 shadow of a bfloat16 probe, a probe output typed int64) changed the original too: every value of
    the copy gets a type of its own here.
    """
    copy = model.clone()
    for graph in copy.graphs():
        values = [*graph.inputs, *graph.initializers.values(), *(o for node in graph for o in node.outputs)]
        for value in values:
            if value.type is not None:
                value.type = _copy.deepcopy(value.type)
    return copy


# --------------------------------------------------------------------------------------- fold and infer


@contextlib.contextmanager
def _quiet_native_output() -> Iterator[None]:
    """Discard C-level writes to fd 1 and fd 2 while onnxsim runs.

    onnxsim prints per-node "failed to run ... skip" notes when a node cannot be folded (the node simply stays
    in the graph, and the static_shapes check reports anything left dynamic); on stdout they would corrupt
    ``--json`` output. Errors still arrive as exceptions.
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


def fold_constants(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constant subgraphs of a (weightless) proto with onnxsim, fusions off; drop onnxsim's metadata.

    Only for use inside :func:`onnxdeploy.model_io.proto_round_trip`: weights arrive as typed graph inputs,
    so onnxsim can neither fold nor copy them.

    Args:
        proto: a model whose graph inputs all have static shapes.

    Returns:
        The folded proto (a new object), computing the same arithmetic with constants precomputed.

    Raises:
        RuntimeError: onnxsim failed (its message names the node).
    """
    import onnxsim  # noqa: PLC0415  (a heavy native import, only for passes that fold)

    with _quiet_native_output():
        folded, _ = onnxsim.simplify(proto, check_n=0, perform_optimization=False)
    # onnxsim records its own bookkeeping (removed nodes, versions) in metadata_props; it is not ours to ship.
    kept = [p for p in folded.metadata_props if not p.key.startswith("onnxsim")]
    del folded.metadata_props[:]
    folded.metadata_props.extend(kept)
    return folded


def forget_shapes(graph: ir.Graph) -> None:
    """Drop intermediate value infos, in place; keep graph outputs' dtype and rank with unknown dims.

    A rewrite that changes input dims calls it so no stale dim survives until :func:`infer_shapes` runs.
    """
    for node in graph:
        for out in node.outputs:
            if out.is_graph_output():
                if out.shape is not None:
                    out.shape = ir.Shape([None] * len(out.shape))
            else:
                out.shape = None
                out.type = None


def _infer_proto(model: ir.Model) -> onnx.ModelProto:
    """Infer with onnx, or with ORT's symbolic shape inference when a node's op has no onnx schema.

    ORT's inference reads every initializer's data (``numpy_helper.to_array``), so there the weights above the
    stand-in threshold are typed graph inputs, not data-less initializers: a real model's 2,304-byte RMSNorm weight
    next to a ``MatMulNBits`` failed with "should be stored in onnxdeploy-stand-in" (the fixtures' are < 1 KiB).
    """
    unknown = any(not onnx.defs.has(node.op_type, node.domain) for node in model.graph)
    if unknown:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference  # noqa: PLC0415

        return SymbolicShapeInference.infer_shapes(model_io.stand_in_proto(model, as_inputs=True), auto_merge=False)
    return onnx.shape_inference.infer_shapes(model_io.stand_in_proto(model), strict_mode=False, data_prop=True)


def infer_shapes(model: ir.Model) -> None:
    """Infer every value's shape and dtype from the graph inputs, in place (onnx, on a stand-in proto).

    Intermediate shapes are forgotten first, so stale symbolic dims (onnxsim keeps some for values it folded
    away) cannot survive. Runs with ``data_prop`` so shapes computed by Shape/Gather/Concat resolve. A graph
    with ops onnx has no schema for (ORT contrib ops: genai's GroupQueryAttention,
    SimplifiedLayerNormalization) is inferred by ONNX Runtime's symbolic shape inference, which knows them.

    Args:
        model: the model (weights never read).
    """
    graph = model.graph
    forget_shapes(graph)
    inferred = _infer_proto(model)
    types = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    for node in graph:
        for out in node.outputs:
            vi = types.get(str(out.name))
            if vi is None or not vi.type.HasField("tensor_type"):
                continue
            tt = vi.type.tensor_type
            if tt.elem_type:
                out.dtype = ir.DataType(tt.elem_type)
            if tt.HasField("shape"):
                out.shape = ir.Shape(
                    [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
                )


def fold_and_infer(model: ir.Model) -> ir.Model:
    """Constant-fold the shape arithmetic of a model with static inputs and re-infer every shape.

    onnxsim runs on a weightless copy (:func:`onnxdeploy.model_io.proto_round_trip`: initializers above 1 KiB
    are typed graph inputs while it runs and come back as the very same tensor objects); dead nodes and unused
    initializers are dropped; then every shape is re-derived (:func:`infer_shapes`).

    Args:
        model: the rewritten model (unchanged).

    Returns:
        A new model sharing ``model``'s weight tensors.

    Raises:
        RuntimeError: onnxsim failed.
    """
    folded = model_io.proto_round_trip(model, fold_constants)
    remove_dead_nodes(folded)
    infer_shapes(folded)
    return folded
