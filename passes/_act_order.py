"""Act-order folded into the graph: each activation's input-channel permutation made exact, no ``g_idx`` left.

``K`` of the weights reading one activation ``(..., K)`` is permuted by decreasing calibration importance
``diag(X^T X)`` (:func:`~onnxdeploy.passes._weight_quant.act_order_permutation`), so each group holds channels of
similar importance. The activation must then arrive permuted, by the first of:

* **producers**: the activation is an elementwise function of quantized MatMul outputs alone (the MLP's
  gate/up with down_proj reading it): their output channels (and the ``(K,)`` constants of the region) are
  permuted instead (:func:`_producer_region`);
* **value**: o_proj's input, folded into V's output channels within each KV head where V's channels never
  leave the graph (:mod:`onnxdeploy.passes._value_fold`; with a KV cache they do, so not there);
* **gather**: a ``Gather`` on the activation, shared by every weight reading it.

``details.act_order`` lists each activation's fold and, for o_proj kept as a Gather, the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxdeploy.graph import const_array, const_tensor
from onnxdeploy.passes._edit import add_initializer, fresh_name, make_node
from onnxdeploy.passes._quant_targets import Target
from onnxdeploy.passes._value_fold import PROBES, ValueFold, concrete_dims, plan_value_fold
from onnxdeploy.passes._weight_quant import act_order_permutation
from onnxdeploy.report import PassReport

__all__ = ["Fold", "apply_fold", "plan_folds"]

ELEMENTWISE = {
    "Mul",
    "Add",
    "Sub",
    "Div",
    "Sigmoid",
    "Tanh",
    "Relu",
    "Erf",
    "Gelu",
    "FastGelu",
    "Softplus",
    "Neg",
    "Cast",
    "Identity",
    "Pow",
    "Sqrt",
    "Exp",
}
"""Ops through which a per-channel permutation of the last axis commutes (with scalar/other permuted operands)."""


@dataclass
class Fold:
    """How one activation's input-channel permutation reaches the graph.

    Attributes:
        activation: the activation ``(..., K)`` its readers' weights are permuted for.
        perm: int64 ``(K,)``, ``perm[j]`` the original channel at position ``j``.
        producers: MatMul targets whose output channels are permuted instead (with the elementwise region
            between them and the activation, or by ``producer_perm`` when it differs: V within each head for
            o_proj); empty means a Gather on the activation.
        region: the elementwise nodes between the producers and the activation.
        bias_constants: ``(node, input index)`` of the ``(K,)`` constants permuted with the channels.
        producer_perm: the producers' output permutation when it is not ``perm``.
        how: what the report says.
    """

    activation: ir.Value
    perm: np.ndarray
    producers: list[Target] = field(default_factory=list)
    region: list[ir.Node] = field(default_factory=list)
    bias_constants: list[tuple[ir.Node, int]] = field(default_factory=list)
    producer_perm: np.ndarray | None = None
    how: str = "by a Gather on the activation"

    @property
    def out_perm(self) -> np.ndarray:
        """The permutation of the producers' output channels."""
        return self.perm if self.producer_perm is None else self.producer_perm


def _split_reason(activation: ir.Value) -> str | None:
    """Why the producer fold cannot take ``activation`` when its elementwise region starts at a ``Split`` of a MatMul.

    ``fuse_matmuls`` leaves gate/up as one MatMul + Split: the permutation would have to go into two column
    ranges of one weight, which the fold does not do. Returns the report's reason, or None.
    """
    todo, seen = [activation], set()
    while todo:
        value = todo.pop()
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "Split" and node.inputs and node.inputs[0] is not None:
            source = node.inputs[0].producer()
            if source is not None and source.op_type in ("MatMul", "MatMulNBits"):
                return (
                    f"its producers are one fused MatMul '{source.name}' + Split (fuse_matmuls); to fold into "
                    "them, leave them apart (fuse_matmuls exclude)"
                )
        if node.op_type in ELEMENTWISE:
            todo.extend(v for v in node.inputs if v is not None)
    return None


