"""The decode contract's cache-policy fields (pydantic only): what a host does once a sequence fills the cache.

``cache_policy: {sinks: N, recent: R}`` (StreamingLLM's attention sinks plus a ring of recent tokens; README,
"Past max_cache_len"): a host decodes past ``max_cache_len`` by keeping the first N positions in slots
``0 .. N-1`` and writing position ``p >= max_cache_len`` at slot ``N + (p - N) mod (max_cache_len - N)``, a ring over
the other slots; from then on the query at ``p`` sees the sinks and positions ``p - R + 1 .. p``. K is cached after
RoPE, so a kept key keeps its true position (nothing is re-rotated) and new queries take their true position ids.
The graph masks from the position each slot holds (the input ``slot_positions``, int64 ``(max_cache_len,)``,
:data:`EMPTY_SLOT` where a slot holds none or an evicted position), not from the slot index. This module imports
pydantic only, so the pass catalogue's config can name :class:`CachePolicy` without onnx.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CACHE_POLICY_VERSION", "EMPTY_SLOT", "CachePolicy"]

CACHE_POLICY_VERSION = 5
"""The lowest ``contract_version`` that knows ``cache_policy`` and ``mask: slot_positions``."""

EMPTY_SLOT = 2**62
"""``slot_positions`` value of a slot that holds no visible position: above every query position, so masked."""


class CachePolicy(BaseModel):
    """Attention sinks plus a ring of recent tokens once the cache is full (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    sinks: int = Field(ge=0, description="First positions N kept for ever, in slots 0..N-1.")
    recent: int = Field(
        ge=1, description="Most recent positions R (the current one included) every query sees once the cache is full."
    )
