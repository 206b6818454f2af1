"""The SDK build stage's section on the console, in report.md and in report.html (issue 19).

The run is real (llama_gqa/optimum made a [1, 4] set, the checks, the reports); RKNN-Toolkit2's answer is stood in
for as in ``test_sdk_stage.py`` (each graph built, a Gather on the CPU), with a hybrid choice on the decode graph.
"""

from __future__ import annotations

import io

from rich.console import Console

from onnxdeploy import sdk as sdk_module
from onnxdeploy import sdk_stage
from onnxdeploy.config import load_pipeline
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.sdk_report import print_sdk_stage, sdk_html, sdk_markdown, sdk_rows
from tests.core.test_sdk_stage import _fake_builds, _pipeline

_HYBRID = {
    "float_layers": ["/m/rotary_emb/Sin_output_0", "/m/rotary_emb/Concat_output_0"],
    "layer_errors": {
        "min_cosine": 0.98,
        "samples": 3,
        "layers": 200,
        "sensitive": ["/m/rotary_emb/Sin_output_0"],
        "worst": [["/m/rotary_emb/Sin_output_0", 0.97848]],
    },
}


def _with_hybrid(build):
    def hybrid_build(models, *, builds, target_platform="rk3588"):
        reports = build(models, builds=builds, target_platform=target_platform)
        reports[0].hybrid = _HYBRID
        return reports

    return hybrid_build


def test_the_sdk_section_is_on_the_console_in_markdown_and_in_html(tmp_path, monkeypatch):
    for module in (sdk_stage, sdk_module):  # the config's check (sdk: build needs the SDK) reads onnxdeploy.sdk's
        monkeypatch.setattr(module, "rknn_python", lambda: "python")
    monkeypatch.setattr(sdk_stage, "rknn_build_reports", _with_hybrid(_fake_builds(None)))
    outcome = run_pipeline(load_pipeline(_pipeline(tmp_path, "sdk: build")))
    assert outcome.exit_code == 0, outcome.report.failures
    sdk = outcome.report.sdk
    rows = sdk_rows(sdk)
    assert [r[0] for r in rows] == ["model.onnx", "model.s4.c32.onnx"]
    assert [r[2] for r in rows] == ["model.rknn", "model.s4.c32.rknn"] and all(r[1] == "yes" for r in rows)
    decode = rows[0]
    assert decode[5] == "2: /m/rotary_emb/Sin_output_0, /m/rotary_emb/Concat_output_0"
    assert decode[6] == "0.97848 (/m/rotary_emb/Sin_output_0; bound 0.98, 1 below)" and rows[1][5:7] == ("—", "—")
    npu, cpu = (int(x) for x in decode[3].split(" / "))
    assert (npu, cpu) == (sdk["graphs"][0]["npu_nodes"], sdk["graphs"][0]["cpu_nodes"]) and cpu > 0

    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "## SDK build" in markdown and "| model.s4.c32.onnx | yes | model.s4.c32.rknn |" in markdown
    assert markdown.count("## SDK build") == 1 and "\n".join(sdk_markdown(sdk)) in markdown
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<h2>SDK build</h2>" in page and "".join(sdk_html(sdk)[2:]) in page
    assert "<td>model.rknn</td>" in page

    console = Console(file=io.StringIO(), width=300, color_system=None)
    print_sdk_stage(console, sdk)
    text = console.file.getvalue()
    assert "sdk: build · rknn-toolkit2 2.5.0 (rk3588) · fp16" in text and "model.s4.c32.rknn" in text


def test_a_stage_that_did_not_run_is_its_note():
    sdk = {"mode": "off", "sdk": "rknn-toolkit2 2.5.0", "target_platform": "rk3588", "ran": False, "note": "sdk: off"}
    assert sdk_markdown(sdk) == ["## SDK build", "", "sdk: off · rknn-toolkit2 2.5.0 (rk3588) · not run: sdk: off", ""]
    assert sdk_html(None) == [] and sdk_markdown(None) == [] and sdk_rows(sdk) == []
