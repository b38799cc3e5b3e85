"""read_yaml: a YAML file's document, or one line saying why not; one_line: PyYAML's errors as
one line, ``FILE:LINE:COL: what``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuagent.yamlfile import YamlFileError, one_line, read_yaml


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


def error_of(text: str) -> yaml.YAMLError:
    with pytest.raises(yaml.YAMLError) as info:
        yaml.safe_load(text)
    return info.value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("a: b: c\n", "f.yaml:1:5: mapping values are not allowed here",
                     id="problem-only"),
        pytest.param('a: "x', "f.yaml:1:6: found unexpected end of stream (while scanning a "
                     "quoted scalar at 1:4)", id="with-context"),
        pytest.param("a:\n\tb: 1\n", "f.yaml:2:1: found character '\\t' that cannot start any "
                     "token (while scanning for the next token)", id="context-without-a-mark"),
        pytest.param("a: 1\nb: \x00\n", "f.yaml:2:4: unacceptable character #x0000: special "
                     "characters are not allowed", id="reader-error"),
    ],
)  # fmt: skip
def test_one_line_names_file_line_and_column(text: str, expected: str) -> None:
    line = one_line(error_of(text), "f.yaml", text)
    assert line == expected
    assert "\n" not in line


def test_without_a_source_the_line_starts_at_the_place() -> None:
    assert one_line(error_of("{a: [")) == (
        "1:6: expected the node content, but found '<stream end>' (while parsing a flow node)"
    )
