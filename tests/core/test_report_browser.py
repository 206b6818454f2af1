"""report.html in a real browser: headless Chromium lays it out at 1280 px (skipped where Chromium is absent).

A graph-set run against a target with findings (long node lists) is rendered; a copy of its report.html gets a
measuring script (the report itself carries none) and Chromium's ``--dump-dom`` returns what the script wrote: the
page's width against the window, each table's width against its container, and the points of each plot.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from onnxdeploy.config import load_pipeline
from onnxdeploy.pipeline import run_pipeline
from tests.conftest import fixture_entry

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (Debian: apt install chromium)"
)

MEASURE = """
<script>
window.addEventListener("load", () => {
  const doc = document.documentElement;
  const tables = [...document.querySelectorAll("table")].map(t => ({
    cls: t.className, width: t.scrollWidth, room: t.parentElement.clientWidth,
    tallest: Math.max(0, ...[...t.rows].map(r => r.getBoundingClientRect().height)),
  }));
  const plots = [...document.querySelectorAll("figure.plot")].map(f => ({
    kind: f.dataset.kind,
    points: f.querySelectorAll("g[id*='points'] use, g[id*='points'] path").length,
  }));
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({scroll: doc.scrollWidth, client: doc.clientWidth, tables, plots});
  document.body.appendChild(out);
});
</script>
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    cfg = {
        "model": str(fixture_entry("llama_gqa_optimum")["model_path"]),
        "output_dir": str(tmp / "out"),
        "target": "rknn-rk3588",
        "passes": [{"static_kv": {"step_lens": [1, 4], "max_cache_lens": [32, 64], "cache_write": "scatter_elements"}}],
        "verify": {"prompt": [1, 17, 42, 99, 7, 3, 5, 9, 11], "steps": 24},
    }
    (tmp / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    outcome = run_pipeline(load_pipeline(tmp / "pipeline.yaml"))
    assert outcome.report.findings, "the target check must leave findings to lay out"
    page = tmp / "measured.html"
    page.write_text((tmp / "out" / "report.html").read_text().replace("</body>", MEASURE + "</body>"))
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / 'profile'}",
        "--window-size=1280,900",
        "--virtual-time-budget=10000",
        "--dump-dom",
    ]
    done = subprocess.run([CHROMIUM, *flags, page.as_uri()], capture_output=True, text=True, timeout=120)
    dom = done.stdout
    if "<html" not in dom:  # the browser could not start here (sandbox, display): nothing was laid out
        pytest.skip(f"Chromium did not run (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def test_the_page_does_not_scroll_sideways_at_1280_px(measured):
    assert measured["scroll"] <= measured["client"], measured


def test_every_table_fits_its_column_and_no_row_grows_tall(measured):
    for table in measured["tables"]:
        assert table["width"] <= table["room"] + 1, table
        assert table["tallest"] < 400, table  # a node list wrapped a few characters a line grew rows to ~1000 px
    assert any(t["cls"] == "findings" for t in measured["tables"])


def test_every_plot_has_points(measured):
    assert measured["plots"] and all(p["points"] > 0 for p in measured["plots"]), measured["plots"]
