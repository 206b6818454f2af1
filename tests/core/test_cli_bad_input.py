"""The bad-input corpus: every case exits 2 with one short error line naming the file, key or node (and, where
the fix is not obvious, what to do), prints no traceback (``--debug`` does), leaves its inputs byte-identical and
writes nothing: no output folder, no staging folder, no cache entry.

Cases run in-process through typer's CliRunner; model builders come from ``tests/core/test_model_io.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest
import yaml
from typer.testing import CliRunner

from onnxdeploy.cli import app
from tests.conftest import PROMPT, fixture_entry
from tests.core.test_model_io import (
    FIXTURE,
    NOT_A_MODEL,
    edit_external,
    middle_tensor,
    relocate,
    save_external,
    sha256,
    unsafe_model,
)

runner = CliRunner()
MAX_ERROR_CHARS = 420
"""The error line's length at most: one screen line or three, never a C++ signature or a stack."""


def _pipeline(tmp: Path, model: Path | str = FIXTURE, **overrides) -> Path:
    cfg = {
        "model": str(model),
        "output_dir": str(tmp / "out"),
        "passes": [{"static_kv": {"max_cache_len": 64}}],
        "verify": {"prompt": PROMPT, "steps": 2},
    }
    cfg.update(overrides)
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _yaml(tmp: Path, text: str) -> Path:
    path = tmp / "pipeline.yaml"
    path.write_text(text.replace("{model}", str(FIXTURE)).replace("{out}", str(tmp / "out")))
    return path


def _edited(tmp: Path, edit: Callable[[onnx.ModelProto], None], name: str = "model.onnx") -> Path:
    proto = onnx.load(str(FIXTURE))
    edit(proto)
    (tmp / "in").mkdir(exist_ok=True)
    path = tmp / "in" / name
    path.write_bytes(proto.SerializeToString())
    return path


def _parsed(tmp: Path, text: str, name: str) -> Path:
    (tmp / "in").mkdir(exist_ok=True)
    path = tmp / "in" / name
    onnx.save(onnx.parser.parse_model(text), path)
    return path


def _external(tmp: Path) -> Path:
    return save_external(FIXTURE, tmp / "in")


def _past_fixed_to_zero(proto: onnx.ModelProto) -> None:
    for vi in proto.graph.input:
        if vi.name.startswith("past_key_values"):
            dim = vi.type.tensor_type.shape.dim[2]
            dim.Clear()
            dim.dim_value = 0


def _missing_data(tmp: Path) -> Path:
    model = _external(tmp)
    relocate(model, middle_tensor(model), "gone.data")
    return model


def _short_data(tmp: Path) -> Path:
    model = _external(tmp)
    data = model.parent / "model.onnx.data"
    os.truncate(data, data.stat().st_size - 1)
    return model


def _unsafe(kind: str) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        model, _, _, _ = unsafe_model(tmp, kind, target="copy")
        return model

    return build


def _length_off(tmp: Path) -> Path:
    model = _external(tmp)
    name = middle_tensor(model)
    edit_external(model, lambda t, e: {**e, "length": str(int(e["length"]) - 4)} if t.name == name else None)
    return model


def _unknown_key(tmp: Path) -> Path:
    model = _external(tmp)
    name = middle_tensor(model)
    edit_external(model, lambda t, e: {**e, "compression": "zstd"} if t.name == name else None)
    return model


def _token_file(tmp: Path, text: str) -> Path:
    (tmp / "in").mkdir(exist_ok=True)
    path = tmp / "in" / "tokens.txt"
    path.write_text(text)
    return path


def _not_a_model(case: str) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        (tmp / "in").mkdir(exist_ok=True)
        return NOT_A_MODEL[case][0](tmp / "in")

    return build


def _random_bytes(tmp: Path) -> Path:
    (tmp / "in").mkdir(exist_ok=True)
    path = tmp / "in" / "noise.onnx"
    path.write_bytes(bytes(range(256)) * 8)
    return path


