"""Session probes the ORT CPU generator adds to the kernel registry: attribute values and function opset ranges.

The kernel registry says which op versions and element types ORT's CPU EP has a kernel for; it does not say

- which attribute values a kernel refuses when it is created: ``GRU``/``LSTM``/``RNN`` with ``layout=1``
  ("Batchwise recurrent operations (layout == 1) are not supported", onnxruntime/core/providers/cpu/rnn/
  deep_cpu_gru.h, lstm_base.h, rnn.h), ``StringNormalizer`` with ``case_change_action`` LOWER/UPPER where the
  host lacks the ``en_US.UTF-8`` locale ORT constructs (string_normalizer.cc: "Failed to construct locale");
  :func:`probe_attributes` opens one one-node session per candidate value of :data:`ATTRIBUTE_PROBES`;
- up to which opset an ONNX function ORT inlines still opens: the body is expanded at the model's opset, so a
  body op whose newer version ORT lacks refuses the node at later opsets (``Swish``-24 opens at opset 24 and is
  refused at 25..28: "Could not find an implementation for Swish(24)", onnxruntime 1.32); :func:`opset_reach`
  opens the one-node probe at each later opset.

- that ``ConvInteger``'s kernel runs a per-tensor ``w_zero_point`` only ("Non per-tensor quantization is not
  supported now", onnxruntime/core/providers/cpu/quantization/conv_integer.cc): :func:`probe_zero_points` runs
  a session with a per-channel one.

All are facts of the installed wheel (and, for locales, of the host), recorded with the source
``ort-attribute-probe`` / ``ort-function-probe``.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from onnxdeploy.matrices._probe_models import PLANS, probe_model

__all__ = ["ATTRIBUTE_PROBES", "opset_reach", "probe_attributes", "probe_zero_points"]

ATTRIBUTE_PROBES: dict[str, tuple[dict, str, list]] = {
    "GRU": ({"hidden_size": 2}, "layout", [0, 1]),
    "LSTM": ({"hidden_size": 2}, "layout", [0, 1]),
    "RNN": ({"hidden_size": 2}, "layout", [0, 1]),
    "StringNormalizer": ({}, "case_change_action", ["NONE", "LOWER", "UPPER"]),
}
"""Op → (attributes every probe sets, the attribute probed, its candidate values)."""


def _base_types(schema: onnx.defs.OpSchema) -> dict[str, str]:
    return {
        tc.type_param_str: "tensor(float)" if "tensor(float)" in tc.allowed_type_strs else tc.allowed_type_strs[0]
        for tc in schema.type_constraints
    }


def probe_attributes(op: str, since: int, opens: Callable[[onnx.ModelProto], bool]) -> dict[str, list] | None:
    """``{attribute: [values a session opens with]}`` for ``op`` at schema version ``since``; None: no constraint.

    None as well when the op is not in :data:`ATTRIBUTE_PROBES`, its schema lacks the attribute, or no plan of
    the probe opens with the base attributes (nothing can be said).
    """
    probe = ATTRIBUTE_PROBES.get(op)
    if probe is None:
        return None
    base, name, values = probe
    try:
        schema = onnx.defs.get_schema(op, since, "")
    except onnx.defs.SchemaError:
        return None
    if schema.since_version != since or name not in schema.attributes:
        return None
    types = _base_types(schema)
    plan = next((p for p in PLANS if (m := probe_model(schema, types, p, base)) is not None and opens(m)), None)
    if plan is None:
        return None
    taken = [v for v in values if (m := probe_model(schema, types, plan, {**base, name: v})) is not None and opens(m)]
    return None if taken == values else {name: taken}


def opset_reach(
    schema: onnx.defs.OpSchema, types: dict[str, list[str]], max_opset: int, opens: Callable[[onnx.ModelProto], bool]
) -> int | None:
    """The highest opset up to ``max_opset`` at which a one-node probe of ``schema`` still opens; None: all do.

    The probe binds each parameter to float, else to the first of the types it took (``types``: names as the
    matrix writes them), with the first plan that opens at the schema's own version; later opsets are tried in
    order until one is refused (or the op's next schema version begins).
    """
    first = {p: "float" if "float" in ts else ts[0] for p, ts in types.items()}
    chosen = {p: t if t.startswith(("seq(", "optional(")) else f"tensor({t})" for p, t in first.items()}
    model = next((m for p in PLANS if (m := probe_model(schema, chosen, p)) is not None and opens(m)), None)
    if model is None:
        return None
    for opset in range(schema.since_version + 1, max_opset + 1):
        try:
            if onnx.defs.get_schema(schema.name, opset, "").since_version != schema.since_version:
                return None  # a newer schema version takes over: its own entry decides
        except onnx.defs.SchemaError:
            return None
        trial = onnx.ModelProto()
        trial.CopyFrom(model)
        for o in trial.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = opset
        if not opens(trial):
            return opset - 1
    return None


def _conv_integer(since: int, channels: int) -> onnx.ModelProto:
    """ConvInteger (1, 1, 3, 3) uint8 by a (2, 1, 2, 2) uint8 weight, ``w_zero_point`` of ``channels`` elements."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 1, 3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, None)
    w = helper.make_tensor("w", TensorProto.UINT8, [2, 1, 2, 2], [1] * 8)
    xz = helper.make_tensor("xz", TensorProto.UINT8, [], [0])
    wz = helper.make_tensor("wz", TensorProto.UINT8, [channels] if channels > 1 else [], [0] * channels)
    node = helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["y"])
    graph = helper.make_graph([node], "probe", [x], [y], initializer=[w, xz, wz])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", since)], ir_version=8)


def probe_zero_points(op: str, since: int, runs: Callable[[onnx.ModelProto, dict], bool]) -> bool:
    """Whether ``op``'s kernel at ``since`` runs a per-tensor zero point but not a per-channel one (ConvInteger only).

    ``runs(model, feeds)``: whether a session opens and one run succeeds.
    """
    if op != "ConvInteger":
        return False
    import numpy as np

    feeds = {"x": np.ones((1, 1, 3, 3), np.uint8)}
    return runs(_conv_integer(since, 1), feeds) and not runs(_conv_integer(since, 2), feeds)
