"""DecodeContract: dtype mapping, layout names, shapes, and metadata on both ModelProto and onnx_ir.Model."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from pydantic import ValidationError

from onnxdeploy.contract import (
    CONTRACT_KEY,
    CacheBinding,
    ContractInputs,
    DecodeContract,
    read_contract,
    write_contract,
)
from onnxdeploy.errors import ContractError

BHSD_ENTRY = CacheBinding(layer=0, key_in="pk", value_in="pv", key_out="ok", value_out="ov")
BSH2D_ENTRY = CacheBinding(layer=0, kv_in="pkv", kv_out="okv")


def contract(**overrides) -> DecodeContract:
    fields = dict(
        batch=2,
        step_len=3,
        max_cache_len=16,
        num_layers=1,
        num_kv_heads=4,
        head_dim=6,
        head_dim_padded=8,
        inputs=ContractInputs(input_ids="ids", cache_position="slots", attention_mask="mask"),
        cache=[BHSD_ENTRY],
    )
    fields.update(overrides)
    return DecodeContract(**fields)


@pytest.mark.parametrize(
    ("name", "onnx_type", "numpy_dtype"),
    [
        ("float32", TensorProto.FLOAT, np.float32),
        ("float", TensorProto.FLOAT, np.float32),  # legacy spelling: float32, never float64
        ("float16", TensorProto.FLOAT16, np.float16),
        ("bfloat16", TensorProto.BFLOAT16, ml_dtypes.bfloat16),
    ],
)
def test_kv_dtype_maps_once_to_onnx_and_numpy(name: str, onnx_type: int, numpy_dtype: type) -> None:
    c = contract(kv_dtype=name)
    assert c.kv_onnx_type == onnx_type
    assert c.kv_numpy_dtype == np.dtype(numpy_dtype)


def test_legacy_float_is_written_back_as_float32() -> None:
    assert json.loads(contract(kv_dtype="float").model_dump_json())["kv_dtype"] == "float32"


@pytest.mark.parametrize("name", ["float64", "FLOAT16", "int8", "float33"])
def test_kv_dtype_outside_the_closed_set_is_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="kv_dtype"):
        contract(kv_dtype=name)


@pytest.mark.parametrize(
    ("layout", "entry", "message"),
    [
        ("BHSD", CacheBinding(layer=0, key_in="pk", value_in="pv", key_out="ok"), "lacks value_out"),
        ("BHSD", BSH2D_ENTRY, "lacks key_in, value_in, key_out, value_out required by kv_layout BHSD"),
        ("BSH2D", BHSD_ENTRY, "layer 0 lacks kv_in, kv_out required by kv_layout BSH2D"),
    ],
)
def test_each_layout_requires_its_names(layout: str, entry: CacheBinding, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        contract(kv_layout=layout, cache=[entry])


def test_bhsd_shapes() -> None:
    c = contract()
    assert c.cache_input_shape() == (2, 4, 16, 8)
    assert c.cache_output_shape() == (2, 4, 16, 8)
    assert contract(cache_update="new_token_only").cache_output_shape() == (2, 4, 3, 8)
    assert c.cache_sequence_axis == 2
    assert c.cache_pairs() == [("pk", "ok"), ("pv", "ov")]


def test_bsh2d_shapes() -> None:
    c = contract(kv_layout="BSH2D", cache=[BSH2D_ENTRY])
    assert c.cache_input_shape() == (2, 16, 4, 16)
    assert c.cache_output_shape() == (2, 16, 4, 16)
    assert contract(kv_layout="BSH2D", cache=[BSH2D_ENTRY], cache_update="new_token_only").cache_output_shape() == (
        2,
        3,
        4,
        16,
    )
    assert c.cache_sequence_axis == 1
    assert c.cache_pairs() == [("pkv", "okv")]


def test_input_shapes_cover_the_named_inputs_only() -> None:
    c = contract()
    assert (c.input_ids_shape(), c.cache_position_shape(), c.position_ids_shape(), c.attention_mask_shape()) == (
        (2, 3),
        (3,),
        (2, 3),
        (2, 16),
    )
    assert c.input_shapes() == {"input_ids": (2, 3), "cache_position": (3,), "attention_mask": (2, 16)}


def _proto() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_read_and_write_on_modelproto_and_onnx_ir() -> None:
    proto = _proto()
    assert read_contract(proto) is None
    write_contract(proto, contract(kv_dtype="float16"))
    write_contract(proto, contract())  # replaces, never duplicates
    assert [p.key for p in proto.metadata_props] == [CONTRACT_KEY]
    assert read_contract(proto) == contract()

    model = ir.serde.deserialize_model(proto)
    assert read_contract(model) == contract()
    write_contract(model, contract(step_len=1))
    assert read_contract(model) == contract(step_len=1)
    assert read_contract(ir.serde.serialize_model(model)) == contract(step_len=1)


def test_read_refuses_an_invalid_contract_naming_the_source() -> None:
    model = ir.serde.deserialize_model(_proto())
    fields = json.loads(contract().model_dump_json())
    model.metadata_props[CONTRACT_KEY] = json.dumps({**fields, "kv_dtype": "float64"})
    with pytest.raises(ContractError, match=r"m\.onnx: metadata_props\['onnxdeploy\.contract'\] is invalid"):
        read_contract(model, source="m.onnx")


def _io(contract_: DecodeContract, **changes: tuple[int, list] | None) -> tuple[list, list]:
    """Graph inputs and outputs exactly as ``contract_`` declares them, then ``changes`` (name -> (dtype, dims) or
    None to drop it)."""
    inputs, outputs = {}, {}
    for name, _, is_input, dtypes, shape in contract_.declared_tensors():
        dims = [10 if d == "V" else d for d in shape]
        (inputs if is_input else outputs)[name] = (min(dtypes), dims)
    for name, change in changes.items():
        target = outputs if name in outputs or name.startswith("out_") else inputs
        if change is None:
            target.pop(name)
        else:
            target[name] = change
    make = helper.make_tensor_value_info
    return [make(n, t, d) for n, (t, d) in inputs.items()], [make(n, t, d) for n, (t, d) in outputs.items()]


def test_mismatches_of_a_graph_the_contract_describes_are_none() -> None:
    for c in (contract(), contract(kv_layout="BSH2D", cache=[BSH2D_ENTRY]), contract(prefill_logits="last")):
        assert c.mismatches(*_io(c)) == []


def test_mismatches_name_each_tensor_with_its_kind_in_declaration_order() -> None:
    c = contract()
    inputs, outputs = _io(
        c,
        ids=(TensorProto.INT32, [2, 3]),  # dtype
        mask=(TensorProto.INT64, [2, "cache"]),  # a symbol where the contract fixes 16
        pk=(TensorProto.FLOAT, [2, 4, 32, 8]),  # a static dim that conflicts
        ov=None,  # a present output the graph lacks
        out_hidden=(TensorProto.FLOAT, [2, 3, 8]),  # an output the contract does not name
        extra=(TensorProto.INT64, [1]),  # an input nobody feeds
    )
    found = c.mismatches(inputs, outputs, defaults={"slots"})
    assert [(m.kind, m.name) for m in found] == [
        ("dtype", "ids"),
        ("not_static", "mask"),
        ("shape", "pk"),
        ("missing", "ov"),
        ("unnamed_input", "extra"),
        ("unnamed_output", "out_hidden"),
    ]
    assert found[0].message == "'ids' (input_ids) has dtype int32, the contract requires int64"
    assert "(2, 4, 32, 8)" in found[2].message and "(2, 4, 16, 8)" in found[2].message
    assert found[2].role == "layer 0 past cache" and found[3].message.endswith("is not a graph output")


def test_mismatches_of_an_input_that_is_an_initializer_and_an_output_without_shape() -> None:
    c = contract()
    inputs, outputs = _io(c, slots=None)
    outputs = [helper.make_tensor_value_info(v.name, v.type.tensor_type.elem_type, None) for v in outputs]
    found = c.mismatches(inputs, outputs, defaults={"slots"})
    assert [(m.kind, m.name) for m in found] == [("missing", "slots"), ("unverified", "ok"), ("unverified", "ov")] + [
        ("unverified", "logits")
    ]
    assert found[0].message == "input 'slots' (cache_position) is an initializer"
    vocab = contract().mismatches(*_io(c, logits=(TensorProto.FLOAT, [2, 3, "vocab"])))
    assert [m.kind for m in vocab] == ["not_static"] and vocab[0].message.endswith("with a static V")
