"""Stand-in protos: a model's ``ModelProto`` with its large initializers stripped to typed stand-ins.

onnx's checker, shape inference, onnxsim and the version converter need a ``ModelProto``; with stand-ins their
cost does not grow with weight bytes.

:func:`stand_in_proto` makes one; :func:`proto_round_trip` runs a proto-to-proto transform on one and brings the
result back as an ``onnx_ir.Model`` with the original weights. :mod:`onnxdeploy.model_io` re-exports both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import onnx
import onnx_ir as ir

from onnxdeploy.inline_weights import STAND_IN_THRESHOLD_BYTES

__all__ = ["proto_round_trip", "stand_in_proto"]


@contextlib.contextmanager
def _stripped(model: ir.Model, threshold: int, as_inputs: bool) -> Iterator[dict[str, ir.TensorProtocol]]:
    """Temporarily strip initializers above ``threshold`` bytes from the main graph; restore on exit.

    ``as_inputs``: stripped weights become typed graph inputs (onnxsim and the version converter then treat
    them as unknown data and never fold or copy them). Otherwise they stay initializers whose data is an
    external reference to nothing (checks see the graph exactly as saved, without the bytes).
    """
    graph = model.graph
    stripped: dict[str, ir.TensorProtocol] = {}
    values = [v for v in graph.initializers.values() if v.const_value is not None and v.const_value.nbytes > threshold]
    n_inputs = len(graph.inputs)
    order = list(graph.initializers.values())
    for value in values:
        tensor = value.const_value
        assert value.name is not None and tensor is not None
        stripped[value.name] = tensor
        value.shape = value.shape or tensor.shape
        value.dtype = value.dtype or tensor.dtype
        if as_inputs:
            graph.initializers.pop(value.name)
            value.const_value = None
            if value not in graph.inputs:
                graph.inputs.append(value)
        else:
            value.const_value = ir.ExternalTensor(
                location="onnxdeploy-stand-in",
                offset=0,
                length=tensor.nbytes,
                dtype=tensor.dtype,
                shape=tensor.shape,
                name=value.name,
            )
    # Small initializers stay in the proto; ones kept in a data file are read (at most `threshold` bytes each)
    # so the proto holds no external reference (with an absolute location) a tool would have to resolve.
    small = [
        v
        for v in graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor) and v.name not in stripped
    ]
    mapped = [v.const_value for v in small]
    for value, tensor in zip(small, mapped, strict=True):
        value.const_value = ir.Tensor(tensor.numpy(), name=value.name)  # type: ignore[union-attr]
    try:
        yield stripped
    finally:
        for value, tensor in zip(small, mapped, strict=True):
            value.const_value = tensor
        for value in values:
            value.const_value = stripped[value.name]  # type: ignore[index]
        if as_inputs:  # re-add in the original order, so serialising the model gives the same bytes as before
            graph.initializers.clear()
            for value in order:
                graph.initializers.add(value)
        kept = list(graph.inputs)[:n_inputs]
        graph.inputs.clear()
        graph.inputs.extend(kept)


def stand_in_proto(
    model: ir.Model, *, threshold: int = STAND_IN_THRESHOLD_BYTES, as_inputs: bool = False
) -> onnx.ModelProto:
    """A ``ModelProto`` of ``model`` whose initializers above ``threshold`` bytes carry no data.

    By default the stripped initializers stay initializers with their dtype and dims and an external-data
    reference to a file that does not exist, so shape inference and graph checks see the graph as it will
    be saved; with ``as_inputs`` they become typed graph inputs instead (what onnx's checker accepts, since
    it looks for external files). Either way the cost does not grow with weight bytes and ``model`` is
    unchanged afterwards.

    Args:
        model: the in-memory model.
        threshold: bytes above which an initializer is stripped.
        as_inputs: strip to typed graph inputs instead of data-less initializers.

    Returns:
        A new ``ModelProto`` (never hand it to ONNX Runtime: the stand-ins have no data).
    """
    with _stripped(model, threshold, as_inputs=as_inputs):
        return ir.serde.serialize_model(model)


def proto_round_trip(
    model: ir.Model,
    transform: Callable[[onnx.ModelProto], onnx.ModelProto],
    *,
    threshold: int = STAND_IN_THRESHOLD_BYTES,
) -> ir.Model:
    """Run a ``ModelProto -> ModelProto`` tool (onnxsim, the version converter) without the weights.

    Initializers above ``threshold`` bytes are handed to ``transform`` as typed graph inputs (so it can
    neither fold nor copy them); in the model it returns they become initializers again, holding the very
    same tensor objects (memory-mapped weights stay mapped, nothing is copied). Smaller initializers kept in
    an external data file are handed over inline (and come back as in-memory copies). ``model`` is unchanged.

    Args:
        model: the in-memory model.
        transform: the tool; it must keep graph input names.
        threshold: bytes above which an initializer is stripped.

    Returns:
        A new ``ir.Model``: ``transform``'s result with the original weights re-attached.

    Raises:
        Whatever ``transform`` raises.
    """
    with _stripped(model, threshold, as_inputs=True) as stripped:
        proto = ir.serde.serialize_model(model)
        weights = dict(stripped)
    result = transform(proto)
    del proto
    out = ir.serde.deserialize_model(result)
    graph = out.graph
    for value in list(graph.inputs):
        if value.name in weights:
            graph.inputs.remove(value)
            value.const_value = weights[value.name]
            graph.initializers.add(value)
    return out
