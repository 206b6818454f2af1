"""``contract``: the decode contract is present, valid, and agrees with the graph's I/O.

Source: DESIGN.md, "The decode contract" (fields, shapes, dtypes), :class:`onnxdeploy.contract.DecodeContract`
and :func:`onnxdeploy.contract.read_contract` (``metadata_props["onnxdeploy.contract"]``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import onnx
from onnx import TensorProto

from onnxdeploy.checks._graph import ValueType, dtype_name, format_dims, infer, value_type
from onnxdeploy.checks.base import Check, CheckContext, register_check
from onnxdeploy.contract import CONTRACT_KEY, DecodeContract, read_contract
from onnxdeploy.errors import ContractError
from onnxdeploy.report import Finding

__all__ = ["ContractCheck"]

_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
_CONTRACT_HINT = "Re-run static_kv (and kv_layout) so the contract is rewritten from the graph."

# Expected dims: an int, or a "V" placeholder for "any static positive int" (the vocabulary size).
_ANY = "V"


@register_check
class ContractCheck(Check):
    """Check the decode contract in ``metadata_props`` against the graph.

    What is checked:

    - the contract is present (``OD401``) and parses and validates (``OD402``; validation is
      :class:`DecodeContract`'s: a ``kv_dtype`` outside float32/float16/bfloat16, a cache entry lacking a
      name its ``kv_layout`` needs);
    - it is consistent in itself: ``num_layers == len(cache)``, layers numbered ``0..n-1``,
      ``head_dim_padded >= head_dim``, no name used twice (``OD403``);
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

    Output types come from the graph outputs, or from shape inference when those lack a static
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
        yield from _GraphComparison(self, model, contract).findings()

    def _self_consistency(self, contract: DecodeContract) -> Iterator[Finding]:
        if contract.num_layers != len(contract.cache):
            yield self._inconsistent(
                f"num_layers is {contract.num_layers} but the cache lists {len(contract.cache)} layer(s)"
            )
        layers = [entry.layer for entry in contract.cache]
        if sorted(layers) != list(range(len(layers))):
            yield self._inconsistent(f"cache layers are {layers}, expected 0..{len(layers) - 1} once each")
        if contract.head_dim_padded < contract.head_dim:
            yield self._inconsistent(
                f"head_dim_padded ({contract.head_dim_padded}) is smaller than head_dim ({contract.head_dim})"
            )
        names = [n for n in _all_names(contract) if n]
        for name, count in Counter(names).items():
            if count > 1:
                yield self._inconsistent(f"tensor name '{name}' is used {count} times in the contract", [name])

    def _inconsistent(self, message: str, nodes: list[str] | None = None) -> Finding:
        return self.finding("OD403", "error", f"contract: {message}", nodes=nodes or [], hint=_CONTRACT_HINT)


def _all_names(contract: DecodeContract) -> list[str | None]:
    inputs = contract.inputs
    names: list[str | None] = [
        inputs.input_ids,
        inputs.cache_position,
        inputs.position_ids,
        inputs.attention_mask,
        inputs.last_token_index,
    ]
    names.append(contract.logits)
    for entry in contract.cache:
        names.extend([entry.key_in, entry.value_in, entry.key_out, entry.value_out, entry.kv_in, entry.kv_out])
    return names


