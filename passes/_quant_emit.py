"""A quantized weight put into a graph: its initializers, a DequantizeLinear, or a MatMulNBits in place of the op.

``qdq`` (and every embedding table): ``DequantizeLinear(q, scale[, zero_point])`` feeds the original op, per
output channel (``axis``; INT8) or per block along K (``axis`` and ``block_size``; INT4, ai.onnx 21). A weight
several consumers read is dequantized once per graph and each layout it is read in (a ``Transpose`` of the
dequantized weight for the other). ``matmulnbits``: ``com.microsoft::MatMulNBits(A, B, scales[, zero_points])``
replaces the MatMul (a Gemm's bias follows as an ``Add``), keeping its output's name, type and shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnxdeploy.passes._edit import fresh_name, make_node
from onnxdeploy.passes._quant_targets import Target
from onnxdeploy.passes._quant_tensors import Quantized

__all__ = ["Values", "graph_values", "rewire"]


@dataclass
class Values:
    """A quantized weight's values in one graph: MatMulNBits inputs, or the dequantized weight per layout."""

    nbits: list[ir.Value] | None = None
    kn: ir.Value | None = None
    nk: ir.Value | None = None


def graph_values(graph: ir.Graph, q: Quantized, dtype: ir.DataType, taken: set[str]) -> Values:
    """Initializers for ``q``'s tensors in ``graph`` (and its DequantizeLinear, for the ``dq`` form).

    Args:
        graph: the graph (edited in place; the DequantizeLinear goes first).
        q: the written tensors (shared with the other graphs of the set, never renamed).
        dtype: the element type the consumers read (the dequantized weight's).
        taken: the graph's names in use, extended.
    """
    inits = []
    for tensor in q.tensors:
        value = ir.val(fresh_name(graph, str(tensor.name), taken), const_value=tensor)
        graph.register_initializer(value)
        inits.append(value)
    if q.form == "nbits":
        return Values(nbits=inits)
    per_channel = len(q.tensors[1].shape) == 1
    attrs: dict = {"axis": (0 if q.nk else 1) if per_channel else (1 if q.nk else 0)}
    if not per_channel:
        attrs["block_size"] = q.block_size
    base = str(q.tensors[0].name)
    node = make_node(
        "DequantizeLinear",
        inits,
        name=fresh_name(graph, f"{base}_DequantizeLinear", taken),
        output=fresh_name(graph, f"{base}_dequantized", taken),
        dtype=dtype,
        shape=[q.n, q.k] if q.nk else [q.k, q.n],
        **attrs,
    )
    if len(graph):
        graph.insert_before(graph.node(0), node)
    else:
        graph.append(node)
    return Values(nk=node.outputs[0]) if q.nk else Values(kn=node.outputs[0])


def _replace_by_matmulnbits(
    graph: ir.Graph, t: Target, q: Quantized, inputs: list[ir.Value], taken: set[str], accuracy_level: int
) -> None:
    """Replace ``t``'s MatMul/Gemm by MatMulNBits (and an ``Add`` of a Gemm's bias) with its output's name."""
    node = t.node
    old = node.outputs[0]
    name, shape, typ = old.name, old.shape, old.type
    bias = node.inputs[2] if t.kind == "gemm" and len(node.inputs) > 2 else None
    mm_name = fresh_name(graph, f"{node.name or 'MatMul'}_Q{q.bits}", taken)
    add_name = fresh_name(graph, f"{node.name}_bias", taken) if bias is not None else ""
    attrs: dict = {"K": q.k, "N": q.n, "bits": q.bits, "block_size": q.block_size}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    mm = make_node("MatMulNBits", [node.inputs[0], *inputs], name=mm_name, domain="com.microsoft", **attrs)
    new_nodes = [mm]
    result = mm.outputs[0]
    if bias is not None:
        mm.outputs[0].name = fresh_name(graph, f"{name}_Q{q.bits}", taken)
        new_nodes.append(make_node("Add", [result, bias], name=add_name))
        result = new_nodes[-1].outputs[0]
    graph.insert_before(node, new_nodes)
    old.replace_all_uses_with(result, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    result.name, result.shape, result.type = name, shape, typ


def _dequantized_for(graph: ir.Graph, nk: bool, values: Values, taken: set[str]) -> ir.Value:
    """The dequantized weight in the layout a consumer reads; the other layout's is transposed (once per graph)."""
    value = values.nk if nk else values.kn
    if value is not None:
        return value
    src = values.kn if nk else values.nk
    assert src is not None and src.producer() is not None
    name = fresh_name(graph, f"{src.name}_T", taken)
    output = fresh_name(graph, f"{src.name}_T", taken)
    tr = make_node("Transpose", [src], name=name, output=output, dtype=src.dtype, perm=[1, 0])
    graph.insert_after(src.producer(), tr)
    if nk:
        values.nk = tr.outputs[0]
    else:
        values.kn = tr.outputs[0]
    return tr.outputs[0]


def rewire(graph: ir.Graph, t: Target, q: Quantized, values: Values, taken: set[str], accuracy_level: int) -> None:
    """Point ``t``'s node at the quantized weight, or replace it by MatMulNBits.

    Args:
        graph: the graph (edited in place).
        t: the target.
        q: its quantized tensors.
        values: their values in ``graph`` (:func:`graph_values`), extended by a transposed layout when needed.
        taken: the graph's names in use, extended.
        accuracy_level: MatMulNBits' ``accuracy_level`` (0: not written).
    """
    if values.nbits is not None:
        _replace_by_matmulnbits(graph, t, q, values.nbits, taken, accuracy_level)
    else:
        t.node.replace_input_with(t.input_index, _dequantized_for(graph, t.nk, values, taken))
