"""The up-front pass-order check: what each pass declares decides, config-aware and graph-aware where it must be
(the CLI cases, exit 2 before any pass, are in tests/core/test_cli_bad_input.py)."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes import get_pass, pass_order_problem


def _passes(*entries: tuple[str, dict]) -> list:
    return [get_pass(name)(get_pass(name).config_model.model_validate(cfg)) for name, cfg in entries]


def _graph(opset: int, gqa: bool = False) -> ir.Model:
    op = "y = com.microsoft.GroupQueryAttention (x)" if gqa else "y = Identity (x)"
    header = f'<ir_version: 7, opset_import: ["" : {opset}, "com.microsoft" : 1]>'
    text = f"{header} g (float[1] x) => (float[1] y) {{ {op} }}"
    return ir.serde.deserialize_model(onnx.parser.parse_model(text))


STATIC = ("static_kv", {"max_cache_len": 64})


def test_kv_layout_keeps_grouped_attention_possible_only_in_bhsd():
    bhsd = _passes(STATIC, ("kv_layout", {"layout": "BHSD", "cache_write": "where"}), ("grouped_attention", {}))
    assert pass_order_problem(bhsd) is None
    padded = _passes(STATIC, ("kv_layout", {"layout": "BHSD", "pad_head_dim_to": 32}), ("grouped_attention", {}))
    i, reason = pass_order_problem(padded)  # attention reads a Slice view of the padded buffer: nothing rewritten
    assert i == 2 and "move grouped_attention before kv_layout" in reason
    twice = _passes(STATIC, ("kv_layout", {"layout": "BHDS_K"}), ("kv_layout", {"layout": "BHSD"}))
    i, reason = pass_order_problem(twice)
    assert i == 2 and reason.endswith("one kv_layout pass does it: keep only the one with the config you need")
    i, reason = pass_order_problem(_passes(STATIC, ("kv_layout", {"layout": "BSH2D"}), ("grouped_attention", {})))
    assert i == 2 and "passes[1].kv_layout" in reason and "move grouped_attention before kv_layout" in reason
    i, reason = pass_order_problem(_passes(("mask_rewrite", {}), STATIC))
    assert i == 0 and reason.startswith("needs the decode contract static_kv writes"), reason


def test_the_opset_a_pass_gets_is_known_from_the_input_or_pin_opset_and_lost_through_other_passes():
    mask = _passes(STATIC, ("mask_rewrite", {}))
    i, reason = pass_order_problem(mask, _graph(11))
    assert i == 1 and "the input model has opset 11: add pin_opset: {opset: 12} before mask_rewrite" in reason
    assert pass_order_problem(mask) is None  # config time: the graph decides (GroupQueryAttention masks inside)
    assert pass_order_problem(mask, _graph(11, gqa=True)) is None  # as mask_rewrite.requires lets it run
    pinned = _passes(STATIC, ("pin_opset", {"opset": 12}), ("mask_rewrite", {}))
    assert pass_order_problem(pinned, _graph(11)) is None
    # quantize_weights may raise the opset (QDQ needs): what mask_rewrite gets is then unknown, not refused
    raised = _passes(STATIC, ("pin_opset", {"opset": 11}), ("quantize_weights", {}), ("mask_rewrite", {}))
    assert pass_order_problem(raised, _graph(17)) is None
    i, reason = pass_order_problem(raised[:2] + raised[3:], _graph(17))
    assert i == 2 and "passes[1].pin_opset sets opset 11" in reason
    # MatMulNBits and fuse_matmuls keep the opset they get: the pass that set it is the one named
    kept = _passes(
        STATIC,
        ("pin_opset", {"opset": 11}),
        ("fuse_matmuls", {}),
        ("quantize_weights", {"bits": 8, "format": "matmulnbits"}),
        ("mask_rewrite", {}),
    )
    i, reason = pass_order_problem(kept, _graph(17))
    assert i == 4 and "passes[1].pin_opset sets opset 11" in reason


def test_what_the_input_graph_already_has_or_lacks_is_known_before_the_first_pass():
    from onnxdeploy import model_io  # noqa: PLC0415
    from tests.conftest import fixture_entry  # noqa: PLC0415

    export = model_io.load_model(fixture_entry("llama_gqa_optimum")["model_path"]).model
    i, reason = pass_order_problem(_passes(("fuse_matmuls", {}), ("mask_rewrite", {})), export)
    assert i == 1 and reason.endswith("which the input model does not have; add static_kv before it")
    static = _passes(STATIC, ("kv_layout", {"layout": "BHDS_K"}))
    for p in static:
        export = p(export, make_pass_context()).artifacts.primary
    assert pass_order_problem(_passes(("fuse_matmuls", {}), ("mask_rewrite", {})), export) is None
    i, reason = pass_order_problem(_passes(("fuse_matmuls", {}), ("grouped_attention", {})), export)
    assert i == 1 and "a BHSD cache (B, H_kv, L, D), which the input model does not have" in reason


def test_order_facts_are_one_predicate_each_used_by_requires_too():
    from onnxdeploy.contract import read_contract  # noqa: PLC0415
    from onnxdeploy.errors import PreconditionError  # noqa: PLC0415
    from onnxdeploy.model_io import load_model  # noqa: PLC0415
    from onnxdeploy.passes import ORDER_FACTS  # noqa: PLC0415
    from tests.conftest import fixture_entry  # noqa: PLC0415

    contract, bhsd = ORDER_FACTS["contract"], ORDER_FACTS["bhsd_cache"]
    export = load_model(fixture_entry("llama_gqa_optimum")["model_path"]).model
    assert not contract.holds_on(export) and not bhsd.holds_on(export)
    static = _passes(STATIC)[0](export, make_pass_context()).artifacts.primary
    assert contract.holds_on(static) and bhsd.holds_on(static)
    padded = _passes(("kv_layout", {"layout": "BHSD", "pad_head_dim_to": 32}))[0](static, make_pass_context())
    padded_graph = padded.artifacts.primary
    assert read_contract(padded_graph).kv_layout == "BHSD" and not bhsd.holds_on(padded_graph)
    assert "head_dim_padded 32" in bhsd.problem(padded_graph, "grouped_attention")
    # the planner refuses grouped_attention after a padding kv_layout, and so does the pass itself, by the same fact
    try:
        _passes(("grouped_attention", {}))[0](padded.artifacts, make_pass_context())
    except PreconditionError as exc:
        assert "needs a BHSD cache (B, H_kv, L, D)" in str(exc) and "head_dim_padded 32" in str(exc)
    else:
        raise AssertionError("grouped_attention ran on a padded cache")
    assert bhsd.problem(static, "grouped_attention") is None


def test_a_pin_below_what_an_earlier_pass_wrote_is_refused_before_any_pass():
    from onnxdeploy.model_io import load_model  # noqa: PLC0415
    from tests.conftest import fixture_entry  # noqa: PLC0415

    int4 = _passes(STATIC, ("quantize_weights", {"bits": 4, "format": "qdq"}), ("pin_opset", {"opset": 19}))
    i, reason = pass_order_problem(int4)
    assert i == 2 and "passes[1].quantize_weights writes blocked INT4 DequantizeLinear" in reason and "21" in reason
    assert pass_order_problem(int4[:2] + _passes(("pin_opset", {"opset": 21}))) is None
    nbits = ("quantize_weights", {"bits": 4, "format": "matmulnbits"})
    assert pass_order_problem(_passes(STATIC, nbits, ("pin_opset", {"opset": 17}))) is None  # com.microsoft
    int8 = _passes(STATIC, ("quantize_weights", {"bits": 8, "format": "qdq"}), ("pin_opset", {"opset": 17}))
    assert pass_order_problem(int8) is None  # float32 weights: per-axis DequantizeLinear-13 is enough
    fp16 = load_model(fixture_entry("llama_gqa_fp16")["model_path"]).model
    i, reason = pass_order_problem(int8, fp16)  # the weights' dtype decides: float16 scales need 19
    assert i == 2 and "float16/bfloat16 scales" in reason and "opset 19" in reason
