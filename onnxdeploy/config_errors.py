"""pydantic's validation errors said in the pipeline file's own words: the key path the user wrote, a plain sentence.

pydantic reports ``rules.0.bits``, "Value error, …", "Input should be a valid dictionary or instance of QuantRule"
and, inside a union, the member it tried (``function-after[…]``, a class name) as if it were a key. The user
wrote ``passes[2].quantize_weights.rules[0].bits`` and needs to read what to change, so:

* the location becomes the key path of the YAML: list indices as ``[i]``, union member labels dropped (a part
  is kept when the input holds it, and the last part always: a missing key is not in the input);
* the message drops pydantic's "Value error, " prefix, says "must be …" for "Input should be …", names a
  mapping where pydantic names its class, and says what was given (``got 3``);
* an unknown key gets "did you mean …?" from the keys the model takes there (``difflib.get_close_matches``).
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["did_you_mean", "format_validation_error", "key_path", "plain_message"]

_PREFIXES = ("Value error, ", "Assertion failed, ")
"""What pydantic puts before the message of a ``ValueError`` (``AssertionError``) raised by a validator."""

_MAPPING_TYPES = {"model_type", "model_attributes_type", "dict_type", "mapping_type"}
"""pydantic error types that mean "a mapping was expected"."""


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` naming the closest of ``known`` to ``word``, else ``""``.

    Candidates are ``difflib.get_close_matches`` (ratio >= 0.6, at most 3); of those, the ones within 0.05 of the
    best ratio are named (names that share a long suffix, ``…ExecutionProvider``, would all pass the cutoff).
    """
    close = difflib.get_close_matches(word, sorted(known), n=3, cutoff=0.6)
    ratio = {c: difflib.SequenceMatcher(None, word, c).ratio() for c in close}
    close = [c for c in close if ratio[c] >= max(ratio.values()) - 0.05]
    return "; did you mean " + " or ".join(f"'{c}'" for c in close) + "?" if close else ""


def _at(data: Any, part: str | int) -> tuple[bool, Any]:
    """(whether ``data`` holds ``part``, the value there)."""
    if isinstance(data, dict) and part in data:
        return True, data[part]
    if isinstance(data, list | tuple) and isinstance(part, int) and 0 <= part < len(data):
        return True, data[part]
    return False, None


def _parts(loc: Sequence[str | int], data: Any) -> list[str | int]:
    """The parts of ``loc`` that are keys or indices of ``data`` (plus the last one): union labels dropped."""
    if data is None:
        return [p for p in loc if isinstance(p, int) or not _looks_like_label(p)]
    kept: list[str | int] = []
    here = data
    for i, part in enumerate(loc):
        found, value = _at(here, part)
        if found:
            kept.append(part)
            here = value
        elif i == len(loc) - 1 and not _looks_like_label(part):
            kept.append(part)
    return kept


def _looks_like_label(part: str | int) -> bool:
    """A union member label pydantic puts in ``loc``: ``function-after[...]``, ``list[int]``, a class name."""
    return isinstance(part, str) and ("[" in part or "-" in part or part[:1].isupper())


def key_path(loc: Sequence[str | int], prefix: str = "", data: Any = None) -> str:
    """``passes[2].quantize_weights.`` + ``("rules", 0, "bits")`` -> ``passes[2].quantize_weights.rules[0].bits``.

    Args:
        loc: a pydantic error's ``loc``.
        prefix: the key path of the validated mapping, ending in ``.`` (empty at the top level).
        data: the validated input, to tell keys from union member labels (None: labels guessed by their form).

    Returns:
        The dotted path with ``[i]`` indices; the prefix without its dot for an error on the mapping itself.
    """
    text = prefix
    for part in _parts(loc, data):
        if isinstance(part, int):
            text = text.rstrip(".") + f"[{part}]."
        else:
            text += f"{part}."
    return text.rstrip(".") or "(top level)"


