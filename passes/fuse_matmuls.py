"""``fuse_matmuls``: MatMuls that read the same activation with constant weights become one MatMul and a Split.

A decoder layer multiplies one normalised activation by several weights: q/k/v projections (LLaMA, Mistral,
dynamo exports keep them apart; GPT-2's ``c_attn`` is already one) and the MLP's gate/up. One token per step
makes each of these a matrix-vector product whose time is the bytes of its weight over the memory bandwidth
the kernel reaches, and narrow weights reach less of it, with a dispatch per call. Fused (q/k/v into
``(768, 1280)``, gate/up into ``(768, 4096)``: 4 MatMuls per layer instead of 7), the decode step of
``benchmarks/decode.py``'s 125M LLaMA-shaped model is 4–6 % faster on ONNX Runtime 1.32's CPU EP (one intra-op
thread, no prepacking, 2-core AMD EPYC; its ``unfus bd`` column against ``static bd``). NPU compilers prefer
the wider MatMul for the same reasons.

The rewrite is exact in arithmetic: every output column is the same dot product over K of the same weight
column, and the Split hands each consumer its own columns (the kernel may order its accumulation differently
for the wider shape, so results can differ in the last bits of fp32, as between any two GEMM blockings).

Run it after ``static_kv`` (or anywhere: it needs no contract), before ``quantize_weights`` when one format
for every projection will do (``quantize_weights``' act-order fold of gate/up into down's columns does not see
through the Split: it then uses a Gather on down's input instead, exact but a copy) — or **after** it, when rules
give q/k/v or gate/up their own bits: ``com.microsoft::MatMulNBits`` siblings of the same format (``K``, ``bits``,
``block_size``, ``accuracy_level``, zero points or not, input dtypes; no ``g_idx``, no bias) are fused too, their
``B (N, k_blocks, blob)``, ``scales`` and ``zero_points`` concatenated along ``N`` (each row of all three is one
output column's: ORT's MatMulNBits layout, contrib_ops/cpu/quantization/matmul_nbits.cc), so the quantized
values are unchanged and the same per-projection quantization runs in fewer kernels. At ``accuracy_level`` 4
the kernel quantizes ``A`` once per call instead of once per projection. Measured on SmolLM2-135M's mixed
INT4/INT8 set (README, "Real model"): k/v and gate/up fused per layer (q/k/v in its INT8 layers), the decode
step takes 0.03-0.04x of the float original's step less. DequantizeLinear-fed MatMuls are not fused.
"""

from __future__ import annotations

import fnmatch
import os
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxdeploy.artifacts import ArtifactSet, ScratchWriter
from onnxdeploy.errors import PostconditionError
from onnxdeploy.graph import FLOAT_TYPES, default_opset
from onnxdeploy.mapped_tensor import unmap
from onnxdeploy.passes._catalog import FuseMatMulsConfig
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._edit import add_initializer, clone, make_node
from onnxdeploy.passes._pass_infra import Pass, register_pass
from onnxdeploy.report import PassReport

__all__ = ["FuseMatMulsConfig", "FuseMatMulsPass", "fusable_groups", "nbits_groups"]


@dataclass
class _Group:
    """MatMuls of one graph reading ``source`` with constant ``(K, N_i)`` weights of one dtype, in graph order."""

    source: ir.Value
    nodes: list[ir.Node]

    @property
    def weights(self) -> list[ir.Value]:
        return [node.inputs[1] for node in self.nodes]  # type: ignore[misc]


