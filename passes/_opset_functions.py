"""Function-op expansion: an op the target opset lacks is replaced by its ONNX function body.

Ops that do not exist at the target opset but have an ONNX function definition (``LayerNormalization`` below
17; ``RMSNormalization``, ``RotaryEmbedding`` and ``Attention`` below 23) are replaced by their function body
(``OpSchema.get_context_dependent_function`` / ``function_body``, ONNX's own definition, built for the node's
attributes and input types). The body is made a small model, raised to the graph's opset by the converter,
its shape arithmetic folded (onnxsim: the node's input shapes are known) and its empty tensors dropped
(:func:`fold_empty_tensors`: the pass-through half of a full rotation is a zero-size ``Split``/``Slice``
output fed to a ``Concat``), then spliced in.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import onnx_ir as ir
from onnx import version_converter

from onnxdeploy.errors import PassError
from onnxdeploy.passes._edit import constant_node
from onnxdeploy.passes._opset_schemas import (
    DEFAULT_DOMAINS,
    hand_over,
    node_since,
    refuse,
    schema_at,
    since_version,
)

__all__ = ["expand_function_ops", "fold_empty_tensors", "function_ops_to_expand"]

Folder = Callable[[onnx.ModelProto], onnx.ModelProto]
"""A weightless constant folder (onnxsim) for a body's shape arithmetic."""


LOWERED_INSTEAD = frozenset({"CastLike"})
"""Function ops the adapters lower directly instead (``CastLike`` → ``Cast``: its body builder needs input shapes)."""


def function_ops_to_expand(model: ir.Model, current: int, target: int) -> list[ir.Node]:
    """Default-domain nodes whose op does not exist at ``target`` but has an ONNX function definition."""
    found = []
    for node in model.graph:
        if node.domain not in DEFAULT_DOMAINS or node.op_type in LOWERED_INSTEAD:
            continue
        schema = schema_at(node.op_type, current)
        if schema is None or schema.since_version <= target:
            continue
        if since_version(node.op_type, target) is None and (
            schema.has_function or schema.has_context_dependent_function
        ):
            found.append(node)
    return found


def _type_proto(value: ir.Value | None) -> onnx.TypeProto:
    if value is None:
        return onnx.TypeProto()
    if value.type is not None and not isinstance(value.type, ir.TensorType):  # sequence, optional: as typed
        proto = onnx.TypeProto()
        proto.CopyFrom(ir.serde.serialize_value(value).type)
        return proto
    dims = None if value.shape is None else [d if isinstance(d, int) else None for d in value.shape]
    return onnx.helper.make_tensor_type_proto(value.dtype.value if value.dtype else 0, dims)


def _function_body(node: ir.Node, current: int) -> onnx.FunctionProto:
    schema = schema_at(node.op_type, current)
    assert schema is not None
    node_proto = ir.serde.serialize_node(node)
    if schema.has_context_dependent_function:
        for value in node.inputs:
            if value is not None and value.dtype is None:
                raise refuse(node, f"the dtype of '{value.name}' is unknown (its function body depends on it)", current)
        types = [_type_proto(v).SerializeToString() for v in node.inputs]
        body = onnx.FunctionProto()
        body.ParseFromString(schema.get_context_dependent_function(node_proto.SerializeToString(), types))
        return body
    return schema.function_body


def _resolve_attribute_refs(body: onnx.FunctionProto, node: ir.Node, schema: onnx.defs.OpSchema) -> None:
    """Replace ``ref_attr_name`` attributes of body nodes by the node's value (or the schema's default)."""
    given = {a.name: a for a in ir.serde.serialize_node(node).attribute}
    for inner in body.node:
        kept = []
        for attr in inner.attribute:
            if not attr.ref_attr_name:
                kept.append(attr)
                continue
            source = given.get(attr.ref_attr_name)
            if source is None and attr.ref_attr_name in schema.attributes:
                default = schema.attributes[attr.ref_attr_name].default_value
                source = default if default.type else None
            if source is not None:
                copy = onnx.AttributeProto()
                copy.CopyFrom(source)
                copy.name = attr.name
                kept.append(copy)
        del inner.attribute[:]
        inner.attribute.extend(kept)


def _body_model(node: ir.Node, current: int, fold: Folder) -> ir.Model:
    """The node's function body as a model at opset ``current``, shape arithmetic folded, empty tensors gone."""
    schema = schema_at(node.op_type, current)
    assert schema is not None
    body = _function_body(node, current)
    _resolve_attribute_refs(body, node, schema)
    inputs = []
    for formal, value in zip(body.input, node.inputs, strict=False):
        if value is not None:
            inputs.append(onnx.helper.make_value_info(formal, _type_proto(value)))
    outputs = [
        onnx.helper.make_value_info(formal, _type_proto(value))
        for formal, value in zip(body.output, node.outputs, strict=False)
        if value is not None and value.name
    ]
    graph = onnx.helper.make_graph(list(body.node), f"{node.op_type}_body", inputs, outputs)
    opsets = [onnx.helper.make_opsetid(o.domain, o.version) for o in body.opset_import]
    mini = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=10)
    # A FunctionProto is no model: graph.default_opset does not read it.
    body_opset = next((o.version for o in body.opset_import if o.domain in DEFAULT_DOMAINS), current)
    if body_opset != current:
        mini = version_converter.convert_version(mini, current)
    mini = onnx.shape_inference.infer_shapes(mini, data_prop=True)
    mini = fold(mini)
    model = ir.serde.deserialize_model(mini)
    fold_empty_tensors(model)
    return model


