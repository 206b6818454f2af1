"""The commands on one model file: ``inspect`` (what it is), ``check`` (findings) and ``sdk`` (the device SDK)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from onnxdeploy.cli_common import JsonOpt, consoles, fail
from onnxdeploy.deferred_imports import defer_sympy
from onnxdeploy.errors import EXIT_FAILED, EXIT_OK, ConfigError, OnnxDeployError

__all__ = ["check_cmd", "inspect", "sdk_app"]


def inspect(
    model: Annotated[Path, typer.Argument(help="An ONNX model file.")],
    *,
    as_json: JsonOpt = False,
) -> None:
    """Show a model's inputs/outputs (symbolic dims), opsets, op histogram, size, external data and contract."""
    defer_sympy()  # onnx_ir imports it; reading a model never uses it
    from onnxdeploy.inspect import inspect_model

    out, err = consoles(as_json)
    try:
        info = inspect_model(model)
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=as_json) from None
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    out.print(
        f"[bold]{info['path']}[/]  ({info['file_bytes']} bytes, ir_version {info['ir_version']}, "
        f"producer {info['producer']})"
    )
    out.print("opsets: " + ", ".join(f"{d} {v}" for d, v in info["opsets"].items()))
    for kind in ("inputs", "outputs"):
        table = Table(title=kind)
        table.add_column("name")
        table.add_column("dtype")
        table.add_column("shape")
        for t in info[kind]:
            table.add_row(escape(t["name"]), t["dtype"], escape(t["shape_text"]))
        out.print(table)
    symbolic = info["symbolic_dims"]
    out.print("symbolic dims: " + (", ".join(symbolic) if symbolic else "none (all static)"))
    out.print("ops: " + ", ".join(f"{k}×{v}" for k, v in info["op_histogram"].items()))
    out.print(f"nodes: {info['nodes']}, initializers: {info['initializers']} ({info['initializer_bytes']} bytes)")
    ext = info["external_data"]
    out.print(
        "external data: "
        + (
            ", ".join(f"{e['location']} ({e['tensors']} tensors{'' if e['present'] else ', MISSING'})" for e in ext)
            or "none"
        )
    )
    if info["contract"]:
        out.print("contract: " + json.dumps(info["contract"]), soft_wrap=True, highlight=False, markup=False)
    else:
        out.print("contract: none (exporter convention)")
    raise typer.Exit(EXIT_OK)


def check_cmd(
    model: Annotated[Path, typer.Argument(help="An ONNX model file.")],
    *,
    target: Annotated[str | None, typer.Option("--target", "-t", help="A target id of matrices/.")] = None,
    checks: Annotated[
        str | None, typer.Option("--checks", help="Comma-separated check names instead of the defaults.")
    ] = None,
    sdk: Annotated[
        bool,
        typer.Option(
            "--sdk",
            help="Also build with the target's SDK (rknn-rk3588) and show its verdict per node beside the matrix's.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run the checks on a model (against --target's matrix): findings with node, rule, source and fixing pass.

    Exit 0 when no finding is an error (and, with --sdk, the SDK builds the model), 1 otherwise, 2 for bad input.
    """
    defer_sympy()
    from onnxdeploy.model_check import check_model_file

    out, err = consoles(as_json)
    names = [c.strip() for c in checks.split(",") if c.strip()] if checks is not None else None
    try:
        report = check_model_file(model, target=target, checks=names, sdk=sdk)
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=as_json) from None
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        out.print(f"checks run: {', '.join(report.checks_run)}" + (f"; target {target}" if target else ""))
        for f in report.findings:
            colour = {"error": "red", "warning": "yellow", "info": "dim"}[f.level]
            out.print(f"[{colour}]{f.code} {f.level}[/] {escape(f.message)}", soft_wrap=True)
            if f.rule:
                out.print(f"    rule: {escape(f.rule)}", soft_wrap=True)
            if f.source:
                out.print(f"    source: {escape(f.source)}", soft_wrap=True)
            if f.hint:
                out.print(f"    fix: {escape(f.hint)}", soft_wrap=True)
        if report.sdk is not None:
            from onnxdeploy.console_report import print_sdk  # noqa: PLC0415  (report models)

            print_sdk(out, report.sdk)
        s = report.summary
        colour = "green" if report.status == "passed" else "red"
        out.print(
            f"[bold {colour}]{report.status.upper()}[/]: {s['error']} error(s), {s['warning']} warning(s), "
            f"{s['info']} info"
        )
    raise typer.Exit(EXIT_OK if report.status == "passed" else EXIT_FAILED)


sdk_app = typer.Typer(help="Device SDK environments (installed on request, run as subprocesses).", no_args_is_help=True)


@sdk_app.command("install")
def sdk_install(
    name: Annotated[str, typer.Argument(help="The SDK: rknn (RKNN-Toolkit2 2.5.0, ~5.6 GB with torch).")],
) -> None:
    """Create the SDK's own virtual environment ($ONNXDEPLOY_SDK_HOME, default ~/.cache/onnxdeploy/sdk)."""
    from onnxdeploy.sdk import install_rknn

    out, err = consoles(False)
    if name != "rknn":
        raise fail(err, ConfigError(f"unknown SDK '{name}'; known: rknn"), as_json=False)
    try:
        python = install_rknn(log=lambda line: out.print(escape(line), soft_wrap=True))
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=False) from None
    out.print(f"RKNN-Toolkit2 environment ready: {python}")
    raise typer.Exit(EXIT_OK)


@sdk_app.command("status")
def sdk_status() -> None:
    """Say whether each SDK environment is installed (exit 0 either way)."""
    from onnxdeploy.sdk import rknn_env, rknn_python

    out, _ = consoles(False)
    python = rknn_python()
    out.print(f"rknn: {'installed, ' + str(python) if python else 'not installed (' + str(rknn_env()) + ')'}")
    raise typer.Exit(EXIT_OK)