NO_CACHE = """
<ir_version: 8, opset_import: ["" : 17]>
lm (int64[B, S] input_ids) => (float[B, S, 4] logits) {
    table = Constant <value = float[3, 4] {0,1,2,3,4,5,6,7,8,9,10,11}> ()
    logits = Gather (table, input_ids)
}"""
CYCLIC = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y) { a = Add (x, b) b = Relu (a) y = Abs (b) }"""
TWICE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y) { t = Relu (x) t = Neg (x) y = Abs (t) }"""


@dataclass(frozen=True)
class Case:
    """One bad input: how to build the command line and what the error must say.

    Attributes:
        argv: ``argv(tmp)`` builds the inputs under ``tmp`` and returns the CLI arguments.
        needles: strings the output must contain (the file, key or node, and what to do where it applies).
    """

    argv: Callable[[Path], list[str]]
    needles: tuple[str, ...]


def run_model(build: Callable[[Path], Path], **overrides) -> Callable[[Path], list[str]]:
    """``onnxdeploy run`` on a pipeline over the model ``build`` makes."""
    return lambda tmp: ["run", str(_pipeline(tmp, build(tmp), **overrides))]


def run_config(**overrides) -> Callable[[Path], list[str]]:
    """``onnxdeploy run`` on the fixture with pipeline keys overridden."""
    return lambda tmp: ["run", str(_pipeline(tmp, **overrides))]


def run_yaml(text: str) -> Callable[[Path], list[str]]:
    """``onnxdeploy run`` on a pipeline file with this text ({model}, {out} filled in)."""
    return lambda tmp: ["run", str(_yaml(tmp, text))]


def static_kv(**cfg) -> list[dict]:
    return [{"static_kv": cfg}]