def _region_closed(nodes: list[ir.Node], inside: set[int], activation: ir.Value, readers: set[int]) -> bool:
    """Every value the region makes is read only inside it (``activation`` also by ``readers``), none is an output."""
    for node in nodes:
        out = node.outputs[0]
        if out.is_graph_output():
            return False
        for user, _ in out.uses():
            if id(user) not in inside and not (out is activation and id(user) in readers):
                return False
    return True


def _producer_region(
    activation: ir.Value, readers: set[int], by_node: dict[int, Target], k: int
) -> tuple[list[Target], list[ir.Node], list[tuple[ir.Node, int]]] | None:
    """The MatMul targets whose output channels can carry a permutation of ``activation``'s last axis, or None.

    ``activation`` must be an elementwise function (:data:`ELEMENTWISE`) of MatMul outputs ``(..., K)`` with
    constant weights (and scalars or ``(K,)`` constants); every value of that region is read only inside it
    (or, for ``activation``, by the nodes in ``readers``), so permuting the producers' columns permutes
    ``activation`` and nothing else.

    Returns:
        ``(producers, region, constants)``: the MatMul targets, the elementwise nodes and the ``(node, input
        index)`` of the ``(K,)`` constants; None when the activation is not such a function.
    """
    producers: list[Target] = []
    region: list[ir.Node] = []
    consts: list[tuple[ir.Node, int]] = []
    todo = [activation]
    seen: set[int] = set()
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        node = value.producer()
        if node is None:
            return None
        target = by_node.get(id(node))
        if target is not None and target.kind == "matmul":
            if target.node.inputs[0] is None:
                return None
            producers.append(target)
            continue
        if node.op_type not in ELEMENTWISE or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            return None
        region.append(node)
        for i, inp in enumerate(node.inputs):
            tensor = None if inp is None else const_tensor(inp)
            if tensor is None:
                if inp is not None:
                    todo.append(inp)
                continue
            size = int(np.prod(tensor.shape)) if tensor.shape else 1
            if size == 1:
                continue
            if size != k or tensor.shape[-1] != k:
                return None
            consts.append((node, i))
    nodes = [*region, *(p.node for p in producers)]
    if not producers or not _region_closed(nodes, {id(n) for n in nodes}, activation, readers):
        return None
    return producers, region, consts


def _plan_fold(
    group: list[Target],
    importance: np.ndarray,
    by_node: dict[int, Target],
    claimed: set[int],
    dims_of: Callable[[int], dict],
) -> tuple[Fold, str, str | None]:
    """The fold of one activation read by ``group``: ``(fold, kind, reason)``, kind producers / value / gather.

    A producer may read a permuted activation itself (its rows and columns are permuted then); one already
    carrying another fold's permutation (``claimed``) may not. ``reason``: why o_proj's permutation stays a
    Gather, when it does.
    """
    act = group[0].activation
    assert act is not None
    fold = Fold(act, act_order_permutation(importance))
    readers = {id(t.node) for t in group}
    found = _producer_region(act, readers, by_node, len(importance))
    if found is not None and not any(id(p.node) in claimed for p in found[0]):
        fold.producers, fold.region, fold.bias_constants = found
        fold.how = f"folded into the output channels of {', '.join(str(p.node.name) for p in found[0])}"
        return fold, "producers", None

    def is_producer(node: ir.Node) -> bool:
        target = by_node.get(id(node))
        return target is not None and target.kind == "matmul" and id(node) not in claimed

    plan = plan_value_fold(act, readers, is_producer, dims_of)
    if isinstance(plan, ValueFold) and plan.head_dim * len(plan.kv_of_head) == len(importance):
        fold.producer_perm, fold.perm = plan.permutations(importance, act_order_permutation)
        fold.producers, fold.bias_constants = [by_node[id(plan.producer)]], plan.constants
        fold.how = (
            f"folded into the output channels of {plan.producer.name} within each of its {plan.n_kv} KV "
            f"heads (head dim {plan.head_dim}, {len(plan.kv_of_head)} query heads)"
        )
        return fold, "value", None
    reason = plan if isinstance(plan, str) else _split_reason(act)
    if isinstance(plan, str):
        fold.how += f" ({plan}; V's channels keep their order)"
    elif reason is not None:
        fold.how += f" ({reason})"
    return fold, "gather", reason