def _fusable_weight(graph: ir.Graph, node: ir.Node) -> ir.Value | None:
    """``node``'s second input when it is a 2-D float initializer of this graph read by this node alone."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    x, w = node.inputs
    if x is None or w is None or w.const_value is None or graph.initializers.get(w.name or "") is not w:
        return None
    if w.const_value.dtype not in FLOAT_TYPES or len(w.const_value.shape) != 2 or w.is_graph_output():
        return None
    if len(w.uses()) != 1:  # a tied weight would be duplicated: more bytes per step, not fewer
        return None
    return w


def fusable_groups(graph: ir.Graph, exclude: list[str]) -> list[_Group]:
    """Groups of two or more MatMuls that read one activation ``(…, K)`` with their own constant ``(K, N_i)`` weight.

    Args:
        graph: the top-level graph (subgraphs of If/Loop are not searched).
        exclude: fnmatch patterns of node names to leave out.

    Returns:
        The groups, each in graph order, in the order of their first node.
    """
    by_source: dict[tuple[int, int, ir.DataType], list[ir.Node]] = defaultdict(list)
    sources: dict[int, ir.Value] = {}
    for node in graph:
        w = _fusable_weight(graph, node)
        if w is None or any(fnmatch.fnmatchcase(node.name or "", pat) for pat in exclude):
            continue
        x = node.inputs[0]
        assert x is not None and w.const_value is not None
        key = (id(x), int(w.const_value.shape[0]), w.const_value.dtype)
        by_source[key].append(node)
        sources[id(x)] = x
    return [_Group(sources[key[0]], nodes) for key, nodes in by_source.items() if len(nodes) > 1]


_NBITS_ATTRS = ("K", "bits", "block_size", "accuracy_level")


def _nbits_key(graph: ir.Graph, node: ir.Node) -> tuple[object, ...] | None:
    """What a MatMulNBits must share with a sibling to be fused with it, or None when it cannot be.

    ``(activation id, K, bits, block_size, accuracy_level, dtypes of B/scales/zero_points)``; None unless the
    node is ``com.microsoft::MatMulNBits(A, B, scales[, zero_points])`` (no ``g_idx``, no bias) whose B, scales
    and zero points are initializers of this graph read by this node alone.
    """
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return None
    inputs = list(node.inputs)
    while inputs and inputs[-1] is None:
        inputs.pop()
    if not 3 <= len(inputs) <= 4 or inputs[0] is None:
        return None
    consts = inputs[1:]
    for value in consts:
        if value is None or value.const_value is None or graph.initializers.get(value.name or "") is not value:
            return None
        if len(value.uses()) != 1 or value.is_graph_output():
            return None
    attrs = tuple(node.attributes.get_int(name, 0) for name in _NBITS_ATTRS)
    dtypes = tuple(v.const_value.dtype for v in consts)  # type: ignore[union-attr]
    return (id(inputs[0]), *attrs, dtypes)


def nbits_groups(graph: ir.Graph, exclude: list[str]) -> list[_Group]:
    """Groups of two or more MatMulNBits of one format reading one activation (:func:`_nbits_key`).

    Args:
        graph: the top-level graph.
        exclude: fnmatch patterns of node names to leave out.

    Returns:
        The groups, each in graph order, in the order of their first node.
    """
    by_key: dict[tuple[object, ...], list[ir.Node]] = defaultdict(list)
    for node in graph:
        key = _nbits_key(graph, node)
        if key is not None and not any(fnmatch.fnmatchcase(node.name or "", pat) for pat in exclude):
            by_key[key].append(node)
    return [_Group(nodes[0].inputs[0], nodes) for nodes in by_key.values() if len(nodes) > 1]  # type: ignore[arg-type]


def _left_apart(graph: ir.Graph, exclude: list[str]) -> tuple[list[str], list[str], set[str]]:
    """What the report says about MatMuls not fused: ``(tied, quantized, patterns that matched)``.

    Only MatMuls that share their activation with another MatMul (what fusing would have taken) are counted:
    ``tied``, whose float initializer weight is read elsewhere too (fusing would duplicate it); ``quantized``,
    MatMuls fed by a DequantizeLinear and MatMulNBits nodes with no sibling of their format (quantize_weights ran
    first).
    """
    by_input: dict[int, list[tuple[ir.Node, str | None]]] = defaultdict(list)
    matched: set[str] = set()
    fusable = {id(n) for group in nbits_groups(graph, exclude) for n in group.nodes}
    for node in graph:
        name = node.name or ""
        matched |= {pat for pat in exclude if fnmatch.fnmatchcase(name, pat)}
        if node.op_type not in ("MatMul", "MatMulNBits") or not node.inputs or node.inputs[0] is None:
            continue
        kind = None
        w = node.inputs[1] if len(node.inputs) > 1 else None
        producer = w.producer() if w is not None else None
        if id(node) in fusable:
            kind = "fused"
        elif node.op_type == "MatMulNBits" or (producer is not None and producer.op_type == "DequantizeLinear"):
            kind = "quantized"
        elif w is not None and w.const_value is not None and len(w.uses()) > 1:
            kind = "tied"
        elif w is None or (w.const_value is None and producer is None):
            continue  # both operands computed (attention): never a fusion candidate
        by_input[id(node.inputs[0])].append((node, kind))
    tied, quantized = [], []
    for group in by_input.values():
        if len(group) < 2:
            continue
        tied += [n.name or "" for n, kind in group if kind == "tied"]
        quantized += [n.name or "" for n, kind in group if kind == "quantized"]
    return tied, quantized, matched


def _names(nodes: list[ir.Node], index: int) -> tuple[str, str]:
    """A node name and a weight name for the fused MatMul: the nodes' common prefix and their differing parts.

    ``/m/layers.0/self_attn/q_proj/MatMul`` … ``v_proj/MatMul`` give ``/m/layers.0/self_attn/q_proj+k_proj+v_proj``.
    """
    names = [n.name or "" for n in nodes]
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind("/") + 1] if "/" in prefix else ""
    suffix = os.path.commonprefix([n[len(prefix) :][::-1] for n in names])[::-1]
    suffix = suffix[suffix.find("/") :] if "/" in suffix else ""
    parts = [n[len(prefix) : len(n) - len(suffix)] for n in names]
    if not all(names):
        base = f"fuse_matmuls/{index}"
        return base + "/MatMul", base + ".weight"
    if not prefix or not all(parts):
        joined = "+".join(names)
        return joined, joined + ".weight"
    joined = prefix + "+".join(parts)
    return joined + (suffix or "/MatMul"), joined + ".weight"


def _fuse(
    graph: ir.Graph,
    group: _Group,
    index: int,
    fused: dict[tuple[int, ...], ir.TensorProtocol],
    writer: ScratchWriter,
) -> str:
    """Replace ``group`` by one MatMul over the concatenated weights and a Split; return the report line.

    ``fused`` maps the weight tensors' ids to the concatenated tensor, so graphs of a set that share the
    weights share the fused one too (written once).
    """
    weights = group.weights
    tensors = [w.const_value for w in weights]
    widths = [int(t.shape[1]) for t in tensors]  # type: ignore[union-attr]
    node_name, weight_name = _names(group.nodes, index)
    key = tuple(id(t) for t in tensors)
    if key not in fused:
        dtype = tensors[0].dtype  # type: ignore[union-attr]
        array = np.concatenate([t.numpy() for t in tensors], axis=1)  # type: ignore[union-attr]
        fused[key] = writer.tensor(array, dtype, weight_name)
        del array
        for t in tensors:  # unmap the input's pages now, not at the pass's end (they map again if read)
            unmap(t)
    tensor = fused[key]
    w_value = ir.val(weight_name, const_value=tensor)
    graph.register_initializer(w_value)
    x = group.source
    shape = None if x.shape is None else [*list(x.shape)[:-1], sum(widths)]
    matmul = make_node(
        "MatMul", [x, w_value], name=node_name, output=f"{node_name}_output_0", dtype=tensor.dtype, shape=shape
    )
    split = _split_of(graph, matmul, node_name, widths, tensor.dtype)
    old_outputs = [node.outputs[0] for node in group.nodes]
    ir.convenience.replace_nodes_and_values(
        graph, group.nodes[0], group.nodes, [matmul, split], old_outputs, list(split.outputs)
    )
    for w in weights:
        if not w.uses() and w.name in graph.initializers:
            graph.initializers.pop(w.name)
    k = int(tensors[0].shape[0])  # type: ignore[union-attr]
    parts = ", ".join(f"{n.name or '?'} ({k}, {width})" for n, width in zip(group.nodes, widths, strict=True))
    return f"fused {parts} -> '{node_name}' ({k}, {sum(widths)}) + Split"


def _rows(array: np.ndarray, n: int) -> np.ndarray:
    """``array`` as ``(N, -1)``: MatMulNBits' B, scales and zero points hold one row per output column."""
    return array.reshape(n, -1)


