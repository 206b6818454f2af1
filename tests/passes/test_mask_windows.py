"""_mask_windows: the window candidates read from the exporter's mask, and the chunk starts probed."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnxdeploy.passes._mask_windows import _probe_starts, window_candidates

_GRAPH = """
<ir_version: 8, opset_import: ["" : 17]>
g (int64[4] slots, int64[1] position) => (bool[4] mask, bool[4] plain) {
    diff = Sub (position, slots)
    w = Constant <value = int64 {8}> ()
    mask = Less (diff, w)
    big = Constant <value = int64 {100}> ()
    shifted = Mul (slots, big)
    plain = Less (shifted, position)
}
"""


def test_window_candidates_are_the_constants_a_comparison_reads_and_one_more():
    graph = ir.serde.deserialize_model(onnx.parser.parse_model(_GRAPH)).graph
    outputs = {str(v.name): v for v in graph.outputs}
    assert window_candidates(outputs["mask"]) == [8, 9]
    assert window_candidates(outputs["plain"]) == []  # a constant that only scales an operand is no window


def test_every_chunk_start_is_probed_up_to_384_then_a_sample_with_both_ends():
    assert _probe_starts(4, 16) == list(range(13))
    sample = _probe_starts(1, 4096)
    assert len(sample) <= 384 and sample[0] == 0 and sample[-1] == 4095