def _given(value: Any) -> str:
    """What the user gave, short: scalars as YAML would show them; mappings and lists by kind."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def plain_message(err: dict[str, Any]) -> str:
    """One pydantic error's message as a plain sentence, with what was given where that helps.

    Args:
        err: one entry of ``ValidationError.errors()`` (``type``, ``msg``, ``input``).
    """
    kind, msg, given = err["type"], str(err["msg"]), err.get("input")
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "missing (required)"
    if kind in _MAPPING_TYPES:
        return f"must be a mapping of keys (key: value), got {_given(given)}"
    for prefix in _PREFIXES:
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    msg = re.sub(r"^Input should be a valid (integer|number|list|string|dictionary)\b", r"must be a \1", msg)
    msg = msg.replace("must be a integer", "must be an integer").replace("a valid boolean", "true or false")
    msg = re.sub(r"^Input should be\b", "must be", msg)
    msg = re.sub(r"^Input should have\b", "must have", msg)
    msg = re.sub(r"^Input should\b", "must", msg)
    if not msg.startswith("must") or ", got " in msg:  # pydantic's own "got a number with a fractional part"
        return msg
    return f"{msg}, got {_given(given)}"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, Union, list, dict, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is None:
        return []
    args = typing.get_args(annotation)
    if origin is dict:
        args = args[1:]
    if origin is typing.Annotated:
        args = args[:1]
    found: list[type[BaseModel]] = []
    for arg in args:
        found += [m for m in _models(arg) if m not in found]
    return found if origin in (list, dict, tuple, set, typing.Union, types.UnionType, typing.Annotated) else []


def _annotation(model: type[BaseModel], name: str) -> Any:
    """The field's type; a forward reference (a class defined later in its module) resolved by ``get_type_hints``."""
    annotation = model.model_fields[name].annotation
    if isinstance(annotation, typing.ForwardRef) or isinstance(annotation, str):
        try:
            return typing.get_type_hints(model).get(name)
        except (NameError, TypeError):  # no suggestion then, never a failure
            return None
    return annotation


def _keys_at(model: type[BaseModel] | None, parts: Sequence[str | int]) -> set[str]:
    """The keys the model at ``parts`` takes (field names and aliases), for "did you mean"."""
    here = [model] if model is not None else []
    for part in parts:
        if isinstance(part, int):
            continue
        following: list[type[BaseModel]] = []
        for m in here:
            for name, field in m.model_fields.items():
                if part in (name, field.alias):
                    following += _models(_annotation(m, name))
        here = following
    return {key for m in here for name, f in m.model_fields.items() for key in (name, f.alias) if key}


def format_validation_error(
    exc: ValidationError, prefix: str = "", *, data: Any = None, model: type[BaseModel] | None = None
) -> str:
    """Render pydantic errors as ``key 'path': sentence`` parts, ``; ``-joined.

    Args:
        exc: the validation error.
        prefix: the key path of the validated mapping, ending in ``.`` (e.g. ``passes[2].quantize_weights.``).
        data: the validated input (tells keys from pydantic's union member labels).
        model: the model validated (gives the known keys for "did you mean").

    Returns:
        E.g. ``key 'passes[1].quantize_weights.rules[0].bits': must be 4, 8 or 'float', got 3``.
    """
    lines = []
    seen = set()
    for err in exc.errors():
        parts = _parts(err["loc"], data)
        key = key_path(err["loc"], prefix, data)
        msg = plain_message(err)
        if err["type"] == "extra_forbidden" and parts and isinstance(parts[-1], str):
            msg += did_you_mean(parts[-1], _keys_at(model, parts[:-1]))
        elif err["type"] == "literal_error" and isinstance(err.get("input"), str):
            msg += did_you_mean(err["input"], re.findall(r"'([^']*)'", str((err.get("ctx") or {}).get("expected"))))
        if (key, msg) not in seen:  # a union reports the same input once per member
            seen.add((key, msg))
            lines.append(f"key '{key}': {msg}")
    return "; ".join(lines)
