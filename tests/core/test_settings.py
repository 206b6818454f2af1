"""PipelineSettings and the refusal a pass keys by another section of the pipeline."""

from __future__ import annotations

import pytest

from onnxdeploy.errors import ConfigError
from onnxdeploy.settings import PipelineSettings, SettingsConflict


def test_settings_default_to_no_verification():
    settings = PipelineSettings()
    assert (settings.verify_positions, settings.verify_runtimes, settings.calibration_tokens) == (None, (), None)


def test_settings_conflict_names_its_key_and_places_the_pass_key():
    conflict = SettingsConflict("verify.runtimes[1]", "openvino cannot run what {pass_key} makes")
    assert isinstance(conflict, ConfigError)
    assert conflict.key == "verify.runtimes[1]"
    assert conflict.located("passes[2].static_kv") == "openvino cannot run what passes[2].static_kv makes"
    assert str(conflict) == "key 'verify.runtimes[1]': openvino cannot run what this pass makes"
    with pytest.raises(ConfigError, match="this pass"):
        raise conflict


def test_a_message_without_the_placeholder_is_kept_as_it_is():
    assert SettingsConflict("verify", "no pass named").located("passes[0].x") == "no pass named"
