"""The decode contract: how a host drives a transformed decoder (DESIGN.md, "The decode contract").

A transformed model carries the contract as JSON in ``metadata_props`` under the key
``onnxdeploy.contract`` so the runner, or a C++ host on the device, can feed it without guessing.
"""

from __future__ import annotations

import json
from typing import Literal

import onnx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onnxdeploy.errors import ContractError

__all__ = [
    "CONTRACT_KEY",
    "CONTRACT_VERSION",
    "CacheBinding",
    "ContractInputs",
    "DecodeContract",
    "read_contract",
    "write_contract",
]

CONTRACT_KEY = "onnxdeploy.contract"
CONTRACT_VERSION = 1


class CacheBinding(BaseModel):
    """Names of one layer's cache tensors.

    With ``kv_layout`` ``BHSD`` the key/value names are set: inputs ``(B, H_kv, max_cache_len, D)``;
    outputs the same shape for ``full_buffer`` or ``(B, H_kv, step_len, D)`` for ``new_token_only``.
    With ``BSH2D`` one packed ``kv_in``/``kv_out`` pair is used instead.
    """

    model_config = ConfigDict(extra="forbid")

    layer: int = Field(description="0-based decoder layer index, in graph (data-flow) order.")
    key_in: str | None = Field(default=None, description="Past key input name.")
    value_in: str | None = Field(default=None, description="Past value input name.")
    key_out: str | None = Field(default=None, description="Present key output name.")
    value_out: str | None = Field(default=None, description="Present value output name.")
    kv_in: str | None = Field(default=None, description="Packed past K/V input (BSH2D layout).")
    kv_out: str | None = Field(default=None, description="Packed present K/V output (BSH2D layout).")


class ContractInputs(BaseModel):
    """Graph input names for the non-cache inputs; ``None`` where the graph has no such input."""

    model_config = ConfigDict(extra="forbid")

    input_ids: str = Field(description="Token ids, int64 (B, step_len).")
    cache_position: str | None = Field(default=None, description="Cache slots this call writes, int64 (step_len,).")
    position_ids: str | None = Field(default=None, description="RoPE/learned positions, int64 (B, step_len).")
    attention_mask: str | None = Field(
        default=None, description="int64 (B, max_cache_len): 1 for slots <= the current position, else 0."
    )


class DecodeContract(BaseModel):
    """The I/O contract of a static decode graph (contract_version 1).

    Shapes: ``input_ids`` int64 ``(batch, step_len)``; ``cache_position`` int64 ``(step_len,)``;
    past cache ``(batch, num_kv_heads, max_cache_len, head_dim_padded)`` of ``kv_dtype`` (BHSD);
    logits float ``(batch, step_len, vocab)``.
    """

    model_config = ConfigDict(extra="forbid")

    contract_version: int = CONTRACT_VERSION
    batch: int = Field(ge=1)
    step_len: int = Field(ge=1)
    max_cache_len: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    head_dim_padded: int = Field(ge=1)
    kv_layout: Literal["BHSD", "BSH2D"] = "BHSD"
    kv_dtype: str = "float32"
    cache_update: Literal["full_buffer", "new_token_only"] = "full_buffer"
    inputs: ContractInputs
    logits: str = "logits"
    cache: list[CacheBinding]

    def cache_pairs(self) -> list[tuple[str, str]]:
        """Return ``(past_input, present_output)`` name pairs, layer by layer, key before value.

        Returns:
            A list of ``2 * num_layers`` pairs for BHSD, ``num_layers`` for BSH2D.
        """
        pairs: list[tuple[str, str]] = []
        for entry in self.cache:
            if self.kv_layout == "BSH2D":
                pairs.append((entry.kv_in, entry.kv_out))  # type: ignore[arg-type]
            else:
                pairs.append((entry.key_in, entry.key_out))  # type: ignore[arg-type]
                pairs.append((entry.value_in, entry.value_out))  # type: ignore[arg-type]
        return pairs


def read_contract(model: onnx.ModelProto, *, source: str = "model") -> DecodeContract | None:
    """Read the decode contract from ``model.metadata_props``.

    Args:
        model: the ONNX model.
        source: how to name the model in errors (usually its path).

    Returns:
        The contract, or ``None`` when the model carries none (an exporter-convention model).

    Raises:
        ContractError: the key is present but the JSON is malformed or does not validate.
    """
    for prop in model.metadata_props:
        if prop.key == CONTRACT_KEY:
            try:
                return DecodeContract.model_validate(json.loads(prop.value))
            except (json.JSONDecodeError, ValidationError) as exc:
                raise ContractError(f"{source}: metadata_props['{CONTRACT_KEY}'] is invalid: {exc}") from exc
    return None


def write_contract(model: onnx.ModelProto, contract: DecodeContract) -> None:
    """Store ``contract`` in ``model.metadata_props`` (replacing any earlier one), in place.

    Args:
        model: the model to annotate; its ``metadata_props`` is changed.
        contract: the contract to write as compact JSON.
    """
    kept = [p for p in model.metadata_props if p.key != CONTRACT_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=CONTRACT_KEY, value=contract.model_dump_json())
