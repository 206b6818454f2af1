"""``verify.batching``: refuse what cannot be served before any pass; after the write, serve the trace and report.

Before any pass (:func:`check_batching`, exit 2 naming the key): the pipeline must build a row-positions set the
host can drive (a ``static_kv {row_positions: true}`` pass, and ``mask_rewrite`` after it when ``batch > 1``), the
trace file must exist and parse, and every request must fit the set's largest ``max_cache_len`` (``prompt +
max_new_tokens - 1`` slots: the last token is never fed, as the host counts in
:meth:`~onnxdeploy.runner.batching.BatchingHost.run`). With a prefill step length > 1 built at batch 1
(``prefill_batch: 1``) the host prefills through those graphs and every prompt must fit one of them, padding
included (the host's own :meth:`~onnxdeploy.runner.batching.BatchingHost.prefill_plan`, run on the pass's
``(step_len, max_cache_len)`` pairs); without, the prompts go through the decode graph's rows (``prefill: rows``,
the decode graph the set's smallest step length S, whose last call's S − 1 padding slots must fit too). In the
verify stage (:func:`batching_report`) the candidate serves the trace
(:func:`~onnxdeploy.runner.batching_verify.verify_batching`) and every request is compared with its own batch-1
decode of the original; a failing request fails the run (exit 1).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from onnxdeploy.errors import ConfigError
from onnxdeploy.report_verify import BatchingReport, BatchRequestReport

if TYPE_CHECKING:
    from onnxdeploy.config import PipelineConfig
    from onnxdeploy.passes._catalog import StaticKVConfig
    from onnxdeploy.runner.batching import Request

__all__ = ["batching_report", "batching_requests", "check_batching"]

KEY = "verify.batching"


def _where(config: PipelineConfig) -> str:
    return str(config.source) if config.source else str(config.model)


def _row_set(config: PipelineConfig) -> tuple[int, StaticKVConfig]:
    """``(i, config)`` of the ``static_kv`` pass that builds the row-positions set.

    Raises:
        ConfigError: no such pass, ``row_positions`` off, or no ``mask_rewrite`` after a ``batch > 1`` static_kv
            (names ``verify.batching`` and the pass).
    """
    where = _where(config)
    found = [(i, spec.config) for i, spec in enumerate(config.passes) if spec.name == "static_kv"]
    if not found or not found[-1][1].row_positions:
        at = f" (passes[{found[-1][0]}].static_kv has row_positions: false)" if found else ""
        raise ConfigError(
            f"{where}: key '{KEY}': continuous batching needs a set made by static_kv {{row_positions: true, "
            f"prefill_batch: 1, step_lens: [1, S]}} then mask_rewrite in passes{at}"
        )
    i, kv = found[-1]
    if kv.batch > 1 and not any(spec.name == "mask_rewrite" for spec in config.passes[i + 1 :]):
        raise ConfigError(
            f"{where}: key '{KEY}': rows at different positions need mask_rewrite after passes[{i}].static_kv"
        )
    return i, kv


def batching_requests(config: PipelineConfig, vocab: int | None) -> list[Request]:
    """The requests of ``verify.batching``: its ``trace`` file (relative to the pipeline file) or its inline keys.

    Args:
        config: the pipeline (``verify.batching`` set).
        vocab: the model's vocabulary (prompt ids are drawn below it when the trace gives none).

    Raises:
        ConfigError: the trace file is missing or bad, or the trace is (names the key or the file).
    """
    from onnxdeploy.runner.batching_verify import read_trace, trace_requests  # noqa: PLC0415  (numpy, ORT)

    assert config.verify is not None and config.verify.batching is not None
    b, where = config.verify.batching, _where(config)
    if b.trace is None:
        return trace_requests(b, vocab=vocab, where=f"{where}: key '{KEY}'")
    base = Path(config.source).resolve().parent if config.source else Path.cwd()
    file = b.trace.expanduser()
    file = file if file.is_absolute() else base / file
    if not file.is_file():
        raise ConfigError(f"{where}: key '{KEY}.trace': file not found: {file}")
    try:
        return read_trace(file, vocab=vocab)
    except ConfigError as exc:
        raise ConfigError(f"{where}: key '{KEY}.trace': {exc}") from None


def check_batching(config: PipelineConfig, vocab: int | None) -> None:
    """Everything ``verify.batching`` needs that the config decides, checked before any pass (module docstring).

    Raises:
        ConfigError: the passes build no set the host can drive, the trace file is missing or bad, a request
            does not fit the largest ``max_cache_len`` (names the request and the pass).
    """
    if config.verify is None or config.verify.batching is None:
        return
    from onnxdeploy.runner.batching import BatchingHost  # noqa: PLC0415  (numpy, ORT)

    i, kv = _row_set(config)
    limit, where = max(kv.caches()), f"{_where(config)}: key '{KEY}'"
    prefill = kv.prefill_batch if kv.prefill_batch is not None else kv.batch
    rows = not (max(kv.steps()) > min(kv.steps()) and (prefill == 1 or kv.batch == 1))  # BatchingHost's choice
    pad = min(kv.steps()) - 1 if rows else 0
    # the host's own prefill plan, on the (step_len, max_cache_len) pairs the pass will build (no graph yet)
    graphs = [SimpleNamespace(contract=SimpleNamespace(step_len=s, max_cache_len=c)) for s, c in kv.graphs() if s > 1]
    planner = SimpleNamespace(prefill=graphs)
    for r in batching_requests(config, vocab):
        if len(r.prompt) + r.max_new_tokens - 1 + pad > limit:
            padded = f" (+ {pad} padding slots of the last call)" if pad else ""
            raise ConfigError(
                f"{where}: request {r.id}: {len(r.prompt)} prompt + {r.max_new_tokens} new tokens need "
                f"{len(r.prompt) + r.max_new_tokens - 1 + pad} cache slots{padded}, more than max_cache_len {limit} "
                f"of passes[{i}].static_kv; shorten the request or raise max_cache_len(s)"
            )
        if rows:
            continue
        try:
            BatchingHost.prefill_plan(planner, len(r.prompt))  # type: ignore[arg-type]
        except ConfigError as exc:
            raise ConfigError(
                f"{where}: request {r.id}: {exc} (passes[{i}].static_kv step_lens {kv.steps()})"
            ) from None


def batching_report(config: PipelineConfig, candidate: Path, vocab: int | None) -> BatchingReport:
    """Serve ``verify.batching``'s trace on ``candidate`` and compare each request with the original (batch 1).

    Args:
        config: the pipeline (``verify.batching`` set; checked by :func:`check_batching`).
        candidate: the staged primary graph of the set.
        vocab: the model's vocabulary.

    Raises:
        ConfigError / ContractError: the set cannot serve a request (a prompt no prefill graph holds).
        DecodeRunError: ONNX Runtime failed.
    """
    from onnxdeploy.runner.batching_verify import verify_batching  # noqa: PLC0415  (numpy, ORT)

    assert config.verify is not None and config.verify.batching is not None
    b = config.verify.batching
    tolerance = b.max_abs_logit_diff if b.max_abs_logit_diff is not None else config.verify.max_abs_logit_diff
    requests = batching_requests(config, vocab)
    result = verify_batching(config.model, candidate, requests, max_abs_logit_diff=tolerance, policy=b.policy)
    arrival = {r.id: r.arrival for r in requests}
    return BatchingReport(
        passed=result.passed,
        policy=b.policy,
        trace=str(b.trace) if b.trace is not None else "inline",
        batch=result.batch,
        prefill=result.prefill,
        decode_steps=result.steps,
        max_abs_logit_diff_threshold=tolerance,
        requests=[
            BatchRequestReport(
                id=r.id,
                prompt_len=r.prompt_len,
                new_tokens=r.new_tokens,
                equal_tokens=r.equal_tokens,
                max_abs_logit_diff=r.max_abs_logit_diff,
                top1_agreement=r.top1,
                row=r.row,
                arrival=arrival.get(r.id),
                admitted=r.admitted,
                finished=r.finished,
                passed=r.passed(tolerance),
            )
            for r in result.requests
        ],
    )
