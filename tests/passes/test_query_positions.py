"""Finding the exporter's query-position vector by running the original, and feeding cache_position there."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from onnxdeploy import model_io
from onnxdeploy.kv_cache import find_kv_cache
from onnxdeploy.passes._context import PassContext
from onnxdeploy.passes._query_positions import feed_query_positions, find_query_positions
from onnxdeploy.runner import open_session
from tests.conftest import REPO
from tests.passes.test_cache_edits import _toy


def _counting_context(tmp_path, calls: list) -> PassContext:
    def factory(path):
        calls.append(path)
        return open_session(path)

    return PassContext(scratch_dir=tmp_path, session_factory=factory)


def _cache_only(extra: str = "") -> ir.Model:
    """A cache Concat and nothing else: no int64 arithmetic unless ``extra`` adds some."""
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[1, S] input_ids, float[1, 2, P, 4] past_key, float[1, 2, P, 4] past_value)
      => (float[1, 2, S, 4] logits, float[1, 2, T, 4] present_key, float[1, 2, T, 4] present_value) {{
        ids_f = Cast <to = 1> (input_ids)
        ax13 = Constant <value = int64[2] {{1, 3}}> ()
        ids4 = Unsqueeze (ids_f, ax13)
        head = Constant <value = float[1, 2, 1, 4] {{1, 2, 3, 4, 5, 6, 7, 8}}> ()
        x = Mul (ids4, head)
        present_key = Concat <axis = 2> (past_key, x)
        present_value = Concat <axis = 2> (past_value, x)
        {extra}
        logits = Identity (x)
    }}
    """
    return ir.serde.deserialize_model(onnx.parser.parse_model(text))


@pytest.mark.parametrize("batch", [1, 2])
def test_find_query_positions_probes_with_the_exports_batch(tmp_path, batch):
    """A toy with a static batch of 2 rejects a batch-1 feed: the probe must use the export's batch."""
    model = _toy(batch="B" if batch == 1 else "2")
    kv = find_kv_cache(model)
    calls: list = []
    assert find_query_positions(model, kv, _counting_context(tmp_path, calls)) == ["qpos"]
    assert len(calls) == 1
    assert list(tmp_path.iterdir()) == []  # probe model and links removed
    # the probe never touched the model it was given
    assert [o.name for o in model.graph.outputs] == ["logits", "present_key", "present_value", "past_seen"]


def test_the_probe_carries_no_weight_but_the_embedding_table(tmp_path):
    """The probe is pruned to shape arithmetic: of a real export's weights only the looked-up table remains."""
    model = model_io.load_model(REPO / "fixtures/llama_gqa/optimum/model.onnx").model
    kv = find_kv_cache(model)
    kept = []

    def factory(path):
        header = onnx.load(str(path), load_external_data=False)
        kept.extend(t.name for t in header.graph.initializer if model_io.tensor_nbytes(t) > 1024)
        return open_session(path)

    assert find_query_positions(model, kv, PassContext(scratch_dir=tmp_path, session_factory=factory))
    assert kept == ["model.embed_tokens.weight"]


def test_a_graph_without_int64_values_is_not_probed(tmp_path):
    model = _cache_only()
    calls: list = []
    assert find_query_positions(model, find_kv_cache(model), _counting_context(tmp_path, calls)) == []
    assert calls == []


def test_int64_values_that_are_not_past_plus_arange_are_not_query_positions(tmp_path):
    """The past length itself and the step length are int64 [1]: probed, never past_len + arange(S)."""
    extra = """
        shp = Shape (past_key)
        two = Constant <value = int64[1] {2}> ()
        plen = Gather <axis = 0> (shp, two)
        sid = Shape (input_ids)
        one = Constant <value = int64[1] {1}> ()
        slen = Gather <axis = 0> (sid, one)
        both = Concat <axis = 0> (plen, slen)
    """
    model = _cache_only(extra)
    calls: list = []
    assert find_query_positions(model, find_kv_cache(model), _counting_context(tmp_path, calls)) == []
    assert len(calls) == 1 and list(tmp_path.iterdir()) == []


def test_feed_query_positions_rewires_every_reader_and_refuses_unknown_names():
    model = _toy()
    graph = model.graph
    position = ir.Value(name="cache_position", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(position)
    qpos = next(o for n in graph for o in n.outputs if o.name == "qpos")
    readers = [use.node for use in qpos.uses()]
    feed_query_positions(graph, ["qpos"], position)
    assert not qpos.uses() and readers and all(position in node.inputs for node in readers)
    with pytest.raises(KeyError):
        feed_query_positions(graph, ["no_such_value"], position)
