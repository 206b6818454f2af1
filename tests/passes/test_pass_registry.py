"""The pass registry loads pass modules when first needed, and is complete when read whole."""

from __future__ import annotations

import subprocess
import sys

import pytest

import onnxdeploy.passes as passes
from onnxdeploy.errors import ConfigError


def test_get_pass_imports_only_the_named_module_and_passes_lists_them_all() -> None:
    code = (
        "import sys, onnxdeploy.passes as p\n"
        "mods = lambda: sorted(m for m in sys.modules if m.startswith('onnxdeploy.passes.') and '._' not in m)\n"
        "print(mods())\n"
        "p.get_pass('quantize_weights')\n"
        "print(mods(), 'onnxsim' in sys.modules)\n"
        "print(len(p.PASSES), len(mods()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == "['onnxdeploy.passes.quantize_weights'] False"  # onnxsim stays unimported
    assert out[2] == f"{len(passes.PASSES)} {len(passes.pass_modules())}"


def test_every_pass_module_registers_and_every_name_resolves() -> None:
    registry = passes.PASSES
    assert {cls.__module__.rsplit(".", 1)[1] for cls in registry.values()} == set(passes.pass_modules())
    for name, cls in registry.items():
        assert passes.get_pass(name) is cls
    with pytest.raises(ConfigError, match="unknown pass 'nope'; known passes: embed_external_data"):
        passes.get_pass("nope")
