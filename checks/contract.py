"""``contract``: the decode contract is present, valid, and agrees with the graph's I/O.

Source: docs/ARCHITECTURE.md and the README, "The decode contract" (fields, shapes, dtypes),
:class:`onnxdeploy.contract.DecodeContract` and :func:`onnxdeploy.contract.read_contract`
(``metadata_props["onnxdeploy.contract"]``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import onnx

from onnxdeploy.checks._graph import infer, value_type
from onnxdeploy.checks.base import Check, CheckContext, register_check
from onnxdeploy.contract import CONTRACT_KEY, ContractMismatch, DecodeContract, read_contract
from onnxdeploy.errors import ContractError
from onnxdeploy.report import Finding

__all__ = ["ContractCheck"]

_CONTRACT_HINT = "Re-run static_kv (and kv_layout) so the contract is rewritten from the graph."


@register_check
class ContractCheck(Check):
    """Check the decode contract in ``metadata_props`` against the graph.

    What is checked:

    - the contract is present (``OD401``) and parses and validates (``OD402``; validation is
      :class:`DecodeContract`'s: a ``kv_dtype`` outside float32/float16/bfloat16, a cache entry lacking a
      name its ``kv_layout`` needs);
    - it is consistent in itself: ``num_layers == len(cache)``, layers numbered ``0..n-1``,
      ``head_dim_padded >= head_dim``, no name used twice, a ``cache_policy`` only with ``mask: slot_positions``
      (``OD403``);
    - every named input is a graph input and every named output a graph output (``OD404``);
    - dtypes and shapes (``OD405``/``OD406``): ``input_ids`` int64 ``[batch, step_len]``;
      ``cache_position`` int64 ``[step_len]``; ``position_ids`` int64 ``[batch, step_len]``;
      ``attention_mask`` int64 ``[batch, max_cache_len]``; past inputs of ``kv_dtype`` with
      :meth:`DecodeContract.pair_input_shapes`, present outputs with
      :meth:`DecodeContract.pair_output_shapes`; ``last_token_index`` int64 ``[batch]``; logits float
      ``[batch, step_len, V]`` (``[batch, 1, V]`` with ``prefill_logits: last``) with a static ``V``;
    - no graph input is left that the contract does not mention (``OD407``: the host cannot feed it;
      inputs with an initializer default are exempt); graph outputs it does not mention are a
      warning (``OD408``).

    The comparison is :meth:`DecodeContract.mismatches` (the runner's contract decoder refuses a graph on the
    same one); this check turns each mismatch into a finding. Output types come from the graph outputs, or from
    shape inference when those lack a static
    shape; where neither gives one, the tensor cannot be verified (``OD409``, warning).
    """

    name = "contract"
    description = "The decode contract is present, valid and consistent with the graph's inputs and outputs."
    codes = {
        "OD401": "error: the model carries no decode contract.",
        "OD402": "error: the contract JSON is malformed or does not validate (fields, kv_dtype, layout names).",
        "OD403": "error: the contract contradicts itself (layer count, layer numbers, head dims, repeated names).",
        "OD404": "error: a tensor named by the contract is not a graph input/output.",
        "OD405": "error: a contract tensor has the wrong dtype.",
        "OD406": "error: a contract tensor has the wrong or a non-static shape.",
        "OD407": "error: a graph input is not mentioned by the contract.",
        "OD408": "warning: a graph output is not mentioned by the contract.",
        "OD409": "warning: a contract output has no static shape even after inference; not verified.",
    }

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        """Yield ``OD401``-``OD409`` findings for ``model`` (see the class docstring)."""
        try:
            contract = read_contract(model, source=str(context.model_path or "model"))
        except ContractError as exc:
            yield self.finding("OD402", "error", str(exc), hint=_CONTRACT_HINT)
            return
        if contract is None:
            yield self.finding(
                "OD401",
                "error",
                f"no decode contract: metadata_props has no '{CONTRACT_KEY}' entry",
                hint="Run the static_kv pass, which fixes the shapes and writes the contract.",
            )
            return
        yield from self._self_consistency(contract)
        yield from _graph_findings(self, model, contract)

    def _self_consistency(self, contract: DecodeContract) -> Iterator[Finding]:
        if contract.num_layers != len(contract.cache):
            yield self._inconsistent(
                f"num_layers is {contract.num_layers} but the cache lists {len(contract.cache)} layer(s)"
            )
        layers = [entry.layer for entry in contract.cache]
        first = contract.first_layer  # 0, or a split model's part's first layer
        if sorted(layers) != list(range(first, first + len(layers))):
            yield self._inconsistent(
                f"cache layers are {layers}, expected {first}..{first + len(layers) - 1} once each"
            )
        if contract.head_dim_padded < contract.head_dim:
            yield self._inconsistent(
                f"head_dim_padded ({contract.head_dim_padded}) is smaller than head_dim ({contract.head_dim})"
            )
        if contract.cache_policy is not None and contract.mask != "slot_positions":  # README "Past max_cache_len"
            yield self._inconsistent(
                f"cache_policy (sinks {contract.cache_policy.sinks} + recent {contract.cache_policy.recent}) but mask "
                f"'{contract.mask}': its host feeds slot_positions past max_cache_len, which this graph never reads "
                "(run mask_rewrite after static_kv)"
            )
        names = contract.tensor_names()
        for name, count in Counter(names).items():
            if count > 1:
                yield self._inconsistent(f"tensor name '{name}' is used {count} times in the contract", [name])

    def _inconsistent(self, message: str, nodes: list[str] | None = None) -> Finding:
        return self.finding("OD403", "error", f"contract: {message}", nodes=nodes or [], hint=_CONTRACT_HINT)


_CODES: dict[str, tuple[str, str]] = {
    "missing": ("OD404", "error"),
    "dtype": ("OD405", "error"),
    "shape": ("OD406", "error"),
    "not_static": ("OD406", "error"),
    "unverified": ("OD409", "warning"),
    "unnamed_input": ("OD407", "error"),
    "unnamed_output": ("OD408", "warning"),
}
"""Finding code and level of each :class:`~onnxdeploy.contract.ContractMismatch` kind."""


def _graph_findings(check: ContractCheck, model: onnx.ModelProto, contract: DecodeContract) -> Iterator[Finding]:
    """The contract's mismatches with the graph (:meth:`DecodeContract.mismatches`) as findings.

    An output the contract names whose declared type has no static shape is compared with its inferred type
    when shape inference gives a static one (inference runs once, only when needed).
    """
    named = {contract.logits, *(present for _, present in contract.cache_pairs())}
    inferred: dict[str, onnx.ValueInfoProto] | None = None
    outputs = []
    for value in model.graph.output:
        if value.name in named and not value_type(value.type).is_static:
            inferred = _inferred_values(model) if inferred is None else inferred
            better = inferred.get(value.name)
            if better is not None and value_type(better.type).is_static:
                value = better
        outputs.append(value)
    defaults = {t.name for t in model.graph.initializer}
    for mismatch in contract.mismatches(model.graph.input, outputs, defaults=defaults):
        code, level = _CODES[mismatch.kind]
        yield check.finding(code, level, _message(mismatch), nodes=[mismatch.name], hint=_hint(mismatch))


def _message(mismatch: ContractMismatch) -> str:
    if mismatch.kind == "missing":
        return f"contract {mismatch.message}"
    if mismatch.kind == "unverified":
        return f"{mismatch.message}, even after shape inference; not verified"
    return mismatch.message


def _hint(mismatch: ContractMismatch) -> str:
    if mismatch.kind == "missing":
        return "Rename the graph I/O or the contract entry so they agree (re-run static_kv)."
    if mismatch.kind == "dtype":
        return (
            _CONTRACT_HINT if mismatch.role.startswith("layer") else "Cast at the graph boundary or fix the contract."
        )
    if mismatch.kind == "unverified":
        return "See the static_shapes findings for why inference cannot type it."
    if mismatch.kind == "unnamed_input":
        return "Remove or fold the input, or name it in the contract (re-run static_kv)."
    if mismatch.kind == "unnamed_output":
        return "Drop the output if nothing reads it; it costs a copy per step."
    return "Fix the I/O shapes with static_kv so they match the contract (or the contract, if the graph is right)."


def _inferred_values(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Graph outputs and value infos after shape inference; empty when inference fails (outputs stay OD409)."""
    try:
        graph = infer(model).graph
    except Exception:  # noqa: BLE001 - unverifiable outputs are reported as OD409
        return {}
    return {v.name: v for v in (*graph.output, *graph.value_info)}
