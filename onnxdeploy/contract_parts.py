"""The decode contract's fields for a model split into parts (``split``), pydantic only.

A model cut at layer boundaries into K graphs is run as a chain: part 0 takes ``input_ids``, every later part
takes the hidden state ``(B, step_len, hidden)`` the part before it returns, each part owns the KV cache of its
own layers, and the last part returns the logits (README, "Passes" → ``split``). Every part's contract lists the
chain (:class:`PartEntry`, in order) and says which part it is (:class:`PartInfo`). These models live apart from
:mod:`onnxdeploy.contract` (which holds :class:`~onnxdeploy.contract.DecodeContract` and imports onnx) so that
module's hunk stays small; it imports them. Contracts with parts carry ``contract_version`` ≥ 5
(:data:`PART_VERSION`), so an older host refuses a part instead of feeding it ``input_ids``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PART_VERSION", "PartEntry", "PartInfo"]

PART_VERSION = 5
"""The lowest ``contract_version`` that knows parts (``part``, ``parts``)."""


class PartEntry(BaseModel):
    """One part of a split graph, as every part's contract lists it (in chain order)."""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(description="File name of the part, relative to the folder of the graph carrying this list.")
    first_layer: int = Field(ge=0, description="Index (in the whole model's data-flow order) of its first layer.")
    num_layers: int = Field(ge=1, description="Decoder layers the part computes (and whose caches it owns).")


class PartInfo(BaseModel):
    """Which part of the chain a graph is, and the hidden-state tensors it exchanges with its neighbours.

    The hidden state is the residual stream between two decoder layers, float ``(B, step_len, hidden_size)`` in the
    model's compute dtype; a host passes one part's ``hidden_out`` to the next part's ``hidden_in`` unchanged.
    """

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0, description="0-based position of this graph in the chain (``parts``).")
    count: int = Field(ge=2, description="Parts in the chain.")
    hidden_size: int = Field(ge=1, description="Last dim of the hidden state exchanged between parts.")
    hidden_in: str | None = Field(
        default=None, description="Graph input taking the previous part's hidden state; None for part 0."
    )
    hidden_out: str | None = Field(
        default=None, description="Graph output with the hidden state for the next part; None for the last part."
    )
    weights_file: str | None = Field(
        default=None,
        description="The data file of this part's weights (split weights: per_part; every graph's part of this "
        "index shares it); None: the run's one weights file.",
    )
