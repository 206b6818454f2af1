"""Decode loop for a transformed model that carries a decode contract (DESIGN.md, "The decode contract").

The host owns fixed cache buffers of ``max_cache_len`` slots, zero at reset. Each call feeds exactly
``step_len`` tokens at positions ``p .. p + step_len - 1``: ``input_ids`` (B, step_len),
``cache_position`` (step_len,) = those positions, ``position_ids`` (B, step_len) = the same, and
``attention_mask`` (B, max_cache_len) with 1 for slots <= the last position of the call. With
``cache_update: full_buffer`` the present outputs replace the buffers; with ``new_token_only`` they hold
only the call's K/V and the host writes them into the buffers at ``cache_position``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxdeploy.contract import DecodeContract
from onnxdeploy.errors import CacheOverflowError, ContractError
from onnxdeploy.runner.decode_state import DecodeState
from onnxdeploy.runner.session import ModelSession

__all__ = ["ContractDecoder"]


class ContractDecoder(DecodeState):
    """Greedy-decode driver for a static-shape model described by a :class:`DecodeContract`.

    Tokens are fed in chunks of ``step_len``, one ``session.run`` per chunk; a feed whose length is
    not a multiple of ``step_len`` is refused rather than padded, because padding tokens would be
    written into cache slots (and could overflow the buffer) that the host never asked for. Batch
    rows all receive the same tokens; logits are returned for row 0. Shapes and dtypes come from the
    contract (:meth:`DecodeContract.cache_input_shape`, :attr:`DecodeContract.kv_numpy_dtype`, ...), so
    both ``BHSD`` ``(B, H_kv, max_cache_len, D_padded)`` and ``BSH2D`` ``(B, max_cache_len, H_kv, 2·D_padded)``
    layouts are driven.

    Args:
        model_session: the loaded model; the decoder closes it in :meth:`close`.
        contract: the model's contract (``read_contract(model_session.model)``).

    Raises:
        ContractError: the contract names an input or output the graph lacks, the graph has an input
            the contract does not describe, a cache input's element type is not ``kv_dtype`` or its static
            shape disagrees with the contract, or ``kv_dtype`` is one ORT's Python API cannot feed
            (bfloat16).
    """

    def __init__(self, model_session: ModelSession, contract: DecodeContract):
        DecodeState.__init__(self, model_session)
        self.contract = contract
        inputs = model_session.input_types()
        outputs = set(model_session.output_names())
        self._pairs = contract.cache_pairs()
        named = {role: name for role, name in contract.inputs.model_dump().items() if name is not None}
        expected_inputs = {*named.values(), *(past for past, _ in self._pairs)}
        expected_outputs = {contract.logits, *(present for _, present in self._pairs)}
        missing = sorted((expected_inputs - set(inputs)) | (expected_outputs - outputs))
        if missing:
            raise ContractError(f"{self.source}: contract names tensors the graph lacks: {missing}")
        unfed = sorted(set(inputs) - expected_inputs)
        if unfed:
            raise ContractError(f"{self.source}: graph inputs not described by the contract: {unfed}")
        if contract.kv_dtype == "bfloat16":
            raise ContractError(f"{self.source}: kv_dtype bfloat16 cannot be fed through ONNX Runtime's Python API")
        self._inputs = named
        self._buffer_shape = contract.cache_input_shape()
        self._written_shape = contract.cache_output_shape()
        declared = {value.name: value.type.tensor_type for value in model_session.model.graph.input}
        for past, _ in self._pairs:
            tensor_type = declared[past]
            if tensor_type.elem_type != contract.kv_onnx_type:
                raise ContractError(f"{self.source}: '{past}' is {inputs[past][1]} but kv_dtype is {contract.kv_dtype}")
            shape = inputs[past][0]
            for axis, (dim, want) in enumerate(zip(shape, self._buffer_shape, strict=True)):
                if isinstance(dim, int) and dim != want:
                    raise ContractError(
                        f"{self.source}: '{past}' has shape {shape}; the contract implies "
                        f"{list(self._buffer_shape)} (dim {axis} differs)"
                    )
        self._output_names = [contract.logits, *(present for _, present in self._pairs)]
        self._buffers: dict[str, np.ndarray] = {}
        self.reset()

    def reset(self) -> None:
        """Zero the cache buffers; the next :meth:`feed` starts at position 0."""
        self._buffers = {
            past: np.zeros(self._buffer_shape, dtype=self.contract.kv_numpy_dtype) for past, _ in self._pairs
        }
        self._reset_counters()

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray, float]]:
        """Run the model on ``tokens``, ``step_len`` tokens per ``session.run``.

        The whole feed is checked against ``max_cache_len`` first: if any slot it would write is
        ``>= max_cache_len`` nothing runs and the decoder state is unchanged.

        Args:
            tokens: token ids for positions ``position .. position + len(tokens) - 1``; the count
                must be a multiple of ``step_len``.

        Returns:
            One ``(logits, latency_ms)`` per token: logits float32 ``(V,)`` of batch row 0 at that
            position; latency_ms is the wall time of the ``session.run`` that computed it (ms).

        Raises:
            CacheOverflowError: a slot to write is ``>= max_cache_len`` (raised before ``session.run``).
            ContractError: ``len(tokens)`` is not a multiple of ``step_len``, or a present output's
                shape disagrees with ``cache_update``.
            DecodeRunError: ONNX Runtime failed, or the decoder is closed.
        """
        c = self.contract
        if len(tokens) % c.step_len:
            raise ContractError(
                f"{self.source}: step_len={c.step_len} graph is fed {c.step_len} tokens per call; "
                f"got {len(tokens)} tokens (not a multiple)"
            )
        end = self._position + len(tokens)
        if end > c.max_cache_len:
            raise CacheOverflowError(max(self._position, c.max_cache_len), c.max_cache_len)
        results: list[tuple[np.ndarray, float]] = []
        for start in range(0, len(tokens), c.step_len):
            results.extend(self._run_step(tokens[start : start + c.step_len]))
        return results

    def _run_step(self, chunk: Sequence[int]) -> list[tuple[np.ndarray, float]]:
        c = self.contract
        slots = np.arange(self._position, self._position + c.step_len, dtype=np.int64)
        feeds: dict[str, np.ndarray] = {
            self._inputs["input_ids"]: np.broadcast_to(np.asarray(chunk, dtype=np.int64), c.input_ids_shape()).copy(),
            **self._buffers,
        }
        if "cache_position" in self._inputs:
            feeds[self._inputs["cache_position"]] = slots.reshape(c.cache_position_shape())
        if "position_ids" in self._inputs:
            feeds[self._inputs["position_ids"]] = np.broadcast_to(slots, c.position_ids_shape()).copy()
        if "attention_mask" in self._inputs:
            mask = np.zeros(c.attention_mask_shape(), dtype=np.int64)
            mask[:, : slots[-1] + 1] = 1
            feeds[self._inputs["attention_mask"]] = mask
        results, latency_ms = self._timed_run(self._output_names, feeds)
        presents = results[1:]
        for (_, name), present in zip(self._pairs, presents, strict=True):
            if present.shape != self._written_shape:
                raise ContractError(
                    f"{self.source}: '{name}' has shape {list(present.shape)}; cache_update "
                    f"'{c.cache_update}' implies {list(self._written_shape)}"
                )
        for (past, _), present in zip(self._pairs, presents, strict=True):
            if c.cache_update == "full_buffer":
                self._buffers[past] = present
            else:
                index = [slice(None)] * present.ndim
                index[c.cache_sequence_axis] = slice(int(slots[0]), int(slots[-1]) + 1)
                self._buffers[past][tuple(index)] = present
        self._position += c.step_len
        logits = np.asarray(results[0][0], dtype=np.float32)
        return [(logits[i], latency_ms) for i in range(c.step_len)]