CASES: dict[str, Case] = {
    # ----------------------------------------------------------------------------------------- model files
    "empty_file": Case(run_model(_not_a_model("empty")), ("empty.onnx", "empty")),
    "truncated_mid_graph": Case(run_model(_not_a_model("cut_mid_graph")), ("half.onnx", "not an ONNX model")),
    "truncated_before_opsets": Case(run_model(_not_a_model("cut_before_opset_import")), ("cut.onnx", "truncated")),
    "no_opset_import": Case(run_model(_not_a_model("no_opset_import")), ("no_opset.onnx", "no opset_import")),
    "text_file": Case(run_model(_not_a_model("text")), ("notes.onnx", "ONNX model")),
    "random_bytes": Case(run_model(_random_bytes), ("noise.onnx", "ONNX")),
    "folder_as_model_run": Case(run_model(_not_a_model("folder")), ("folder.onnx", "key 'model'", "not a file")),
    "folder_as_model_inspect": Case(
        lambda tmp: ["inspect", str(_not_a_model("folder")(tmp))], ("folder.onnx", "folder", "expected an .onnx")
    ),
    "folder_as_model_verify": Case(
        lambda tmp: ["verify", str(_not_a_model("folder")(tmp)), str(FIXTURE), "-n", "1"], ("folder.onnx", "folder")
    ),
    "missing_model": Case(run_config(model="/nonexistent/model.onnx"), ("/nonexistent/model.onnx", "not found")),
    "missing_external_data": Case(run_model(_missing_data), ("gone.data", "not found")),
    "short_external_data": Case(run_model(_short_data), ("model.onnx.data", "short")),
    "location_dotdot": Case(run_model(_unsafe("dotdot")), ("../outside/weights.bin", "'..'")),
    "location_absolute": Case(run_model(_unsafe("absolute")), ("outside/weights.bin", "absolute path")),
    "location_symlinked_file": Case(run_model(_unsafe("symlinked_file")), ("weights.bin", "symlink")),
    "location_symlinked_folder": Case(run_model(_unsafe("symlinked_folder")), ("shards/weights.bin", "symlinked")),
    "external_length_disagrees": Case(run_model(_length_off), ("length", "need")),
    "external_unknown_key": Case(run_model(_unknown_key), ("compression", "unknown external_data key")),
    "ir_version_too_new": Case(
        run_model(lambda tmp: _edited(tmp, lambda p: setattr(p, "ir_version", 99))),
        ("model.onnx", "IR version 99", "upgrade onnx"),
    ),
    "opset_too_new": Case(
        run_model(lambda tmp: _edited(tmp, lambda p: setattr(p.opset_import[0], "version", 40))),
        ("model.onnx", "opset 40", "upgrade onnx", "opset <= "),
    ),
    # ------------------------------------------------------------------------------------------ graphs
    "no_kv_cache": Case(run_model(lambda tmp: _parsed(tmp, NO_CACHE, "no_cache.onnx")), ("no KV cache found",)),
    "cyclic_graph": Case(
        run_model(lambda tmp: _parsed(tmp, CYCLIC, "cyclic.onnx"), verify=None),
        ("cyclic.onnx", "cycle", "(Add)", "(Relu)", "re-export"),
    ),
    "duplicate_tensor_with_a_pass": Case(
        run_model(lambda tmp: _parsed(tmp, TWICE, "twice.onnx"), verify=None),
        ("twice.onnx", "tensor 't' is defined twice", "(Relu)", "(Neg)", "rename"),
    ),
    "past_length_fixed_to_0": Case(
        run_model(lambda tmp: _edited(tmp, _past_fixed_to_zero)),
        ("static_kv", "past_key_values.0.key", "fixed to 0", "re-export with a dynamic past length"),
    ),
    # ------------------------------------------------------------------------------------ the YAML file
    "pipeline_missing": Case(lambda tmp: ["run", str(tmp / "nope.yaml")], ("nope.yaml", "not found")),
    "pipeline_is_a_model": Case(lambda tmp: ["run", str(FIXTURE)], ("model.onnx", "not a text file")),
    "not_yaml": Case(run_yaml("model: {model}\npasses: [static_kv: {max_cache_len: 64}\n"), ("not valid YAML",)),
    "yaml_is_a_list": Case(run_yaml("- model: {model}\n"), ("YAML mapping", "'model'")),
    "duplicate_key": Case(run_yaml("model: {model}\nmodel: {model}\n"), ("duplicate key 'model'",)),
    "passes_not_a_list": Case(run_config(passes=3), ("key 'passes'", "list")),
    "pass_entry_two_names": Case(
        run_config(passes=[{"static_kv": {}, "mask_rewrite": {}}]), ("key 'passes[0]'", "one pass name")
    ),
    "pass_config_not_a_mapping": Case(run_config(passes=[{"static_kv": 64}]), ("passes[0].static_kv", "mapping")),
    "max_cache_len_a_string": Case(run_config(passes=static_kv(max_cache_len="64")), ("static_kv.max_cache_len",)),
    "max_cache_len_a_bool": Case(run_config(passes=static_kv(max_cache_len=True)), ("static_kv.max_cache_len",)),
    "steps_a_string": Case(run_config(verify={"steps": "ten"}), ("verify.steps",)),
    "prompt_not_a_list": Case(run_config(verify={"prompt": "1 2 3"}), ("verify.prompt",)),
    "check_after_each_pass_not_bool": Case(run_config(check_after_each_pass="maybe"), ("check_after_each_pass",)),
    "cache_max_bytes_negative": Case(run_config(cache={"max_bytes": -1}), ("cache.max_bytes", "greater than")),
    "unknown_top_level_key": Case(run_config(speed="max"), ("key 'speed'", "unknown key")),
    "unknown_pass_key": Case(
        run_config(passes=static_kv(max_cache_len=64, turbo=1)), ("passes[0].static_kv.turbo", "unknown key")
    ),
    "unknown_verify_key": Case(run_config(verify={"stepz": 3}), ("verify.stepz", "unknown key")),
    "unknown_cache_key": Case(run_config(cache={"folder": "x"}), ("cache.folder", "unknown key")),
    "unknown_pass": Case(run_config(passes=[{"make_it_fast": {}}]), ("make_it_fast", "known passes")),
    "unknown_check": Case(run_config(checks=["checker", "vibes"]), ("checks[1]", "vibes")),
    "unknown_target": Case(run_config(target="no-such-npu"), ("key 'target'", "no-such-npu")),
    "max_cache_len_negative": Case(
        run_config(passes=static_kv(max_cache_len=-4)), ("static_kv.max_cache_len", "greater than or equal to 1")
    ),
    "max_cache_len_zero": Case(run_config(passes=static_kv(max_cache_len=0)), ("static_kv.max_cache_len",)),
    "max_cache_len_below_verify": Case(
        run_config(passes=static_kv(max_cache_len=6)), ("max_cache_len=6", "lower verify.steps or raise")
    ),
    "max_cache_len_below_step_len": Case(
        run_config(passes=static_kv(max_cache_len=4, step_len=8), verify=None),
        ("passes[0].static_kv", "step length 8", "cache length 4"),
    ),
    "calibration_not_token_ids": Case(
        lambda tmp: ["run", str(_pipeline(tmp, calibration={"token_ids_file": str(_token_file(tmp, "one two"))}))],
        ("key 'calibration.token_ids_file'", "tokens.txt", "not a token ids file"),
    ),
    "accuracy_tokens_empty": Case(
        lambda tmp: [
            "run",
            str(_pipeline(tmp, verify={"prompt": PROMPT, "accuracy": {"token_ids_file": str(_token_file(tmp, ""))}})),
        ],
        ("key 'verify.accuracy.token_ids_file'", "tokens.txt", "holds no token ids"),
    ),
    "calibration_id_outside_the_vocabulary": Case(
        lambda tmp: [
            "run",
            str(_pipeline(tmp, calibration={"token_ids_file": str(_token_file(tmp, "1 2 99999 3"))})),
        ],
        ("key 'calibration.token_ids_file'", "tokens.txt", "99999"),
    ),
    "accuracy_id_outside_the_vocabulary": Case(
        lambda tmp: [
            "run",
            str(
                _pipeline(
                    tmp, verify={"prompt": PROMPT, "accuracy": {"token_ids_file": str(_token_file(tmp, "5 6 512 7"))}}
                )
            ),
        ],
        ("key 'verify.accuracy.token_ids_file'", "tokens.txt", "512"),
    ),
    "accuracy_longer_than_the_cache": Case(
        lambda tmp: [
            "run",
            str(
                _pipeline(
                    tmp,
                    verify={
                        "prompt": PROMPT,
                        "accuracy": {"token_ids_file": str(_token_file(tmp, " ".join(["5"] * 80)))},
                    },
                )
            ),
        ],
        ("key 'verify.accuracy.max_tokens'", "80 held-out tokens", "passes[0].static_kv", "at most 64 slots"),
    ),
    "pin_opset_below_what_int4_qdq_needs": Case(
        run_config(
            passes=[
                *static_kv(max_cache_len=64),
                {"quantize_weights": {"bits": 4, "format": "qdq"}},
                {"pin_opset": {"opset": 19}},
            ]
        ),
        ("passes[2].pin_opset", "passes[1].quantize_weights", "blocked INT4 DequantizeLinear", "opset 21"),
    ),
    "kv_layout_on_a_cache_inside_group_query_attention": Case(
        lambda tmp: [
            "run",
            str(
                _pipeline(
                    tmp,
                    model=fixture_entry("llama_gqa_genai")["model_path"],
                    passes=[*static_kv(max_cache_len=64), {"kv_layout": {"layout": "BSH2D"}}],
                    verify=None,
                )
            ),
        ],
        ("passes[1].kv_layout", "GroupQueryAttention", "leave kv_layout out"),
    ),
    "pin_opset_above_the_newest": Case(
        run_config(passes=[*static_kv(max_cache_len=64), {"pin_opset": {"opset": onnx.defs.onnx_opset_version() + 1}}]),
        ("passes[1].pin_opset.opset", f"outside the supported range 11..{onnx.defs.onnx_opset_version()}"),
    ),
    # pass order: refused before the first pass runs (no cache entry, no output)
    "grouped_attention_after_kv_layout": Case(
        run_config(passes=[*static_kv(max_cache_len=64), {"kv_layout": {"layout": "BHDS_K"}}, "grouped_attention"]),
        ("passes[2].grouped_attention", "passes[1].kv_layout", "move grouped_attention before kv_layout"),
    ),
    "grouped_attention_before_static_kv": Case(
        run_config(passes=["grouped_attention", *static_kv(max_cache_len=64)]),
        ("passes[0].grouped_attention", "passes[1].static_kv", "move grouped_attention after static_kv"),
    ),
    "mask_rewrite_after_pin_opset_11": Case(
        run_config(passes=[*static_kv(max_cache_len=64), {"pin_opset": {"opset": 11}}, "mask_rewrite"]),
        ("passes[2].mask_rewrite", "opset >= 12", "passes[1].pin_opset", "move pin_opset after mask_rewrite"),
    ),
    "prompt_outside_vocabulary": Case(run_config(verify={"prompt": [1, 512]}), ("verify.prompt", "vocabulary")),
    "verify_prompt_not_integers": Case(
        lambda tmp: ["verify", str(FIXTURE), str(FIXTURE), "--prompt", "1,two"], ("--prompt", "integers")
    ),
    # ------------------------------------------------------------------------------------------ outputs
    "output_dir_unwritable": Case(
        run_config(output_dir="/proc/onnxdeploy-out"), ("/proc/onnxdeploy-out", "choose a writable output_dir")
    ),
    "output_dir_is_a_file": Case(
        lambda tmp: ["run", str(_pipeline(tmp, output_dir=str(_file(tmp / "out.txt"))))], ("out.txt", "not a folder")
    ),
    "output_onto_the_input": Case(
        lambda tmp: ["run", str(_pipeline(tmp, _external(tmp), output_dir=str(tmp / "in")))],
        ("model.onnx", "never overwritten"),
    ),
    "output_name_with_folder": Case(run_config(output_name="../x.onnx"), ("output_name", "plain file name")),
}


