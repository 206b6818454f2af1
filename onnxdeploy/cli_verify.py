"""``onnxdeploy verify``: the step-by-step runner alone, on two model files given on the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from onnxdeploy.cli_common import JsonOpt, QuietOpt, consoles, fail, interrupted, progress, progress_callback
from onnxdeploy.errors import EXIT_FAILED, EXIT_OK, ConfigError, OnnxDeployError, OutputError

__all__ = ["verify_cmd"]

PromptTextOpt = Annotated[
    str | None, typer.Option("--prompt-text", help="The prompt as text, replacing --prompt (the text extra).")
]
TokenizerOpt = Annotated[
    Path | None, typer.Option("--tokenizer", help="tokenizer.json or its folder (default: the original's folder).")
]
ChatTemplateOpt = Annotated[
    bool, typer.Option("--chat-template", help="Render --prompt-text through the folder's chat template.")
]


def verify_cmd(
    original: Annotated[Path, typer.Argument(help="The original model (exporter convention).")],
    candidate: Annotated[Path, typer.Argument(help="The candidate: with a decode contract, or exporter convention.")],
    *,
    steps: Annotated[int, typer.Option("--steps", "-n", min=0, help="Greedy steps after the prompt.")] = 32,
    prompt: Annotated[str, typer.Option("--prompt", help="Comma-separated prompt token ids.")] = "1,17,42,99,7,3",
    prompt_text: PromptTextOpt = None,
    tok: TokenizerOpt = None,
    chat: ChatTemplateOpt = False,
    max_abs_logit_diff: Annotated[float, typer.Option(help="Tolerance on max abs logit diff.")] = 1e-4,
    min_top1_agreement: Annotated[float, typer.Option(help="Minimum top-1 agreement rate.")] = 1.0,
    providers: Annotated[
        str, typer.Option("--providers", help="Comma-separated ONNX Runtime execution providers, in priority order.")
    ] = "CPUExecutionProvider",
    strict_providers: Annotated[
        bool, typer.Option("--strict-providers", help="Exit 1 when a requested provider fell back to another.")
    ] = False,
    remainder: Annotated[
        str, typer.Option("--remainder", help="Graph sets: feed the prompt's remainder 'padded' or through 'buckets'.")
    ] = "padded",
    report: Annotated[
        Path | None, typer.Option("--report", help="Also write the JSON report here (its folder must exist).")
    ] = None,
    max_rows: Annotated[
        int, typer.Option("--max-rows", min=1, help="Per-position rows listed per mode in the JSON at most.")
    ] = 200,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run the step-by-step runner alone: decode both models greedily and compare logits per position.

    A candidate whose contract lists a graph set (prefill buckets, several cache lengths) is driven as a set.
    """
    from onnxdeploy.console_report import print_verify
    from onnxdeploy.report import SCHEMA_VERSION, summarise_verify
    from onnxdeploy.runner import verify
    from onnxdeploy.text import generations_with

    out, err = consoles(as_json)
    try:
        tokens, requested, tok = _verify_args(prompt, providers, remainder, report, (original, prompt_text, tok, chat))
        with progress(err, quiet=quiet) as bar:
            on_verify = progress_callback(bar)
            result = verify(
                str(original),
                str(candidate),
                prompt=tokens,
                steps=steps,
                max_abs_logit_diff=max_abs_logit_diff,
                min_top1_agreement=min_top1_agreement,
                providers=tuple(requested),
                strict_providers=strict_providers,
                remainder=remainder,  # type: ignore[arg-type]
                progress=on_verify,
            )
    except OnnxDeployError as exc:
        raise fail(err, exc, as_json=as_json) from None
    except KeyboardInterrupt:
        raise interrupted(err, as_json=as_json) from None
    result = generations_with(result, tok, prompt_text=prompt_text, chat=chat)
    result = summarise_verify(result, max_rows)
    head = {"schema_version": SCHEMA_VERSION, "status": "passed" if result.passed else "failed"}
    payload = json.dumps({**head, **result.model_dump(mode="json")}, indent=2)
    if report is not None:
        try:
            _write_verify_report(report, payload, original, candidate)
        except OnnxDeployError as exc:
            raise fail(err, exc, as_json=as_json) from None
    if not quiet:
        for line in result.provider_fallbacks:
            err.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)
    if as_json:
        sys.stdout.write(payload + "\n")
    if quiet:
        for msg in [*result.failures, *(line for m in result.modes.values() for line in m.failures)]:
            err.print(f"FAILED: {msg}", markup=False)
    elif not as_json:
        print_verify(out, result)
    raise typer.Exit(EXIT_OK if result.passed else EXIT_FAILED)


