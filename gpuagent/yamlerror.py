"""A YAML syntax error as one line, ``FILE:LINE:COL: what``, as compilers and editors write them.

PyYAML's own text spans several lines (a ``while parsing …`` context, the offending line quoted
with a caret under it, ``in "<unicode string>"``); an agent's error, and the ``/readyz`` or log
line that carries it, must be one. This module does not import PyYAML: it reads the attributes
its errors have (``problem``, ``problem_mark``, ``context``, ``context_mark``; a reader error's
``position`` and ``reason``), so it costs nothing where no YAML is read.
"""

from __future__ import annotations

__all__ = ["one_line"]


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
