"""Bound cache buffers: each layer's past input and present output are one host buffer (ORT IOBinding).

With ``cache_update: full_buffer`` a static graph's present output is its past input with the call's slots
written (ScatterElements at ``cache_position``). Fed as numpy arrays, ONNX Runtime allocates every present
output and the Scatter kernel first copies the whole past into it: ``2 × layers`` buffer copies per call
(~4.7 ms of a ~40 ms step on the 125M LLaMA export of ``benchmarks/decode.py`` at ``max_cache_len`` 1024).
Bound to the same memory, ORT 1.32's CPU ScatterElements skips the copy when its input and output share a
buffer and writes the call's slots in place (README, "Passes" → ``static_kv``).

Whether a kernel may alias its input and output is the kernel's business, not the graph's, so the decoder
checks it once per session (:meth:`ContractDecoder.check_binding`): one call on random cache contents with
numpy feeds and one with bound buffers must give bit-identical logits and buffers, else the decoder refuses
to bind.

The host buffers stay numpy arrays (``OrtValue.ortvalue_from_numpy`` wraps their memory without a copy), so
:meth:`ContractDecoder.cache_buffers` and :meth:`ContractDecoder.load_cache` work the same with or without
binding.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort

__all__ = ["BufferBinding"]


class BufferBinding:
    """The IOBinding of one session: cache pairs on host buffers, other inputs per call, logits ORT-allocated.

    Args:
        session: the ORT session.
        pairs: ``(past_input, present_output)`` names, one per cache tensor.
        logits: the logits output name.
    """

    def __init__(self, session: ort.InferenceSession, pairs: list[tuple[str, str]], logits: str):
        self._binding = session.io_binding()
        self._pairs = pairs
        self._logits = logits
        self._bound: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}
        self._binding.bind_output(logits)  # bound first: output 0 of every run (rebinding keeps a name's slot)

    def run(
        self,
        feeds: dict[str, np.ndarray],
        buffers: dict[str, np.ndarray],
        timed: Callable[[ort.IOBinding], float],
    ) -> tuple[list[np.ndarray], float]:
        """Bind ``feeds`` and the cache buffers, run once, and return ``[logits, *buffers]`` and the call's ms.

        Args:
            feeds: the non-cache inputs (input_ids, cache_position, ...) by name; cache inputs are ignored here.
            buffers: past-input name → host buffer (C-contiguous, ``kv_dtype``); written in place by the call.
            timed: runs the binding once and returns its wall time (ms) (the decoder's timed run).

        Returns:
            ``([logits, *buffers in pair order], latency_ms)``: logits as ORT returned them, the buffers are the
            very arrays of ``buffers``, updated.
        """
        binding = self._binding
        cache = {past for past, _ in self._pairs}
        for name, value in feeds.items():
            if name not in cache:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for past, present in self._pairs:
            array = buffers[past]
            held = self._bound.get(past)
            if held is None or held[0] is not array:
                if not array.flags.c_contiguous:
                    raise ValueError(f"cache buffer '{past}' is not C-contiguous")
                value = ort.OrtValue.ortvalue_from_numpy(array)
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
                self._bound[past] = (array, value)
        binding.bind_output(self._logits)  # a fresh ORT allocation each call: the last call's logits stay valid
        latency_ms = timed(binding)
        logits = binding.get_outputs()[0].numpy()
        return [logits, *(buffers[past] for past, _ in self._pairs)], latency_ms
