"""A tiny seeded decoder built with onnx.helper, in the exporter convention or with a decode contract.

Every variant of one seed has the same weights, so they must decode identically:

- ``exporter``: dynamic dims; ``input_ids`` (B, S), ``past_key_values.{i}.key|value`` (B, H, past, D)
  listed *before* ``attention_mask`` (B, past+S) and ``position_ids`` (B, S), as in GPT-2 exports;
  the cache is appended by Concat and the causal mask is built from ``past_len + arange(S)``.
- ``full_buffer`` / ``new_token_only``: static dims, fixed buffers (1, H, max_cache_len, D) written by
  ScatterElements at ``cache_position``, ``attention_mask`` (1, max_cache_len), and a contract in
  ``metadata_props``.

Layers: learned token + position embeddings, then per layer single-softmax attention (Where mask with
-1e9) and a ReLU MLP whose weight is ``layers.{i}.mlp.fc.weight``, each with a residual; a final
MatMul to ``logits`` (B, S, V).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxdeploy.contract import CacheBinding, ContractInputs, DecodeContract, write_contract

Kind = Literal["exporter", "full_buffer", "new_token_only"]

VOCAB = 32
HIDDEN = 16
HEADS = 2
HEAD_DIM = 8
MAX_POSITIONS = 64
TINY_PROMPT = [1, 5, 7, 3, 2, 9]


def build_tiny_decoder(
    kind: Kind = "exporter",
    *,
    layers: int = 2,
    max_cache_len: int = 16,
    step_len: int = 1,
    seed: int = 0,
) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int, per_fan_in: bool = True) -> str:
        values = rng.standard_normal(shape)
        if per_fan_in:  # keeps activations and logits O(1), so float reordering stays near 1e-6
            values /= np.sqrt(shape[0])
        inits.append(numpy_helper.from_array(values.astype(np.float32), name))
        return name

    def const(name: str, values, dtype=np.int64) -> str:
        inits.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=f"n{len(nodes)}_{op}", **attrs))
        return output

    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    static = kind != "exporter"
    batch, seq = (1, step_len) if static else ("batch", "seq")
    past_len = max_cache_len if static else "past"

    # Weights first so every variant of one seed draws the same numbers.
    embed = weight("embed.weight", VOCAB, HIDDEN, per_fan_in=False)
    pos_embed = weight("pos_embed.weight", MAX_POSITIONS, HIDDEN, per_fan_in=False)
    layer_weights = [
        {
            name: weight(f"layers.{i}.{name}.weight", *shape)
            for name, shape in (
                ("attn.q", (HIDDEN, HEADS * HEAD_DIM)),
                ("attn.k", (HIDDEN, HEADS * HEAD_DIM)),
                ("attn.v", (HIDDEN, HEADS * HEAD_DIM)),
                ("attn.o", (HEADS * HEAD_DIM, HIDDEN)),
                ("mlp.fc", (HIDDEN, 2 * HIDDEN)),
                ("mlp.proj", (2 * HIDDEN, HIDDEN)),
            )
        }
        for i in range(layers)
    ]
    lm_head = weight("lm_head.weight", HIDDEN, VOCAB)
    const("heads_shape", [0, 0, HEADS, HEAD_DIM])
    const("hidden_shape", [0, 0, HEADS * HEAD_DIM])
    const("zero", 0)
    const("one", 1)
    const("axis0", [0])
    const("axis1", [1])
    const("axes12", [1, 2])
    const("scale", 1.0 / np.sqrt(HEAD_DIM), np.float32)
    const("neg", -1e9, np.float32)

    x = node(
        "Add",
        [node("Gather", [embed, "input_ids"], "tok_emb"), node("Gather", [pos_embed, "position_ids"], "pos_emb")],
        "x0",
    )

    # Allowed (B, 1, S, T): key slot <= query position, and attention_mask == 1.
    if static:
        query_pos = "cache_position"
        key_pos = const("key_pos", np.arange(max_cache_len))
        const("slot_shape", [1, 1, step_len, 1])
    else:
        shape_k = node("Shape", ["past_key_values.0.key"], "past_shape")
        past = node("Gather", [shape_k, const("two", 2)], "past_len")
        s = node("Gather", [node("Shape", ["input_ids"], "ids_shape"), "one"], "seq_len")
        total = node("Add", [past, s], "total_len")
        query_pos = node("Range", [past, total, "one"], "query_pos")
        key_pos = node("Range", ["zero", total, "one"], "key_pos")
    causal = node(
        "LessOrEqual",
        [node("Unsqueeze", [key_pos, "axis0"], "key_row"), node("Unsqueeze", [query_pos, "axis1"], "query_col")],
        "causal",
    )
    padding = node("Unsqueeze", [node("Cast", ["attention_mask"], "mask_bool", to=TensorProto.BOOL), "axes12"], "pad4")
    allowed = node("And", [causal, padding], "allowed")

    cache_inputs, cache_outputs, bindings = [], [], []
    for i, w in enumerate(layer_weights):
        p = f"l{i}"

        q, k, v = (
            node(
                "Transpose",
                [node("Reshape", [node("MatMul", [x, w[f"attn.{n}"]], f"{p}_{n}_mm"), "heads_shape"], f"{p}_{n}_r")],
                f"{p}_{n}",
                perm=[0, 2, 1, 3],
            )
            for n in "qkv"
        )
        kv_all = {}
        for kind_name, new in (("key", k), ("value", v)):
            past_name, present_name = f"past_key_values.{i}.{kind_name}", f"present.{i}.{kind_name}"
            cache_inputs.append(
                helper.make_tensor_value_info(past_name, TensorProto.FLOAT, [batch, HEADS, past_len, HEAD_DIM])
            )
            if static:
                index = node(
                    "Expand",
                    [
                        node("Reshape", ["cache_position", "slot_shape"], f"{p}_{kind_name}_slots"),
                        node("Shape", [new], f"{p}_{kind_name}_shape"),
                    ],
                    f"{p}_{kind_name}_index",
                )
                full = node("ScatterElements", [past_name, index, new], f"{p}_{kind_name}_all", axis=2)
                out_len = max_cache_len if kind == "full_buffer" else step_len
                node("Identity", [full if kind == "full_buffer" else new], present_name)
            else:
                full = node("Concat", [past_name, new], f"{p}_{kind_name}_all", axis=2)
                out_len = "total"
                node("Identity", [full], present_name)
            cache_outputs.append(
                helper.make_tensor_value_info(present_name, TensorProto.FLOAT, [batch, HEADS, out_len, HEAD_DIM])
            )
            kv_all[kind_name] = full
        bindings.append(
            CacheBinding(
                layer=i,
                key_in=f"past_key_values.{i}.key",
                value_in=f"past_key_values.{i}.value",
                key_out=f"present.{i}.key",
                value_out=f"present.{i}.value",
            )
        )
        kt = node("Transpose", [kv_all["key"]], f"{p}_kt", perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [q, kt], f"{p}_qk"), "scale"], f"{p}_scores")
        probs = node("Softmax", [node("Where", [allowed, scores, "neg"], f"{p}_masked")], f"{p}_probs", axis=-1)
        ctx = node("Transpose", [node("MatMul", [probs, kv_all["value"]], f"{p}_ctx")], f"{p}_ctx_t", perm=[0, 2, 1, 3])
        attn = node("MatMul", [node("Reshape", [ctx, "hidden_shape"], f"{p}_ctx_r"), w["attn.o"]], f"{p}_attn")
        x = node("Add", [x, attn], f"{p}_h")
        mlp = node("Relu", [node("MatMul", [x, w["mlp.fc"]], f"{p}_fc")], f"{p}_act")
        x = node("Add", [x, node("MatMul", [mlp, w["mlp.proj"]], f"{p}_mlp")], f"{p}_out")
    node("MatMul", [x, lm_head], "logits")

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])
    mask_len = max_cache_len if static else "total"
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, mask_len])
    positions = helper.make_tensor_value_info("position_ids", TensorProto.INT64, [batch, seq])
    if static:
        slots = helper.make_tensor_value_info("cache_position", TensorProto.INT64, [step_len])
        graph_inputs = [ids, positions, slots, mask, *cache_inputs]
    else:
        graph_inputs = [ids, *cache_inputs, mask, positions]
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq, VOCAB])
    graph = helper.make_graph(nodes, f"tiny_{kind}", graph_inputs, [logits, *cache_outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    if static:
        write_contract(
            model,
            DecodeContract(
                batch=1,
                step_len=step_len,
                max_cache_len=max_cache_len,
                num_layers=layers,
                num_kv_heads=HEADS,
                head_dim=HEAD_DIM,
                head_dim_padded=HEAD_DIM,
                cache_update=kind,
                inputs=ContractInputs(
                    input_ids="input_ids",
                    cache_position="cache_position",
                    position_ids="position_ids",
                    attention_mask="attention_mask",
                ),
                cache=bindings,
            ),
        )
    return model


def save_tiny_decoder(path: Path, kind: Kind = "exporter", **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_tiny_decoder(kind, **kwargs), str(path))
    return path
