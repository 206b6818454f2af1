"""The pass catalogue (passes/_catalog.py) says what the registry says, and the fast commands import no onnx.

``onnxdeploy passes``, ``matrix list|show`` and the pipeline's refusals read the catalogue, so they start without
onnx, onnx_ir, onnxruntime or numpy (issue 20: ``ml_dtypes``' import alone takes ~1.5 s). These tests check the
imports, not the time (``benchmarks/startup.py`` measures that).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import onnxdeploy.passes as passes
from onnxdeploy.cli import app
from onnxdeploy.pass_listing import config_rows
from onnxdeploy.passes import CATALOG, describe_config
from onnxdeploy.passes._pass_infra import PASS_REGISTRY, Pass, register_pass
from tests.conftest import fixture_entry

HEAVY = ("onnx", "onnx_ir", "onnxruntime", "numpy", "ml_dtypes", "onnxsim")


def _package_registry() -> dict[str, type[Pass]]:
    """The registry after importing every pass module, less the passes tests register from outside the package."""
    return {n: c for n, c in passes.load_passes().items() if c.__module__.startswith("onnxdeploy.passes.")}


def test_the_catalogue_equals_the_registry_of_every_pass_module():
    registry = _package_registry()
    assert set(registry) == set(CATALOG)
    for name, cls in registry.items():
        info = CATALOG[name]
        assert cls.__module__ == f"onnxdeploy.passes.{info.module}", name
        assert cls.config_model is info.config_model, name
        assert cls.summary == info.summary and cls.summary, name
        assert cls.describe_config() == describe_config(info.config_model), name


def test_onnxdeploy_passes_lists_what_the_registry_says():
    result = CliRunner().invoke(app, ["passes", "--json"])
    assert result.exit_code == 0, result.output
    expected = [
        {"name": name, "summary": cls.summary, "config": config_rows(cls.config_model)}
        for name, cls in sorted(_package_registry().items())
    ]
    assert json.loads(result.stdout) == json.loads(json.dumps(expected, default=str))


def test_a_package_pass_registers_only_against_its_catalogue_entry(monkeypatch):
    monkeypatch.delitem(PASS_REGISTRY, "static_kv", raising=False)  # as before static_kv.py was imported

    def make(name: str, module: str, **attrs) -> type[Pass]:
        return type("_Probe", (Pass,), {"name": name, "__module__": module, **attrs})

    with pytest.raises(ValueError, match="no entry in passes/_catalog.py"):
        register_pass(make("not_catalogued", "onnxdeploy.passes.not_catalogued"))
    info = CATALOG["static_kv"]
    with pytest.raises(ValueError, match="differs from its catalogue entry"):
        register_pass(make("static_kv", "onnxdeploy.passes.elsewhere", config_model=info.config_model))
    with pytest.raises(ValueError, match="summary lives in passes/_catalog.py"):
        register_pass(make("static_kv", "onnxdeploy.passes.static_kv", config_model=info.config_model, summary="mine"))


def _fresh_cli(tmp_path, *args: str) -> tuple[int, list[str], str]:
    """Run the CLI in a fresh interpreter: (exit code, heavy modules it imported, stderr)."""
    code = (
        "import sys\n"
        "from onnxdeploy.cli import main\n"
        f"sys.argv = ['onnxdeploy', *{list(args)!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        f"print(code, sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False)
    last = done.stderr.strip().splitlines()[-1]
    status, heavy = last.split(" ", 1)
    return int(status), json.loads(heavy.replace("'", '"')), done.stderr


def _pipeline(tmp_path, passes_yaml: str) -> str:
    model = fixture_entry("llama_gqa_optimum")["model_path"]
    path = tmp_path / "p.yaml"
    path.write_text(f"model: {model}\npasses:\n{passes_yaml}")
    return str(path)


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (("passes",), 0, ""),
        (("matrix", "list"), 0, ""),
        (("matrix", "show", "rknn-rk3588"), 0, ""),
        (("run", "missing.yaml"), 2, "pipeline file not found"),
        (("run", "{bad_key}"), 2, "key 'passes[0].static_kv.max_cache_lenn': unknown key"),
        (("run", "{bad_pass}"), 2, "unknown pass 'static_kvv'"),
        (("run", "{bad_value}"), 2, "passes[1].quantize_weights.bits': must be 4 or 8, got 3"),
    ],
    ids=["passes", "matrix-list", "matrix-show", "run-missing", "run-bad-key", "run-unknown-pass", "run-bad-value"],
)
def test_fast_commands_and_refusals_import_no_onnx(tmp_path, args, status, says):
    files = {
        "{bad_key}": "  - static_kv: {max_cache_len: 64, max_cache_lenn: 3}\n",
        "{bad_pass}": "  - static_kvv: {max_cache_len: 64}\n",
        "{bad_value}": "  - static_kv: {max_cache_len: 64}\n  - quantize_weights: {bits: 3}\n",
    }
    args = tuple(_pipeline(tmp_path, files[a]) if a in files else a for a in args)
    code, heavy, stderr = _fresh_cli(tmp_path, *args)
    assert code == status, stderr
    assert says in stderr
    assert heavy == [], f"{args} imported {heavy}"


def test_the_catalogue_and_the_pipeline_schema_import_no_onnx():
    code = (
        "import sys\n"
        "import onnxdeploy.passes._catalog, onnxdeploy.config, onnxdeploy.matrices\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
