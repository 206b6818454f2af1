"""Text in, text out: a model folder's tokenizer, its chat template and stop tokens, for prompts and reports.

onnxdeploy decodes token ids; this module turns text into them and back where the user gives text
(``verify.prompt_text``, ``verify.accuracy.text_file``, ``onnxdeploy verify --prompt-text``) and decodes the
generations the reports show. It reads the files a Hugging Face export folder holds (optimum copies them beside
``model.onnx``; transformers' ``save_pretrained`` writes them):

* ``tokenizer.json`` (required): read by the ``tokenizers`` package (``Tokenizer.from_file``), which applies
  the file's normalizer, pre-tokenizer, model and post-processor (BOS/EOS it declares) exactly as transformers'
  fast tokenizer does (transformers' ``PreTrainedTokenizerFast`` wraps the same object);
* ``chat_template.jinja`` or ``tokenizer_config.json`` → ``chat_template`` (optional): a Jinja template rendered
  as transformers' ``apply_chat_template`` does (``jinja2`` sandbox, ``trim_blocks``/``lstrip_blocks``,
  ``messages``, ``add_generation_prompt``, ``bos_token``/``eos_token``; transformers 4.57
  ``utils/chat_template_utils.py``), then encoded without the post-processor's special tokens (the template
  writes them);
* stop tokens: ``generation_config.json`` → ``eos_token_id`` (an id or a list), else ``config.json`` →
  ``eos_token_id``, else ``tokenizer_config.json`` → ``eos_token`` (a token string looked up in the vocabulary).

Both packages are the optional extra ``[text]`` (``pip install -e '.[text]'``): ``tokenizers`` always, ``jinja2``
only for a chat template. Nothing here is needed when prompts and held-out data are token ids.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxdeploy.errors import ConfigError
from onnxdeploy.report import GenerationsReport, GenerationText, VerifyReport

__all__ = [
    "TextCodec",
    "find_tokenizer",
    "generations",
    "generations_with",
    "load_codec",
    "text_prompt",
    "text_token_ids",
]

TOKENIZER_FILE = "tokenizer.json"
INSTALL_HINT = "pip install -e '.[text]'"


def find_tokenizer(path: str | Path, *, key: str) -> Path:
    """The ``tokenizer.json`` that ``path`` names: the file itself, or the one inside a folder.

    Args:
        path: a ``tokenizer.json`` file, or a folder holding one (an export folder, a model's folder).
        key: the config key or option the path came from, for the message.

    Returns:
        The absolute path of the ``tokenizer.json`` file.

    Raises:
        ConfigError: neither the file nor the folder's ``tokenizer.json`` exists (names ``key`` and the path).
    """
    p = Path(path)
    file = p / TOKENIZER_FILE if p.is_dir() else p
    if not file.is_file():
        where = f"folder {p} holds no {TOKENIZER_FILE}" if p.is_dir() else f"file not found: {p}"
        raise ConfigError(
            f"{key}: no tokenizer found ({where}); give the export folder that holds {TOKENIZER_FILE} "
            "(optimum writes it beside model.onnx) or the file itself, or token ids instead of text"
        )
    return file.resolve()


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when absent; ConfigError naming it when unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a JSON file: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}`` (AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TextCodec:
    """A model folder's tokenizer, chat template and stop tokens (see the module docstring for the files read).

    Attributes:
        path: the ``tokenizer.json`` file.
        tokenizer: the ``tokenizers.Tokenizer`` read from it.
        chat_template: the Jinja chat template the folder declares, or None.
        stop_token_ids: ids that end a generation (the folder's EOS), possibly empty.
        bos_token / eos_token: the special token strings the template may use ("" when undeclared).
    """

    path: Path
    tokenizer: Any
    chat_template: str | None = None
    stop_token_ids: tuple[int, ...] = ()
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (int, in order; with the post-processor's BOS/EOS unless told otherwise)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out (as transformers' ``decode(skip_special_tokens=True)``)."""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the largest id + 1 at most)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def render_chat(self, user_text: str, *, key: str) -> str:
        """``user_text`` as one user message through the chat template, with the assistant's turn opened.

        Raises:
            ConfigError: the folder declares no chat template, jinja2 is not installed, or the template fails
                (names ``key``).
        """
        if self.chat_template is None:
            raise ConfigError(
                f"{key}: the tokenizer folder {self.path.parent} declares no chat template (chat_template.jinja or "
                "tokenizer_config.json 'chat_template'); set verify.chat_template: false"
            )
        try:
            from jinja2 import TemplateError  # noqa: PLC0415
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
        except ImportError:
            raise ConfigError(f"{key}: a chat template needs the jinja2 package ({INSTALL_HINT})") from None

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": user_text}],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ConfigError(f"{key}: the chat template of {self.path.parent} failed: {exc}") from None

    def prompt_ids(self, text: str, *, chat: bool, key: str) -> list[int]:
        """The prompt's token ids: ``text`` encoded, or rendered through the chat template first (``chat``).

        A rendered template holds its own special tokens, so it is encoded without the post-processor's.

        Raises:
            ConfigError: as :meth:`render_chat`; the text encodes to no token.
        """
        ids = self.encode(self.render_chat(text, key=key), add_special_tokens=False) if chat else self.encode(text)
        if not ids:
            raise ConfigError(f"{key}: the text encodes to no token")
        return ids


def _stop_ids(folder: Path, tokenizer: Any, tok_cfg: dict[str, Any]) -> tuple[int, ...]:
    """The stop ids the folder declares: generation_config.json, else config.json, else tokenizer_config.json."""
    for name in ("generation_config.json", "config.json"):
        eos = _json(folder / name).get("eos_token_id")
        if isinstance(eos, int) and not isinstance(eos, bool):
            return (eos,)
        if isinstance(eos, list) and eos and all(isinstance(t, int) for t in eos):
            return tuple(eos)
    token = _token_text(tok_cfg.get("eos_token"))
    tid = tokenizer.token_to_id(token) if token else None
    return () if tid is None else (int(tid),)


def load_codec(path: str | Path, *, key: str) -> TextCodec:
    """Read the tokenizer ``path`` names (a folder or its ``tokenizer.json``) with its chat template and stop ids.

    Args:
        path: as :func:`find_tokenizer`.
        key: the config key or option the path came from, for messages.

    Returns:
        The codec; its chat template and stop ids are those the folder declares (none when it declares none).

    Raises:
        ConfigError: no tokenizer found, the ``tokenizers`` package missing, or a file unreadable (names ``key``).
    """
    file = find_tokenizer(path, key=key)
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415
    except ImportError:
        raise ConfigError(f"{key}: reading {file} needs the tokenizers package ({INSTALL_HINT})") from None
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001  (tokenizers raises a bare Exception on a malformed file)
        raise ConfigError(f"{key}: {file} is not a tokenizers file: {exc}") from None
    folder = file.parent
    tok_cfg = _json(folder / "tokenizer_config.json")
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else tok_cfg.get("chat_template")
    if isinstance(template, list):  # a list of named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return TextCodec(
        path=file,
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) and template else None,
        stop_token_ids=_stop_ids(folder, tokenizer, tok_cfg),
        bos_token=_token_text(tok_cfg.get("bos_token")) or "",
        eos_token=_token_text(tok_cfg.get("eos_token")) or "",
    )


