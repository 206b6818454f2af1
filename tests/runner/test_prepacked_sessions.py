"""Sessions sharing one prepacked copy of the weights (C API container): they decode as ORT's Python sessions do.

On the ``llama_gqa_optimum`` fixture's row-positions set (B = 3, batch-1 prefill buckets; 4 graphs), opened once through
``onnxruntime``'s Python sessions (prepacking on) and once through :class:`SharedPrepacking` (every graph in one
container), the continuous-batching host serves the same trace: the tokens are equal and the logits agree within
1e-6 (the same kernels on the same packed weights; each request also against its batch-1 decode of the original,
1e-4, by ``tests/runner/test_batching.py``'s check). The set's graphs read one data file, mapped once.
"""

from __future__ import annotations

import numpy as np

from onnxdeploy.runner.batching import BatchingHost
from onnxdeploy.runner.graph_set import open_graph_set
from onnxdeploy.runner.prepacked_sessions import PrepackedSession, SharedPrepacking
from onnxdeploy.runner.session import PREPACKING_KEY
from tests.runner.test_batching import _check, _requests, served  # noqa: F401  (the module fixture)


def test_shared_prepacked_sessions_serve_the_trace_as_the_python_sessions_do(served) -> None:  # noqa: F811
    requests = _requests(served["name"])
    with open_graph_set(served["sets"][3], config_entries={PREPACKING_KEY: "0"}) as decoder:
        python = BatchingHost(decoder, keep_logits=True).run(requests)
    sharing = SharedPrepacking()
    with open_graph_set(served["sets"][3], opener=sharing.open) as decoder:
        assert all(isinstance(s.session, PrepackedSession) for s in decoder.sessions())
        assert len(decoder.sessions()) == 4 and len(sharing.maps) == 1  # 2 x 2 graphs, one map of their data file
        sharing.drop_mapped_pages()  # the pages are read back from the file where a call needs them
        shared = BatchingHost(decoder, keep_logits=True).run(requests)
    _check(shared, served["refs"])
    for a, b in zip(python.finished, shared.finished, strict=True):
        assert a.tokens == b.tokens and a.row == b.row
        assert np.abs(np.stack(a.logits) - np.stack(b.logits)).max() <= 1e-6


def _mapped_rss(file: str) -> int:
    """This process's resident bytes of its mappings of ``file`` (``/proc/self/smaps``)."""
    rss, inside = 0, False
    for line in open("/proc/self/smaps").read().splitlines():  # noqa: SIM115
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: range perms offset dev inode [path]
            inside = len(fields) == 6 and fields[5] == file
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1]) * 1024
    return rss


def test_pages_are_dropped_while_loading_and_prefills_run_beside_the_decode(served) -> None:  # noqa: F811
    """The maps hold no resident page after loading (none dropped: prepacking left them resident); prefill workers
    on these sessions (ctypes calls release the GIL) decode every request to the bit as the decode thread does."""
    requests = _requests(served["name"])
    kept = SharedPrepacking(drop_interval_s=None)
    with open_graph_set(served["sets"][3], opener=kept.open):
        (file,) = (str(f) for f in kept.maps)
        assert _mapped_rss(file) > 0
    del kept
    sharing = SharedPrepacking()
    with open_graph_set(served["sets"][3], opener=sharing.open) as decoder:
        assert _mapped_rss(file) == 0
        alone = BatchingHost(decoder, keep_logits=True).run(requests)
        beside = BatchingHost(decoder, keep_logits=True, prefill_workers=1).run(requests)
    _check(beside, served["refs"])
    for a, b in zip(alone.finished, beside.finished, strict=True):
        assert a.tokens == b.tokens and all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
