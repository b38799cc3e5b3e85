"""Where each option's raw value comes from: a flag, the environment or the config file."""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpuagent.config.errors import ConfigError, Invalid
from gpuagent.config.option import CONFIG_VERSION, Option
from gpuagent.config.options import FILE_KEYS, OPTIONS
from gpuagent.config.spellings import closest_key, closest_variable
from gpuagent.config.values import type_name
from gpuagent.yamlfile import YamlFileError, read_yaml

if TYPE_CHECKING:
    import yaml

__all__ = ["Sources", "check_environment"]

# How a setting from the config file is named in errors.
_FILE_KEY = "config file key {!r}"

T = TypeVar("T")
D = TypeVar("D")


@functools.cache
def _yaml_loader() -> type[yaml.SafeLoader]:
    """A safe YAML loader that rejects duplicate mapping keys (built when a file is read)."""
    import yaml  # noqa: PLC0415 - a config file is optional; the import costs start-up time

    class SafeLoaderNoDuplicates(yaml.SafeLoader):
        pass

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        mapping = loader.construct_mapping(node)
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return mapping

    SafeLoaderNoDuplicates.add_constructor(
        yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping
    )
    return SafeLoaderNoDuplicates


def read_config_file(
    path: Path, named: str = "--config", keys: Sequence[str] = FILE_KEYS
) -> dict[str, object]:
    """Read and check the config file (chosen by ``named``: the flag or variable as given), whose
    settings are ``keys``; return them keyed by option name."""
    try:
        document = read_yaml(path, _yaml_loader())
    except YamlFileError as exc:
        raise ConfigError(named, str(exc)) from None
    if not isinstance(document, dict):
        raise ConfigError(
            named, f"{path} must hold a mapping of settings, got {type_name(document)}"
        )
    version = document.pop("version", None)
    if version is None:
        raise ConfigError(named, f"{path} must declare 'version: {CONFIG_VERSION}'")
    if version != CONFIG_VERSION:
        raise ConfigError(
            _FILE_KEY.format("version"),
            f"unsupported version {version!r} in {path}; expected {CONFIG_VERSION!r}",
        )
    for key in document:
        if key not in keys:
            raise ConfigError(_FILE_KEY.format(key), _unknown_key_reason(key, path))
    return document


def _unknown_key_reason(key: object, path: Path) -> str:
    if key in ("config", "config-file"):
        return "not a setting of the file (the file is chosen by --config or GPUAGENT_CONFIG)"
    close = closest_key(str(key))
    hint = f" (did you mean {close!r}?)" if close else ""
    return f"no such setting in {path}{hint}"


class Sources:
    """Finds each option's raw value and where it came from, by precedence (of ``options``,
    the option table: :data:`OPTIONS` unless given)."""

    def __init__(
        self,
        flags: argparse.Namespace,
        environ: Mapping[str, str],
        options: Sequence[Option[Any]] = OPTIONS,
    ) -> None:
        self._flags = flags
        self._environ = environ
        self._options = options
        self._file: dict[str, object] = {}

    def load_file(self, path: Path, named: str) -> None:
        """Read the config file ``path``, chosen by ``named`` (the flag or variable as given)."""
        keys = [opt.name for opt in self._options if opt.in_file]
        self._file = read_config_file(path, named, keys)

    def find(self, opt: Option[Any]) -> tuple[object, str] | None:
        given = getattr(self._flags, opt.dest, None)
        if given is not None:
            spelling, value = given
            return value, spelling
        for env_name in opt.env_names:
            if self._environ.get(env_name):
                return self._environ[env_name], env_name
        if opt.name in self._file:
            return self._file[opt.name], _FILE_KEY.format(opt.name)
        return None

    def get(self, opt: Option[T], default: D) -> T | D:
        found = self.find(opt)
        if found is None:
            return default
        raw, label = found
        try:
            return opt.parse(raw)
        except Invalid as exc:
            raise ConfigError(label, str(exc)) from None

    def label(self, opt: Option[Any]) -> str:
        found = self.find(opt)
        return found[1] if found else f"--{opt.name}"

    def origins(self) -> dict[str, str]:
        """Where each option given came from, by its dest: the flag as typed, the variable as
        set, or the config file's key."""
        return {opt.dest: found[1] for opt in self._options if (found := self.find(opt))}


# Kubernetes' service links for a Service named "gpuagent" (when enableServiceLinks is on).
_SERVICE_LINK = re.compile(
    r"GPUAGENT_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)\w*)?)"
)


def check_environment(environ: Mapping[str, str], options: Sequence[Option[Any]] = OPTIONS) -> None:
    """Refuse a ``GPUAGENT_*`` variable that names no option (of ``options``): a typo must not
    pass silently."""
    known = {name for opt in options for name in opt.env_names}
    for name in sorted(environ):
        if not name.startswith("GPUAGENT_") or name in known or _SERVICE_LINK.fullmatch(name):
            continue
        close = closest_variable(name)
        hint = f" (did you mean {close}?)" if close else ""
        raise ConfigError(name, f"no such setting{hint}; see gpuagent --help")
