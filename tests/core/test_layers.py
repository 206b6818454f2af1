"""The layers of docs/ARCHITECTURE.md ("Layers and what each may import"), read off every module's imports."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

BOTTOM = {
    "errors",
    "graph",
    "model_io",
    "external_refs",
    "stand_in",
    "model_write",
    "inline_weights",
    "mapped_tensor",
    "contract",
    "contract_terms",
    "contract_parts",
    "contract_cache",
    "contract_entries",
    "batching_trace",
    "kv_cache",
    "artifacts",
    "settings",
    "report",
    "report_verify",
    "run_scratch",
    "config_errors",
    "pass_listing",
    "resources",
    "token_ids",
    "text",
    "sdk",
    "_rknn_worker",
}
"""The core's bottom modules (``onnxdeploy/<name>.py``): they import no layer above them."""

ALLOWED = {
    "bottom": {"bottom"},
    "passes": {"bottom", "passes"},
    "checks": {"bottom", "checks", "matrices"},
    "runner": {"bottom", "runner"},
    "matrices": {"bottom", "matrices"},
}


def _layer(module: str) -> str:
    """``onnxdeploy.passes._edit`` -> ``passes``; ``onnxdeploy.graph`` -> ``bottom``; ``onnxdeploy.cli`` -> ``top``."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("passes", "checks", "runner", "matrices"):
        return parts[1]
    if len(parts) == 1 or parts[1] in BOTTOM or parts[1] == "__version__":
        return "bottom"
    return "top"


def _imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("onnxdeploy"):
            found |= {f"{node.module}.{a.name}" if node.module == "onnxdeploy" else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("onnxdeploy")}
    return found


MODULES = [("bottom", REPO / "onnxdeploy" / f"{name}.py") for name in sorted(BOTTOM)] + [
    (layer, path)
    for layer in ("passes", "checks", "runner", "matrices")
    for path in sorted((REPO / layer).glob("*.py"))
]


@pytest.mark.parametrize(("layer", "path"), MODULES, ids=[f"{layer}/{p.name}" for layer, p in MODULES])
def test_each_module_imports_only_the_layers_below_it(layer, path):
    wrong = sorted(m for m in _imports(path) if _layer(m) not in ALLOWED[layer])
    assert not wrong, f"{path.relative_to(REPO)} ({layer}) imports {wrong}"


def test_the_layer_reader_tells_layers_apart():
    assert _layer("onnxdeploy.passes._edit") == "passes" and _layer("onnxdeploy.graph") == "bottom"
    assert _layer("onnxdeploy.pipeline") == "top" and _layer("onnxdeploy.runner") == "runner"


def test_modules_and_functions_stay_the_size_of_a_concept():
    """docs/ARCHITECTURE.md: no pass module over 600 lines, no function over 80 in the library's five folders."""
    long = []
    for folder in ("onnxdeploy", "passes", "checks", "runner", "matrices"):
        for path in sorted((REPO / folder).glob("*.py")):
            text = path.read_text()
            if folder == "passes" and len(text.splitlines()) > 600:
                long.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                    long.append(
                        f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}"
                    )
    assert not long, long