def _fuse_nbits(
    graph: ir.Graph,
    group: _Group,
    index: int,
    fused: dict[tuple[int, ...], list[ir.TensorProtocol]],
    writer: ScratchWriter,
) -> str:
    """Replace a MatMulNBits ``group`` by one over B/scales/zero points concatenated along N, and a Split.

    Returns the report line. ``fused``: as in :func:`_fuse`, for the node's two or three tensors.
    """
    nodes = group.nodes
    consts = [[v for v in node.inputs[1:] if v is not None] for node in nodes]
    widths = [node.attributes.get_int("N", 0) for node in nodes]
    node_name, weight_name = _names(nodes, index)
    stem = weight_name.removesuffix(".weight")
    bits = nodes[0].attributes.get_int("bits", 4)
    key = tuple(id(v.const_value) for values in consts for v in values)
    if key not in fused:
        tensors = []
        for i, suffix in enumerate((f"_Q{bits}", "_scales", "_zero_points")[: len(consts[0])]):
            parts = [values[i].const_value for values in consts]
            array = np.concatenate([_rows(t.numpy(), w) for t, w in zip(parts, widths, strict=True)])  # type: ignore[union-attr]
            first = parts[0]
            assert first is not None
            rank = len(first.shape)
            shaped = array.reshape(sum(widths), *[int(d) for d in first.shape[1:]]) if rank > 1 else array.ravel()
            tensors.append(writer.tensor(shaped, first.dtype, stem + suffix))
            del array, shaped
        fused[key] = tensors
    values = []
    for tensor in fused[key]:
        value = ir.val(tensor.name, const_value=tensor)
        graph.register_initializer(value)
        values.append(value)
    x = group.source
    shape = None if x.shape is None else [*list(x.shape)[:-1], sum(widths)]
    attrs = {name: nodes[0].attributes.get_int(name, 0) for name in _NBITS_ATTRS}
    if not attrs["accuracy_level"]:
        del attrs["accuracy_level"]
    dtype = nodes[0].outputs[0].dtype
    mm = make_node(
        "MatMulNBits",
        [x, *values],
        name=node_name,
        output=f"{node_name}_output_0",
        dtype=dtype,
        shape=shape,
        domain="com.microsoft",
        N=sum(widths),
        **attrs,
    )
    split = _split_of(graph, mm, node_name, widths, dtype)
    old_outputs = [node.outputs[0] for node in nodes]
    ir.convenience.replace_nodes_and_values(graph, nodes[0], nodes, [mm, split], old_outputs, list(split.outputs))
    for value in (v for values in consts for v in values):
        if not value.uses() and value.name in graph.initializers:
            graph.initializers.pop(value.name)
    k = attrs["K"]
    parts_line = ", ".join(f"{n.name or '?'} ({k}, {w})" for n, w in zip(nodes, widths, strict=True))
    return f"fused {parts_line} -> '{node_name}' MatMulNBits bits {bits} ({k}, {sum(widths)}) + Split"