def _file(path: Path) -> Path:
    path.write_text("a file, not a folder")
    return path


def _tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (symlinks by target), to show the inputs were not touched."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p)] = sha256(p)
    return out


def _invoke(argv: list[str]):
    result = runner.invoke(app, argv)
    return result, (result.stdout or "") + (result.stderr or "")


def test_the_corpus_has_at_least_40_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_2_with_a_short_message_and_leaves_everything_untouched(tmp_path, name):
    case = CASES[name]
    cache = tmp_path / "cache"
    argv = case.argv(tmp_path)
    if argv[0] == "run":
        argv += ["--cache-dir", str(cache)]
    before, fixture_before = _tree(tmp_path), sha256(FIXTURE)
    result, out = _invoke(argv)
    assert result.exit_code == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors, out
    message = " ".join(out[out.index("error:") :].split())  # rich wraps long lines on a narrow terminal
    short = message.replace(str(tmp_path), "<tmp>")  # the test's folder is long; the message is not to blame
    assert len(short) <= MAX_ERROR_CHARS, f"{len(short)} chars: {short}"
    for needle in case.needles:
        assert needle in message, (needle, message)
    assert _tree(tmp_path) == before and sha256(FIXTURE) == fixture_before, "an input or the folder changed"
    assert not (tmp_path / "out").is_dir(), "an output folder was left"
    assert not cache.exists(), "a cache entry or staging folder was left"


def test_debug_shows_the_traceback_of_a_bad_input(tmp_path):
    argv = CASES["cyclic_graph"].argv(tmp_path)
    plain, plain_out = _invoke(argv)
    debug, debug_out = _invoke(["--debug", *argv])
    assert plain.exit_code == debug.exit_code == 2
    assert "Traceback" not in plain_out
    assert "Traceback (most recent call last)" in debug_out and "ModelLoadError" in debug_out, debug_out
    assert debug_out.rstrip().splitlines()[-1].startswith("error:") or "error:" in debug_out


def test_a_checks_only_run_reports_a_duplicate_tensor_as_a_finding(tmp_path):
    model = _parsed(tmp_path, TWICE, "twice.onnx")
    before = sha256(model)
    result, out = _invoke(["run", str(_pipeline(tmp_path, model, passes=[], verify=None)), "--json"])
    assert result.exit_code == 1, out
    report = json.loads(result.stdout)
    assert report["status"] == "failed" and report["output_model"] is None
    assert any(f["code"] == "OD303" and "'t'" in f["message"] for f in report["findings"]), report["findings"]
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "report.json" in written and all(n.startswith("report.") for n in written), written
    assert sha256(model) == before
