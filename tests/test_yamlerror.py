"""PyYAML's errors as one line, ``FILE:LINE:COL: what``."""

from __future__ import annotations

import pytest
import yaml

from gpuagent.yamlerror import one_line


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