def _splice(graph: ir.Graph, node: ir.Node, body: ir.Model, prefix: str) -> int:
    """Move ``body``'s nodes in before ``node``, reading the node's inputs, and hand its outputs over; return count.

    The body's nodes are moved, not copied, so subgraphs (``If``/``Loop`` branches of a body) keep reading the
    outer values they capture. Body initializers become ``Constant`` nodes; every moved node and value is named
    ``<prefix>/<body name>``.
    """
    actuals = [v for v in node.inputs if v is not None]
    formals = list(body.graph.inputs)[: len(actuals)]
    inner_nodes = list(body.graph)
    for inner in inner_nodes:
        body.graph.remove(inner)
    for init in list(body.graph.initializers.values()):
        constant = constant_node(f"{prefix}/{init.name}", init.const_value.numpy())
        graph.insert_before(node, constant)
        ir.convenience.replace_all_uses_with(init, constant.outputs[0], replace_graph_outputs=True)
    for formal, actual in zip(formals, actuals, strict=True):
        ir.convenience.replace_all_uses_with(formal, actual, replace_graph_outputs=True)
    for inner in inner_nodes:
        inner.name = f"{prefix}/{inner.name or inner.op_type}"
        for out in inner.outputs:
            out.name = f"{prefix}/{out.name}"
    graph.insert_before(node, inner_nodes)
    outs = [v for v in node.outputs if v is not None and v.name]
    results = list(body.graph.outputs)
    body.graph.outputs.clear()
    for old, new in zip(outs, results, strict=True):
        if new.producer() is None or new in actuals:  # an output that is an input: it needs a node of its own
            ident = ir.node("Identity", [new], name=f"{prefix}/out")
            graph.insert_before(node, ident)
            new = ident.outputs[0]
        hand_over(old, new, "__expanded")
    graph.remove(node, safe=True)
    return len(inner_nodes)


def expand_function_ops(model: ir.Model, nodes: list[ir.Node], current: int, fold: Folder) -> list[str]:
    """Replace each of ``nodes`` by its ONNX function body (see the module docstring), in place.

    Args:
        model: the graph (its values' dtypes and shapes inferred).
        nodes: from :func:`function_ops_to_expand`.
        current: the graph's ``ai.onnx`` opset.
        fold: a weightless constant folder (onnxsim) for the body's shape arithmetic.

    Returns:
        One line per expanded node.

    Raises:
        PassError: a body cannot be built (an input dtype is unknown) or the converter cannot raise it.
    """
    changes = []
    for i, node in enumerate(nodes):
        try:
            body = _body_model(node, current, fold)
        except PassError:
            raise
        except Exception as exc:  # onnx's function builder, converter or onnxsim: name the node
            why = " ".join(str(exc).split())[:200]
            raise refuse(
                node,
                f"{node.op_type} does not exist at the target and ONNX's function definition of it cannot be "
                f"instantiated for this node ({why})",
                node_since(node, current),
            ) from exc
        count = _splice(model.graph, node, body, f"{node.name or node.op_type}#{i}")
        changes.append(f"{node.op_type} '{node.name}' expanded to {count} nodes (ONNX function body)")
    return changes


def _empty(value: ir.Value | None) -> bool:
    return value is not None and value.shape is not None and any(d == 0 for d in value.shape)


def _drop_empty_concat_inputs(graph: ir.Graph) -> int:
    """Drop statically empty inputs of Concat nodes whose output is not empty; return how many."""
    removed = 0
    for node in list(graph):
        if node.op_type == "Concat" and node.domain in DEFAULT_DOMAINS and not _empty(node.outputs[0]):
            keep = [v for v in node.inputs if not _empty(v)]
            if keep and len(keep) < len(node.inputs):
                removed += len(node.inputs) - len(keep)
                for i, v in enumerate(keep):
                    node.replace_input_with(i, v)
                node.resize_inputs(len(keep))
    return removed


def _drop_one_way_splits(graph: ir.Graph) -> int:
    """Replace by an Identity each Split left with one non-empty output (the empty ones unread); return how many."""
    removed = 0
    for node in list(graph):
        if node.op_type == "Split" and node.domain in DEFAULT_DOMAINS:
            full = [v for v in node.outputs if not _empty(v)]
            if len(full) == 1 and all(not v.uses() and not v.is_graph_output() for v in node.outputs if _empty(v)):
                ident = ir.node("Identity", [node.inputs[0]], name=node.name)
                graph.insert_before(node, ident)
                hand_over(full[0], ident.outputs[0], "__split")
                graph.remove(node, safe=True)
                removed += 1
    return removed


def fold_empty_tensors(model: ir.Model) -> int:
    """Drop statically empty inputs of Concat nodes and Split nodes left with one non-empty output; return count.

    An input with a 0 in its (inferred) shape contributes nothing to a Concat whose output is non-empty;
    many runtimes and NPU compilers refuse zero-size tensors. Producers left without users are removed.
    """
    graph = model.graph
    removed = _drop_empty_concat_inputs(graph) + _drop_one_way_splits(graph)
    for node in reversed(list(graph)):
        if all(not v.uses() and not v.is_graph_output() for v in node.outputs):
            graph.remove(node, safe=True)
    return removed
