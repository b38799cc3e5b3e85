"""read_yaml: a YAML file's document, or one line saying why not."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuagent.yamlfile import YamlFileError, read_yaml


def test_the_document(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("version: v1\nlist: [1, 2]\n", encoding="utf-8")
    assert read_yaml(path) == {"version": "v1", "list": [1, 2]}


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "cannot read {path}: No such file or directory"),
        (b"a: \xff\n", "cannot read {path}: 'utf-8' codec can't decode byte 0xff"),
        (b"a: [1\n", "{path}:2:1: expected ',' or ']', but got '<stream end>'"),
    ],
)
def test_why_not_in_one_line(tmp_path: Path, content: bytes | None, reason: str) -> None:
    path = tmp_path / "a.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(YamlFileError) as info:
        read_yaml(path)
    assert str(info.value).startswith(reason.format(path=path))
    assert "\n" not in str(info.value)


def test_the_loader_given(tmp_path: Path) -> None:
    class Strict(yaml.SafeLoader):
        def construct_document(self, node: yaml.Node) -> object:
            raise yaml.constructor.ConstructorError(None, None, "refused", node.start_mark)

    path = tmp_path / "a.yaml"
    path.write_text("a: 1\n", encoding="utf-8")
    with pytest.raises(YamlFileError, match=r"a\.yaml:1:1: refused"):
        read_yaml(path, Strict)
