"""An option (:class:`Option`: flag, config key, environment names, parser, default, help), how a
field of the settings takes its value from one (:func:`setting`), and the config file's version.

The options themselves are in :mod:`gpuagent.config.groups`, by subsystem; the fields of
:class:`~gpuagent.config.settings.Settings` name them, and their order is the option table's
(:data:`gpuagent.config.options.OPTIONS`, ``--help``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
U = TypeVar("U")

CONFIG_VERSION = "v1"

# The key of a settings field's metadata that holds its binding.
_BOUND = "gpuagent.option"


@dataclass(frozen=True, slots=True)
class Option(Generic[T]):
    """One setting: its flag spelling, config key, environment names, parser and default.

    ``default``: the value when no flag, variable or file key gives one (a rule of
    :mod:`gpuagent.config.load` may put another in its place: ``--kubelet-socket`` follows
    ``--socket-dir``). ``live``: a reload applies it without a restart (the plan holds it: see
    :mod:`gpuagent.config.planning`); any other setting is read once, at start.
    """

    name: str
    parse: Callable[[object], T]
    help: str
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    env_aliases: tuple[str, ...] = ()
    is_bool: bool = False
    in_file: bool = True
    live: bool = False
    default: T = field(kw_only=True)

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env_names(self) -> tuple[str, ...]:
        return (f"GPUAGENT_{self.dest.upper()}", *self.env_aliases)


@dataclass(frozen=True, slots=True)
class Binding:
    """A settings field (``field``) and the option it takes its value from; ``pick`` takes the
    field's part of the option's value (``--metrics-address`` makes two fields), or ``None``."""

    field: str
    option: Option[Any]
    pick: Callable[[Any], Any] | None = None

    def value(self, option_value: object) -> object:
        return option_value if self.pick is None else self.pick(option_value)


@overload
def setting(option: Option[T]) -> T: ...
@overload
def setting(option: Option[T], pick: Callable[[T], U]) -> U: ...
def setting(option: Option[Any], pick: Callable[[Any], Any] | None = None) -> Any:
    """A settings field whose value is ``option``'s (or the part ``pick`` takes of it), with the
    option's default: ``socket_dir: Path = setting(kubelet.SOCKET_DIR)``. Typed as the value, so
    mypy checks the field's annotation against the option's parser and default."""
    default = option.default if pick is None else pick(option.default)
    return field(default=default, metadata={_BOUND: Binding("", option, pick)})


# Read once per settings class: a load reads them, and a class does not change.
_BINDINGS: dict[type[DataclassInstance], tuple[Binding, ...]] = {}
_OPTIONS: dict[type[DataclassInstance], tuple[Option[Any], ...]] = {}


def bindings(settings: type[DataclassInstance]) -> tuple[Binding, ...]:
    """The fields of the dataclass ``settings`` made by :func:`setting`, in their order."""
    if settings not in _BINDINGS:
        _BINDINGS[settings] = tuple(
            dataclasses.replace(bound, field=f.name)
            for f in dataclasses.fields(settings)
            if isinstance(bound := f.metadata.get(_BOUND), Binding)
        )
    return _BINDINGS[settings]


def options_of(settings: type[DataclassInstance]) -> tuple[Option[Any], ...]:
    """The options the fields of ``settings`` take their values from, in field order. An option
    is taken by one field, or by adjacent fields each picking a part of it; else TypeError."""
    if settings not in _OPTIONS:
        _OPTIONS[settings] = _options(bindings(settings))
    return _OPTIONS[settings]


def _options(bound_fields: tuple[Binding, ...]) -> tuple[Option[Any], ...]:
    found: dict[str, Option[Any]] = {}
    previous: Option[Any] | None = None
    for bound in bound_fields:
        if bound.option is previous and bound.pick is not None:
            continue
        if bound.option.name in found:
            raise TypeError(f"option --{bound.option.name} is taken by more than one field")
        found[bound.option.name] = previous = bound.option
    return tuple(found.values())
