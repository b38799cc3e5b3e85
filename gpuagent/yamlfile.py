"""Reading a YAML file whose failure must be one line: ``cannot read PATH: why``, or
``PATH:LINE:COL: what`` for a syntax error (:func:`~gpuagent.yamlerror.one_line`). Each reader
(the config file, the web config, the simulated node) turns :class:`YamlFileError` into its own
error, naming its key. PyYAML is imported when a file is read, not before."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gpuagent.yamlerror import one_line

if TYPE_CHECKING:
    import yaml

__all__ = ["YamlFileError", "read_yaml"]


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
