"""Decode loop for a model without a contract, driven by the exporter convention (docs/ARCHITECTURE.md, "Runner").

The convention (optimum, the TorchScript and dynamo exporters): inputs ``input_ids`` (B, S) int64,
``attention_mask`` (B, past+S), ``position_ids`` (B, S) if present, ``past_key_values.{i}.key|value``
(B, H_kv, past, D); outputs ``logits`` (B, S, V) and ``present.{i}.key|value`` (B, H_kv, past+S, D),
fed back as the next call's past. Inputs are fed by name: their order differs between exporters.
A cache whose tensors are renamed is paired by data flow instead (:func:`exporter_cache_pairs`), and the
logits are the one output that is not a present (an export may call it ``lm_logits``:
:func:`exporter_logits_output`). A static batch dim of ``input_ids`` (e.g. ``[2, "sequence_length"]``) is
fed that many identical rows.

onnxruntime-genai builder exports follow the same convention without ``position_ids`` (positions come from
``attention_mask`` inside GroupQueryAttention: ``seqlens_k = sum - 1``), with all keys before all values, and
with the head dim as the symbol ``kv_cache_dim``: the empty past then takes D from ``genai_config.json``
beside the model or from the attention op's projection weights (:func:`exporter_head_dim`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnxdeploy.errors import ContractError, PreconditionError
from onnxdeploy.kv_cache import find_kv_cache, genai_head_size
from onnxdeploy.runner.decode_state import DecodeState
from onnxdeploy.runner.session import ModelSession, numpy_dtype

__all__ = ["ExporterDecoder", "exporter_batch", "exporter_cache_pairs", "exporter_head_dim", "exporter_logits_output"]

_PAST_INPUT = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


def exporter_cache_pairs(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """Pair each past K/V input with the present output that becomes the next call's past.

    The exporter naming convention ``past_key_values.{i}.key|value`` -> ``present.{i}.key|value``
    decides when the graph has such inputs (it also covers fused attention ops, where no Concat
    joins past and present). Without them the cache is discovered by data flow
    (:func:`onnxdeploy.kv_cache.find_kv_cache`: input -> Concat -> output), so renamed caches work.

    Args:
        model: the exporter-convention model (weights not needed).

    Returns:
        ``(past_input, present_output)`` name pairs ordered by layer, key before value.

    Raises:
        ContractError: a named past input has no matching present output, or the graph has no
            named past inputs and data flow finds no cache either.
    """
    initializers = {init.name for init in model.graph.initializer}
    outputs = {out.name for out in model.graph.output}
    found: list[tuple[int, int, str, str]] = []
    for graph_input in model.graph.input:
        match = _PAST_INPUT.match(graph_input.name)
        if match is None or graph_input.name in initializers:
            continue
        layer, kind = int(match.group(1)), match.group(2)
        present = f"present.{layer}.{kind}"
        if present not in outputs:
            raise ContractError(
                f"past input '{graph_input.name}' has no matching output '{present}' (exporter convention)"
            )
        found.append((layer, 0 if kind == "key" else 1, graph_input.name, present))
    if found:
        return [(past, present) for _, _, past, present in sorted(found)]
    try:
        return find_kv_cache(ir.serde.deserialize_model(model), who="runner").pairs()
    except PreconditionError as exc:
        raise ContractError(
            "the model has neither a decode contract nor 'past_key_values.{i}.key|value' inputs, and no "
            f"KV cache was found by data flow: {exc.detail}"
        ) from exc


def exporter_logits_output(model: onnx.ModelProto, pairs: Sequence[tuple[str, str]] | None = None) -> str:
    """Name the logits output ``(B, S, V)`` of an exporter-convention model: the one output that is not a present.

    Args:
        model: the exporter-convention model (weights not needed).
        pairs: its cache pairs, if already known (else :func:`exporter_cache_pairs`).

    Returns:
        The output's name (``logits``, ``lm_logits``, ...).

    Raises:
        ContractError: no output, or more than one, besides the present outputs; or no KV cache (see
            :func:`exporter_cache_pairs`).
    """
    presents = {present for _, present in (pairs if pairs is not None else exporter_cache_pairs(model))}
    # find_logits_output's rule on the proto's output names (deserializing the graph cost ~0.35 s at 125M).
    others = [out.name for out in model.graph.output if out.name not in presents]
    if len(others) != 1:
        raise ContractError(
            f"exporter convention: expected one logits output besides the cache outputs; found {others}"
        )
    return others[0]


def exporter_batch(model: onnx.ModelProto) -> int:
    """Batch rows B to feed an exporter-convention model: the static dim 0 of ``input_ids``, else 1.

    Args:
        model: the exporter-convention model (weights not needed).

    Returns:
        B >= 1 (every row is fed the same tokens; row 0 is compared).
    """
    ids = next((value for value in model.graph.input if value.name == "input_ids"), None)
    dims = ids.type.tensor_type.shape.dim if ids is not None else []
    return dims[0].dim_value if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0 else 1


def exporter_head_dim(model: onnx.ModelProto, path: str | None) -> int:
    """D of a cache whose inputs leave it symbolic (genai's ``kv_cache_dim``).

    Args:
        model: the exporter-convention model header (weights not needed: only the weights' shapes are read).
        path: its file; a ``genai_config.json`` beside it gives ``model.decoder.head_size``.

    Returns:
        D, from genai_config.json when present (checked against the weights' shapes), else from the weights.

    Raises:
        ContractError: neither gives D, or they disagree.
    """
    try:
        return find_kv_cache(ir.serde.deserialize_model(model), who="runner", head_dim=genai_head_size(path)).head_dim
    except PreconditionError as exc:
        raise ContractError(f"the cache's head dim is symbolic and could not be resolved: {exc.detail}") from exc


class ExporterDecoder(DecodeState):
    """Greedy-decode driver for exporter-convention models with a growing (dynamic) KV cache.

    Each :meth:`feed` is one ``session.run`` over all tokens given (the prompt as one prefill call,
    then one token per call); the call's latency is attributed to every position it computes.
    Batch rows all receive the same tokens (B from :func:`exporter_batch`); logits are returned for row 0.

    Args:
        model_session: the loaded model; the decoder closes it in :meth:`close`.

    Raises:
        ContractError: an input outside the convention, no ``input_ids``, no single logits output (see
            :func:`exporter_logits_output`), no KV cache (see :func:`exporter_cache_pairs`), a past input
            whose head count or head dim is not static, or an element type the runner cannot feed.
    """

    def __init__(self, model_session: ModelSession):
        DecodeState.__init__(self, model_session)
        inputs = model_session.input_types()
        if "input_ids" not in inputs:
            raise ContractError(f"{self.source}: exporter convention needs an 'input_ids' input")
        self._pairs = exporter_cache_pairs(model_session.model)
        try:
            logits = exporter_logits_output(model_session.model, self._pairs)
        except ContractError as exc:
            raise ContractError(f"{self.source}: {exc}") from exc
        self._batch = exporter_batch(model_session.model)
        self._mask_dtype = (
            numpy_dtype(inputs["attention_mask"][1], tensor="attention_mask") if "attention_mask" in inputs else None
        )
        self._has_position_ids = "position_ids" in inputs
        self._empty_past: dict[str, np.ndarray] = {}
        resolved: int | None = None
        for past, _ in self._pairs:
            shape, ort_type = inputs[past]
            heads, head_dim = shape[1], shape[3]
            if isinstance(heads, int) and not isinstance(head_dim, int):
                resolved = resolved or exporter_head_dim(model_session.model, model_session.path)
                head_dim = resolved
            if not (isinstance(heads, int) and isinstance(head_dim, int)):
                raise ContractError(
                    f"{self.source}: past input '{past}' has shape {shape}; H_kv (dim 1) and D (dim 3) must be static"
                )
            self._empty_past[past] = np.zeros(
                (self._batch, heads, 0, head_dim), dtype=numpy_dtype(ort_type, tensor=past)
            )
        known = {"input_ids", "attention_mask", "position_ids", *self._empty_past}
        unknown = sorted(set(inputs) - known)
        if unknown:
            raise ContractError(f"{self.source}: inputs outside the exporter convention: {unknown}")
        self._logits = logits
        self._output_names = [logits, *(present for _, present in self._pairs)]
        self._past: dict[str, np.ndarray] = {}
        self.reset()

    def reset(self) -> None:
        """Drop the cache: the next :meth:`feed` starts at position 0 with an empty past."""
        self._past = dict(self._empty_past)
        self._reset_counters()

    def feed(self, tokens: Sequence[int]) -> list[tuple[np.ndarray, float]]:
        """Run the model on ``tokens`` in one call, appending them to the cache.

        Args:
            tokens: token ids for positions ``position .. position + len(tokens) - 1``.

        Returns:
            One ``(logits, latency_ms)`` per token: logits float32 ``(V,)`` of batch row 0 at that
            position; latency_ms is the wall time of the single ``session.run`` (ms).

        Raises:
            ContractError: the logits output does not hold one row per token fed.
            DecodeRunError: ONNX Runtime failed, or the decoder is closed.
        """
        if not tokens:
            return []
        steps = len(tokens)
        total = self._position + steps
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.tile(np.asarray(tokens, dtype=np.int64), (self._batch, 1)),
            **self._past,
        }
        if self._mask_dtype is not None:
            feeds["attention_mask"] = np.ones((self._batch, total), dtype=self._mask_dtype)
        if self._has_position_ids:
            feeds["position_ids"] = np.tile(np.arange(self._position, total, dtype=np.int64), (self._batch, 1))
        results, latency_ms = self._timed_run(self._output_names, feeds)
        logits = np.asarray(results[0][0], dtype=np.float32)
        if logits.shape[0] != steps:
            raise ContractError(
                f"{self.source}: '{self._logits}' has {logits.shape[0]} positions for {steps} tokens fed; "
                "expected (B, S, V) logits for every position"
            )
        self._past = {past: present for (past, _), present in zip(self._pairs, results[1:], strict=True)}
        self._position = total
        return [(logits[i], latency_ms) for i in range(steps)]
