import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxdeploy.checks import ContractCheck
from onnxdeploy.contract import CONTRACT_KEY, CacheBinding, ContractInputs, DecodeContract, write_contract
from onnxdeploy.contract_cache import CachePolicy
from tests.checks.checks_testutil import by_code, codes, parse

VOCAB = 10


def decoder(
    *,
    past: str = "float[1,2,8,4]",
    present: str = "float[1,2,8,4]",
    logits: str = f"float[1,1,{VOCAB}]",
    ids: str = "int64[1,1]",
    extra_inputs: str = "",
    extra_outputs: str = "",
    extra_nodes: str = "",
    present_op: str = "Identity",
    logits_node: str = "Gather(emb, input_ids)",
) -> onnx.ModelProto:
    """A one-layer decode step: logits = embedding[input_ids]; present = f(past) (BHSD cache)."""
    model = parse(
        f"""
        g ({ids} input_ids, int64[1] cache_position, {past} past_key_0, {past} past_value_0{extra_inputs})
          => ({logits} logits, {present} present_key_0, {present} present_value_0{extra_outputs})
        {{
            [embed] logits = {logits_node}
            [kout] present_key_0 = {present_op}(past_key_0)
            [vout] present_value_0 = {present_op}(past_value_0)
            {extra_nodes}
        }}
        """,
        extra_opsets=', "com.example": 1',
    )
    emb = np.arange(VOCAB * VOCAB, dtype=np.float32).reshape(VOCAB, VOCAB)
    model.graph.initializer.append(numpy_helper.from_array(emb, "emb"))
    return model


def contract(**overrides) -> DecodeContract:
    fields = dict(
        batch=1,
        step_len=1,
        max_cache_len=8,
        num_layers=1,
        num_kv_heads=2,
        head_dim=4,
        head_dim_padded=4,
        inputs=ContractInputs(input_ids="input_ids", cache_position="cache_position"),
        logits="logits",
        cache=[
            CacheBinding(
                layer=0,
                key_in="past_key_0",
                value_in="past_value_0",
                key_out="present_key_0",
                value_out="present_value_0",
            )
        ],
    )
    fields.update(overrides)
    return DecodeContract(**fields)


def run(model: onnx.ModelProto, decode_contract: DecodeContract | None = None):
    if decode_contract is not None:
        write_contract(model, decode_contract)
    return ContractCheck().run(model)


def test_consistent_contract_has_no_findings():
    model = decoder()
    onnx.checker.check_model(model, full_check=True)
    assert run(model, contract()) == []


def test_missing_contract_is_an_error_pointing_to_static_kv():
    findings = run(decoder())
    assert codes(findings) == ["OD401"]
    assert findings[0].level == "error" and "static_kv" in findings[0].hint


def test_malformed_contract_is_an_error():
    model = decoder()
    model.metadata_props.add(key=CONTRACT_KEY, value="{not json")
    findings = run(model)
    assert codes(findings) == ["OD402"] and CONTRACT_KEY in findings[0].message


def test_layer_count_mismatch():
    findings = run(decoder(), contract(num_layers=2))
    assert codes(findings) == ["OD403"]
    assert "num_layers is 2" in findings[0].message and findings[0].level == "error"


def test_self_inconsistencies_are_each_reported():
    bad = contract(
        head_dim_padded=2,
        cache=[
            CacheBinding(
                layer=1, key_in="past_key_0", value_in="past_key_0", key_out="present_key_0", value_out="present_v"
            )
        ],
    )
    messages = [f.message for f in by_code(run(decoder(), bad), "OD403")]
    assert any("layers are [1]" in m for m in messages)
    assert any("head_dim_padded (2)" in m for m in messages)
    assert any("'past_key_0' is used 2 times" in m for m in messages)
    assert len(messages) == 3


