"""Checks: inspect a model and report findings (docs/ARCHITECTURE.md, "Core interfaces").

A check never raises for a problem of the model; it returns :class:`~onnxdeploy.report.Finding` objects
with a stable code, a level, the nodes/tensors concerned and a hint. Pipelines name checks by their
registry key (``checks: [checker, static_shapes, topo_order, contract]``)::

    from onnxdeploy.checks import CheckContext, run_checks

    findings = run_checks(model, ["checker", "static_shapes"], CheckContext(model_path=path))
    failed = any(f.level == "error" for f in findings)

Finding codes (stable; a code keeps its meaning once released):

=======  =============  ==============  ========================================================================
Code     Level          Check           Meaning
=======  =============  ==============  ========================================================================
OD001    error          (any)           The check crashed (a bug in onnxdeploy); its results are partial.
OD101    error          checker         ``onnx.checker`` rejected the model (IR / operator schema / data).
OD102    error          checker         Strict shape/type inference in the full check failed at a node.
OD103    warning        checker         External-data files not looked for (no model path or base dir).
OD104    info           checker         Default-domain ops ONNX does not define (ORT contrib ops) were not checked.
OD201    error          static_shapes   A tensor has no type or no shape (unknown rank).
OD202    error          static_shapes   A tensor has a symbolic dim (``dim_param``); names axis and symbol.
OD203    error          static_shapes   A tensor has an unknown dim (no ``dim_value``/``dim_param``).
OD204    warning        static_shapes   A value is a sequence/map/optional (no static tensor shape).
OD205    warning        static_shapes   Shape inference could not type a node output at all.
OD206    warning        static_shapes   ``Shape``/``Range``/``Trilu`` nodes left: shape arithmetic unfolded.
OD207    error          static_shapes   Shape inference could not run; declared shapes were checked.
OD301    error          topo_order      A node reads a tensor produced only by a later node.
OD302    error          topo_order      A node input or graph output is never produced.
OD303    error          topo_order      A tensor has several producers (not SSA).
OD304    warning        topo_order      Nodes without a name.
OD305    warning        topo_order      Several nodes share one name.
OD306    error          topo_order      A graph output is listed more than once.
OD307    error          topo_order      A graph output is also a graph input (a pass-through).
OD308    error          topo_order      A graph input, output or initializer has an empty name.
OD401    error          contract        No decode contract in ``metadata_props``.
OD402    error          contract        The contract is malformed or does not validate.
OD403    error          contract        The contract contradicts itself (layers, cache names, dims, dtype).
OD404    error          contract        A contract tensor is not a graph input/output.
OD405    error          contract        A contract tensor has the wrong dtype.
OD406    error          contract        A contract tensor has the wrong or a non-static shape.
OD407    error          contract        A graph input the contract does not mention.
OD408    warning        contract        A graph output the contract does not mention.
OD409    warning        contract        A contract output has no shape even after inference; not verified.
OD501    error          target_opset    A domain's opset is outside the target's matrix range.
OD502    error          target_opset    An opset domain the target does not list.
OD503    error          target_opset    The IR version is above the target's maximum.
OD504    info           target_opset    No target given; nothing checked.
OD510    error          target_ops      An op the target lacks at its schema version (hint: fixing pass or pin_opset).
OD511    warning        target_ops      An op the target's partial (sourced) list does not name: support unknown.
OD512    error          target_ops      An input/output dtype outside the target's type constraint for the op.
OD513    error          target_ops      An attribute value the target does not accept for the op.
OD514    error          target_ops      A tensor rank above the target's limit for the op.
OD515    warning        target_ops      Accepted, but runs on the host CPU (no accelerator lowering).
OD516    info           target_ops      Constraints the source states in words for an op, with its nodes.
OD517    warning        target_ops      No kernel in a dtype the target emulates (ORT CPU: float16 cast to float32).
OD518    error          target_ops      A shape rule of the op's entry broken (blocked DequantizeLinear, partial block).
OD520    error          target_tensors  A graph input/output with a dynamic dim on a target that requires static shapes.
OD521    error          target_tensors  A zero-size tensor (a dim of 0), on compiler targets.
OD522    error          target_tensors  A tensor or dim above the target's size limit.
OD523    error/warning  target_tensors  Initializers in a dtype the target does not / only partly supports.
OD524    warning        target_tensors  Intermediate tensors with dynamic dims on a static-shape target.
OD525    info           target_tensors  A size limit scoped in words only (``applies_to``, no ops/tensors): not checked.
OD526    error          target_tensors  The graph's weights above the target's ``context_bytes`` (one context).
=======  =============  ==============  ========================================================================

Ranges: OD0xx framework, OD1xx checker, OD2xx static shapes, OD3xx topological order and names,
OD4xx decode contract, OD5xx target matrix (OD50x opsets, OD51x ops, OD52x tensors); later families take OD6xx and up.
Each check class also lists its codes in its ``codes`` attribute.
"""

from onnxdeploy.checks.base import (
    CHECK_REGISTRY,
    CRASH_CODE,
    Check,
    CheckContext,
    check_names,
    get_check,
    register_check,
    run_checks,
)
from onnxdeploy.checks.checker import CheckerCheck
from onnxdeploy.checks.contract import ContractCheck
from onnxdeploy.checks.static_shapes import StaticShapesCheck
from onnxdeploy.checks.target import TargetOpsCheck, TargetOpsetCheck, TargetTensorsCheck
from onnxdeploy.checks.topo_order import TopoOrderCheck

__all__ = [
    "CHECK_REGISTRY",
    "CRASH_CODE",
    "Check",
    "CheckContext",
    "CheckerCheck",
    "ContractCheck",
    "StaticShapesCheck",
    "TargetOpsCheck",
    "TargetOpsetCheck",
    "TargetTensorsCheck",
    "TopoOrderCheck",
    "check_names",
    "get_check",
    "register_check",
    "run_checks",
]
