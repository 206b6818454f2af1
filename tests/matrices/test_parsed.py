"""Matrix files parsed once per content (matrices/_parsed.py): the cached data validates to the same matrix."""

from __future__ import annotations

from importlib import resources

import yaml

from onnxdeploy.matrices import _Loader, list_targets
from onnxdeploy.matrices._parsed import cache_folder, load_yaml
from onnxdeploy.matrices.schema import Matrix


def test_every_matrix_reads_the_same_from_the_cache_as_from_its_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in list_targets():
        text = resources.files("onnxdeploy.matrices").joinpath(f"{name}.yaml").read_text(encoding="utf-8")
        direct = Matrix.model_validate(yaml.load(text, Loader=_Loader))  # noqa: S506 (a SafeLoader)
        first = Matrix.model_validate(load_yaml(text, _Loader))  # parses, writes the cache
        cached = Matrix.model_validate(load_yaml(text, _Loader))  # reads it
        assert direct == first == cached, name
    assert cache_folder() == tmp_path / "onnxdeploy" / "matrices"
    assert len(list(cache_folder().glob("*.json"))) == len(list_targets())
    assert not list(cache_folder().glob("*.tmp"))


def test_an_edited_file_is_parsed_again_and_an_unwritable_folder_only_costs_time(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_yaml("target: a\n", _Loader) == {"target": "a"}
    assert load_yaml("target: b\n", _Loader) == {"target": "b"}
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # a file where the folder should be
    assert load_yaml("target: c\n", _Loader) == {"target": "c"}