def with_raw_contract(model: onnx.ModelProto, **overrides) -> onnx.ModelProto:
    """Write a contract JSON that skips validation (what a hand-edited or foreign model may carry)."""
    fields = json.loads(contract().model_dump_json())
    for key, value in overrides.items():
        if value is None:
            del fields[key]
        else:
            fields[key] = value
    model.metadata_props.add(key=CONTRACT_KEY, value=json.dumps(fields))
    return model


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_dtype": "float33"}, "kv_dtype"),
        ({"kv_dtype": "float64"}, "kv_dtype"),
        (
            {"cache": [{"layer": 0, "key_in": "past_key_0", "value_in": "past_value_0", "key_out": "present_key_0"}]},
            "lacks value_out required by kv_layout BHSD",
        ),
        ({"kv_layout": "BSH2D"}, "lacks kv_in, kv_out required by kv_layout BSH2D"),
    ],
)
def test_contract_that_does_not_validate_is_od402(overrides, message):
    findings = run(with_raw_contract(decoder(), **overrides))
    assert codes(findings) == ["OD402"] and message in findings[0].message


def test_legacy_float_kv_dtype_is_float32():
    assert run(with_raw_contract(decoder(), kv_dtype="float")) == []
    findings = run(with_raw_contract(decoder(past="float16[1,2,8,4]", present="float16[1,2,8,4]"), kv_dtype="float"))
    assert codes(findings) == ["OD405"] * 4 and findings[0].message.endswith("the contract requires float")


def test_cache_shape_disagreeing_with_max_cache_len():
    findings = run(decoder(past="float[1,2,16,4]"), contract())
    assert codes(findings) == ["OD406", "OD406"]
    assert [f.nodes for f in findings] == [["past_key_0"], ["past_value_0"]]
    assert "(1, 2, 16, 4)" in findings[0].message and "(1, 2, 8, 4)" in findings[0].message


def test_symbolic_cache_dim_is_a_shape_error():
    findings = run(decoder(past="float[1,2,past,4]", present="float[1,2,past,4]"), contract())
    assert codes(findings) == ["OD406"] * 4


def test_kv_dtype_mismatch():
    findings = run(decoder(), contract(kv_dtype="float16"))
    assert codes(findings) == ["OD405"] * 4
    assert {f.nodes[0] for f in findings} == {"past_key_0", "past_value_0", "present_key_0", "present_value_0"}
    assert "float16" in findings[0].message


def test_input_ids_dtype_and_shape():
    findings = run(decoder(ids="int32[1,2]"), contract())
    assert codes(findings) == ["OD405", "OD406"]
    assert all(f.nodes == ["input_ids"] for f in findings)


def test_named_tensor_missing_from_graph_and_unmentioned_input():
    bad = contract(
        cache=[
            CacheBinding(
                layer=0,
                key_in="past_key_values.0.key",
                value_in="past_value_0",
                key_out="present_key_0",
                value_out="present_value_0",
            )
        ]
    )
    findings = run(decoder(), bad)
    assert codes(findings) == ["OD404", "OD407"]
    assert findings[0].nodes == ["past_key_values.0.key"]
    assert findings[1].nodes == ["past_key_0"] and findings[1].level == "error"


def test_attention_mask_named_and_checked():
    model = decoder(extra_inputs=", int64[1,8] attention_mask")
    assert codes(run(model)) == ["OD401"]
    with_mask = contract(
        inputs=ContractInputs(input_ids="input_ids", cache_position="cache_position", attention_mask="attention_mask")
    )
    assert run(decoder(extra_inputs=", int64[1,8] attention_mask"), with_mask) == []
    findings = run(decoder(extra_inputs=", int64[1,9] attention_mask"), with_mask)
    assert codes(findings) == ["OD406"] and findings[0].nodes == ["attention_mask"]
    unmentioned = run(decoder(extra_inputs=", int64[1,8] attention_mask"), contract())
    assert codes(unmentioned) == ["OD407"] and unmentioned[0].nodes == ["attention_mask"]


def test_unmentioned_output_is_a_warning():
    model = decoder(extra_outputs=", float[1,1,10] hidden", extra_nodes="[h] hidden = Identity(logits)")
    findings = run(model, contract())
    assert codes(findings) == ["OD408"]
    assert findings[0].level == "warning" and findings[0].nodes == ["hidden"]