def _split_of(graph: ir.Graph, node: ir.Node, node_name: str, widths: list[int], dtype: ir.DataType | None) -> ir.Node:
    """A Split of ``node``'s output into ``widths`` on the last axis (sizes an input from opset 13)."""
    out = node.outputs[0]
    split_name = node_name.rsplit("/", 1)[0] + "/Split" if "/" in node_name else node_name + "_Split"
    if default_opset(graph, 13) >= 13:
        sizes = add_initializer(graph, f"{split_name}.split", np.asarray(widths, np.int64))
        split = make_node("Split", [out, sizes], name=split_name, num_outputs=len(widths), axis=-1)
    else:
        split = make_node("Split", [out], name=split_name, num_outputs=len(widths), axis=-1, split=widths)
    for new in split.outputs:
        new.dtype = dtype
    return split


@register_pass
class FuseMatMulsPass(Pass):
    """Fuse MatMuls that share an input activation and have their own constant weights (q/k/v, gate/up).

    Input: any graph (static or not). Every group of two or more top-level ``MatMul`` nodes whose first input is
    the same value ``X (…, K)`` and whose second input is a 2-D float initializer ``W_i (K, N_i)`` read by that
    node alone (a tied weight is left apart: fusing would duplicate it) becomes ``MatMul(X, concat(W_i, axis=1))
    (…, ΣN_i)`` followed by ``Split(axis=-1, [N_i])`` whose outputs keep the old MatMuls' names and consumers.
    The concatenated weights are written one group at a time to the pass's scratch data file (never all in
    memory); graphs of a set that share the weights share the fused tensor. Graph inputs, outputs and the
    contract are unchanged. The pass is functional: it rewrites structural copies.

    ``com.microsoft::MatMulNBits`` nodes reading one activation with the same ``K``, ``bits``, ``block_size``,
    ``accuracy_level`` and input dtypes (each weight, scale and zero-point initializer read by its node alone; no
    ``g_idx``, no bias) become one MatMulNBits ``(K, ΣN_i)`` over their ``B (N_i, k_blocks, blob)``, ``scales``
    and ``zero_points`` concatenated along N, and a Split: the quantized values and the output columns are
    unchanged (module docstring), so it may run after ``quantize_weights`` with per-projection rules.

    Raises:
        PostconditionError: a fusable group is still there after the rewrite (names the nodes).
    """

    name = "fuse_matmuls"
    config_model = FuseMatMulsConfig
    in_place = False
    keeps_opset = True  # Split takes its sizes as an input from 13, as an attribute before: the graph's own opset

    def call(self, artifacts: ArtifactSet, context: PassContext, report: PassReport) -> tuple[ArtifactSet, bool]:
        """Rewrite a structural copy of every graph; see the class docstring."""
        config: FuseMatMulsConfig = self.config  # type: ignore[assignment]
        writer: ScratchWriter | None = None
        fused: dict[tuple[int, ...], ir.TensorProtocol] = {}
        fused_nbits: dict[tuple[int, ...], list[ir.TensorProtocol]] = {}
        models: list[ir.Model] = []
        modified = False
        for artifact in artifacts.artifacts:
            model = clone(artifact.model)
            groups = fusable_groups(model.graph, config.exclude)
            quantized_groups = nbits_groups(model.graph, config.exclude)
            if (groups or quantized_groups) and writer is None:
                writer = ScratchWriter(context.scratch() / f"fuse_matmuls_{id(self):x}")
            lines = [_fuse(model.graph, g, i, fused, writer) for i, g in enumerate(groups)]  # type: ignore[arg-type]
            lines += [
                _fuse_nbits(model.graph, g, len(groups) + i, fused_nbits, writer)  # type: ignore[arg-type]
                for i, g in enumerate(quantized_groups)
            ]
            modified |= bool(lines)
            prefix = f"{artifact.name}: " if len(artifacts.artifacts) > 1 else ""
            if artifact is artifacts.artifacts[0]:
                report.changes += lines
                tied, quantized, matched = _left_apart(artifact.model.graph, config.exclude)
                if tied:
                    report.changes.append(
                        f"left apart: {len(tied)} MatMul(s) whose weight is read elsewhere too (tied), e.g. {tied[0]}"
                    )
                if quantized:
                    report.warnings.append(
                        f"{len(quantized)} MatMul(s) already quantized (e.g. {quantized[0]}) are not fused (a "
                        "DequantizeLinear weight, or no MatMulNBits sibling of the same bits/block_size): run "
                        "fuse_matmuls before quantize_weights to fuse them in float"
                    )
                report.warnings += [
                    f"exclude pattern '{pat}' matched no node" for pat in config.exclude if pat not in matched
                ]
            elif lines:
                report.changes.append(f"{prefix}{len(lines)} group(s) fused as in {artifacts.artifacts[0].name}")
            if not lines:
                report.changes.append(
                    f"{prefix}no MatMuls sharing an input with their own constant float weights (or MatMulNBits "
                    "of one format)"
                )
            models.append(model)
        return artifacts.with_models(models), modified

    def ensures(self, artifacts: ArtifactSet, context: PassContext) -> None:
        """No fusable group is left.

        Raises:
            PostconditionError: naming the graph and the nodes.
        """
        config: FuseMatMulsConfig = self.config  # type: ignore[assignment]
        for artifact in artifacts.artifacts:
            left = fusable_groups(artifact.model.graph, config.exclude) or nbits_groups(
                artifact.model.graph, config.exclude
            )
            if left:
                names = [n.name for n in left[0].nodes]
                raise PostconditionError(self.name, f"graph '{artifact.name}': MatMuls {names} are still apart")
