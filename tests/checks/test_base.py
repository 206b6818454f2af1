from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest

from onnxdeploy.checks import (
    CHECK_REGISTRY,
    CRASH_CODE,
    Check,
    CheckContext,
    CheckerCheck,
    ContractCheck,
    StaticShapesCheck,
    TopoOrderCheck,
    check_names,
    get_check,
    run_checks,
)
from onnxdeploy.errors import ConfigError
from onnxdeploy.report import Finding
from tests.checks.checks_testutil import STATIC_MODEL, errors, parse


def test_registry_maps_pipeline_names_to_classes():
    assert CHECK_REGISTRY["checker"] is CheckerCheck
    assert CHECK_REGISTRY["static_shapes"] is StaticShapesCheck
    assert CHECK_REGISTRY["topo_order"] is TopoOrderCheck
    assert CHECK_REGISTRY["contract"] is ContractCheck
    assert get_check("topo_order") is TopoOrderCheck
    assert check_names() == sorted(CHECK_REGISTRY)


def test_get_check_unknown_name_lists_known_ones():
    with pytest.raises(ConfigError) as info:
        get_check("static_shape")
    message = str(info.value)
    assert "'static_shape'" in message
    for name in ("checker", "static_shapes", "topo_order", "contract"):
        assert name in message


def test_run_checks_resolves_all_names_before_running():
    with pytest.raises(ConfigError, match="nope"):
        run_checks(parse(STATIC_MODEL), ["checker", "nope"])


def test_codes_are_unique_and_in_range_per_check():
    seen: dict[str, str] = {}
    ranges = {"checker": "OD1", "static_shapes": "OD2", "topo_order": "OD3", "contract": "OD4"}
    for name, cls in CHECK_REGISTRY.items():
        assert cls.codes, name
        for code in cls.codes:
            assert code not in seen, f"{code} declared by {name} and {seen.get(code)}"
            seen[code] = name
            if name in ranges:
                assert code.startswith(ranges[name])


def test_code_table_in_package_docstring_matches_declared_codes():
    import onnxdeploy.checks as package

    for cls in CHECK_REGISTRY.values():
        for code, meaning in cls.codes.items():
            level = meaning.split(":", 1)[0]
            row = next(line for line in package.__doc__.splitlines() if line.startswith(code))
            assert level in row and cls.name in row, row


class _Crashing(Check):
    name = "crashing"
    codes = {"OD999": "info: before the crash."}

    def collect(self, model: onnx.ModelProto, context: CheckContext) -> Iterator[Finding]:
        yield self.finding("OD999", "info", "found before the crash")
        raise RuntimeError("boom")


class _Undeclared(Check):
    name = "undeclared"
    codes = {}

    def collect(self, model, context):
        return [self.finding("OD998", "error", "not declared")]


class _BadConfig(Check):
    name = "bad_config"

    def collect(self, model, context):
        raise ConfigError("unknown target 'x'")


def test_crash_becomes_error_finding_and_keeps_earlier_findings():
    findings = _Crashing().run(parse(STATIC_MODEL))
    assert [f.code for f in findings] == ["OD999", CRASH_CODE]
    crash = findings[-1]
    assert crash.level == "error" and crash.check == "crashing"
    assert "crashing" in crash.message and "RuntimeError" in crash.message and "boom" in crash.message


def test_undeclared_code_is_reported_as_crash():
    findings = _Undeclared().run(parse(STATIC_MODEL))
    assert [f.code for f in findings] == [CRASH_CODE]
    assert "OD998" in findings[0].message


def test_config_error_is_not_swallowed():
    with pytest.raises(ConfigError):
        _BadConfig().run(parse(STATIC_MODEL))


def test_context_data_dir(tmp_path: Path):
    assert CheckContext().data_dir is None
    assert CheckContext(model_path=tmp_path / "m.onnx").data_dir == tmp_path
    assert CheckContext(model_path=tmp_path / "m.onnx", base_dir="/data").data_dir == Path("/data")
    with pytest.raises(ValueError):
        CheckContext(model_dir=tmp_path)


def test_all_checks_pass_on_a_static_sorted_model():
    findings = run_checks(parse(STATIC_MODEL), ["checker", "static_shapes", "topo_order"])
    assert findings == []


def test_checks_do_not_mutate_the_model():
    model = parse(STATIC_MODEL)
    before = model.SerializeToString()
    run_checks(model, check_names())
    assert model.SerializeToString() == before
    assert errors(run_checks(model, ["checker"])) == []