def test_new_token_only_outputs_step_len_slots():
    model = decoder(present="float[1,2,1,4]", present_op="Slice", extra_nodes="")
    for node in model.graph.node:
        if node.op_type == "Slice":
            node.input.extend(["zero", "one", "two"])
    for name, value in (("zero", 0), ("one", 1), ("two", 2)):
        model.graph.initializer.append(numpy_helper.from_array(np.array([value], dtype=np.int64), name))
    onnx.checker.check_model(model, full_check=True)
    assert run(model, contract(cache_update="new_token_only")) == []
    findings = run(model, contract(cache_update="full_buffer"))
    assert codes(findings) == ["OD406", "OD406"]
    assert [f.nodes for f in findings] == [["present_key_0"], ["present_value_0"]]


def drop_output_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Keep only the element type of every graph output (unknown rank)."""
    for output in model.graph.output:
        output.type.tensor_type.ClearField("shape")
    return model


def test_output_shapes_come_from_inference_when_missing():
    model = drop_output_shapes(decoder())
    assert run(model, contract()) == []
    # ...and the inferred shapes are still compared: 4 past inputs/present outputs disagree
    findings = run(drop_output_shapes(decoder()), contract(max_cache_len=16))
    assert codes(findings) == ["OD406"] * 4
    assert [f.nodes[0] for f in findings] == ["past_key_0", "past_value_0", "present_key_0", "present_value_0"]


def test_output_without_any_shape_is_a_warning_not_verified():
    model = drop_output_shapes(decoder(present_op="com.example.Opaque"))
    findings = run(model, contract())
    assert codes(findings) == ["OD409", "OD409"]
    assert all(f.level == "warning" for f in findings)
    assert [f.nodes for f in findings] == [["present_key_0"], ["present_value_0"]]
    # the declared dtype is still compared
    findings = run(drop_output_shapes(decoder(present="float16", present_op="com.example.Opaque")), contract())
    assert codes(findings) == ["OD409", "OD405", "OD409", "OD405"]


def test_logits_shape_and_static_vocab():
    # a declared symbol that inference resolves (Gather of a [10, 10] table) counts as static
    assert run(decoder(logits="float[1,1,vocab]"), contract()) == []
    findings = run(decoder(logits="float[1,2,10]"), contract())
    assert codes(findings) == ["OD406"] and findings[0].nodes == ["logits"]
    opaque = decoder(logits="float[1,1,vocab]", logits_node="com.example.Opaque(input_ids)")
    findings = run(opaque, contract())
    assert codes(findings) == ["OD406"] and "static V" in findings[0].message
    findings = run(decoder(logits="int64[1,1,vocab]", logits_node="com.example.Opaque(input_ids)"), contract())
    assert codes(findings) == ["OD405", "OD406"]


def test_bsh2d_layout():
    model = parse(
        """
        g (int64[1,1] input_ids, int64[1] cache_position, float[1,8,2,8] past_kv_0)
          => (float[1,1,10] logits, float[1,8,2,8] present_kv_0)
        {
            [embed] logits = Gather(emb, input_ids)
            [kv] present_kv_0 = Identity(past_kv_0)
        }
        """
    )
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((VOCAB, VOCAB), np.float32), "emb"))
    packed = contract(kv_layout="BSH2D", cache=[CacheBinding(layer=0, kv_in="past_kv_0", kv_out="present_kv_0")])
    assert run(model, packed) == []
    findings = run(model, contract(kv_layout="BSH2D", max_cache_len=4, cache=packed.cache))
    assert codes(findings) == ["OD406", "OD406"] and "(1, 4, 2, 8)" in findings[0].message


def test_a_cache_policy_without_the_slot_positions_mask_is_flagged():
    """static_kv's cache_policy without mask_rewrite: the host would feed slot_positions to a graph that never reads
    them (README, "Past max_cache_len"); with mask: slot_positions and its input the same policy is consistent."""
    policy = CachePolicy(sinks=2, recent=4)
    findings = by_code(run(decoder(), contract(contract_version=5, cache_policy=policy)), "OD403")
    assert [f.level for f in findings] == ["error"]
    assert "cache_policy (sinks 2 + recent 4) but mask 'attention_mask'" in findings[0].message
    assert "run mask_rewrite after static_kv" in findings[0].message
    inputs = ContractInputs(input_ids="input_ids", cache_position="cache_position", slot_positions="slot_positions")
    masked = contract(contract_version=5, cache_policy=policy, mask="slot_positions", inputs=inputs)
    assert run(decoder(extra_inputs=", int64[8] slot_positions"), masked) == []
