"""YAML files read, and YAML errors said in one line.

A reader's failure must be one line: ``cannot read PATH: why``, or ``PATH:LINE:COL: what`` for
a syntax error, as compilers and editors write them (:func:`one_line`). Each reader (the config
file, the web config, the simulated node) turns :class:`YamlFileError` into its own error,
naming its key. PyYAML's own text spans several lines (a ``while parsing …`` context, the
offending line quoted with a caret under it, ``in "<unicode string>"``); :func:`one_line` reads
the attributes its errors have (``problem``, ``problem_mark``, ``context``, ``context_mark``; a
reader error's ``position`` and ``reason``) without importing PyYAML, which is imported when a
file is read, not before.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import yaml

__all__ = ["YamlFileError", "one_line", "read_yaml"]


class YamlFileError(Exception):
    """Why a YAML file could not be read or parsed, in one line (its ``str``)."""


def read_yaml(path: Path, loader: type[yaml.SafeLoader] | None = None) -> object:
    """The document in ``path`` (UTF-8), parsed by ``loader`` (PyYAML's safe loader unless
    given); raises :class:`YamlFileError`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise YamlFileError(f"cannot read {path}: {reason}") from None
    import yaml  # noqa: PLC0415 - the files are optional; the import costs start-up time

    try:
        return yaml.load(text, Loader=loader or yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise YamlFileError(one_line(exc, str(path), text)) from None


def one_line(error: Exception, source: str = "", text: str | None = None) -> str:
    """``error`` (a ``yaml.YAMLError``) as ``SOURCE:LINE:COL: what (context at LINE:COL)``.

    ``source`` names the file (or the option the text came from); without it the line starts at
    ``LINE:COL``. ``text`` is the document, to place a reader error (which counts characters,
    not lines). Lines and columns count from 1.
    """
    prefix = f"{source}:" if source else ""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if problem is None:
        reason = getattr(error, "reason", None)
        position = getattr(error, "position", None)
        if reason is not None and isinstance(position, int) and text is not None:
            line, column = _place(text, position)
            # ("unacceptable character #x0000: …" and where: the where is the prefix now)
            return f"{prefix}{line}:{column}: {str(error).splitlines()[0]}"
        return f"{prefix} {_flat(str(error))}" if prefix else _flat(str(error))
    what = _flat(str(problem))
    context = getattr(error, "context", None)
    context_mark = getattr(error, "context_mark", None)
    if context:
        where = ""
        if context_mark is not None and (
            mark is None or (context_mark.line, context_mark.column) != (mark.line, mark.column)
        ):
            where = f" at {context_mark.line + 1}:{context_mark.column + 1}"
        what += f" ({_flat(str(context))}{where})"
    if mark is None:
        return f"{prefix} {what}" if prefix else what
    return f"{prefix}{mark.line + 1}:{mark.column + 1}: {what}"


def _place(text: str, position: int) -> tuple[int, int]:
    """Line and column (from 1) of character ``position`` of ``text``."""
    line_start = text.rfind("\n", 0, position) + 1
    return text.count("\n", 0, position) + 1, position - line_start + 1


def _flat(text: str) -> str:
    return " ".join(text.split())
