"""The pipeline file (``pipeline.yaml``): loading, resolving paths, and error messages naming the key.

Relative paths (``model``, ``output_dir``) are resolved against the folder of the pipeline file, so a
pipeline runs the same from any working directory. The schema is :mod:`onnxdeploy.pipeline_config` (top level,
passes, sdk, report) and :mod:`onnxdeploy.verify_config` (verify, calibration), re-exported here; pydantic's
errors are said in the file's words by :mod:`onnxdeploy.config_errors`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from onnxdeploy.config_errors import did_you_mean, format_validation_error
from onnxdeploy.errors import ConfigError
from onnxdeploy.passes import CATALOG, pass_config_model
from onnxdeploy.pipeline_config import (
    DEFAULT_CHECKS,
    DEFAULT_CHECKS_NO_CONTRACT,
    PassSpec,
    PipelineConfig,
    ReportConfig,
    SdkConfig,
    SdkQuantization,
    default_checks,
)
from onnxdeploy.settings import PipelineSettings, SettingsConflict
from onnxdeploy.verify_config import AccuracyConfig, CalibrationConfig, RuntimeSpec, VerifyConfig

__all__ = [
    "DEFAULT_CHECKS",
    "DEFAULT_CHECKS_NO_CONTRACT",
    "AccuracyConfig",
    "CalibrationConfig",
    "VerifyConfig",
    "ReportConfig",
    "SdkConfig",
    "SdkQuantization",
    "PassSpec",
    "PipelineConfig",
    "RuntimeSpec",
    "check_pass_settings",
    "default_checks",
    "load_pipeline",
    "format_validation_error",
]


def _parse_passes(raw: Any, where: str) -> list[PassSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: key 'passes' must be a list of '- name: {{config}}' entries")
    specs = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            name, cfg = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            name, cfg = next(iter(entry.items()))
        else:
            raise ConfigError(f"{where}: key 'passes[{i}]' must map one pass name to its config, got {entry!r}")
        try:
            config_model = pass_config_model(str(name))  # the catalogue's: no pass module imported yet
        except ConfigError as exc:
            raise ConfigError(f"{where}: key 'passes[{i}]': {exc}{did_you_mean(str(name), CATALOG)}") from None
        if cfg is None:
            cfg = {}
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where}: key 'passes[{i}].{name}' must be a mapping of config keys")
        try:
            config = config_model.model_validate(cfg)
        except ValidationError as exc:
            said = format_validation_error(exc, f"passes[{i}].{name}.", data=cfg, model=config_model)
            passes = [e["loc"][0] for e in exc.errors() if e["type"] == "extra_forbidden" and e["loc"][0] in CATALOG]
            for other in dict.fromkeys(passes):  # e.g. kv_layout written inside static_kv's mapping
                said += f"; '{other}' is a pass of its own: list it in passes as '- {other}: {{...}}'"
            raise ConfigError(f"{where}: {said}") from None
        specs.append(PassSpec(name=str(name), config=config))
    return specs


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses duplicate mapping keys instead of keeping the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)  # resolve YAML merge keys (<<: *anchor) first
    keys = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in keys:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key}'", key_node.start_mark)
        keys.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _check_pass_settings(cfg: PipelineConfig, where: str) -> None:
    """Let each pass refuse, before any work, a combination with the rest of the pipeline it cannot run.

    First the order of the passes (:func:`~onnxdeploy.passes.pass_order_problem`, without the graph: the
    pipeline re-checks it with the input graph before the first pass), then each pass's ``check_settings``
    (:func:`check_pass_settings`).
    """
    from onnxdeploy.passes import pass_order_problem  # noqa: PLC0415  (imports onnx_ir: the file validated)

    problem = pass_order_problem([spec.build() for spec in cfg.passes])
    if problem is not None:
        i, reason = problem
        raise ConfigError(f"{where}: key 'passes[{i}].{cfg.passes[i].name}': {reason}")
    check_pass_settings(cfg, where, cfg.settings())


def check_pass_settings(cfg: PipelineConfig, where: str, settings: PipelineSettings) -> None:
    """Each pass's ``check_settings`` on ``settings``: at config load, and again once the token files are read.

    Raises:
        ConfigError: under ``passes[i].<name>``, or under the other section's key for a
            :class:`~onnxdeploy.settings.SettingsConflict` (e.g. ``verify.runtimes[1]``).
    """
    for i, spec in enumerate(cfg.passes):
        try:
            spec.build().check_settings(settings)
        except SettingsConflict as exc:
            raise ConfigError(f"{where}: key '{exc.key}': {exc.located(f'passes[{i}].{spec.name}')}") from None
        except ConfigError as exc:
            raise ConfigError(f"{where}: key 'passes[{i}].{spec.name}': {exc}") from None


def _resolve_token_files(cfg: PipelineConfig, base: Path, where: Path) -> PipelineConfig:
    """Resolve the calibration and verify.accuracy ``token_ids_file`` against ``base``; they must exist."""
    update: dict[str, Any] = {}
    sections = (("calibration", cfg.calibration), ("verify.accuracy", cfg.verify.accuracy if cfg.verify else None))
    for key, section in sections:
        if section is None:
            continue
        field = "text_file" if getattr(section, "text_file", None) is not None else "token_ids_file"
        given = getattr(section, field)
        file = given if given.is_absolute() else base / given
        if not file.is_file():
            raise ConfigError(f"{where}: key '{key}.{field}': file not found: {file}")
        resolved = section.model_copy(update={field: file.resolve()})
        if key == "calibration":
            update["calibration"] = resolved
        else:
            assert cfg.verify is not None
            update["verify"] = cfg.verify.model_copy(update={"accuracy": resolved})
    return cfg.model_copy(update=update) if update else cfg


def _resolve_text(cfg: PipelineConfig, base: Path, model: Path, where: Path) -> PipelineConfig:
    """Find the tokenizer (``verify.tokenizer``, else the model's folder) and encode ``verify.prompt_text``.

    ``verify.tokenizer`` becomes the resolved ``tokenizer.json`` when one is found, and ``verify.prompt`` the text's
    ids, so everything after (the passes' ``check_settings``, the prompt's vocabulary check) sees them.

    Raises:
        ConfigError: ``prompt`` and ``prompt_text`` both given; text (``prompt_text``, ``accuracy.text_file``)
            but no tokenizer found, the tokenizers/jinja2 package missing, no chat template declared (each names
            its key).
    """
    from onnxdeploy.text import find_tokenizer, load_codec  # noqa: PLC0415  (tokenizers only when text is given)

    v = cfg.verify
    if v is None:
        return cfg
    if v.prompt_text is not None and "prompt" in v.model_fields_set:
        raise ConfigError(f"{where}: key 'verify.prompt_text': give verify.prompt (token ids) or prompt_text, not both")
    needs = "verify.prompt_text" if v.prompt_text is not None else None
    if needs is None and v.accuracy is not None and v.accuracy.text_file is not None:
        needs = "verify.accuracy.text_file"
    if v.tokenizer is not None:
        given = v.tokenizer.expanduser()
        tokenizer: Path | None = find_tokenizer(
            given if given.is_absolute() else base / given, key=f"{where}: key 'verify.tokenizer'"
        )
    else:
        try:
            tokenizer = find_tokenizer(model.parent, key=f"{where}: key '{needs}'")
        except ConfigError:
            if needs is not None:
                raise
            tokenizer = None  # ids in, and no tokenizer beside the model: the reports show ids only
    if v.tokenizer is not None:  # asked for by name: read it now, so a bad file exits 2 before any pass
        load_codec(tokenizer, key=f"{where}: key 'verify.tokenizer'")
    update: dict[str, Any] = {"tokenizer": tokenizer}
    if v.prompt_text is not None:
        assert tokenizer is not None
        codec = load_codec(tokenizer, key=f"{where}: key 'verify.prompt_text'")
        update["prompt"] = codec.prompt_ids(
            v.prompt_text, chat=v.chat_template, key=f"{where}: key 'verify.prompt_text'"
        )
    elif v.chat_template:
        raise ConfigError(f"{where}: key 'verify.chat_template': applies to verify.prompt_text, which is not given")
    return cfg.model_copy(update={"verify": v.model_copy(update=update)})


def _check_sdk(cfg: PipelineConfig, where: Path) -> None:
    """``sdk: build`` needs the SDK environment, and quantization needs ``calibration`` (ConfigError, exit 2)."""
    if cfg.sdk.mode == "off":
        return
    if cfg.sdk.quantization is not None and cfg.calibration is None:
        raise ConfigError(
            f"{where}: key 'sdk.quantization': the {cfg.sdk.quantization.dtype} build needs a calibration dataset, "
            "generated from the 'calibration' section's token ids; add calibration: {token_ids_file: ...}"
        )
    on_sim = cfg.verify is not None and any(r.name == "rknn-sim" for r in cfg.verify.runtimes)
    if cfg.sdk.quantization is not None and on_sim and cfg.verify is not None and cfg.verify.accuracy is None:
        raise ConfigError(
            f"{where}: key 'sdk.quantization': an int8 build on rknn-sim is judged by held-out accuracy (mean KL, "
            "top-1, perplexity); add verify.accuracy: {token_ids_file: ...}"
        )
    if cfg.sdk.mode != "build":
        return
    if cfg.target != "rknn-rk3588":
        raise ConfigError(f"{where}: key 'sdk': no SDK build is wired for target {cfg.target!r}; only rknn-rk3588")
    from onnxdeploy.sdk import rknn_env, rknn_python  # noqa: PLC0415

    if rknn_python() is None:
        raise ConfigError(
            f"{where}: key 'sdk': mode build needs the RKNN-Toolkit2 environment ({rknn_env()}), which is not "
            "installed; run `onnxdeploy sdk install rknn`, or use sdk: auto / off"
        )


def load_pipeline(path: str | Path, *, output_dir: str | Path | None = None) -> PipelineConfig:
    """Read and validate a pipeline file.

    Args:
        path: the YAML file.
        output_dir: overrides the file's ``output_dir`` (relative to the current directory).

    Returns:
        The config with ``model`` and ``output_dir`` resolved to absolute paths.

    Raises:
        ConfigError: the file is missing or not YAML, a key is unknown or invalid (named as a dotted
            path, e.g. ``passes[0].static_kv.max_cache_len``), a key is repeated, a pass or check name
            is unknown, the model file does not exist, or a pass refuses the rest of the pipeline through its
            ``check_settings`` hook (e.g. ``static_kv``: ``len(prompt) + steps > max_cache_len``).
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p} is a folder; expected a pipeline YAML file")
    if not p.is_file():
        raise ConfigError(f"pipeline file not found: {p}")
    try:
        with p.open(encoding="utf-8") as stream:  # a named stream, so YAML errors cite the file
            raw = yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file; expected a pipeline YAML (did you pass the model?)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the pipeline must be a YAML mapping with at least the key 'model'")
    raw = dict(raw)
    if "source" in raw:
        raise ConfigError(f"{p}: key 'source': unknown key")
    passes = _parse_passes(raw.pop("passes", None), str(p))
    try:
        cfg = PipelineConfig.model_validate({**raw, "passes": []})
    except ValidationError as exc:
        raise ConfigError(f"{p}: {format_validation_error(exc, data=raw, model=PipelineConfig)}") from None
    base = p.resolve().parent
    model = cfg.model if cfg.model.is_absolute() else base / cfg.model
    out = Path(output_dir).resolve() if output_dir is not None else cfg.output_dir
    if not out.is_absolute():
        out = base / out
    if not model.exists():
        raise ConfigError(f"{p}: key 'model': model file not found: {model}")
    if not model.is_file():
        raise ConfigError(f"{p}: key 'model': not a file: {model}")
    from onnxdeploy.checks import check_names, get_check  # noqa: PLC0415  (checks import config-free modules only)

    for i, name in enumerate(cfg.checks or []):
        try:
            get_check(name)
        except ConfigError as exc:
            raise ConfigError(f"{p}: key 'checks[{i}]': {exc}{did_you_mean(name, check_names())}") from None
    if cfg.target is not None:
        from onnxdeploy.matrices import get_target, list_targets  # noqa: PLC0415

        try:
            get_target(cfg.target)
        except ConfigError as exc:
            raise ConfigError(f"{p}: key 'target': {exc}{did_you_mean(cfg.target, list_targets())}") from None
    if cfg.verify is not None:
        from onnxdeploy.runner.runtimes import check_runtimes  # noqa: PLC0415

        try:
            check_runtimes([spec.name for spec in cfg.verify.runtime_specs()])
        except ConfigError as exc:
            raise ConfigError(f"{p}: key 'verify.runtimes': {exc}") from None
    _check_sdk(cfg, p)
    cfg = _resolve_token_files(cfg, base, p)
    cfg = _resolve_text(cfg, base, model, p)
    if cfg.cache is not None and cfg.cache.dir is not None and not cfg.cache.dir.is_absolute():
        cfg = cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"dir": (base / cfg.cache.dir).resolve()})})
    cfg = cfg.model_copy(
        update={"model": Path(os.path.abspath(model)), "output_dir": out.resolve(), "passes": passes, "source": p}
    )
    _check_pass_settings(cfg, str(p))
    return cfg
