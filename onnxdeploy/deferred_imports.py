"""Defer sympy, which onnx_ir imports at start-up but needs only for symbolic-dim arithmetic.

``onnx_ir._core`` runs ``import sympy`` at module level and ``onnx_ir._symbolic_shapes`` builds a table of
sympy functions at import, so every process that imports onnx_ir pays sympy's import: ~0.2 s of CPU on an idle
core here (~0.4 s of the 0.6 s ``onnxdeploy inspect`` took; measured 2026-12-02 with ``python -X importtime``,
onnx-ir 1.1.0, sympy 1.14.0), more on a loaded machine. onnx_ir touches sympy only when a ``SymbolicDim`` is
combined arithmetically or built from a sympy expression; reading, inspecting and checking a model never does.
No onnx_ir submodule avoids it: importing any of them runs ``onnx_ir/__init__`` and so ``_core``.

:func:`defer_sympy` therefore makes the first import of ``sympy`` and of ``onnx_ir._symbolic_shapes`` return
modules that execute on first attribute access (the standard library's ``importlib.util.LazyLoader``, the
recipe of the ``importlib`` documentation, "Implementing lazy imports"). Behaviour is unchanged: the first
use loads the real module in full. Only the ``inspect`` and ``check`` commands install it, which read models in
one thread: Python 3.11's ``LazyLoader`` takes no lock, so a first use from two threads at once could see a
half-loaded module, and ``run``/``verify`` (thread pools; start-up small against their work) keep plain imports,
as library users do.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["DEFERRED_MODULES", "defer_sympy"]

DEFERRED_MODULES = ("sympy", "onnx_ir._symbolic_shapes")
"""The modules :func:`defer_sympy` loads lazily: sympy, and the onnx_ir module that reads sympy at import."""


class _LazyFinder(importlib.abc.MetaPathFinder):
    """A one-shot finder: the first import of each name gets the real spec with a ``LazyLoader``."""

    def __init__(self, names: Sequence[str]) -> None:
        self._pending = set(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The real finders' spec for a pending name, its loader wrapped to execute on first attribute access."""
        if fullname not in self._pending:
            return None
        self._pending.discard(fullname)
        if not self._pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = importlib.util.LazyLoader(spec.loader)
                return spec
        return None


def defer_sympy() -> None:
    """Make sympy (and ``onnx_ir._symbolic_shapes``) load on first use rather than when onnx_ir is imported.

    A no-op for a module already imported; safe to call more than once.
    """
    pending = [name for name in DEFERRED_MODULES if name not in sys.modules]
    if pending and not any(isinstance(f, _LazyFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LazyFinder(pending))
