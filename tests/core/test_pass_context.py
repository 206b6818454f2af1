"""The pass context the pipeline builds (onnxdeploy/pass_context.py): runner services and target defaults."""

from __future__ import annotations

import pytest

from onnxdeploy.errors import ConfigError
from onnxdeploy.pass_context import make_pass_context, runner_source_digest, target_defaults
from onnxdeploy.passes import PassContext
from onnxdeploy.runner import ModelSession, open_session


def test_the_context_carries_the_runners_session_factory_and_decoders():
    context = make_pass_context()
    assert context.session_factory is open_session
    assert context.decoder_factory is not None and context.decoder_source == runner_source_digest()
    assert context.target is None and context.target_defaults is None


def test_target_defaults_come_from_the_matrix_file():
    defaults = target_defaults("rknn-rk3588")
    assert defaults is not None and defaults.cache_write == "where" and defaults.source == "matrices/rknn-rk3588.yaml"
    assert target_defaults("ort-cpu").cache_write is None  # a target that implies nothing
    with pytest.raises(ConfigError):
        target_defaults("no-such-target")


def test_provenance_names_everything_the_context_supplies():
    plain, rknn = make_pass_context().provenance(), make_pass_context(target="rknn-rk3588").provenance()
    assert plain["target_defaults"] is None and rknn["target_defaults"]["cache_write"] == "where"
    assert plain["decoder_source"] == rknn["decoder_source"] == runner_source_digest()


def test_session_factory_is_required():
    with pytest.raises(TypeError):
        PassContext()  # type: ignore[call-arg]


def test_the_factory_opens_model_sessions(tmp_path):
    from tests.conftest import fixture_entry  # noqa: PLC0415

    session = make_pass_context().session_factory(fixture_entry("llama_gqa_optimum")["model_path"])
    try:
        assert isinstance(session, ModelSession) and session.session is not None
    finally:
        session.close()
