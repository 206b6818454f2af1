"""The continuous-batching host against each request's own batch-1 decode of the original export.

A set ``static_kv {batch: 3, row_positions: true, prefill_batch: 1, step_lens: [1, 4], max_cache_lens: [32, 64]}``
+ ``mask_rewrite`` serves a deterministic trace of requests of different prompt lengths and lengths, arriving at
different steps (rows are refilled mid-stream, so a row holds the stale values of its previous sequence). Every
request's greedy tokens must equal its batch-1 greedy decode on the original export and the logits they were chosen
from must agree to 1e-4 (top-1 100%), with every row in use, with one row idle and full of NaN, under static
batching, and on the batch-1 set (batch-1 serving). The same with the prompts prefilled through the decode graph's
own rows (``prefill="rows"``), on one-graph sets of step_len 1 and 4 (chunked prefill, decoding rows padded).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxdeploy.errors import ConfigError, ContractError
from onnxdeploy.runner.batching import BatchingHost, Request
from onnxdeploy.runner.batching_verify import read_trace, verify_batching
from onnxdeploy.runner.graph_set import open_graph_set
from onnxdeploy.runner.verify import greedy_decode
from tests.conftest import fixture_entry
from tests.runner.test_row_positions import build_row_set

STEP_LENS = [1, 4]
CACHE_LENS = [32, 64]
TRACE = [  # (prompt length, max new tokens, arrival step)
    (5, 12, 0),
    (1, 6, 0),
    (13, 20, 1),
    (9, 3, 2),
    (20, 9, 4),
    (3, 15, 9),
    (17, 7, 9),
    (6, 10, 30),
]


def _requests(name: str, stop: dict[int, int] | None = None) -> list[Request]:
    vocab = fixture_entry(name)["config"]["vocab"]
    rng = np.random.default_rng(3)
    return [
        Request(
            id=i,
            prompt=tuple(rng.integers(1, vocab, size=p).tolist()),
            max_new_tokens=n,
            arrival=a,
            stop_token=(stop or {}).get(i),
        )  # fmt: skip
        for i, (p, n, a) in enumerate(TRACE)
    ]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """The fixture's row-positions sets (batch 3 and batch 1) and each request's batch-1 reference."""
    name = "llama_gqa_optimum"
    folder = tmp_path_factory.mktemp("batching")
    config = {"prefill_batch": 1, "step_lens": STEP_LENS, "max_cache_lens": CACHE_LENS}
    sets: dict = {b: build_row_set(name, folder / f"b{b}", batch=b, **config) for b in (3, 1)}
    for step in (1, 4):  # one graph: the prompts go through the decode graph's rows
        one = {"step_lens": None, "max_cache_lens": None, "step_len": step, "max_cache_len": 64}
        sets[f"rows{step}"] = build_row_set(name, folder / f"rows{step}", batch=3, **one)
    model = fixture_entry(name)["model_path"]
    refs = {r.id: greedy_decode(model, list(r.prompt), r.max_new_tokens) for r in _requests(name)}
    return {"name": name, "sets": sets, "refs": refs}


def _check(run, refs, *, tol: float = 1e-4) -> None:
    for f in run.finished:
        tokens, logits = refs[f.request.id]
        p, n = len(f.request.prompt), len(f.tokens)
        assert f.tokens == tokens[:n].tolist(), f.request.id
        want = logits[p - 1 : p - 1 + n]
        got = np.stack(f.logits)
        assert np.abs(got - want).max() <= tol, (f.request.id, float(np.abs(got - want).max()))
        assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
        if f.request.stop_token is None:
            assert n == f.request.max_new_tokens
        else:
            assert f.tokens[-1] == f.request.stop_token and f.request.stop_token not in f.tokens[:-1]


def test_continuous_batching_matches_each_requests_batch1_decode(served) -> None:
    with open_graph_set(served["sets"][3]) as decoder:
        host = BatchingHost(decoder, keep_logits=True)
        run = host.run(_requests(served["name"]))
    _check(run, served["refs"])
    rows = {f.row for f in run.finished}
    assert rows == {0, 1, 2}  # every row refilled at least once: stale values of an earlier sequence in each
    assert sum(len(f.tokens) - 1 for f in run.finished) <= 3 * run.steps  # decode calls carried several rows
    assert run.steps < sum(n - 1 for _, n, _ in TRACE)
    assert len(run.step_ms) == run.steps and run.tokens_per_s > 0


def test_a_nan_row_and_a_stop_token_change_nothing_for_the_others(served) -> None:
    refs = served["refs"]
    stop = {2: int(refs[2][0][4]), 5: int(refs[5][0][0])}  # stops after 5 tokens, and at the prefill's own
    stop = {i: t for i, t in stop.items() if t not in refs[i][0][: (4 if i == 2 else 0)].tolist()}
    with open_graph_set(served["sets"][3]) as decoder:
        host = BatchingHost(decoder, keep_logits=True, idle_rows={1})
        for buffer in host.buffers.values():
            buffer[1] = np.nan
        run = host.run(_requests(served["name"], stop))
    _check(run, refs)
    assert {f.row for f in run.finished} == {0, 2}
    axes = host.decode.contract.pair_sequence_axes()
    for b, axis in zip(host.buffers.values(), axes, strict=True):  # the idle row: only slot 0 ever written
        assert np.isnan(np.delete(b[1], 0, axis=axis - 1)).all()


def test_static_batching_and_batch1_serving_decode_the_same(served) -> None:
    with open_graph_set(served["sets"][3]) as decoder:
        static = BatchingHost(decoder, keep_logits=True).run(_requests(served["name"]), policy="static")
    _check(static, served["refs"])
    with open_graph_set(served["sets"][1]) as decoder:
        single = BatchingHost(decoder, keep_logits=True).run(_requests(served["name"]))
    _check(single, served["refs"])
    assert single.steps == sum(n - 1 for _, n, _ in TRACE)  # one request at a time


@pytest.mark.parametrize("step", [1, 4])
def test_prefill_through_the_decode_rows_matches_each_requests_batch1_decode(served, step: int) -> None:
    refs = served["refs"]
    stop = {2: int(refs[2][0][4])} if int(refs[2][0][4]) not in refs[2][0][:4].tolist() else {}
    with open_graph_set(served["sets"][f"rows{step}"]) as decoder:
        host = BatchingHost(decoder, keep_logits=True, idle_rows={1})
        assert host.prefill_mode == "rows" and host.prefill == [] and host.decode.contract.step_len == step
        for buffer in host.buffers.values():
            buffer[1] = np.nan
        run = host.run(_requests(served["name"], stop))
        calls = len(host.decode.call_records)
    _check(run, refs)
    assert run.prefill_ms == [] and calls == run.steps  # no other graph ran
    assert {f.row for f in run.finished} == {0, 2}  # both rows refilled: stale values of an earlier sequence
    prompts = sum(-(-p // step) for p, _, _ in TRACE)  # calls that carry a prompt chunk of some row
    assert run.steps < prompts + sum(n - 1 for _, n, _ in TRACE)  # rows decoded and prefilled in the same calls
    with open_graph_set(served["sets"][f"rows{step}"]) as decoder:
        static = BatchingHost(decoder, keep_logits=True).run(_requests(served["name"]), policy="static")
    _check(static, refs)


def test_prefill_mode_is_checked(served) -> None:
    with open_graph_set(served["sets"]["rows1"]) as decoder:
        with pytest.raises(ContractError, match="no batch-1 prefill graph"):
            BatchingHost(decoder, prefill="graphs")
        with pytest.raises(ConfigError, match="prefill must be graphs or rows"):
            BatchingHost(decoder, prefill="chunks")  # type: ignore[arg-type]
    with open_graph_set(served["sets"]["rows4"]) as decoder:
        host = BatchingHost(decoder)
        with pytest.raises(ConfigError, match=r"request 7: 50 prompt \+ 13 new tokens \(\+ 3 padding slots"):
            host.run([Request(id=7, prompt=(1,) * 50, max_new_tokens=13)])  # 62 slots fit, the last call's 65 not
        assert host.decode.call_records == []


def test_requests_that_cannot_run_are_refused_before_any_call(served) -> None:
    with open_graph_set(served["sets"][3]) as decoder:
        host = BatchingHost(decoder)
        with pytest.raises(ConfigError, match="request 7: 60 prompt \\+ 10 new tokens pass the decode cache"):
            host.run([Request(id=7, prompt=(1,) * 60, max_new_tokens=10)])
        assert host.decode.call_records == []


def test_a_batch_of_rows_without_row_positions_is_refused(tmp_path: Path) -> None:
    name = "llama_gqa_optimum"
    primary = build_row_set(name, tmp_path / "s", row_positions=False, step_lens=STEP_LENS, max_cache_lens=[32])
    with open_graph_set(primary) as decoder, pytest.raises(ContractError, match="needs row_positions"):
        BatchingHost(decoder)


def test_verify_batching_reads_its_trace_from_a_file(served, tmp_path: Path) -> None:
    trace = tmp_path / "trace.yaml"
    trace.write_text(
        "vocab: 512\nseed: 1\nrequests:\n"
        "  - {prompt_len: 7, max_new_tokens: 9, arrival: 0}\n"
        "  - {prompt: [1, 17, 42], max_new_tokens: 6, arrival: 2}\n"
        "  - {prompt_len: 19, max_new_tokens: 4, arrival: 2}\n"
        "  - {prompt_len: 2, max_new_tokens: 11, arrival: 5}\n"
    )
    requests = read_trace(trace)
    assert [(len(r.prompt), r.max_new_tokens, r.arrival) for r in requests] == [(7, 9, 0), (3, 6, 2), (19, 4, 2),
                                                                                (2, 11, 5)]  # fmt: skip
    model = fixture_entry(served["name"])["model_path"]
    result = verify_batching(model, served["sets"][3], requests)
    assert result.passed and len(result.requests) == 4, result.requests
    drawn = tmp_path / "poisson.yaml"
    drawn.write_text(
        "poisson: {count: 5, prompt_lens: [4, 10], new_tokens: [2, 5], mean_gap: 2, seed: 0, vocab: 512}\n"
    )
    assert len(read_trace(drawn)) == 5
    (tmp_path / "bad.yaml").write_text("requests:\n  - {max_new_tokens: 3}\n")
    with pytest.raises(ConfigError, match="bad.yaml: bad trace entry"):
        read_trace(tmp_path / "bad.yaml")


@pytest.mark.parametrize(("policy", "workers"), [("continuous", 1), ("static", 2)])
def test_concurrent_prefill_decodes_every_request_bit_identically(served, policy: str, workers: int) -> None:
    """Prefills on worker threads beside the decode loop: the same tokens and logits, to the bit, per request.

    When a prefill is placed depends on timing (the first step boundary after its worker finished), so which row
    a request gets and at which step may change; rows never interact, so its tokens and logits may not. Bound
    buffers: two workers run the same prefill graph at once (one IOBinding per thread).
    """
    requests = _requests(served["name"])
    with open_graph_set(served["sets"][3], bind_buffers=True) as decoder:
        alone = BatchingHost(decoder, keep_logits=True, idle_rows={1})
        for buffer in alone.buffers.values():
            buffer[1] = np.nan
        one_thread = alone.run(requests, policy=policy)  # type: ignore[arg-type]
        host = BatchingHost(decoder, keep_logits=True, idle_rows={1}, prefill_workers=workers)
        for buffer in host.buffers.values():
            buffer[1] = np.nan
        run = host.run(requests, policy=policy)  # type: ignore[arg-type]
        again = host.run(requests, policy=policy)  # type: ignore[arg-type]  # stale rows, spare prefill buffers
    _check(run, served["refs"])
    for f, g, h in zip(one_thread.finished, run.finished, again.finished, strict=True):
        assert f.tokens == g.tokens == h.tokens, f.request.id
        assert all(
            np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(f.logits, g.logits, h.logits, strict=True)
        )
    assert {f.row for f in run.finished} == {0, 2}
    assert len(run.prefill_ms) == len(one_thread.prefill_ms) and len(run.copy_ms) == len(TRACE)
    phases = run.phases()
    assert run.prefill_workers == workers and phases["decode"] > 0 and phases["prefill"] > 0
    assert phases["host"] < run.wall_s


def test_prefill_workers_are_checked(served) -> None:
    with open_graph_set(served["sets"]["rows1"]) as decoder:
        with pytest.raises(ConfigError, match="prefill_workers must be >= 0, and 0 with prefill through the rows"):
            BatchingHost(decoder, prefill_workers=1)
    with open_graph_set(served["sets"][3]) as decoder:
        with pytest.raises(ConfigError, match="prefill_workers must be >= 0"):
            BatchingHost(decoder, prefill_workers=-1)
