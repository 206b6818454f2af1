"""``static_kv`` with ``kv_dtype: float16`` on fp32 models: fp16 cache I/O cast at the boundary, run by contract."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxdeploy.contract import CacheBinding, ContractInputs, DecodeContract, read_contract
from onnxdeploy.errors import PreconditionError
from onnxdeploy.model_io import load_model, write_for_ort
from onnxdeploy.pass_context import make_pass_context
from onnxdeploy.passes._cache_edits import cast_cache_boundary
from onnxdeploy.passes.static_kv import StaticKVCachePass, StaticKVConfig
from onnxdeploy.runner import ContractDecoder, open_decoder, verify


def test_fp16_cache_keeps_top1_on_an_fp32_fixture(any_fixture: dict, tmp_path: Path) -> None:
    expect = any_fixture["expect"]
    reference = np.load(any_fixture["reference_path"])
    positions = reference["logits"].shape[0]
    config = StaticKVConfig(max_cache_len=positions, kv_dtype="float16")
    if expect.cache_op == "GroupQueryAttention":  # the op keeps the cache in its compute dtype
        with pytest.raises(PreconditionError, match="kv_dtype float16: .* feeds GroupQueryAttention"):
            StaticKVCachePass(config)(load_model(any_fixture["model_path"]).model, make_pass_context())
        return
    static = StaticKVCachePass(config)(
        load_model(any_fixture["model_path"]).model, make_pass_context()
    ).artifacts.primary
    contract = read_contract(static)
    assert contract is not None and contract.kv_dtype == "float16"
    past, present = contract.cache_pairs()[0]
    assert {str(v.name): v.dtype for v in static.graph.inputs}[past] == ir.DataType.FLOAT16
    assert {str(v.name): v.dtype for v in static.graph.outputs}[present] == ir.DataType.FLOAT16
    path = write_for_ort(static, tmp_path)
    with open_decoder(path) as decoder:
        assert isinstance(decoder, ContractDecoder)
        decoder.feed(reference["prompt"].tolist())
        assert all(buffer.dtype == np.float16 for buffer in decoder._buffers.values())
    report = verify(
        any_fixture["model_path"],
        path,
        prompt=reference["prompt"].tolist(),
        steps=len(reference["tokens"]),
        max_abs_logit_diff=0.05,
    )
    assert report.passed, [m.failures for m in report.modes.values()]
    for result in report.modes.values():
        assert result.top1_agreement == 1.0
        if not expect.fp16:  # an fp16 model's cache was float16 already
            assert 0 < result.max_abs_logit_diff  # fp16 rounding of the cache is visible, and small


def test_a_cache_inside_group_query_attention_is_refused() -> None:
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    names = ["q", "k", "v", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k", "total_seq"]
    shapes = [[1, 1, 64], [1, 1, 32], [1, 1, 32], [1, 2, 8, 16], [1, 2, 8, 16], [1], [1]]
    types = [f32] * 5 + [i32] * 2
    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in zip(names, types, shapes, strict=True)]
    outs = ["out", "present.0.key", "present.0.value"]
    node = helper.make_node("GroupQueryAttention", names, outs, domain="com.microsoft", num_heads=4, kv_num_heads=2)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, f32, None) for o in outs])
    model = ir.serde.deserialize_model(helper.make_model(graph))
    entry = CacheBinding(
        layer=0,
        key_in="past_key_values.0.key",
        value_in="past_key_values.0.value",
        key_out="present.0.key",
        value_out="present.0.value",
    )
    contract = DecodeContract(
        batch=1,
        step_len=1,
        max_cache_len=8,
        num_layers=1,
        num_kv_heads=2,
        head_dim=16,
        head_dim_padded=16,
        inputs=ContractInputs(input_ids="input_ids"),
        cache=[entry],
    )
    with pytest.raises(PreconditionError, match="GroupQueryAttention.*cache dtype to equal its compute dtype"):
        cast_cache_boundary(model, contract, "float16")