def plan_folds(
    model: ir.Model,
    graph_name: str,
    by_activation: dict[int, list[Target]],
    by_node: dict[int, Target],
    stats: dict[str, np.ndarray],
    report: PassReport,
) -> list[Fold]:
    """One act-order permutation per activation, folded into producers where the graph allows it.

    Args:
        model: the graph's model (read, not edited).
        graph_name: the artifact's name, for ``details.act_order``.
        by_activation: the targets reading each activation (by ``id`` of the activation), in graph order.
        by_node: every target by ``id`` of its node.
        stats: ``X^T X`` ``(K, K)`` or its diagonal ``(K,)`` float64 by activation name; an activation the
            primary graph does not have keeps its natural order.
        report: receives a change line and a ``details.act_order`` row per fold.

    Returns:
        The folds, in the order of ``by_activation``.
    """
    folds: list[Fold] = []
    claimed: set[int] = set()
    dims: dict[int, dict] = {}

    def dims_of(probe: int) -> dict:
        if probe not in dims:
            dims[probe] = concrete_dims(model, PROBES[probe])
        return dims[probe]

    rows = report.details.setdefault("act_order", [])
    for group in by_activation.values():
        act = group[0].activation
        assert act is not None
        stat = stats.get(str(act.name))
        if stat is None:
            continue
        importance = np.diag(stat) if stat.ndim == 2 else stat
        fold, kind, reason = _plan_fold(group, importance, by_node, claimed, dims_of)
        claimed.update(id(p.node) for p in fold.producers)
        folds.append(fold)
        report.changes.append(f"act-order on '{act.name}' (K={len(importance)}) {fold.how}")
        rows.append(
            {
                "graph": graph_name,
                "activation": str(act.name),
                "readers": [str(t.node.name) for t in group],
                "fold": kind,
                "into": [str(p.node.name) for p in fold.producers],
                "reason": reason,
            }
        )
    return folds


def apply_fold(graph: ir.Graph, fold: Fold, readers: list[Target], taken: set[str]) -> None:
    """Make the permuted activation reach its readers: permute the producers' constant operands, or Gather.

    The producers' weights are permuted when they are quantized; here only the region's ``(K,)`` constants
    (new initializers: the input's tensors are never written) or the Gather ``(..., K) -> (..., K)``.

    Args:
        graph: the graph (edited in place).
        fold: the fold.
        readers: the targets reading ``fold.activation`` (re-pointed at the Gather's output).
        taken: the graph's names in use (:func:`~onnxdeploy.passes._edit.names_in_use`), extended.
    """
    if fold.producers:
        for node, index in fold.bias_constants:
            value = node.inputs[index]
            array = const_array(value)
            assert value is not None and array is not None
            name = fresh_name(graph, f"{value.name}_act_order", taken)
            node.replace_input_with(
                index, add_initializer(graph, name, np.ascontiguousarray(array[..., fold.out_perm]))
            )
        return
    act = fold.activation
    perm = add_initializer(graph, fresh_name(graph, f"{act.name}_act_order_perm", taken), fold.perm)
    name = fresh_name(graph, "act_order_Gather", taken)
    output = fresh_name(graph, f"{act.name}_act_order", taken)
    known = act.dtype is not None
    gather = make_node(
        "Gather", [act, perm], name=name, output=output, dtype=act.dtype, shape=act.shape if known else None, axis=-1
    )
    producer = act.producer()
    if producer is not None:
        graph.insert_after(producer, gather)
    else:
        graph.insert_before(graph.node(0), gather)
    for reader in readers:
        reader.node.replace_input_with(0, gather.outputs[0])