def _verify_args(
    prompt: str, providers: str, remainder: str, report: Path | None, text: tuple[Path, str | None, Path | None, bool]
) -> tuple[list[int], list[str], Path | None]:
    """``onnxdeploy verify``'s options checked before any model is read: the prompt ids and the providers.

    ``text`` is ``(original, --prompt-text, --tokenizer, --chat-template)``: the prompt text replaces the ids
    (``onnxdeploy.text.text_prompt``), and the tokenizer found is returned third (None without one).

    Raises:
        ConfigError: the prompt is empty or not comma-separated integers, no provider, an unknown remainder.
        OutputError: ``--report``'s folder does not exist.
    """
    try:
        tokens = [int(t) for t in prompt.split(",")]
    except ValueError:
        raise ConfigError(f"--prompt must be comma-separated integers, got {prompt!r}") from None
    if not tokens:
        raise ConfigError("--prompt is empty")
    requested = [name.strip() for name in providers.split(",") if name.strip()]
    if not requested:
        raise ConfigError("--providers is empty")
    if remainder not in ("padded", "buckets"):
        raise ConfigError(f"--remainder must be 'padded' or 'buckets', got {remainder!r}")
    if report is not None and not report.parent.is_dir():
        raise OutputError(f"--report {report}: folder {report.parent} does not exist; create it or choose another")
    from onnxdeploy.text import text_prompt  # noqa: PLC0415  (tokenizers only when asked for)

    original, prompt_text, tokenizer, chat = text
    tokens, found = text_prompt(original, tokens, prompt_text, tokenizer, chat=chat)
    if prompt_text is not None and found is not None:
        _check_text_vocab(original, tokens, found)
    return tokens, requested, found


def _check_text_vocab(original: Path, tokens: list[int], tokenizer: Path) -> None:
    """Refuse ``--prompt-text`` ids outside the original's vocabulary, naming the tokenizer and both sizes.

    Raises:
        ConfigError: ``max(tokens) >=`` the original's logits' last dim (a tokenizer that is not the model's).
    """
    from onnxdeploy.errors import ContractError, ModelLoadError  # noqa: PLC0415
    from onnxdeploy.runner.verify import logits_vocab  # noqa: PLC0415  (onnx: once the options are valid)
    from onnxdeploy.text import load_codec  # noqa: PLC0415

    try:
        vocab = logits_vocab(original)
    except (ContractError, ModelLoadError):
        return  # the runner refuses the model with its own message
    if vocab is None or max(tokens) < vocab:
        return
    size = load_codec(tokenizer, key="--tokenizer").vocab_size()
    raise ConfigError(
        f"--prompt-text: the tokenizer {tokenizer} ({size} tokens) encodes it to id {max(tokens)}, outside the "
        f"vocabulary of {original} (its logits have {vocab} entries: ids 0..{vocab - 1}): the tokenizer is not "
        "this model's; pass the model's tokenizer.json or its folder with --tokenizer"
    )


def _write_verify_report(report: Path, payload: str, original: Path, candidate: Path) -> None:
    """Write ``--report`` atomically.

    Raises:
        OutputError: it would overwrite one of the models' files, or it cannot be written.
    """
    from onnxdeploy.artifacts import write_text_atomic
    from onnxdeploy.model_io import check_not_an_input, input_files

    try:
        check_not_an_input(report, input_files(original) | input_files(candidate), "--report")
        write_text_atomic(report, payload)
    except OSError as exc:
        raise OutputError(f"cannot write --report {report}: {exc.strerror or exc}") from None
