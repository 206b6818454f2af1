"""The pass registry loads pass modules when first needed, and is complete when read whole."""

from __future__ import annotations

import subprocess
import sys

import pytest

import onnxdeploy.passes as passes
from onnxdeploy.errors import ConfigError


def test_get_pass_imports_only_the_named_module_and_passes_lists_them_all() -> None:
    # A fresh interpreter: this one's registry also holds the passes other tests register.
    code = (
        "import sys, onnxdeploy.passes as p\n"
        "mods = lambda: sorted(m for m in sys.modules if m.startswith('onnxdeploy.passes.') and '._' not in m)\n"
        "print(mods())\n"
        "p.get_pass('quantize_weights')\n"
        "print(mods(), 'onnxsim' in sys.modules)\n"
        "print(sorted({c.__module__ for c in p.PASSES.values()}) == mods(), len(mods()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == "['onnxdeploy.passes.quantize_weights'] False"  # onnxsim stays unimported
    assert out[2] == f"True {len(passes.pass_modules())}"  # every pass module imported, each registers a pass


def test_every_name_resolves() -> None:
    registry = passes.PASSES
    assert {"static_kv", "quantize_weights", "externalize", "embed_external_data"} <= set(registry)
    for name, cls in registry.items():
        assert passes.get_pass(name) is cls
    with pytest.raises(ConfigError, match="unknown pass 'nope'; known passes: "):
        passes.get_pass("nope")


def test_the_passes_import_neither_the_runner_nor_the_matrices():
    """What a pass needs of them comes through its PassContext (docs/ARCHITECTURE.md, "Layers")."""
    import ast  # noqa: PLC0415

    from tests.conftest import REPO  # noqa: PLC0415

    for path in sorted((REPO / "passes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                assert not name.startswith(("onnxdeploy.runner", "onnxdeploy.matrices")), f"{path.name} imports {name}"
    code = (
        "import sys; import onnxdeploy.passes as p; p.load_passes(); "
        "print(sorted(m for m in sys.modules if m.startswith(('onnxdeploy.runner', 'onnxdeploy.matrices'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
