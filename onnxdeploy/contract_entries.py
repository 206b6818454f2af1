"""The decode contract's entries: one layer's cache names, the non-cache input names, a graph of a set, a mismatch.

Pydantic and the standard library only; :mod:`onnxdeploy.contract` (which re-exports them) builds
:class:`~onnxdeploy.contract.DecodeContract` from them and owns their meaning (shapes, dtypes, versions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CacheBinding", "ContractInputs", "ContractMismatch", "GraphSetEntry", "MismatchKind"]

MismatchKind = Literal["missing", "dtype", "shape", "not_static", "unverified", "unnamed_input", "unnamed_output"]
"""How a graph input/output disagrees with its contract (:class:`ContractMismatch`)."""


@dataclass(frozen=True)
class ContractMismatch:
    """One way a graph's inputs and outputs disagree with its contract (:meth:`DecodeContract.mismatches`).

    Attributes:
        kind: ``missing``: a tensor the contract names is not a graph input/output; ``dtype``: its element type
            is not the contract's; ``shape``: its rank or a static dim differs from the contract's;
            ``not_static``: the static dims agree but one the contract fixes is symbolic or unknown (or an input's
            rank is unknown); ``unverified``: an output without any shape (its dtype is still compared);
            ``unnamed_input``: a graph input the contract does not name and no initializer feeds (a host cannot
            feed it); ``unnamed_output``: a graph output the contract does not name (a host ignores it).
        name: the tensor.
        role: what the contract calls it (``input_ids``, ``layer 0 past cache``, ``logits``); ``""`` when unnamed.
        message: one line naming the tensor, what the graph has and what the contract requires.
    """

    kind: MismatchKind
    name: str
    role: str
    message: str


class CacheBinding(BaseModel):
    """Names of one layer's cache tensors.

    With ``kv_layout`` ``BHSD`` or ``BHDS_K`` the key/value names are set; with ``BSH2D`` one packed
    ``kv_in``/``kv_out`` pair is used instead. :meth:`DecodeContract.cache_input_shape` and
    :meth:`DecodeContract.cache_output_shape` give their shapes.
    """

    model_config = ConfigDict(extra="forbid")

    layer: int = Field(description="0-based decoder layer index, in graph (data-flow) order.")
    key_in: str | None = Field(default=None, description="Past key input name (BHSD layout).")
    value_in: str | None = Field(default=None, description="Past value input name (BHSD layout).")
    key_out: str | None = Field(default=None, description="Present key output name (BHSD layout).")
    value_out: str | None = Field(default=None, description="Present value output name (BHSD layout).")
    kv_in: str | None = Field(default=None, description="Packed past K/V input (BSH2D layout).")
    kv_out: str | None = Field(default=None, description="Packed present K/V output (BSH2D layout).")
    cache_len: int | None = Field(
        default=None,
        ge=1,
        description="Slots of this layer's buffers; None: max_cache_len (window_cache: W + max(step_lens) - 1 for a "
        "windowed layer, the same in every graph of the set; contract_version >= 5).",
    )
    slot_mapping: Literal["position", "ring"] = Field(
        default="position",
        description="Where position p is written: position: slot p; ring: slot p mod cache_len (the graph computes "
        "it from cache_position, which stays the position; the host never re-slots a ring buffer).",
    )


class ContractInputs(BaseModel):
    """Graph input names for the non-cache inputs; ``None`` where the graph has no such input."""

    model_config = ConfigDict(extra="forbid")

    input_ids: str | None = Field(description="Token ids, int64 (B, step_len); None in a part fed a hidden state.")
    cache_position: str | None = Field(default=None, description="Cache slots this call writes, int64 (step_len,).")
    position_ids: str | None = Field(default=None, description="RoPE/learned positions, int64 (B, step_len).")
    attention_mask: str | None = Field(
        default=None, description="int64 (B, max_cache_len): 1 for slots <= the current position, else 0."
    )
    slot_positions: str | None = Field(
        default=None,
        description="int64 (max_cache_len,): the position each slot holds, EMPTY_SLOT where none (mask: "
        "slot_positions); the graph masks from it.",
    )
    last_token_index: str | None = Field(
        default=None,
        description="int64 (B,): index inside the chunk (0..step_len-1) of the last real token; the graph "
        "computes logits (B, 1, V) for that position only (prefill_logits: last).",
    )


class GraphSetEntry(BaseModel):
    """One graph of a set that shares one weights file (a decode graph or a prefill bucket)."""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(description="File name, relative to the folder of the graph carrying this contract.")
    step_len: int = Field(ge=1, description="Tokens per call S of that graph.")
    max_cache_len: int = Field(ge=1, description="Cache slots of that graph's buffers.")
    prefill_logits: Literal["all", "last"] = Field(
        default="all", description="all: logits (B, S, V); last: logits (B, 1, V) at last_token_index."
    )
    role: Literal["decode", "prefill"] = Field(description="decode: step_len 1; prefill: a bucket, step_len > 1.")
