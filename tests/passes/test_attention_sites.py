"""_attention_sites: attention Softmaxes found by data flow from the cache, with the exporter's mask."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from onnxdeploy.errors import PreconditionError
from onnxdeploy.passes._attention_sites import find_attention_sites

_GRAPH = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 1, 1, 2] q, float[1, 1, 4, 2] past_key, float[1, 1, 1, 4] mask, float[1, 1, 1, 4] other)
  => (float[1, 1, 1, 4] probs, float[1, 1, 1, 4] side, float[1, 1, 1, 4] guarded) {
    kt = Transpose <perm = [0, 1, 3, 2]> (past_key)
    scores = MatMul (q, kt)
    half = Constant <value = float {0.5}> ()
    scaled = Mul (scores, half)
    masked = Add (scaled, mask)
    probs = Softmax <axis = -1> (masked)
    nan = IsNaN (probs)
    zero = Constant <value = float {0.0}> ()
    guarded = Where (nan, zero, probs)
    side = Softmax <axis = -1> (other)
}
"""


def _graph() -> ir.Graph:
    proto = onnx.shape_inference.infer_shapes(onnx.parser.parse_model(_GRAPH))  # sites are told apart by shape
    return ir.serde.deserialize_model(proto).graph


def test_the_softmax_fed_by_the_cache_is_found_with_its_additive_mask_and_guard():
    (site,) = find_attention_sites(_graph(), ["past_key"], 4)  # the Softmax of `other` is not from the cache
    assert site.kind == "add" and site.old_mask.name == "mask" and site.scores.name == "scaled"
    assert [(isnan.op_type, where.op_type) for isnan, where in site.nan_guards] == [("IsNaN", "Where")]
    assert site.scores_shape == (1, 1, 1, 4)


def test_a_missing_cache_input_or_no_attention_softmax_is_refused():
    with pytest.raises(PreconditionError, match="cache input\\(s\\) \\['past_value'\\] the graph lacks"):
        find_attention_sites(_graph(), ["past_value"], 4)
    with pytest.raises(PreconditionError, match="no Softmax is computed from the key cache inputs"):
        find_attention_sites(_graph(), ["past_key"], 8)  # no Softmax over 8 slots
