"""``prefill_logits: last``: a prefill graph's LM head reads only the hidden state of the last real token.

A chunk graph (S > 1 tokens per call) needs the logits of one position only, the chunk's last real token
(trailing padding follows it). :func:`gather_last_position` gathers that position's hidden state before the
LM head, so the head runs once per call and the logits are ``(B, 1, V)``; the new int64 input
``last_token_index`` ``(B,)`` names the position.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxdeploy.errors import PreconditionError
from onnxdeploy.passes._edit import add_initializer, infer_shapes, make_node

__all__ = ["LAST_TOKEN_INDEX", "gather_last_position"]

LAST_TOKEN_INDEX = "last_token_index"
"""Name of the int64 ``(B,)`` input of a ``prefill_logits: last`` graph: the chunk index of the last real token."""

_PREFIX = "onnxdeploy/static_kv/last_position"
_ELEMENTWISE_AFTER_HEAD = ("Identity", "Cast", "Tanh", "Mul", "Div", "Add", "Sub")
"""Ops allowed between the LM head and the logits output (soft-capping, casts): they act per position."""


def gather_last_position(model: ir.Model, logits_name: str, *, batch: int, who: str = "static_kv") -> str:
    """Feed the LM head only the hidden state at ``last_token_index``: logits become ``(B, 1, V)``.

    The LM head is the MatMul whose output reaches the logits output through per-position ops only
    (:data:`_ELEMENTWISE_AFTER_HEAD` with constant other operands). Its hidden-state operand ``(B, S, H)`` is
    replaced by ``GatherElements(hidden, Expand(Reshape(last_token_index, (B, 1, 1)), (B, 1, H)), axis=1)``
    ``(B, 1, H)``; the new input ``last_token_index`` is int64 ``(B,)``. Shapes are re-inferred.

    Args:
        model: a static graph (shapes inferred), edited in place.
        logits_name: its logits output.
        batch: B.
        who: the pass named in errors.

    Returns:
        The LM head node's name, for the report.

    Raises:
        PreconditionError: no MatMul reached that way, or its hidden-state operand is not a static
            ``(B, S, H)``; the message suggests ``prefill_logits: all``.
    """
    graph = model.graph
    head = _lm_head(next(v for v in graph.outputs if v.name == logits_name))
    hidden = head.inputs[0] if head is not None else None
    shape = hidden.shape if hidden is not None else None
    if head is None or hidden is None or shape is None or len(shape) != 3 or not all(isinstance(d, int) for d in shape):
        raise PreconditionError(
            who,
            f"prefill_logits: last needs the LM head as a MatMul on hidden states (B, S, H) whose output reaches "
            f"'{logits_name}' through per-position ops only; found none (hidden operand shape {shape}). "
            "Use prefill_logits: all",
        )
    index = ir.Value(name=LAST_TOKEN_INDEX, shape=ir.Shape([batch]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(index)
    shape3 = add_initializer(graph, f"{_PREFIX}/index_shape", np.array([batch, 1, 1], dtype=np.int64))
    wide = add_initializer(graph, f"{_PREFIX}/gather_shape", np.array([1, 1, shape[2]], dtype=np.int64))
    reshape = make_node("Reshape", [index, shape3], name=f"{_PREFIX}/Reshape", output=f"{_PREFIX}/index_3d")
    expand = make_node("Expand", [reshape.outputs[0], wide], name=f"{_PREFIX}/Expand", output=f"{_PREFIX}/index_wide")
    gather = make_node(
        "GatherElements",
        [hidden, expand.outputs[0]],
        name=f"{_PREFIX}/GatherElements",
        output=f"{_PREFIX}/hidden",
        axis=1,
    )
    graph.insert_before(head, [reshape, expand, gather])
    head.replace_input_with(0, gather.outputs[0])
    infer_shapes(model)
    return str(head.name or "?")


def _lm_head(logits: ir.Value) -> ir.Node | None:
    """The MatMul whose output reaches ``logits`` through per-position ops with constant scalar operands, or None."""
    node = logits.producer()
    while node is not None and node.op_type != "MatMul":
        others = [i for i in node.inputs[1:] if i is not None]
        if node.op_type not in _ELEMENTWISE_AFTER_HEAD or any(
            i.const_value is None or i.const_value.size != 1 for i in others
        ):
            return None
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node