def text_token_ids(
    file: str | Path, codec: TextCodec, max_tokens: int, *, key: str, vocab: int | None = None
) -> list[int]:
    """The first ``max_tokens`` token ids of a UTF-8 text file, encoded by ``codec`` (its BOS/EOS included).

    Args:
        file: the text file.
        codec: the tokenizer.
        max_tokens: ids kept at most.
        key: the config key, for messages.
        vocab: the model's vocabulary size (its logits' last dim); every id must be below it (None: not checked).

    Raises:
        ConfigError: the file is missing, not UTF-8 text, encodes to fewer than 2 tokens, or to an id outside
            ``vocab`` (a tokenizer that is not the model's) (names ``key``).
    """
    p = Path(file)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{key}: file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: {p} is not UTF-8 text: {exc}") from None
    ids = codec.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ConfigError(f"{key}: {p} encodes to {len(ids)} token(s); the accuracy figures need at least 2")
    if vocab is not None and max(ids) >= vocab:
        raise ConfigError(
            f"{key}: {codec.path} encodes {p} to id {max(ids)}, outside the model's vocabulary 0..{vocab - 1}: "
            "is verify.tokenizer the model's?"
        )
    return ids


def _until_stop(tokens: list[int], stop: tuple[int, ...]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first stop id, and whether one was met."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1], True
    return tokens, False


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two generations (one ending earlier differs there); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _side(codec: TextCodec, tokens: list[int], stopped: bool, first: int | None) -> GenerationText:
    """One generation decoded (the stop token left out of the text), the first differing token located in it."""
    shown = tokens[:-1] if stopped else tokens
    text = codec.decode(shown)
    start = end = None
    if first is not None and first <= len(shown):  # == len(shown): the difference is where this side ended
        before, through = codec.decode(shown[:first]), codec.decode(shown[: first + 1])
        # Byte-level BPE may split a character over tokens: clamp to what the whole text shares with each prefix.
        start = len(os.path.commonprefix([text, before]))
        end = max(start, len(os.path.commonprefix([text, through])))
    return GenerationText(tokens=tokens, text=text, stopped=stopped, mark_start=start, mark_end=end)


def generations(
    report: VerifyReport, codec: TextCodec, *, prompt_text: str | None = None, chat: bool = False
) -> GenerationsReport:
    """Both models' free-running generations of a verification, as text (before its rows are summarised).

    The original's generation is its greedy decode (``top1_reference`` from the last prompt position on), the
    candidate's is its own free run (``top1_candidate`` of the ``free_running`` mode); each ends at the first
    stop token the folder declares (:attr:`TextCodec.stop_token_ids`), so ``len(prompt) + steps`` positions give
    at most ``steps + 1`` generated tokens.

    Args:
        report: the verification, with every per-position record (``ModeResult.steps`` not summarised).
        codec: the tokenizer that decodes them.
        prompt_text: the prompt as the user gave it; None: its ids decoded.
        chat: whether the prompt went through the chat template.

    Returns:
        The generations; ``candidate`` is None when the verification had no ``free_running`` mode.
    """
    start = len(report.prompt) - 1
    free = report.modes.get("free_running")
    rows = (free or next(iter(report.modes.values()))).steps
    rows = [r for r in rows if r.position >= start]
    original, o_stop = _until_stop([r.top1_reference for r in rows], codec.stop_token_ids)
    cand, c_stop = _until_stop([r.top1_candidate for r in rows], codec.stop_token_ids) if free else ([], False)
    first = _first_difference(original, cand) if free else None
    return GenerationsReport(
        tokenizer=str(codec.path),
        prompt_text=prompt_text if prompt_text is not None else codec.decode(list(report.prompt)),
        chat_template=chat,
        stop_token_ids=list(codec.stop_token_ids),
        original=_side(codec, original, o_stop, first),
        candidate=_side(codec, cand, c_stop, first) if free else None,
        first_differing_token=first,
    )


def generations_with(
    report: VerifyReport, tokenizer: str | Path | None, *, prompt_text: str | None = None, chat: bool = False
) -> VerifyReport:
    """``report`` with :attr:`VerifyReport.generations` filled in when ``tokenizer`` can be read, else unchanged.

    A tokenizer the run found by itself (beside the model) without the ``tokenizers`` package installed is
    skipped: the reports then show ids only. One the user named was read at config load (errors exit 2 there).
    """
    if tokenizer is None:
        return report
    try:
        codec = load_codec(tokenizer, key="verify.tokenizer")
    except ConfigError:
        return report
    return report.model_copy(update={"generations": generations(report, codec, prompt_text=prompt_text, chat=chat)})


def text_prompt(
    original: str | Path, ids: list[int], prompt_text: str | None, tokenizer: str | Path | None, *, chat: bool
) -> tuple[list[int], Path | None]:
    """``onnxdeploy verify``'s prompt: ``--prompt-text`` encoded, else the ``--prompt`` ids; and the tokenizer file.

    The tokenizer is ``--tokenizer`` (read now: a bad one exits 2 before any model is decoded), else the
    original's folder's ``tokenizer.json`` when there is one (needed only with ``--prompt-text``).

    Returns:
        ``(prompt ids, tokenizer.json or None)``.

    Raises:
        ConfigError: as :func:`load_codec` and :meth:`TextCodec.prompt_ids` (naming ``--prompt-text`` or
            ``--tokenizer``); ``--chat-template`` without ``--prompt-text``.
    """
    if chat and prompt_text is None:
        raise ConfigError("--chat-template applies to --prompt-text, which is not given")
    if tokenizer is not None:
        file: Path | None = load_codec(tokenizer, key="--tokenizer").path
    else:
        try:
            file = find_tokenizer(Path(original).parent, key="--prompt-text")
        except ConfigError:
            if prompt_text is not None:
                raise
            file = None
    if prompt_text is None:
        return ids, file
    assert file is not None
    return load_codec(file, key="--prompt-text").prompt_ids(prompt_text, chat=chat, key="--prompt-text"), file
