"""What ``onnxdeploy passes`` lists per config key: its YAML key path, a type in the pipeline file's words.

Also the default and the description; nested mappings (``quantize_weights.rules``, ``budget``) are expanded into
their keys. The catalogue's :func:`~onnxdeploy.passes.describe_config` names types as Python spells them
(``onnxdeploy.passes._quant_rules.Budget | None``, ``list``); a user writes YAML, so here a pydantic model is "a
mapping" whose keys follow as ``budget.max_mean_kl`` rows, a list of them ``rules[].bits``, ``None`` is ``null``.
Only pydantic and the standard library are imported: the listing stays as fast as the catalogue.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

__all__ = ["config_rows", "yaml_type"]

_NAMES = {bool: "bool", int: "int", float: "float", str: "string", Path: "path", type(None): "null"}
"""Scalar types as the listing names them."""

MAX_DEPTH = 3
"""Nested mappings expanded at most this deep (the configs nest two levels today)."""


def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``X | None``), else the annotation alone; ``Annotated[X, ...]`` as X."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return tuple(m for a in typing.get_args(annotation) for m in _members(a))
    return (annotation,)


def yaml_type(annotation: Any) -> str:
    """A field type in YAML terms: ``4 | 8``, ``int | null``, ``list of int``, ``mapping``, ``list of mappings``.

    Args:
        annotation: a pydantic field's (resolved) annotation.
    """
    parts = []
    for m in _members(annotation):
        origin, args = typing.get_origin(m), typing.get_args(m)
        if origin is typing.Literal:
            parts += ["null" if a is None else str(a) for a in args]
        elif isinstance(m, type) and issubclass(m, BaseModel):
            parts.append("mapping")
        elif origin in (list, tuple, set) or m in (list, tuple, set):
            inner = yaml_type(args[0]) if args else ""
            parts.append("list of mappings" if inner == "mapping" else f"list of {inner}" if inner else "list")
        elif origin is dict or m is dict:
            parts.append(f"mapping of {yaml_type(args[0])} to {yaml_type(args[1])}" if len(args) == 2 else "mapping")
        else:
            parts.append(_NAMES.get(m, getattr(m, "__name__", str(m))))
    return " | ".join(dict.fromkeys(parts))


def _nested(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The pydantic model a field holds (directly: ``.``, or in a list: ``[].``) and the key joiner, else None."""
    for m in _members(annotation):
        origin, args = typing.get_origin(m), typing.get_args(m)
        if isinstance(m, type) and issubclass(m, BaseModel):
            return m, "."
        if origin in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            return args[0], "[]."
    return None


def _annotations(model: type[BaseModel]) -> dict[str, Any]:
    """Field name -> resolved annotation (forward references to classes defined later resolved by typing)."""
    resolved = {name: f.annotation for name, f in model.model_fields.items()}
    if any(isinstance(a, str | typing.ForwardRef) for a in resolved.values()):
        hints = typing.get_type_hints(model)
        resolved = {name: hints.get(name, a) for name, a in resolved.items()}
    return resolved


def config_rows(model: type[BaseModel], prefix: str = "", depth: int = 0) -> list[dict[str, Any]]:
    """One row per config key, nested keys after their mapping.

    Each row: ``name``, ``type``, ``default``, ``required``, ``description``.

    Args:
        model: a pass's config model (``CATALOG[name].config_model``).
        prefix: the key path of ``model`` in its parent (``budget.``, ``rules[].``); empty at the top.
        depth: nesting level (expansion stops at :data:`MAX_DEPTH`).

    Returns:
        Rows in declaration order; ``default`` is the field's default (a nested model as its dict), None when
        required.
    """
    rows = []
    for name, annotation in _annotations(model).items():
        field = model.model_fields[name]
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        rows.append(
            {
                "name": prefix + name,
                "type": yaml_type(annotation),
                "default": default,
                "required": field.is_required(),
                "description": field.description or "",
            }
        )
        nested = _nested(annotation)
        if nested is not None and depth < MAX_DEPTH:
            rows += config_rows(nested[0], prefix + name + nested[1], depth + 1)
    return rows
