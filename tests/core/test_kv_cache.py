"""Finding the KV cache by data flow on tiny inline graphs: found, and each refusal naming what it saw."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from onnxdeploy.errors import PreconditionError
from onnxdeploy.kv_cache import find_kv_cache
from tests.passes.test_cache_edits import _toy


def _parse(text: str) -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(text))


def test_the_toy_layer_is_one_key_value_pair():
    kv = find_kv_cache(_toy())
    assert [(la.key.past_name, la.value.past_name) for la in kv.layers] == [("past_key", "past_value")]
    assert (kv.num_kv_heads, kv.head_dim, kv.dtype, kv.batch, kv.attention_op) == (2, 4, ir.DataType.FLOAT, None, None)
    assert kv.pairs() == [("past_key", "present_key"), ("past_value", "present_value")]


def test_a_static_batch_is_read_from_the_cache_inputs():
    assert find_kv_cache(_toy(batch="2")).batch == 2


def test_no_cache_lists_the_graph_inputs_and_outputs():
    model = _parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[1, S] input_ids, float[1, 8] h) => (float[1, 8] logits) { logits = Identity (h) }
        """
    )
    with pytest.raises(PreconditionError, match="no KV cache found") as err:
        find_kv_cache(model, who="static_kv")
    text = str(err.value)
    assert "no rank-4 float graph input" in text and "'h' [1, 8]" in text and "Graph outputs: 'logits'" in text


def test_an_unnamed_concat_on_the_wrong_axis_is_named_by_its_index():
    model = _parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 2, P, 4] pk, float[1, 2, 1, 4] k) => (float[1, 2, P, 8] present) {
            present = Concat <axis = 3> (pk, k)
        }
        """
    )
    with pytest.raises(PreconditionError, match=r"Concat #0 \(Concat\) of 'pk' is on axis 3, not the sequence axis"):
        find_kv_cache(model)


def test_an_odd_number_of_cache_tensors_is_refused():
    model = _parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 2, P, 4] pk, float[1, 2, 4] k) => (float[1, 2, T, 4] present) {
            two = Constant <value = int64[1] {2}> ()
            k4 = Unsqueeze (k, two)
            present = Concat <axis = 2> (pk, k4)
        }
        """
    )
    with pytest.raises(PreconditionError, match="found 1 cache tensors; expected key/value pairs"):
        find_kv_cache(model)
