"""Graph helpers shared by the checks: walking subgraphs, reading types, and copying a model cheaply.

Private to :mod:`onnxdeploy.checks`. The "skeleton" copy replaces large initializer payloads with
external-data stubs so that shape inference and the path-based checker can run on models whose
protobuf exceeds the 2 GiB limit (``onnx.checker.MAXIMUM_PROTOBUF``) without copying the weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import onnx
from google.protobuf.message import EncodeError
from onnx import AttributeProto, TensorProto

from onnxdeploy.model_io import PROTOBUF_LIMIT_BYTES
from onnxdeploy.report import Finding

__all__ = [
    "MAX_PROTOBUF_BYTES",
    "STUB_MIN_BYTES",
    "ValueType",
    "group_per_op",
    "infer",
    "iter_graphs",
    "iter_tensors",
    "list_names",
    "node_ref",
    "serialized_size",
    "skeleton",
    "subgraphs",
    "value_type",
]

MAX_PROTOBUF_BYTES = PROTOBUF_LIMIT_BYTES
# Shape-carrying constants (Reshape targets, Slice bounds) are a few bytes; weights are far above this.
STUB_MIN_BYTES = 64 * 1024


def list_names(names: list[str], limit: int = 10) -> str:
    """The first ``limit`` names joined by commas, then how many more (a finding's message stays one line)."""
    more = f", … ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


_PLURAL = ((" is not supported", " are not supported"), (" has no ", " have no "), (" does not name", " do not name"))


def group_per_op(findings: list[Finding]) -> list[Finding]:
    """One finding per op type for per-node findings that repeat the same message, hint, rule and source.

    A per-node finding names one node (``nodes == [ref]``) and its message starts ``node <ref> (<Op>)``; those
    equal once the ref is taken out merge into one whose message starts ``<n> <Op> node(s) (<a few names>)`` and
    whose ``nodes`` lists them all, as ``OD516`` groups its nodes (a user reads the ~900-character source and
    fix once, not 60 times). Others, and groups of one, are kept as they are, in first-seen order.
    """
    groups: dict[tuple, list[Finding]] = {}
    for f in findings:
        ref = f.nodes[0] if len(f.nodes) == 1 else None
        head = f"node {ref} (" if ref is not None else None
        if head is None or not f.message.startswith(head):
            groups[(id(f),)] = [f]
            continue
        key = (f.code, f.level, f.check, "node \0 (" + f.message[len(head) :], f.hint, f.rule, f.source)
        groups.setdefault(key, []).append(f)
    out = []
    for members in groups.values():
        first = members[0]
        if len(members) == 1:
            out.append(first)
            continue
        refs = [m.nodes[0] for m in members]
        rest = first.message[len(f"node {refs[0]} (") :]
        match = re.match(r"([^)]*)\)(.*)", rest, re.DOTALL)
        op, tail = (match.group(1), match.group(2)) if match else ("", rest)
        for one, many in _PLURAL:
            tail = tail.replace(one, many, 1) if tail.startswith(one) else tail
        message = f"{len(refs)} {op} node(s) ({list_names(refs, 5)}){tail}"
        out.append(first.model_copy(update={"message": message, "nodes": refs}))
    return out


def node_ref(node: onnx.NodeProto, index: int) -> str:
    """Name a node for a finding: its name, or ``<OpType #index>`` when it has none."""
    return node.name or f"<{node.op_type} #{index}>"


def subgraphs(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """Yield ``(attribute name, graph)`` for each graph attribute of ``node`` (If/Loop/Scan bodies)."""
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            yield attr.name, attr.g
        elif attr.type == AttributeProto.GRAPHS:
            for i, graph in enumerate(attr.graphs):
                yield f"{attr.name}[{i}]", graph


def iter_graphs(graph: onnx.GraphProto, scope: str = "") -> Iterator[tuple[onnx.GraphProto, str]]:
    """Yield ``graph`` and every nested subgraph, depth first, with a scope label.

    The main graph has scope ``""``; a Loop body of node ``loop0`` has scope ``"loop0/body"``.
    """
    yield graph, scope
    for index, node in enumerate(graph.node):
        for attr_name, sub in subgraphs(node):
            yield from iter_graphs(sub, f"{scope}{node_ref(node, index)}/{attr_name}/")


def iter_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """Yield every TensorProto of a graph and its subgraphs: initializers and tensor attributes."""
    for sub, _ in iter_graphs(graph):
        yield from sub.initializer
        for sparse in sub.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in sub.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == AttributeProto.TENSORS:
                    yield from attr.tensors


@dataclass(frozen=True)
class ValueType:
    """What a ``TypeProto`` says about a value.

    Attributes:
        kind: ``tensor``, ``sparse_tensor``, ``sequence``, ``map``, ``optional`` or ``missing``
            (no type set at all).
        elem_type: the ``TensorProto.DataType`` of a (sparse) tensor, ``0`` when unknown.
        dims: per axis an ``int`` (dim_value), a ``str`` (dim_param) or ``None`` (unknown);
            ``None`` as a whole when the rank is unknown (no ``shape`` field).
    """

    kind: str
    elem_type: int = 0
    dims: tuple[int | str | None, ...] | None = None

    @property
    def is_static(self) -> bool:
        """True for a (sparse) tensor of known element type whose every dim is a non-negative int."""
        return (
            self.kind in ("tensor", "sparse_tensor")
            and self.elem_type != 0
            and self.dims is not None
            and all(isinstance(d, int) and d >= 0 for d in self.dims)
        )


def value_type(type_proto: onnx.TypeProto) -> ValueType:
    """Read a ``TypeProto`` (ONNX IR spec, "Type System") into a :class:`ValueType`."""
    which = type_proto.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        tensor = getattr(type_proto, which)
        kind = "tensor" if which == "tensor_type" else "sparse_tensor"
        if not tensor.HasField("shape"):
            return ValueType(kind, tensor.elem_type, None)
        dims: list[int | str | None] = []
        for dim in tensor.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(dim.dim_value)
            elif dim.HasField("dim_param") and dim.dim_param:
                dims.append(dim.dim_param)
            else:
                dims.append(None)
        return ValueType(kind, tensor.elem_type, tuple(dims))
    if which == "sequence_type":
        return ValueType("sequence")
    if which == "map_type":
        return ValueType("map")
    if which == "optional_type":
        return ValueType("optional")
    return ValueType("missing")


def serialized_size(model: onnx.ModelProto) -> int | None:
    """Return the protobuf size of ``model`` in bytes, or ``None`` when it cannot be serialized (> 2 GiB)."""
    try:
        size = model.ByteSize()
    except (EncodeError, ValueError, OverflowError):
        return None
    return size if size <= MAX_PROTOBUF_BYTES else None


def _copy_fields(source, target, skip: tuple[str, ...] = ()) -> None:
    for field, value in source.ListFields():
        if field.name in skip:
            continue
        repeated = getattr(field, "is_repeated", None)
        if repeated is None:
            repeated = field.label == field.LABEL_REPEATED
        if repeated:
            getattr(target, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def skeleton(
    model: onnx.ModelProto, *, stub_location: str = "__onnxdeploy_stub__.data", min_bytes: int = STUB_MIN_BYTES
) -> tuple[onnx.ModelProto, list[TensorProto]]:
    """Copy ``model`` with each large main-graph initializer replaced by an external-data stub.

    The stub keeps name, data type, dims and doc string, and points at ``stub_location`` with
    ``length`` equal to the original ``raw_data`` size. Shape inference never reads external data
    and the ONNX checker only checks that the file exists, so the copy answers both without
    copying the weights. The input model is not modified.

    Args:
        model: the model to copy.
        stub_location: the external-data ``location`` written into the stubs.
        min_bytes: initializers whose ``raw_data`` has at least this many bytes are stubbed.

    Returns:
        The copy, and the original initializers that were stubbed.
    """
    copy = onnx.ModelProto()
    _copy_fields(model, copy, skip=("graph",))
    _copy_fields(model.graph, copy.graph, skip=("initializer",))
    stubbed: list[TensorProto] = []
    for tensor in model.graph.initializer:
        if len(tensor.raw_data) >= min_bytes:
            stub = copy.graph.initializer.add()
            stub.name = tensor.name
            stub.data_type = tensor.data_type
            stub.dims.extend(tensor.dims)
            stub.doc_string = tensor.doc_string
            stub.data_location = TensorProto.EXTERNAL
            for key, value in (("location", stub_location), ("offset", "0"), ("length", str(len(tensor.raw_data)))):
                stub.external_data.add(key=key, value=value)
            stubbed.append(tensor)
        else:
            copy.graph.initializer.add().CopyFrom(tensor)
    return copy, stubbed


def infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """Run ONNX shape inference with data propagation on a skeleton of ``model``.

    Uses ``onnx.shape_inference.infer_shapes(..., strict_mode=False, data_prop=True)``; node errors are
    left out rather than raised (non-strict). Works for models above 2 GiB because weights are stubbed.

    Returns:
        The inferred skeleton; read its ``graph.input/output/value_info``, not its weights.

    Raises:
        Exception: whatever ``infer_shapes`` raises when inference cannot run at all.
    """
    copy, _ = skeleton(model)
    return onnx.shape_inference.infer_shapes(copy, check_type=False, strict_mode=False, data_prop=True)
