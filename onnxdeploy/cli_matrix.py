"""``onnxdeploy matrix list | show | lookup``: the compatibility matrices of ``matrices/``, read without onnx."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from onnxdeploy.cli_common import JsonOpt, consoles, fail
from onnxdeploy.errors import EXIT_OK, OnnxDeployError

__all__ = ["matrix_app"]

matrix_app = typer.Typer(
    help="Compatibility matrices: list targets, show one, look up an op across targets.", no_args_is_help=True
)


@matrix_app.command("list")
def matrix_list(*, as_json: JsonOpt = False) -> None:
    """List every target with its kind, version, ai.onnx opset range, IR range and op count."""
    from onnxdeploy.matrices import get_target, list_targets

    out, err = consoles(as_json)
    try:
        matrices = [get_target(t) for t in list_targets()]
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=as_json) from None
    rows = []
    for m in matrices:
        ai = m.opsets.get("ai.onnx")
        rows.append(
            {
                "target": m.target,
                "name": m.name,
                "kind": m.kind,
                "product_version": m.product_version,
                "ai_onnx_opset": [ai.min, ai.max] if ai else None,
                "ir_version": [m.ir_version.min, m.ir_version.max] if m.ir_version else None,
                "static_shapes": m.static_shapes,
                "ops": len(m.ops),
                "ops_complete": m.ops_complete,
                "gaps": len(m.gaps),
            }
        )
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    table = Table(title="targets (matrices/)")
    for col in ("target", "kind", "version", "ai.onnx", "IR", "static", "ops", "gaps"):
        table.add_column(col, overflow="fold")
    for r in rows:
        opset, ir = r["ai_onnx_opset"], r["ir_version"]
        table.add_row(
            r["target"],
            r["kind"],
            escape(r["product_version"]),
            f"{opset[0]}..{opset[1]}" if opset else "?",
            f"{ir[0]}..{ir[1]}" if ir else "?",
            r["static_shapes"] or "?",
            f"{r['ops']}" + ("" if r["ops_complete"] else " (partial)"),
            str(r["gaps"]),
        )
    out.print(table)
    raise typer.Exit(EXIT_OK)


@matrix_app.command("show")
def matrix_show(
    target: Annotated[str, typer.Argument(help="A target id (see `onnxdeploy matrix list`).")],
    *,
    as_json: JsonOpt = False,
) -> None:
    """Show one target's matrix: ranges, dtypes, limits, sources, gaps; with --json, the whole file."""
    from onnxdeploy.matrices import get_target

    out, err = consoles(as_json)
    try:
        m = get_target(target)
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=as_json) from None
    if as_json:
        sys.stdout.write(m.model_dump_json(indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    out.print(f"[bold]{m.target}[/]: {escape(m.name)} ({m.kind}; {escape(m.product_version)})")
    out.print(escape(m.description), soft_wrap=True)
    ir = f"{m.ir_version.min}..{m.ir_version.max} [{m.ir_version.source}]" if m.ir_version else "unsourced"
    out.print(f"IR version: {ir}; static shapes: {m.static_shapes or 'unsourced'}")
    out.print("opsets: " + ", ".join(f"{d} {r.min}..{r.max} [{r.source}]" for d, r in m.opsets.items()))
    for name, d in m.dtypes.items():
        out.print(f"dtype {name}: {d.supported} [{d.source}] {escape(d.note)}", soft_wrap=True)
    for lim in m.limits:
        out.print(f"limit {lim.name} <= {lim.value} {lim.unit} {escape(lim.applies_to)} [{lim.source}]")
    ops = sorted({f"{e.op}" if e.domain == "ai.onnx" else f"{e.domain}::{e.op}" for e in m.ops})
    out.print(f"ops ({len(ops)}{'' if m.ops_complete else ', partial list'}): " + ", ".join(ops), soft_wrap=True)
    for sid, s in m.sources.items():
        out.print(f"[{sid}] {escape(s.doc)}, {escape(s.section)} ({escape(s.version)}; {s.address}; read {s.read})")
    for gap in m.gaps:
        out.print(f"[yellow]gap:[/] {escape(gap)}", soft_wrap=True)
    raise typer.Exit(EXIT_OK)


@matrix_app.command("lookup")
def matrix_lookup(
    op: Annotated[str, typer.Argument(help="Operator type, e.g. Attention.")],
    *,
    opset: Annotated[int | None, typer.Option("--opset", min=1, help="The model's opset for the op's domain.")] = None,
    target: Annotated[str | None, typer.Option("--target", "-t", help="One target; default: all.")] = None,
    domain: Annotated[str, typer.Option("--domain", help="Operator domain.")] = "ai.onnx",
    as_json: JsonOpt = False,
) -> None:
    """Which targets take OP (at --opset), under which constraints; and each target's highest opset."""
    from onnxdeploy.matrices import get_target, lookup

    out, err = consoles(as_json)
    try:
        answers = lookup(op, opset=opset, target=target, domain=domain)
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=as_json) from None
    rows = []
    for a in answers:
        m = get_target(a.target)
        rows.append(
            {
                "target": a.target,
                "verdict": a.verdict,
                "reason": a.reason,
                "max_opset": a.max_opset,
                "entries": [e.model_dump(exclude_none=True) for e in a.entries],
                "sources": {e.source: m.source_text(e.source) for e in a.entries},
            }
        )
    if as_json:
        sys.stdout.write(json.dumps({"op": op, "domain": domain, "opset": opset, "answers": rows}, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    table = Table(title=f"{domain}::{op}" + (f" at opset {opset}" if opset else ""))
    for col in ("target", "takes it", "why", "constraints", "max opset"):
        table.add_column(col, overflow="fold")
    colours = {"yes": "green", "no": "red", "unknown": "yellow"}
    for r in rows:
        cons = []
        for e in r["entries"]:
            parts = [f"{k}: {'|'.join(v)}" for k, v in (e.get("types") or {}).items()]
            parts += e.get("constraints", [])
            if e.get("placement") == "cpu_fallback":
                parts.append("runs on CPU")
            cons.append(f"v{e['since']}..{e.get('until', '∞')}: " + ("; ".join(parts) or "none stated"))
        table.add_row(
            r["target"],
            f"[{colours[r['verdict']]}]{r['verdict']}[/]",
            escape(r["reason"]),
            escape("\n".join(cons)),
            str(r["max_opset"] or "?"),
        )
    out.print(table)
    for verdict, label in (("yes", "take it"), ("no", "lack it"), ("unknown", "unknown")):
        named = [r["target"] for r in rows if r["verdict"] == verdict]
        if named:
            out.print(f"{label}: {', '.join(named)}", soft_wrap=True)
    raise typer.Exit(EXIT_OK)
