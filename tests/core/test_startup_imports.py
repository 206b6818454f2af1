"""Start-up guards without timing: what the fast commands import, read off ``sys.modules`` in a fresh interpreter.

Issue 20 asks ``passes``, ``matrix list``, ``inspect MODEL`` and the exit-2 paths to start in <= 1.0 s;
``benchmarks/startup.py`` measures that. These tests keep the cause from coming back: a module-level import of
onnxruntime or onnx_ir on the catalogue path, or sympy (~0.2-0.4 s of CPU, pulled by onnx_ir) on the inspect path.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, fixture_entry

PROBE = ("onnxruntime", "onnx_ir", "onnx", "numpy", "sympy.core")
"""Modules whose presence in ``sys.modules`` after a command says what it paid for (``sympy.core``: sympy executed)."""


def _imported(tmp_path, *args: str) -> tuple[int, set[str], str]:
    """Run ``onnxdeploy ARGS`` through ``main`` in a fresh interpreter: (exit, probed modules, stderr)."""
    code = (
        "import sys\n"
        "from onnxdeploy.cli import main\n"
        f"sys.argv = ['onnxdeploy', *{list(args)!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        f"print(code, sorted(m for m in {PROBE!r} if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False)
    status, modules = done.stderr.strip().splitlines()[-1].split(" ", 1)
    return int(status), set(json.loads(modules.replace("'", '"'))), done.stderr


def test_passes_imports_neither_onnxruntime_nor_onnx_ir(tmp_path):
    status, modules, stderr = _imported(tmp_path, "passes")
    assert status == 0, stderr
    assert not modules, f"`onnxdeploy passes` imported {sorted(modules)}"


def test_inspect_reads_the_model_without_executing_sympy_or_onnxruntime(tmp_path):
    model = str(fixture_entry("llama_gqa_optimum")["model_path"])
    status, modules, stderr = _imported(tmp_path, "inspect", model, "--json")
    assert status == 0, stderr
    assert "onnx" in modules  # it did read the protobuf
    assert "sympy.core" not in modules and "onnxruntime" not in modules, sorted(modules)


def test_deferred_sympy_still_does_symbolic_arithmetic():
    """Deferring sympy changes when it loads, not what onnx_ir computes with it."""
    code = (
        "import sys\n"
        "from onnxdeploy.deferred_imports import defer_sympy\n"
        "defer_sympy()\n"
        "import onnx_ir as ir\n"
        "before = 'sympy.core' in sys.modules\n"
        "d = ir.SymbolicDim('past') + 1\n"
        "print(before, d, type(d._expr).__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "past", "+", "1", "sympy.core.add"], done.stdout


def test_version_is_read_only_when_asked_for():
    """``--version`` prints the installed version; other commands never read package metadata for it."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from onnxdeploy.cli import app  # noqa: PLC0415

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("onnxdeploy "), result.output
    assert "__version__" not in (REPO / "onnxdeploy" / "cli.py").read_text().split("def _root")[0]
