"""Hybrid quantization chosen from per-layer error (issue 19): the worker's analysis parser and float region.

The worker (``onnxdeploy/_rknn_worker.py``) runs in the SDK's environment, but its selection helpers import only
the standard library and onnx, so they are tested here on the trained fixture's static graph and on the text
RKNN-Toolkit2 2.5.0's ``accuracy_analysis`` writes; the real build with the SDK is in ``test_sdk_stage.py``.
"""

from __future__ import annotations

import onnx
import pytest

from onnxdeploy import _rknn_worker as worker
from onnxdeploy.config import load_pipeline
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.sdk import RknnBuild
from tests.conftest import fixture_entry

# the layout of RKNN-Toolkit2 2.5.0's snapshot/error_analysis.txt (rows cut from a llama_bytes w8a8 analysis)
_ANALYSIS = """\
layer_name                                       simulator_error
                                              entire              single
                                          cos      euc        cos      euc
--------------------------------------------------------------------------------
[Input] position_ids                     1.00000 | 0.00000   1.00000 | 0.00000
[Cos] /m/model/rotary_emb/Cos_output_0-rs 0.99274 | 0.56428   {cos} | 0.56428
[Sin] /m/model/rotary_emb/Sin_output_0-rs 0.97848 | 0.68240   {sin} | 0.68240
[exDataConvert] logits                   0.99991 | 10.57439  1.00000 | 0.64206
"""


class _FakeRknn:
    """Stands in for ``RKNN.accuracy_analysis``: writes one canned analysis per call (line k's figures)."""

    def __init__(self, figures):
        self.figures, self.calls = figures, []

    def accuracy_analysis(self, inputs, output_dir):
        import os

        self.calls.append(inputs)
        os.makedirs(output_dir, exist_ok=True)
        cos, sin = self.figures[len(self.calls) - 1]
        with open(os.path.join(output_dir, "error_analysis.txt"), "w") as f:
            f.write(_ANALYSIS.format(cos=cos, sin=sin))
        return 0


def test_layer_errors_keep_each_tensors_worst_single_cosine_over_the_samples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dataset = tmp_path / "dataset.txt"
    dataset.write_text("".join(f"s{i}_in0.npy s{i}_in1.npy\n" for i in range(9)))
    rknn = _FakeRknn([("0.99500", "0.97000"), ("0.99100", "0.99000"), ("0.99900", "0.98000")])
    errors = worker._layer_errors(rknn, str(dataset), samples=3)
    assert [c[0] for c in rknn.calls] == ["s0_in0.npy", "s4_in0.npy", "s8_in0.npy"]  # spread over the file
    assert errors == {
        "/m/model/rotary_emb/Cos_output_0-rs": 0.991,
        "/m/model/rotary_emb/Sin_output_0-rs": 0.97,
        "logits": 1.0,
    }  # the single-layer column, min over samples; Input rows left out


def _static_step1(tmp_path, fixture: str) -> str:
    """A fixture's static decode graph (what the SDK loads, before its own rewrites)."""
    (tmp_path / "p.yaml").write_text(
        f"model: {fixture_entry(fixture)['model_path']}\noutput_dir: {tmp_path / 'out'}\n"
        "target: ort-cpu\npasses:\n  - static_kv: {max_cache_len: 32}\n  - mask_rewrite: {}\nverify: null\n"
    )
    outcome = run_pipeline(load_pipeline(str(tmp_path / "p.yaml")))
    assert outcome.exit_code == 0, outcome.report.failures
    return str(outcome.model_path)


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    """The float activations (the tensors the SDK would quantize): constants left out, as the SDK folds them."""
    constants = {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    values = [*model.graph.value_info, *model.graph.output]
    return {v.name for v in values if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT} - constants


_ROTARY = {
    # torch.onnx.export: angle = Cast(position) * inv_freq
    "llama_bytes_torchscript": ("/m/model/rotary_emb/", ["Sin", "Concat", "Mul", "Cast", "Cos"]),
    # optimum: angle = MatMul(inv_freq, Cast(Cast(position))), transposed; the walk goes through the MatMul
    "llama_gqa_optimum": ("/model/rotary_emb/", ["Sin", "Concat_1", "Transpose", "MatMul", "Cast_3", "Cast_1", "Cos"]),
}


@pytest.mark.parametrize("fixture", sorted(_ROTARY))
def test_the_float_region_of_the_rotary_sin_takes_its_angle_chain_and_the_cos_beside_it(tmp_path, fixture):
    """A sensitive Sin gains nothing in fp16 while its angle stays int8 (measured on llama_bytes w8a8: Sin and
    Cos alone in fp16 leave the held-out KL at 0.113; the chain takes it to 0.006): the region walks back the
    single-input chain to the position input and adds the Cos that reads the same angle; a two-input op ends
    the walk."""
    step1 = _static_step1(tmp_path, fixture)
    model = onnx.shape_inference.infer_shapes(onnx.load(step1, load_external_data=False))
    floats = _float_tensors(model)
    (sin,) = [n.output[0] for n in model.graph.node if n.op_type == "Sin"]
    prefix, layers = _ROTARY[fixture]
    assert worker._float_region(step1, [sin], floats) == [f"{prefix}{op}_output_0" for op in layers]
    (gated,) = [n for n in model.graph.node if n.name.endswith("layers.0/mlp/Mul")]  # act(gate) * up: two inputs
    assert worker._float_region(step1, [gated.output[0]], floats) == [gated.output[0]]


def test_hybrid_options_reach_the_worker_and_the_label():
    build = RknnBuild(quantized_dtype="w8a8", dataset="d.txt", hybrid_min_cosine=0.98, hybrid_samples=2)
    assert worker._options(build.to_json())["hybrid_min_cosine"] == 0.98
    assert worker._options(build.to_json())["hybrid_samples"] == 2
    assert worker._options("")["hybrid_min_cosine"] is None  # the worker's own default: plain quantization
    assert build.label() == "w8a8 (normal, hybrid: layers below single-layer cosine 0.98 fp16)"
