"""runner/tied_weights: a tied embedding read transposed from one file per process, logits bit-identical.

The tied form is what optimum writes for SmolLM2 (``Gather(W)`` for the embedding, ``Transpose(W)`` into the LM
head's MatMul). The committed GPT-2 fixture is tied too, but its exporter folded the transpose into a second
initializer (``onnx::MatMul_670`` = ``wte^T``); the test model is that export with the copy replaced by
``Transpose(transformer.wte.weight)``, the very values, so it runs as SmolLM2's graph does.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnxdeploy.model_io import read_model_header
from onnxdeploy.runner import open_session, tied_weights
from tests.conftest import REAL_MODEL_DIR, fixture_entry

FIXTURE = Path(fixture_entry("gpt2_optimum")["model_path"])
EMBED, FOLDED = "transformer.wte.weight", "onnx::MatMul_670"
PROMPT = [1, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    """The GPT-2 fixture with its LM head reading ``Transpose(wte)``, saved with external data."""
    model = onnx.load(str(FIXTURE))
    inits = {t.name: t for t in model.graph.initializer}
    np.testing.assert_array_equal(numpy_helper.to_array(inits[FOLDED]), numpy_helper.to_array(inits[EMBED]).T)
    model.graph.initializer.remove(inits[FOLDED])
    model.graph.node.insert(0, onnx.helper.make_node("Transpose", [EMBED], [FOLDED], name="tied_T", perm=[1, 0]))
    out = tmp_path_factory.mktemp("tied") / "model.onnx"
    onnx.save(model, str(out), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return out


def _feeds(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.asarray([PROMPT], np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, len(PROMPT)), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(len(PROMPT), dtype=np.int64)[None]
        else:  # past_key_values.{i}.key / .value: an empty past
            feeds[i.name] = np.zeros([1, i.shape[1], 0, i.shape[3]], np.float32)
    return feeds


def test_the_tied_embedding_is_found_and_logits_are_bit_identical(tied_model, monkeypatch):
    monkeypatch.setattr(tied_weights, "MIN_BYTES", 0)  # the fixture's wte is 128 KiB
    (tied,) = tied_weights.find_tied(onnx.load(str(tied_model), load_external_data=False))
    assert tied.name == EMBED and len(tied.transposes) == 1 and [rank for _, rank in tied.gathers] == [2]
    plain = ort.InferenceSession(str(tied_model), providers=["CPUExecutionProvider"])  # ORT folds Transpose(W)
    want = plain.run(None, _feeds(plain))
    with open_session(tied_model) as one, open_session(tied_model, share_weights=True) as two:
        for s in (one, two):
            assert s.scratch is not None
            (header,) = s.scratch.glob("*.onnx")
            proto = onnx.load(str(header), load_external_data=False)
            assert EMBED not in {t.name for t in proto.graph.initializer}  # the session never reads W itself
            assert all(EMBED not in n.input for n in proto.graph.node)
            assert "tied_T" not in {n.name for n in proto.graph.node}
            links = list(s.scratch.glob("tied-*.T.bin"))
            assert len(links) == 1
            got = s.session.run(None, _feeds(s.session))
            for w, g in zip(want, got, strict=True):
                np.testing.assert_array_equal(g, w)
        # the transpose was written once for the process: both sessions' links are one file
        a, b = (next(s.scratch.glob("tied-*.T.bin")) for s in (one, two))
        assert os.path.samefile(a, b)
        expect = numpy_helper.to_array(
            next(t for t in onnx.load(str(FIXTURE)).graph.initializer if t.name == FOLDED)
        ).tobytes()
        assert a.read_bytes() == expect


def test_the_input_is_never_modified(tied_model, monkeypatch):
    monkeypatch.setattr(tied_weights, "MIN_BYTES", 0)
    before = {p.name: p.read_bytes() for p in tied_model.parent.iterdir()}
    with open_session(tied_model) as s:
        s.session.run(None, _feeds(s.session))
    assert {p.name: p.read_bytes() for p in tied_model.parent.iterdir()} == before


def test_an_untied_graph_is_opened_as_it_is():
    header = onnx.load(str(FIXTURE), load_external_data=False)
    assert tied_weights.find_tied(header) == []  # wte is only gathered; the LM head has its own copy
    with open_session(FIXTURE) as s:
        assert not list((s.scratch or Path("/nonexistent")).glob("tied-*"))


SMOLLM2 = REAL_MODEL_DIR / "optimum" / "model.onnx"


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="not built: python3 fixtures/_export_real.py")
def test_smollm2s_optimum_export_reads_its_embedding_transposed():
    header = read_model_header(SMOLLM2)  # the single file's weights as references
    (tied,) = tied_weights.find_tied(header)
    assert tied.name == "model.embed_tokens.weight" and len(tied.transposes) == 1 and len(tied.gathers) == 1
