"""Which weights ``quantize_weights`` quantizes: MatMul/Gemm/Gather nodes with a constant 2-D float weight.

A weight is an initializer (or ``Constant``) reached through a chain of ``Cast``/``Transpose``/``Identity``
nodes (:func:`resolve_weight`): what the consumer reads is the root's values in the chain's last dtype,
transposed when the chain transposes. The LM head is the MatMul/Gemm feeding the logits output (through
reshapes, casts and a softcap). Each target's bit width and block size come from the config's rules
(:mod:`._quant_rules`: ``rules``, and ``lm_head``/``embedding``/``exclude`` which they generalise); every node
with a constant weight left in float is listed with the reason (the config, or a weight that cannot be
quantized: rank ≠ 2, not floating point, a Gemm with ``transA``/``alpha``/``beta``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import onnx_ir as ir

from onnxdeploy.contract import read_contract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.graph import const_tensor
from onnxdeploy.passes._quant_rules import QuantRule, legacy_rules, resolve

__all__ = ["Target", "Weight", "find_targets", "resolve_weight"]

CHAIN_OPS = {"Cast", "Transpose", "Identity"}
"""Ops between a stored weight and its consumer that the quantized weight replaces (they are folded)."""
_TO_LOGITS = {"Reshape", "Identity", "Cast", "Squeeze", "Unsqueeze", "Slice", "Add", "Mul", "Div", "Softcap"}
_LM_HEAD_DEPTH = 8


@dataclass
class Weight:
    """A constant weight after its Cast/Transpose chain: where it starts, what it looks like at the consumer.

    Attributes:
        root: the initializer (or ``Constant`` output) holding the stored 2-D tensor.
        chain: the Cast/Transpose/Identity nodes from ``root`` to the consumer, in order.
        transposed: the consumer reads the root transposed.
        dtype: the element type the consumer reads.
        shape: the shape the consumer reads.
    """

    root: ir.Value
    chain: list[ir.Node]
    transposed: bool
    dtype: ir.DataType
    shape: tuple[int, int]

    @property
    def tensor(self) -> ir.TensorProtocol:
        """The stored tensor (memory-mapped when external)."""
        tensor = const_tensor(self.root)
        assert tensor is not None
        return tensor


def _chain_step(node: ir.Node | None) -> bool | None:
    """Whether a chain node transposes (False: it does not), or None when it is no chain node."""
    if node is None or node.op_type not in CHAIN_OPS or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
        return None
    if node.op_type != "Transpose":
        return False
    perm = node.attributes.get_ints("perm", None)
    if perm is not None and list(perm) not in ([1, 0], [0, 1]):
        return None
    return perm is None or list(perm) == [1, 0]


def resolve_weight(value: ir.Value | None) -> Weight | None:
    """Follow Cast/Transpose/Identity producers back to a constant 2-D float tensor.

    Args:
        value: a consumer's weight input.

    Returns:
        The weight, or None when ``value`` is not such a chain over a 2-D floating-point constant (or reads
        it as a non-float type).
    """
    if value is None:
        return None
    chain: list[ir.Node] = []
    transposed = False
    cur = value
    while const_tensor(cur) is None:
        node = cur.producer()
        step = _chain_step(node)
        if step is None:
            return None
        assert node is not None
        transposed ^= step
        chain.insert(0, node)
        cur = node.inputs[0]
        if cur is None:
            return None
    tensor = const_tensor(cur)
    assert tensor is not None
    if len(tensor.shape) != 2 or not tensor.dtype.is_floating_point():
        return None
    dtype = value.dtype or tensor.dtype
    for node in chain:
        if node.op_type == "Cast":
            dtype = ir.DataType(node.attributes.get_int("to"))
    if not dtype.is_floating_point():
        return None
    rows, cols = (int(d) for d in tensor.shape)
    return Weight(cur, chain, transposed, dtype, (cols, rows) if transposed else (rows, cols))


@dataclass
class Target:
    """One node whose weight is quantized.

    Attributes:
        node: the MatMul, Gemm or Gather.
        kind: which of them.
        weight: its resolved weight.
        input_index: the node input the weight arrives at (1, or 0 for Gather).
        nk: the consumer reads the weight as ``(N, K)`` (Gemm ``transB=1``, Gather) rather than ``(K, N)``.
        lm_head: the node produces the logits.
        bits: the bit width the rules give it (4 or 8; None: the pass config's).
        block_size: its INT4 block size (input channels per group; None: the pass config's).
    """

    node: ir.Node
    kind: Literal["matmul", "gemm", "gather"]
    weight: Weight
    input_index: int
    nk: bool
    lm_head: bool = False
    bits: int | None = None
    block_size: int | None = None

    @property
    def activation(self) -> ir.Value | None:
        """The activation the weight multiplies ``(..., K)`` (None for a Gather)."""
        return None if self.kind == "gather" else self.node.inputs[0]

    @property
    def root_nk(self) -> bool:
        """The root initializer is stored (N, K)."""
        return self.nk != self.weight.transposed


def _logits_value(model: ir.Model) -> ir.Value | None:
    contract = read_contract(model)
    outputs = {str(v.name): v for v in model.graph.outputs}
    if contract is not None:
        return outputs.get(contract.logits)
    if "logits" in outputs:
        return outputs["logits"]
    from onnxdeploy.kv_cache import find_kv_cache, find_logits_output  # noqa: PLC0415

    try:
        kv = find_kv_cache(model, who="quantize_weights")
        return find_logits_output(model.graph, {t.present_name for t in kv.tensors}, who="quantize_weights")
    except PreconditionError:
        return None


def _lm_head_node(model: ir.Model) -> ir.Node | None:
    value = _logits_value(model)
    for _ in range(_LM_HEAD_DEPTH):
        node = value.producer() if value is not None else None
        if node is None:
            return None
        if node.op_type in ("MatMul", "Gemm"):
            return node
        if node.op_type not in _TO_LOGITS:
            return None
        value = node.inputs[0]
    return None


def _target_of(node: ir.Node, lm_head: ir.Node | None) -> Target | str | None:
    """The target ``node`` is (a MatMul/Gemm/Gather with a constant weight), why it is left in float, or None."""
    if node.op_type == "Gather":
        if node.attributes.get_int("axis", 0) != 0:
            return None
        weight = resolve_weight(node.inputs[0])
        if weight is None or weight.transposed:
            return None
        return Target(node, "gather", weight, 0, nk=True)
    weight = resolve_weight(node.inputs[1] if len(node.inputs) > 1 else None)
    if weight is None:
        return None
    if node.op_type == "MatMul":
        return Target(node, "matmul", weight, 1, nk=False, lm_head=node is lm_head)
    attrs = node.attributes
    plain = attrs.get_float("alpha", 1.0) == 1.0 and attrs.get_float("beta", 1.0) == 1.0
    if attrs.get_int("transA", 0) or not plain:
        return "Gemm with transA/alpha/beta other than 0/1/1 is left in float"
    return Target(node, "gemm", weight, 1, nk=bool(attrs.get_int("transB", 0)), lm_head=node is lm_head)


def _not_a_weight(value: ir.Value | None) -> str | None:
    """Why a constant a MatMul/Gemm/Gather reads is not quantized (rank, dtype), or None when it is no constant."""
    cur = value
    while cur is not None and const_tensor(cur) is None:
        node = cur.producer()
        if node is None or node.op_type not in CHAIN_OPS or len(node.inputs) != 1:
            return None
        cur = node.inputs[0]
    tensor = const_tensor(cur) if cur is not None else None
    if tensor is None:
        return None
    shape = [int(d) for d in tensor.shape]
    if len(shape) != 2:
        return f"constant weight {cur.name!r} of rank {len(shape)} {shape}: only 2-D weights are quantized"
    if not tensor.dtype.is_floating_point():
        return f"constant weight {cur.name!r} is {tensor.dtype.name}, not floating point"
    return f"constant weight {cur.name!r} reaches the node through ops other than Cast/Transpose(perm [1, 0])/Identity"


def _kinds(target: Target) -> set[str]:
    kind = "embedding" if target.kind == "gather" else target.kind
    return {kind, "lm_head"} if target.lm_head else {kind}


def find_targets(
    model: ir.Model,
    *,
    exclude: list[str],
    lm_head: bool,
    embedding: bool,
    bits: int | None = None,
    block_size: int | None = None,
    rules: list[QuantRule] | None = None,
) -> tuple[list[Target], list[str]]:
    """The nodes whose weights the config quantizes (each with its bits and block size), and notes on the rest.

    Args:
        model: the model (its top-level graph is searched, in graph order).
        exclude: node names (shell patterns) left in float.
        lm_head: quantize the LM head.
        embedding: quantize embedding Gather tables.
        bits: the pass's bit width (4 or 8) before the rules (None: left to the quantizer's config).
        block_size: the pass's INT4 block size before the rules (None: as ``bits``).
        rules: ``quantize_weights.rules`` (:mod:`._quant_rules`), applied after the keys above.

    Returns:
        ``(targets, skipped)``: the targets in graph order; one note ``"<node>: <why>"`` per MatMul/Gemm/Gather
        with a constant weight that is left in float (by the config, or because it cannot be quantized: a rank-3
        weight, a Gemm with ``transA``…) and per ``nodes`` pattern that matched no quantizable node.
    """
    head = _lm_head_node(model)
    legacy = legacy_rules(lm_head=lm_head, embedding=embedding, exclude=exclude)
    rules = list(rules or [])
    targets: list[Target] = []
    skipped: list[str] = []
    matched: set[str] = set()
    for node in model.graph:
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm", "Gather"):
            continue
        label = node.name or f"<{node.op_type} -> {node.outputs[0].name}>"
        found = _target_of(node, head)
        if found is None:
            why = _not_a_weight(node.inputs[0 if node.op_type == "Gather" else 1] if len(node.inputs) > 1 else None)
            found = why if why and (node.op_type != "Gather" or node.attributes.get_int("axis", 0) == 0) else None
        if isinstance(found, str):
            skipped.append(f"{label}: {found}")
        if not isinstance(found, Target):
            continue
        decided = resolve(
            str(node.name or ""), _kinds(found), bits=bits or 0, block_size=block_size or 0, legacy=legacy, rules=rules
        )
        matched.update(decided.matched)
        if decided.bits is None:
            skipped.append(f"{label}: {decided.reason}")
            continue
        found.bits, found.block_size = decided.bits or None, decided.block_size or None  # 0: the config's
        targets.append(found)
    patterns = [r.nodes for r in [*legacy, *rules] if r.nodes is not None]
    skipped += [
        (f"exclude pattern {p!r}" if p in exclude else f"rule pattern {p!r}") + " matched no quantizable node"
        for p in dict.fromkeys(patterns)
        if p not in matched
    ]
    return targets, skipped