class _GraphComparison:
    """Compares one contract with one graph; lazily runs shape inference for outputs without shapes."""

    def __init__(self, check: ContractCheck, model: onnx.ModelProto, contract: DecodeContract):
        self.check = check
        self.model = model
        self.contract = contract
        self.inputs = {v.name: v for v in model.graph.input}
        self.outputs = {v.name: v for v in model.graph.output}
        self.initializers = {t.name for t in model.graph.initializer}
        self._inferred: dict[str, onnx.ValueInfoProto] | None = None

    def findings(self) -> Iterator[Finding]:
        c = self.contract
        names = c.inputs.model_dump()
        for role, shape in c.input_shapes().items():
            yield from self._input(names[role], role, (TensorProto.INT64,), shape)

        kv_types = (int(c.kv_onnx_type),)
        shapes = iter(zip(c.pair_input_shapes(), c.pair_output_shapes(), strict=True))  # K and V differ for BHDS_K
        for entry in c.cache:
            pairs = [(names, next(shapes)) for names in c.layer_cache_pairs(entry)]
            for (past, _), (past_shape, _) in pairs:
                yield from self._input(past, f"layer {entry.layer} past cache", kv_types, past_shape)
            for (_, present), (_, present_shape) in pairs:
                yield from self._output(present, f"layer {entry.layer} present cache", kv_types, present_shape)
        yield from self._output(c.logits, "logits", _FLOAT_TYPES, (c.batch, c.logits_positions(), _ANY))

        mentioned = {n for n in _all_names(c) if n}
        for name in self.inputs:
            if name not in mentioned and name not in self.initializers:
                yield self.check.finding(
                    "OD407",
                    "error",
                    f"graph input '{name}' is not mentioned by the contract, so a host cannot feed it",
                    nodes=[name],
                    hint="Remove or fold the input, or name it in the contract (re-run static_kv).",
                )
        for name in self.outputs:
            if name not in mentioned:
                yield self.check.finding(
                    "OD408",
                    "warning",
                    f"graph output '{name}' is not mentioned by the contract; the host will ignore it",
                    nodes=[name],
                    hint="Drop the output if nothing reads it; it costs a copy per step.",
                )

    def _input(
        self, name: str | None, role: str, dtypes: tuple[int, ...], shape: tuple[int | str, ...]
    ) -> Iterator[Finding]:
        if not name:
            return
        value = self.inputs.get(name)
        if value is None:
            where = "an initializer" if name in self.initializers else "not a graph input"
            yield self._missing(name, role, f"input '{name}' ({role}) is {where}")
            return
        yield from self._compare(name, role, value_type(value.type), dtypes, shape)

    def _output(
        self, name: str | None, role: str, dtypes: tuple[int, ...], shape: tuple[int | str, ...]
    ) -> Iterator[Finding]:
        if not name:
            return
        value = self.outputs.get(name)
        if value is None:
            yield self._missing(name, role, f"output '{name}' ({role}) is not a graph output")
            return
        vtype = value_type(value.type)
        if not vtype.is_static:
            inferred = self._inferred_outputs().get(name)
            if inferred is not None and value_type(inferred.type).is_static:
                vtype = value_type(inferred.type)
        if not vtype.is_static and vtype.dims is None:
            yield self.check.finding(
                "OD409",
                "warning",
                f"output '{name}' ({role}) has no shape, even after shape inference; not verified",
                nodes=[name],
                hint="See the static_shapes findings for why inference cannot type it.",
            )
            if vtype.elem_type:
                yield from self._compare(name, role, vtype, dtypes, shape, check_shape=False)
            return
        yield from self._compare(name, role, vtype, dtypes, shape)

    def _compare(
        self,
        name: str,
        role: str,
        vtype: ValueType,
        dtypes: tuple[int, ...],
        shape: tuple[int | str, ...],
        *,
        check_shape: bool = True,
    ) -> Iterator[Finding]:
        expected_shape = format_dims(tuple(shape))
        if dtypes and vtype.elem_type not in dtypes:
            wanted = " or ".join(dtype_name(t) for t in dtypes)
            yield self.check.finding(
                "OD405",
                "error",
                f"'{name}' ({role}) has dtype {dtype_name(vtype.elem_type) if vtype.elem_type else 'unknown'}, "
                f"the contract requires {wanted}",
                nodes=[name],
                hint=_CONTRACT_HINT if role.startswith("layer") else "Cast at the graph boundary or fix the contract.",
            )
        if not check_shape:
            return
        dims = vtype.dims
        ok = dims is not None and len(dims) == len(shape)
        if ok:
            for got, want in zip(dims, shape, strict=True):
                if want == _ANY:
                    ok = ok and isinstance(got, int) and got > 0
                else:
                    ok = ok and got == want
        if not ok:
            yield self.check.finding(
                "OD406",
                "error",
                f"'{name}' ({role}) has shape {format_dims(dims)}, the contract requires {expected_shape}"
                + (" with a static V" if _ANY in shape else ""),
                nodes=[name],
                hint="Fix the I/O shapes with static_kv so they match the contract (or the contract, if the "
                "graph is right).",
            )

    def _missing(self, name: str, role: str, message: str) -> Finding:
        return self.check.finding(
            "OD404",
            "error",
            f"contract {message}",
            nodes=[name],
            hint="Rename the graph I/O or the contract entry so they agree (re-run static_kv).",
        )

    def _inferred_outputs(self) -> dict[str, onnx.ValueInfoProto]:
        if self._inferred is None:
            try:
                graph = infer(self.model).graph
                self._inferred = {v.name: v for v in (*graph.output, *graph.value_info)}
            except Exception:  # noqa: BLE001 - unverifiable outputs are reported as OD409
                self._inferred = {}
        return self._inferred
