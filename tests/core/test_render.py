"""report.html (plots hold the run's points, self-contained), report.max_rows summarisation, Markdown size."""

from __future__ import annotations

import hashlib
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.errors import ConfigError
from onnxdeploy.pipeline import run_pipeline
from onnxdeploy.render import render_markdown
from onnxdeploy.report import RunReport, summarise_steps, summarise_verify
from tests.conftest import fixture_entry

MAX_ROWS = 12


@pytest.fixture(scope="module")
def graph_set_run(tmp_path_factory):
    """One graph-set run (decode 32/64 slots, prefill bucket of 4), both modes, 27 positions compared, max_rows 12."""
    tmp = tmp_path_factory.mktemp("html")
    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(tmp / "out"),
        "passes": [{"static_kv": {"batch": 1, "step_lens": [1, 4], "max_cache_lens": [32, 64]}}],
        "verify": {"prompt": [1, 17, 42, 99, 7, 3, 5, 9, 11], "steps": 24},
        "report": {"max_rows": MAX_ROWS},
    }
    (tmp / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    outcome = run_pipeline(load_pipeline(tmp / "pipeline.yaml"))
    assert outcome.exit_code == 0, outcome.report.failures
    out = tmp / "out"
    return json.loads((out / "report.json").read_text()), (out / "report.html").read_text(), out


class _Plots(HTMLParser):
    """Collects each ``figure.plot``: its data attributes and the markers (``<use>``) in its points group."""

    def __init__(self) -> None:
        super().__init__()
        self.plots: list[dict] = []
        self.ids: list[str] = []
        self._depth = 0  # open <g> elements inside the points group
        self.attribute_values: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        self.attribute_values += [v for _, v in attrs if v]
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "figure" and "plot" in (a.get("class") or ""):
            self.plots.append({"kind": a.get("data-kind"), "mode": a.get("data-mode"), "graph": a.get("data-graph")})
            self.plots[-1]["points"] = 0
        elif tag == "g" and self.plots and (a.get("id") or "").endswith("-points"):
            self._depth = 1
        elif tag == "g" and self._depth:
            self._depth += 1
        elif tag == "use" and self._depth:
            self.plots[-1]["points"] += 1

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag == "g" and self._depth:
            self._depth -= 1

    def handle_endtag(self, tag):
        if tag == "g" and self._depth:
            self._depth -= 1


def _parse(html_text: str) -> _Plots:
    parser = _Plots()
    parser.feed(html_text)
    return parser


def test_html_has_one_error_and_one_latency_plot_per_graph_and_mode_holding_every_position(graph_set_run):
    report, html_text, _ = graph_set_run
    roles = {g["file"]: g["role"] for g in report["graphs"]}
    plots = _parse(html_text).plots
    found = {(p["kind"], p["mode"], p["graph"]): p["points"] for p in plots if p["kind"] in ("error", "latency")}
    expected = set()
    for name, mode in report["verify"]["modes"].items():
        assert len(mode["positions_by_graph"]) >= 3, "the run should touch a prefill graph and two decode graphs"
        per_step_points = 0
        for graph, positions in mode["positions_by_graph"].items():
            expected |= {("error", name, graph), ("latency", name, graph)}
            assert found[("error", name, graph)] == positions, (name, graph)
            latency_points = found[("latency", name, graph)]
            if roles[graph] == "prefill":  # its calls are multi-token: one point per call
                calls = [c for c in mode["prefill"]["per_call"] if c["graph"] == graph]
                assert latency_points == len(calls) > 0, (name, graph)
            else:
                per_step_points += latency_points
        # every single-token call once: the steps after the prompt and the prompt's single-token calls
        prompt_single = sum(c["step_len"] == 1 for c in mode["prefill"]["per_call"])
        assert per_step_points == mode["latency_ms"]["calls"] + prompt_single, name
    assert set(found) == expected


def test_html_opens_offline_and_ids_are_unique(graph_set_run):
    _, html_text, _ = graph_set_run
    parsed = _parse(html_text)
    assert not parsed.tags & {"script", "link", "img", "iframe", "object", "embed"}
    assert not [v for v in parsed.attribute_values if re.search(r"https?:|//", v)], "a resource outside the file"
    assert "@import" not in html_text and not re.search(r"url\(\s*['\"]?(https?:|//)", html_text)
    assert len(parsed.ids) == len(set(parsed.ids)), "duplicate ids across the inline SVGs"
    refs = set(re.findall(r"url\(#([^)]+)\)", html_text)) | set(re.findall(r'href="#([^"]+)"', html_text))
    assert refs and refs <= set(parsed.ids)


def test_files_carry_sha256_and_graph_io(graph_set_run):
    report, html_text, out = graph_set_run
    files = {Path(f["path"]).name if f["role"] == "output" else f["path"]: f for f in report["files"]}
    for name in ("model.onnx", "model.onnx.data", "model.s4.c32.onnx"):
        record = files[name]
        assert record["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
        assert record["sha256"] in html_text
    assert all(Path(f["path"]).is_absolute() for f in report["files"]), "every file listed by its absolute path"
    model_in = files[str(Path(fixture_entry("llama_gqa_optimum")["model_path"]).resolve())]
    assert model_in["role"] == "input" and any(isinstance(d, str) for t in model_in["inputs"] for d in t["shape"])
    graph = files["model.s4.c32.onnx"]
    shapes = {t["name"]: t["shape"] for t in graph["inputs"]}
    assert shapes["input_ids"] == [1, 4] and all(isinstance(d, int) for s in shapes.values() for d in s)
    assert {t["dtype"] for t in graph["outputs"]} == {"FLOAT"}


def test_rows_beyond_max_rows_are_summarised_in_json_and_markdown(graph_set_run):
    report, _, out = graph_set_run
    for mode in report["verify"]["modes"].values():
        assert len(mode["steps"]) == MAX_ROWS < mode["positions"]
        omitted = sum(b["positions"] for b in mode["steps_omitted"])
        assert omitted + MAX_ROWS == mode["positions"]
        covered = {p for b in mode["steps_omitted"] for p in range(b["first_position"], b["last_position"] + 1)}
        assert not covered & {s["position"] for s in mode["steps"]}
    md = (out / "report.md").read_text()
    assert f"{MAX_ROWS} of {mode['positions']} positions" in md and "omitted" in md
    # a clean pass says so in each block's legend (it read "⚠ diverges" on every block)
    assert "positions (none diverges; rows beyond report.max_rows summarised)" in md and "⚠ diverges" not in md


def test_summarise_keeps_divergent_and_spiking_rows_and_the_ends(graph_set_run):
    report = RunReport.model_validate(graph_set_run[0])
    mode = report.verify.modes["teacher_forced"]
    template = mode.steps[-1]
    steps = []
    for pos in range(3000):  # a long run: a few divergent positions and one latency spike
        bad = pos in (700, 1500)
        ms = 1000.0 if pos == 2200 else 0.1
        steps.append(
            template.model_copy(
                update={"position": pos, "top1_match": not bad, "within_tolerance": not bad, "latency_ms_candidate": ms}
            )
        )
    lat = mode.latency_ms.model_copy(update={"p50": 0.1})
    long = mode.model_copy(update={"steps": steps, "positions": 3000, "latency_ms": lat})
    kept = summarise_steps(long, 200)
    positions = [s.position for s in kept.steps]
    assert len(positions) == 200 and {0, 2999, 700, 1500, 2200} <= set(positions)
    assert sum(b.positions for b in kept.steps_omitted) == 2800
    assert summarise_steps(long, 5000) is long
    big = report.model_copy(update={"verify": summarise_verify(report.verify, 200)})
    big.verify.modes["teacher_forced"] = kept
    md = render_markdown(big)
    assert len(md.encode()) < 100_000, "a CI job summary (GitHub: 1 MiB) must hold it with room"


def test_report_max_rows_must_be_positive(tmp_path):
    cfg = {"model": str(fixture_entry("llama_gqa_optimum")["model_path"]), "report": {"max_rows": 0}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="report.max_rows"):
        load_pipeline(tmp_path / "p.yaml")


def test_yaml_inline_scalars_carry_no_document_end_marker():
    from onnxdeploy.render import yaml_inline  # noqa: PLC0415

    assert [yaml_inline(v) for v in (64, None, "auto", True, 1.5)] == ["64", "null", "auto", "true", "1.5"]
    assert yaml_inline({"max_cache_lens": [32, 64]}) == "{max_cache_lens: [32, 64]}"


def test_a_graph_sets_pass_table_says_its_nodes_are_summed(graph_set_run):
    report, html_text, out = graph_set_run
    static = next(p for p in report["passes"] if p["name"] == "static_kv")
    assert static["graphs_before"] == 1 and static["graphs_after"] > 1
    assert f"(Σ 1 → {static['graphs_after']} graphs)" in (out / "report.md").read_text()
    assert "ops added and removed are the decode graph" in html_text


def test_the_graphs_a_set_verification_drove_are_named_in_the_markdown(graph_set_run):
    report, _, out = graph_set_run
    driven = report["verify"]["graphs_driven"]
    assert len(driven) > 1 and all(calls > 0 for calls in driven.values())
    line = next(x for x in (out / "report.md").read_text().splitlines() if "graphs driven:" in x)
    assert all(f"{name} {calls} call(s)" in line for name, calls in driven.items())


def test_the_latency_legend_counts_spikes_as_the_table_does():
    """A slow prompt position is drawn but is no spike: the verification's spikes count only generated steps."""
    from onnxdeploy.plots import latency_plot  # noqa: PLC0415
    from onnxdeploy.report import StepRecord  # noqa: PLC0415

    def step(position: int, ms: float) -> StepRecord:
        return StepRecord(
            position=position,
            phase="prompt" if position < 3 else "generate",
            token_in=1,
            top1_reference=2,
            top1_candidate=2,
            top1_match=True,
            topk_overlap=1.0,
            max_abs_logit_diff=0.0,
            max_rel_logit_diff=0.0,
            cosine_similarity=1.0,
            within_tolerance=True,
            latency_ms_candidate=ms,
        )

    steps = [step(p, 50.0 if p in (1, 6) else 1.0) for p in range(10)]
    svg = latency_plot(steps, spike_ms=3.0, title="t", plot_id="l0")
    assert "1 spike(s)" in svg and "2 spike(s)" not in svg
