"""The decode contract: how a host drives a transformed decoder (docs/ARCHITECTURE.md, "The decode contract").

A transformed model carries the contract as JSON in ``metadata_props`` under the key
``onnxdeploy.contract`` so the runner, or a C++ host on the device, can feed it without guessing.
:class:`DecodeContract` owns the contract's meaning: the cache dtype (one mapping to numpy and ONNX),
which names each layout needs, and the shape of every input and output it names. Checks and the runner
ask it; nobody re-derives it.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from typing import Any, Literal

import numpy as np
import onnx
import onnx_ir as ir
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from onnxdeploy.contract_cache import CACHE_POLICY_VERSION, EMPTY_SLOT, CachePolicy
from onnxdeploy.contract_entries import CacheBinding, ContractInputs, ContractMismatch, GraphSetEntry, MismatchKind
from onnxdeploy.contract_parts import PART_VERSION, PartEntry, PartInfo
from onnxdeploy.contract_terms import CacheWrite
from onnxdeploy.errors import ContractError
from onnxdeploy.graph import FLOAT_ELEM_TYPES, dtype_name, format_dims, tensor_dims

__all__ = [
    "CACHE_WRITES",
    "CONTRACT_KEY",
    "CONTRACT_VERSION",
    "FEATURE_VERSIONS",
    "KV_DTYPES",
    "LAYOUT_VERSIONS",
    "EMPTY_SLOT",
    "CacheBinding",
    "CachePolicy",
    "CacheWrite",
    "ContractInputs",
    "ContractMismatch",
    "GraphSetEntry",
    "DecodeContract",
    "PartEntry",
    "PartInfo",
    "KVDtype",
    "read_contract",
    "write_contract",
]

CONTRACT_KEY = "onnxdeploy.contract"
CONTRACT_VERSION = 2
"""2 added what a host must read to drive a graph set: ``prefill_logits``, ``inputs.last_token_index``,
``padding`` and ``graph_set``; and, from ``mask_rewrite``, ``mask``, ``sliding_window`` and ``cache_init``. Version 1
contracts read with those absent (one graph, logits at every position, the exporter's mask fed by attention_mask).
Contracts that need a later version say so themselves (:data:`LAYOUT_VERSIONS`)."""

LAYOUT_VERSIONS: dict[str, int] = {"BHSD": 1, "BSH2D": 1, "BHDS_K": 3}
"""The lowest ``contract_version`` that knows each ``kv_layout`` (3 added ``BHDS_K``): a contract with that layout
carries at least that version, so a host that knows fewer layouts refuses it instead of guessing."""

FEATURE_VERSIONS: dict[str, int] = {
    "row_positions": 4,
    "cache_policy": CACHE_POLICY_VERSION,
    "part": PART_VERSION,
    "parts": PART_VERSION,
}
"""The lowest ``contract_version`` that knows each optional contract feature (a field that is on), as
:data:`LAYOUT_VERSIONS` does for layouts: 4 added ``row_positions`` (``cache_position`` ``(B, S)``, each batch row at
its own positions); 5 added ``cache_policy`` (sinks + recent past ``max_cache_len``) and ``part``/``parts`` (a
decoder split into parts run in sequence). A contract using a feature carries at least its version; others keep
theirs."""

CACHE_WRITES: tuple[str, ...] = ("scatter_elements", "scatter_nd", "where", "host")

KVDtype = Literal["float32", "float16", "bfloat16"]
"""Element types a contract's cache may have."""

KV_DTYPES: dict[str, ir.DataType] = {
    "float32": ir.DataType.FLOAT,
    "float16": ir.DataType.FLOAT16,
    "bfloat16": ir.DataType.BFLOAT16,
}
"""The one mapping of ``kv_dtype`` to ONNX element types (numpy dtypes follow from ``ir.DataType.numpy()``)."""

_LEGACY_KV_DTYPES = {"float": "float32"}
"""Names older contracts wrote (ONNX's ``float``); read with their meaning, written in the current spelling."""

_LAYOUT_NAMES: dict[str, tuple[str, ...]] = {
    "BHSD": ("key_in", "value_in", "key_out", "value_out"),
    "BSH2D": ("kv_in", "kv_out"),
    "BHDS_K": ("key_in", "value_in", "key_out", "value_out"),
}
"""The cache-entry names each ``kv_layout`` needs."""

Shape = tuple[int, ...]

_ANY = "V"
"""An expected dim that may be any static positive int (the vocabulary size of the logits)."""


class DecodeContract(BaseModel):
    """The I/O contract of a static decode graph (contract_version 2, 3 for BHDS_K; version 1 still reads).

    Shapes (``B`` = ``batch``, ``S`` = ``step_len``, ``M`` = ``max_cache_len``, ``H_kv`` = ``num_kv_heads``,
    ``D`` = ``head_dim_padded``): ``input_ids`` int64 ``(B, S)``; ``cache_position`` int64 ``(S,)`` (``(B, S)`` with
    ``row_positions``); ``position_ids`` int64 ``(B, S)``; ``attention_mask`` int64 ``(B, M)``; past cache of
    ``kv_dtype`` ``(B, H_kv, M, D)`` (BHSD), ``(B, M, H_kv, 2·D)`` (BSH2D, K and V packed on the last axis, K first,
    each zero-padded from ``head_dim`` to ``D``), or K ``(B, H_kv, D, M)`` and V ``(B, H_kv, M, D)`` (BHDS_K: K
    transposed); present cache the same with ``S`` in place of ``M`` for ``new_token_only``; logits float
    ``(B, S, V)``, or ``(B, 1, V)`` with ``prefill_logits: last`` (then ``last_token_index`` int64 ``(B,)`` is an
    input).

    Raises:
        pydantic.ValidationError: on construction, an unknown ``kv_dtype`` or ``kv_layout``, or a cache
            entry lacking a name its ``kv_layout`` needs (:func:`read_contract` turns it into a
            :class:`~onnxdeploy.errors.ContractError`).
    """

    model_config = ConfigDict(extra="forbid")

    contract_version: Literal[1, 2, 3, 4, 5] = Field(
        default=CONTRACT_VERSION, description="Contract format version; a host refuses a version it does not know."
    )
    batch: int = Field(ge=1, description="Batch rows B of every input and output.")
    step_len: int = Field(ge=1, description="Tokens per call S.")
    max_cache_len: int = Field(ge=1, description="Cache slots M.")
    num_layers: int = Field(ge=1, description="Decoder layers (entries of cache).")
    num_kv_heads: int = Field(ge=1, description="KV heads H_kv.")
    head_dim: int = Field(ge=1, description="Head dim of the model.")
    head_dim_padded: int = Field(ge=1, description="Head dim of the cache tensors, >= head_dim.")
    kv_layout: Literal["BHSD", "BSH2D", "BHDS_K"] = Field(
        default="BHSD",
        description="Cache tensor layout: BHSD (B, H_kv, M, D); BSH2D (B, M, H_kv, 2·D), K then V on the last axis; "
        "BHDS_K: K (B, H_kv, D, M), V (B, H_kv, M, D). contract_version >= 3 for BHDS_K.",
    )
    kv_dtype: KVDtype = Field(default="float32", description="Cache element type; legacy 'float' reads as float32.")
    cache_update: Literal["full_buffer", "new_token_only"] = Field(
        default="full_buffer",
        description="full_buffer: present outputs are the updated buffers; new_token_only: only the step's K/V.",
    )
    inputs: ContractInputs
    logits: str | None = Field(
        default="logits",
        description="Logits output name, float (B, S, V), or (B, 1, V) with prefill_logits last; None in a part "
        "that returns a hidden state (split).",
    )
    cache: list[CacheBinding]
    prefill_logits: Literal["all", "last"] = Field(
        default="all",
        description="all: logits for every position of the call; last: only for the position at "
        "inputs.last_token_index (the LM head skips the others).",
    )
    padding: Literal["trailing"] | None = Field(
        default=None,
        description="How a chunk of r < step_len real tokens is fed (step_len > 1): trailing = the r tokens "
        "first, then step_len - r padding tokens at the next positions (cache_position and position_ids "
        "continue, all < max_cache_len); the causal mask hides their cache slots from every real query and "
        "the next call overwrites them; attention_mask (if any) is 0 there. None: chunks are always full.",
    )
    graph_set: list[GraphSetEntry] = Field(
        default_factory=list,
        description="Every graph of the set sharing this graph's weights file, the primary decode graph first "
        "(this graph among them); empty for a graph made alone by an older version.",
    )
    mask: Literal["attention_mask", "cache_position", "slot_positions"] = Field(
        default="attention_mask",
        description="attention_mask: the exporter's mask, fed by inputs.attention_mask (1 for slots <= the current "
        "position). cache_position: computed in the graph (mask_rewrite): slot j is visible to the query at position "
        "p iff j <= p (and p - j < sliding_window), ANDed with inputs.attention_mask when the graph keeps one. "
        "slot_positions: the same from the position each slot holds (inputs.slot_positions), the query's from "
        "position_ids (a ring: cache_policy).",
    )
    sliding_window: int | None = Field(
        default=None,
        ge=1,
        description="Window W the graph applies (mask: cache_position): a query at p sees slots p-W+1..p in the "
        "layers that have a window; None: no layer has one.",
    )
    row_positions: bool = Field(
        default=False,
        description="cache_position is int64 (B, S): each batch row writes and masks at its own positions (and "
        "position_ids (B, S) are its own). Rows at different positions need mask: cache_position (mask_rewrite, or an "
        "attention op masking by per-row length). An idle row is fed any token at a position whose slot it may "
        "overwrite (its next position keeps its cache; a free row: 0); its logits are ignored. contract_version >= 4.",
    )
    cache_init: Literal["zeros"] = Field(
        default="zeros",
        description="The host fills every cache buffer with zeros once, when it allocates it. Masked slots get "
        "probability exactly 0, but 0 x NaN is NaN: a V slot must never hold NaN/inf (stale finite values are fine).",
    )

    part: PartInfo | None = Field(
        default=None, description="Which part of a split model this graph is (split; contract_version >= 5)."
    )
    cache_policy: CachePolicy | None = Field(
        default=None,
        description="What a host does once the cache is full: keep sinks, a ring of recent (contract_version >= 5).",
    )
    parts: list[PartEntry] = Field(
        default_factory=list,
        description="Every part of this graph's chain, in the order a host runs them (this graph among them); "
        "empty for a whole model.",
    )

    @field_validator("kv_dtype", mode="before")
    @classmethod
    def _legacy_kv_dtype(cls, value: Any) -> Any:
        return _LEGACY_KV_DTYPES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _layout_names(self) -> DecodeContract:
        if self.contract_version < LAYOUT_VERSIONS[self.kv_layout]:
            raise ValueError(
                f"kv_layout {self.kv_layout} needs contract_version >= {LAYOUT_VERSIONS[self.kv_layout]}, "
                f"got {self.contract_version}"
            )
        rings = any(e.cache_len is not None or e.slot_mapping != "position" for e in self.cache)
        if rings and self.contract_version < CACHE_POLICY_VERSION:
            raise ValueError(f"per-layer cache lengths need contract_version >= {CACHE_POLICY_VERSION}")
        for feature, version in FEATURE_VERSIONS.items():
            if getattr(self, feature) and self.contract_version < version:
                raise ValueError(f"{feature} needs contract_version >= {version}, got {self.contract_version}")
        needed = _LAYOUT_NAMES[self.kv_layout]
        for entry in self.cache:
            absent = [name for name in needed if not getattr(entry, name)]
            if absent:
                raise ValueError(
                    f"cache entry of layer {entry.layer} lacks {', '.join(absent)} required by kv_layout "
                    f"{self.kv_layout}"
                )
        return self

    @property
    def first_layer(self) -> int:
        """Whole-model index of the first layer whose cache this graph holds: 0, or a part's first layer (split)."""
        return self.parts[self.part.index].first_layer if self.part is not None and self.parts else 0

    # -- dtypes ------------------------------------------------------------------------------------

    @property
    def kv_onnx_type(self) -> ir.DataType:
        """The cache element type as an ONNX data type (an ``IntEnum`` equal to ``TensorProto.DataType``)."""
        return KV_DTYPES[self.kv_dtype]

    @property
    def kv_numpy_dtype(self) -> np.dtype:
        """The cache element type as a numpy dtype (``bfloat16`` is ``ml_dtypes.bfloat16``)."""
        return np.dtype(self.kv_onnx_type.numpy())

    # -- shapes ------------------------------------------------------------------------------------

    @property
    def cache_sequence_axis(self) -> int:
        """Axis of the cache tensors that indexes slots: 2 for BHSD, 1 for BSH2D.

        Raises:
            ValueError: ``BHDS_K``, whose K and V differ (use :meth:`pair_sequence_axes`).
        """
        if self.kv_layout == "BHDS_K":
            raise ValueError("kv_layout BHDS_K: K and V have different sequence axes; use pair_sequence_axes()")
        return 2 if self.kv_layout == "BHSD" else 1

    def _cache_shape(self, slots: int, kind: Literal["key", "value", "kv"] = "kv") -> Shape:
        b, h, d = self.batch, self.num_kv_heads, self.head_dim_padded
        if self.kv_layout == "BSH2D":
            return (b, slots, h, 2 * d)
        if self.kv_layout == "BHDS_K" and kind == "key":
            return (b, h, d, slots)
        return (b, h, slots, d)

    def _pair_kinds(self) -> list[Literal["key", "value", "kv"]]:
        return ["kv"] * len(self.cache) if self.kv_layout == "BSH2D" else ["key", "value"] * len(self.cache)

    def pair_sequence_axes(self) -> list[int]:
        """The slot axis of each :meth:`cache_pairs` entry: 2 (BHSD, BHDS_K V), 3 (BHDS_K K) or 1 (BSH2D)."""
        if self.kv_layout == "BSH2D":
            return [1] * len(self.cache)
        return [3 if kind == "key" and self.kv_layout == "BHDS_K" else 2 for kind in self._pair_kinds()]

    def layer_cache_len(self, entry: CacheBinding) -> int:
        """Slots of one layer's buffers: its ``cache_len`` (a ring), else ``max_cache_len``."""
        return entry.cache_len if entry.cache_len is not None else self.max_cache_len

    def _pair_lens(self) -> list[int]:
        per = 1 if self.kv_layout == "BSH2D" else 2
        return [self.layer_cache_len(e) for e in self.cache for _ in range(per)]

    def pair_input_shapes(self) -> list[Shape]:
        """The past input shape of each :meth:`cache_pairs` entry (K and V differ for BHDS_K; per-layer lengths)."""
        return [self._cache_shape(n, kind) for n, kind in zip(self._pair_lens(), self._pair_kinds(), strict=True)]

    def pair_output_shapes(self) -> list[Shape]:
        """The present output shape of each :meth:`cache_pairs` entry (``step_len`` slots for ``new_token_only``)."""
        if self.cache_update == "new_token_only":
            return [self._cache_shape(self.step_len, kind) for kind in self._pair_kinds()]
        return [self._cache_shape(n, kind) for n, kind in zip(self._pair_lens(), self._pair_kinds(), strict=True)]

    def cache_input_shape(self) -> Shape:
        """Shape of every past cache input (one shape for all: BHSD or BSH2D).

        Returns:
            ``(B, H_kv, max_cache_len, D_padded)`` for BHSD, ``(B, max_cache_len, H_kv, 2·D_padded)`` for BSH2D.

        Raises:
            ValueError: ``BHDS_K``, whose K and V shapes differ (use :meth:`pair_input_shapes`).
        """
        if self.kv_layout == "BHDS_K":
            raise ValueError("kv_layout BHDS_K: K and V shapes differ; use pair_input_shapes()")
        return self._cache_shape(self.max_cache_len)

    def cache_output_shape(self) -> Shape:
        """Shape of every present cache output.

        Returns:
            :meth:`cache_input_shape` for ``full_buffer``; for ``new_token_only`` the same with ``step_len``
            in place of ``max_cache_len`` on the sequence axis (:attr:`cache_sequence_axis`).

        Raises:
            ValueError: ``BHDS_K`` (use :meth:`pair_output_shapes`).
        """
        if self.kv_layout == "BHDS_K":
            raise ValueError("kv_layout BHDS_K: K and V shapes differ; use pair_output_shapes()")
        return self._cache_shape(self.step_len if self.cache_update == "new_token_only" else self.max_cache_len)

    def input_ids_shape(self) -> Shape:
        """Shape of ``input_ids`` (int64): ``(B, step_len)``."""
        return (self.batch, self.step_len)

    def cache_position_shape(self) -> Shape:
        """Shape of ``cache_position`` (int64): ``(step_len,)``, or ``(B, step_len)`` with ``row_positions``."""
        return (self.batch, self.step_len) if self.row_positions else (self.step_len,)

    def position_ids_shape(self) -> Shape:
        """Shape of ``position_ids`` (int64): ``(B, step_len)``."""
        return (self.batch, self.step_len)

    def attention_mask_shape(self) -> Shape:
        """Shape of ``attention_mask`` (int64): ``(B, max_cache_len)``."""
        return (self.batch, self.max_cache_len)

    def last_token_index_shape(self) -> Shape:
        """Shape of ``last_token_index`` (int64): ``(B,)``."""
        return (self.batch,)

    def logits_positions(self) -> int:
        """Positions the logits output holds per call: 1 with ``prefill_logits: last``, else ``step_len``."""
        return 1 if self.prefill_logits == "last" else self.step_len

    def input_shapes(self) -> dict[str, Shape]:
        """Shape of each named non-cache input, by role (``input_ids``, ``cache_position``, …); int64 all."""
        shapes = {
            "input_ids": self.input_ids_shape(),
            "cache_position": self.cache_position_shape(),
            "position_ids": self.position_ids_shape(),
            "attention_mask": self.attention_mask_shape(),
            "last_token_index": self.last_token_index_shape(),
            "slot_positions": (self.max_cache_len,),
        }
        return {role: shapes[role] for role, name in self.inputs.model_dump().items() if name is not None}

    # -- the graph's I/O against the contract -------------------------------------------------------

    def declared_tensors(self) -> Iterator[tuple[str, str, bool, frozenset[int], tuple[int | str, ...]]]:
        """Every tensor the contract declares: ``(name, role, is_input, allowed element types, shape)``.

        Order: the non-cache inputs by role, then layer by layer the past inputs and the present outputs, then the
        logits. Shapes are ints, except the logits' vocabulary dim (``"V"``: any static positive int).
        """
        int64 = frozenset({int(ir.DataType.INT64)})
        names = self.inputs.model_dump()
        for role, shape in self.input_shapes().items():
            yield names[role], role, True, int64, shape
        kv = frozenset({int(self.kv_onnx_type)})
        shapes = iter(zip(self.pair_input_shapes(), self.pair_output_shapes(), strict=True))
        for entry in self.cache:
            pairs = [(pair, next(shapes)) for pair in self.layer_cache_pairs(entry)]
            role = f"layer {entry.layer}"
            for (past, _), (past_shape, _) in pairs:
                yield past, f"{role} past cache", True, kv, past_shape
            for (_, present), (_, present_shape) in pairs:
                yield present, f"{role} present cache", False, kv, present_shape
        hidden = (self.batch, self.step_len, self.part.hidden_size) if self.part is not None else ()
        if self.part is not None and self.part.hidden_in:
            yield self.part.hidden_in, "hidden state in", True, FLOAT_ELEM_TYPES, hidden
        if self.part is not None and self.part.hidden_out:
            yield self.part.hidden_out, "hidden state out", False, FLOAT_ELEM_TYPES, hidden
        if self.logits is not None:
            yield self.logits, "logits", False, FLOAT_ELEM_TYPES, (self.batch, self.logits_positions(), _ANY)

    def mismatches(
        self,
        inputs: Iterable[onnx.ValueInfoProto],
        outputs: Iterable[onnx.ValueInfoProto],
        *,
        defaults: Collection[str] = (),
    ) -> list[ContractMismatch]:
        """Compare every input and output the contract declares with the graph's: names, dtypes and shapes.

        The one contract-vs-graph comparison: the ``contract`` check reports each mismatch as a finding, the
        runner's contract decoder refuses a graph it cannot drive. Mismatches come in :meth:`declared_tensors`
        order (per tensor: missing, or unverified, then dtype, then shape), then the graph inputs and outputs the
        contract does not name.

        Args:
            inputs: the graph inputs (``graph.input``).
            outputs: the graph outputs, each with the best type its caller knows (an inferred one may stand in
                for a declared one without a static shape).
            defaults: initializer names; a graph input with an initializer default need not be named, and a named
                input that is only an initializer is ``missing``.

        Returns:
            The mismatches (:class:`ContractMismatch`); empty when the graph's I/O is what the contract says.
        """
        given = {True: {v.name: v for v in inputs}, False: {v.name: v for v in outputs}}
        found: list[ContractMismatch] = []
        for name, role, is_input, dtypes, shape in self.declared_tensors():
            if not name:
                continue
            value = given[is_input].get(name)
            if value is None:
                where = ("an initializer" if name in defaults else "not a graph input") if is_input else None
                what = (
                    f"input '{name}' ({role}) is {where}"
                    if is_input
                    else f"output '{name}' ({role}) is not a graph output"
                )
                found.append(ContractMismatch("missing", name, role, what))
                continue
            found += _compare_tensor(name, role, is_input, value, dtypes, shape)
        named = set(self.tensor_names())
        found += [
            ContractMismatch(
                "unnamed_input", n, "", f"graph input '{n}' is not mentioned by the contract, so a host cannot feed it"
            )
            for n in given[True]
            if n not in named and n not in defaults
        ]
        found += [
            ContractMismatch(
                "unnamed_output", n, "", f"graph output '{n}' is not mentioned by the contract; the host will ignore it"
            )
            for n in given[False]
            if n not in named
        ]
        return found

    # -- names -------------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Every tensor name the contract sets (inputs, logits, cache entries), in that order, repeats kept."""
        names = [name for name in self.inputs.model_dump().values() if name]
        names += [n for n in (self.logits, *((self.part.hidden_in, self.part.hidden_out) if self.part else ())) if n]
        for entry in self.cache:
            names += [
                n
                for n in (entry.key_in, entry.value_in, entry.key_out, entry.value_out, entry.kv_in, entry.kv_out)
                if n
            ]
        return names

    def cache_pairs(self) -> list[tuple[str, str]]:
        """Return ``(past_input, present_output)`` name pairs, layer by layer, key before value.

        Returns:
            A list of ``2 * len(cache)`` pairs for BHSD and BHDS_K, ``len(cache)`` for BSH2D.
        """
        return [pair for entry in self.cache for pair in self.layer_cache_pairs(entry)]

    def layer_cache_pairs(self, entry: CacheBinding) -> list[tuple[str, str]]:
        """Return one cache entry's ``(past_input, present_output)`` name pairs, key before value.

        Args:
            entry: an entry of :attr:`cache`.

        Returns:
            ``[(key_in, key_out), (value_in, value_out)]`` for BHSD and BHDS_K, ``[(kv_in, kv_out)]`` for BSH2D.
        """
        # The names are set: the model validator refuses an entry lacking one its layout needs.
        if self.kv_layout == "BSH2D":
            return [(entry.kv_in, entry.kv_out)]  # type: ignore[list-item]
        return [(entry.key_in, entry.key_out), (entry.value_in, entry.value_out)]  # type: ignore[list-item]


def _compare_tensor(
    name: str,
    role: str,
    is_input: bool,
    value: onnx.ValueInfoProto,
    dtypes: frozenset[int],
    shape: tuple[int | str, ...],
) -> list[ContractMismatch]:
    """The dtype and shape mismatches of one graph input/output the contract declares."""
    found = []
    dims = tensor_dims(value)
    elem = value.type.tensor_type.elem_type
    unverified = dims is None and not is_input
    if unverified:
        found.append(ContractMismatch("unverified", name, role, f"output '{name}' ({role}) has no shape"))
    if elem not in dtypes and not (unverified and not elem):  # an output without shape or dtype: nothing to compare
        got = dtype_name(elem) if elem else "unknown"
        wanted = " or ".join(dtype_name(t) for t in sorted(dtypes))
        found.append(
            ContractMismatch("dtype", name, role, f"'{name}' ({role}) has dtype {got}, the contract requires {wanted}")
        )
    if unverified:
        return found
    kind = _shape_mismatch(dims, shape)
    if kind is not None:
        message = f"'{name}' ({role}) has shape {format_dims(dims)}, the contract requires {format_dims(list(shape))}"
        found.append(ContractMismatch(kind, name, role, message + (" with a static V" if _ANY in shape else "")))
    return found


def _shape_mismatch(dims: list[int | str | None] | None, shape: tuple[int | str, ...]) -> MismatchKind | None:
    """``shape`` when the rank or a static dim conflicts, ``not_static`` when a dim is not static, else None."""
    if dims is None:
        return "not_static"
    if len(dims) != len(shape):
        return "shape"
    conflict = any(
        isinstance(got, int) and (got <= 0 if want == _ANY else got != want)
        for got, want in zip(dims, shape, strict=True)
    )
    if conflict:
        return "shape"
    return "not_static" if not all(isinstance(got, int) for got in dims) else None


def _metadata(model: onnx.ModelProto | ir.Model) -> dict[str, str]:
    if isinstance(model, ir.Model):
        return model.metadata_props
    return {prop.key: prop.value for prop in model.metadata_props}


def read_contract(model: onnx.ModelProto | ir.Model, *, source: str = "model") -> DecodeContract | None:
    """Read the decode contract from ``model.metadata_props``.

    Args:
        model: the model, as a ``ModelProto`` (weights need not be loaded) or an ``onnx_ir.Model``.
        source: how to name the model in errors (usually its path).

    Returns:
        The contract, or ``None`` when the model carries none (an exporter-convention model).

    Raises:
        ContractError: the key is present but the JSON is malformed or does not validate (unknown
            ``kv_dtype``, a cache entry lacking a name its layout needs, ...).
    """
    text = _metadata(model).get(CONTRACT_KEY)
    if text is None:
        return None
    try:
        return DecodeContract.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ContractError(f"{source}: metadata_props['{CONTRACT_KEY}'] is invalid: {exc}") from exc


def write_contract(model: onnx.ModelProto | ir.Model, contract: DecodeContract) -> None:
    """Store ``contract`` in ``model.metadata_props`` (replacing any earlier one), in place.

    Args:
        model: the model to annotate, a ``ModelProto`` or an ``onnx_ir.Model``; its ``metadata_props``
            is changed.
        contract: the contract to write as compact JSON.
    """
    text = contract.model_dump_json()
    if isinstance(model, ir.Model):
        model.metadata_props[CONTRACT_KEY] = text
        return
    kept = [p for p in model.metadata_props if p.key != CONTRACT_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=CONTRACT_KEY, value=text)
