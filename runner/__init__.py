"""Runner: step-by-step decode verification on ONNX Runtime (docs/ARCHITECTURE.md, "Runner").

Two decode loops share the :class:`Decoder` interface: :class:`ExporterDecoder` for models that follow
the exporter convention (dynamic KV cache) and :class:`ContractDecoder` for models carrying a decode
contract (fixed cache buffers). :func:`verify` compares a candidate against the original position by
position, holding one model at a time; :func:`greedy_decode` produces a model's greedy continuation and
logits. Sessions open models by path with weights memory-mapped (:func:`open_session`); decoders and
sessions are context managers.
"""

from onnxdeploy.runner.accuracy import evaluate_accuracy, teacher_forced_logits
from onnxdeploy.runner.compare import latency_summary, step_record, summarize_mode
from onnxdeploy.runner.contract_decoder import ContractDecoder
from onnxdeploy.runner.decoder import Decoder, make_decoder, open_decoder
from onnxdeploy.runner.exporter_decoder import (
    ExporterDecoder,
    exporter_batch,
    exporter_cache_pairs,
    exporter_logits_output,
)
from onnxdeploy.runner.session import DEFAULT_PROVIDERS, ModelSession, open_session, read_header, session_options
from onnxdeploy.runner.verify import MODES, ProgressCallback, check_header, greedy_decode, logits_vocab, verify

__all__ = [
    "evaluate_accuracy",
    "teacher_forced_logits",
    "DEFAULT_PROVIDERS",
    "MODES",
    "ContractDecoder",
    "Decoder",
    "ExporterDecoder",
    "ModelSession",
    "ProgressCallback",
    "exporter_batch",
    "check_header",
    "exporter_cache_pairs",
    "exporter_logits_output",
    "greedy_decode",
    "latency_summary",
    "logits_vocab",
    "make_decoder",
    "open_decoder",
    "open_session",
    "read_header",
    "session_options",
    "step_record",
    "summarize_mode",
    "verify",
]
