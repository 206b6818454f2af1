"""Compatibility matrices: one YAML data file per target (``matrices/<target>.yaml``), validated by a schema.

Each file (schema: :mod:`onnxdeploy.matrices.schema`) states the target's opset range per domain, IR version,
static-shape requirement, dtype support, size limits and supported operators with their constraints; every
fact names its source (document, section, version, address, date read). ``ort-cpu.yaml`` is generated from the
installed onnxruntime (``python -m onnxdeploy.matrices.generate_ort_cpu``); the others are transcribed from the
documents they cite, and what could not be sourced is listed under ``gaps`` instead of guessed.

Questions answered here (and by ``onnxdeploy matrix``): which targets take op X at opset N
(:func:`lookup`), the highest opset a target accepts (``get_target(t).opsets['ai.onnx'].max``), and, with the
target checks, which ops of a model a target lacks.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from importlib import resources
from typing import Literal

import yaml
from pydantic import ValidationError

from onnxdeploy.errors import ConfigError
from onnxdeploy.matrices.schema import Matrix, OpEntry

__all__ = ["LookupAnswer", "Matrix", "OpEntry", "get_target", "list_targets", "lookup", "schema_version_of"]

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def list_targets() -> list[str]:
    """Return the ids of every target with a data file, sorted."""
    files = resources.files(__name__).iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


@functools.cache
def get_target(name: str) -> Matrix:
    """Load and validate the matrix of target ``name`` (cached: the files are package data).

    Raises:
        ConfigError: no data file for ``name`` (the message lists the known targets), or the file does not
            validate against :class:`~onnxdeploy.matrices.schema.Matrix` (the message names the file and keys).
    """
    if name not in list_targets():
        raise ConfigError(f"unknown target '{name}'; known targets: {', '.join(list_targets()) or 'none'}")
    text = resources.files(__name__).joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    where = f"matrices/{name}.yaml"
    try:
        matrix = Matrix.model_validate(yaml.load(text, Loader=_Loader))  # noqa: S506 (a SafeLoader)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:10])
        raise ConfigError(f"{where} does not validate: {problems}") from None
    if matrix.target != name:
        raise ConfigError(f"{where}: key 'target' is '{matrix.target}', expected '{name}' (the file name)")
    return matrix


def schema_version_of(domain: str, op: str, opset: int) -> int | None:
    """The ``since_version`` of ``domain::op``'s ONNX schema selected by ``opset`` (``onnx.defs.get_schema``).

    Returns:
        The schema version, or None when onnx has no schema for the op at that opset (a custom domain such
        as ``com.microsoft``, or an op newer than ``opset``).
    """
    import onnx  # noqa: PLC0415  (only the op questions need onnx's schemas: `matrix list` and `show` start fast)

    try:
        return onnx.defs.get_schema(op, opset, "" if domain == "ai.onnx" else domain).since_version
    except onnx.defs.SchemaError:
        return None


@dataclass
class LookupAnswer:
    """Whether one target takes an op at an opset, and on what terms.

    Attributes:
        target: target id.
        verdict: ``yes`` (an entry covers it), ``no`` (outside the opset range, or the target's list is
            complete and has no entry), ``unknown`` (the sourced list is partial and does not name it).
        reason: one sentence saying why.
        entries: the matching entries (types, constraints, placement, source).
        max_opset: the highest ``ai.onnx`` opset the target accepts (None when unsourced).
    """

    target: str
    verdict: Literal["yes", "no", "unknown"]
    reason: str
    entries: list[OpEntry] = field(default_factory=list)
    max_opset: int | None = None


def _answer(matrix: Matrix, op: str, domain: str, opset: int | None) -> LookupAnswer:
    rng = matrix.opsets.get(domain)
    ai_onnx = matrix.opsets.get("ai.onnx")
    max_opset = ai_onnx.max if ai_onnx else None
    if opset is not None and rng is not None and not rng.min <= opset <= rng.max:
        return LookupAnswer(
            matrix.target, "no", f"{domain} opset {opset} is outside {rng.min}..{rng.max}", max_opset=max_opset
        )
    if rng is None:
        return LookupAnswer(matrix.target, "no", f"domain {domain} is not supported", max_opset=max_opset)
    version = schema_version_of(domain, op, opset) if opset is not None else None
    if opset is not None and version is None and domain == "ai.onnx":
        return LookupAnswer(matrix.target, "no", f"ONNX has no {op} at opset {opset}", max_opset=max_opset)
    entries = matrix.ops_for(domain, op, version if version is not None else opset)
    if entries:
        where = f" (schema version {version})" if version is not None else ""
        return LookupAnswer(matrix.target, "yes", f"listed{where}", entries, max_opset)
    any_version = matrix.ops_for(domain, op)
    if any_version:
        spans = ", ".join(f"{e.since}..{e.until or '∞'}" for e in any_version)
        return LookupAnswer(
            matrix.target, "no", f"listed only for schema versions {spans}, not {version}", any_version, max_opset
        )
    if matrix.ops_complete:
        return LookupAnswer(matrix.target, "no", "not in the target's operator list", max_opset=max_opset)
    return LookupAnswer(
        matrix.target, "unknown", "not in the sourced operator list (partial; see gaps)", max_opset=max_opset
    )


def lookup(
    op: str, *, opset: int | None = None, target: str | None = None, domain: str = "ai.onnx"
) -> list[LookupAnswer]:
    """Answer, per target, whether it takes ``domain::op`` at ``opset`` (any version when None).

    Args:
        op: operator type, e.g. ``Attention``.
        opset: the model's opset for ``domain``; the op's schema version is derived from it.
        target: one target id, or None for every target.
        domain: operator domain.

    Returns:
        One :class:`LookupAnswer` per target, in target order.

    Raises:
        ConfigError: ``target`` is unknown, a matrix file does not validate, or neither ONNX nor any target's
            matrix knows ``domain::op`` (a typo: the message names the op and its closest known names).
    """
    targets = [target] if target else list_targets()
    answers = [_answer(get_target(t), op, domain, opset) for t in targets]
    _check_known(op, domain)
    return answers


def _known_ops(domain: str) -> set[str]:
    """Op types of ``domain`` that ONNX defines (any opset) or any target's matrix lists."""
    import onnx  # noqa: PLC0415  (see schema_version_of)

    onnx_domain = "" if domain == "ai.onnx" else domain
    known = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain == onnx_domain}
    for name in list_targets():
        known |= {e.op for e in get_target(name).ops if e.domain == domain}
    return known


def _check_known(op: str, domain: str) -> None:
    """Refuse an op neither ONNX nor any matrix knows, naming the closest known names (case-insensitive).

    Raises:
        ConfigError: ``domain::op`` is unknown.
    """
    known = _known_ops(domain)
    if op in known:
        return
    lower = {k.lower(): k for k in known}
    close = [lower[k] for k in difflib.get_close_matches(op.lower(), list(lower), n=3, cutoff=0.6)]
    elsewhere = sorted(d for d in ("ai.onnx", *_other_domains()) if d != domain and op in _known_ops(d))
    hint = f" (closest: {', '.join(close)})" if close else ""
    if elsewhere:
        hint += f"; {op} is known in domain {', '.join(elsewhere)} (--domain {elsewhere[0]})"
    raise ConfigError(f"unknown op '{domain}::{op}': neither ONNX nor any target's matrix defines it{hint}")


def _other_domains() -> set[str]:
    return {e.domain for name in list_targets() for e in get_target(name).ops}
