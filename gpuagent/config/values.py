"""Parsers of one setting's raw value (a flag's or variable's text, or a config file's YAML value).

Each returns the typed value or raises :class:`Invalid` with the reason; the caller names the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from gpuagent.config.errors import Invalid
from gpuagent.config.sharing import parse_sharing
from gpuagent.domain.containers import DeviceListStrategy
from gpuagent.domain.errors import SettingError
from gpuagent.domain.health import HealthCheckSpecError, HealthPolicy
from gpuagent.domain.naming import resource_name
from gpuagent.domain.sharing import Sharing
from gpuagent.yamlfile import one_line

E = TypeVar("E", bound=StrEnum)

MAX_SIMULATED_GPUS = 64
MAX_POLL_INTERVAL = 3600.0
# The node condition's heartbeat: lastHeartbeatTime moves at most once a minute.
MIN_HEARTBEAT = 60.0
MAX_HEARTBEAT = 86_400.0
MIN_NVML_TIMEOUT = 1.0
MIN_POD_RESOURCES_INTERVAL = 1.0

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?")


def type_name(raw: object) -> str:
    return "null" if raw is None else type(raw).__name__


def as_text(raw: object) -> str:
    if not isinstance(raw, str):
        raise Invalid(f"expected a string, got {type_name(raw)}")
    return raw


def text_nonempty(raw: object) -> str:
    text = as_text(raw)
    if not text:
        raise Invalid("must not be empty")
    return text


def parse_path(raw: object) -> Path:
    text = text_nonempty(raw)
    if "\0" in text:
        raise Invalid("must not contain a NUL character")
    return Path(text)


def parse_absolute_path(raw: object) -> Path:
    path = parse_path(raw)
    if not path.is_absolute():
        raise Invalid(f"must be an absolute path, got {str(path)!r}")
    return path


def parse_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if not isinstance(raw, str):
        raise Invalid(f"expected true or false, got {type_name(raw)}")
    text = raw
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise Invalid(f"expected true or false, got {text!r}")


def parse_simulate(raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        count = raw
    elif isinstance(raw, str) and raw.isascii() and raw.strip().isdecimal():
        count = int(raw)
    else:
        raise Invalid(f"expected a whole number of GPUs, got {raw!r}")
    if not 1 <= count <= MAX_SIMULATED_GPUS:
        raise Invalid(f"must be between 1 and {MAX_SIMULATED_GPUS}, got {count}")
    return count


def _seconds(raw: object) -> float:
    """A number of seconds: a number (the config file) or its text (a flag, the environment)."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            raise Invalid(f"expected a number of seconds, got {raw!r}") from None
    raise Invalid(f"expected a number of seconds, got {type_name(raw)}")


def parse_poll_interval(raw: object) -> float:
    seconds = _seconds(raw)
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_POLL_INTERVAL):
        raise Invalid(f"must be > 0 and <= {MAX_POLL_INTERVAL:g} seconds, got {raw!r}")
    return seconds


def parse_nvml_timeout(raw: object) -> float:
    seconds = parse_poll_interval(raw)
    if seconds < MIN_NVML_TIMEOUT:
        raise Invalid(f"must be at least {MIN_NVML_TIMEOUT:g} second, got {raw!r}")
    return seconds


def parse_pod_resources_interval(raw: object) -> float:
    seconds = parse_poll_interval(raw)
    if seconds < MIN_POD_RESOURCES_INTERVAL:
        raise Invalid(f"must be at least {MIN_POD_RESOURCES_INTERVAL:g} second, got {raw!r}")
    return seconds


def parse_heartbeat(raw: object) -> float:
    """Seconds between writes of an unchanged node condition: a minute to a day."""
    seconds = _seconds(raw)
    if not (math.isfinite(seconds) and MIN_HEARTBEAT <= seconds <= MAX_HEARTBEAT):
        raise Invalid(f"must be {MIN_HEARTBEAT:g} to {MAX_HEARTBEAT:g} seconds, got {raw!r}")
    return seconds


def parse_sharing_value(raw: object) -> Sharing:
    """NVIDIA's ``sharing`` block: a mapping in the file, YAML/JSON text in a flag or env."""
    value = raw
    if isinstance(raw, str):
        import yaml  # noqa: PLC0415 - only for sharing given as text

        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise Invalid(f"not valid YAML or JSON: {one_line(exc, text=raw)}") from None
    if value is None:
        return Sharing()
    if not isinstance(value, dict):
        raise Invalid(
            f"expected a mapping such as {{timeSlicing: ...}} or {{mps: ...}}, "
            f"got {type_name(value)}"
        )
    try:
        return parse_sharing(value)
    except SettingError as exc:
        raise Invalid(str(exc)) from None


def choice(allowed: tuple[str, ...], *, fold_case: bool = False) -> Callable[[object], str]:
    def parse(raw: object) -> str:
        text = as_text(raw)
        value = text.lower() if fold_case else text
        if value not in allowed:
            raise Invalid(f"must be one of {', '.join(allowed)}, got {text!r}")
        return value

    return parse


def one_of(kind: type[E]) -> Callable[[object], E]:
    """A parser for one of the domain enum ``kind``'s values."""
    allowed = tuple(member.value for member in kind)

    def parse(raw: object) -> E:
        return kind(choice(allowed)(raw))

    return parse


def parse_device_list_strategy(raw: object) -> tuple[DeviceListStrategy, ...]:
    if isinstance(raw, list):
        items = [as_text(item).strip() for item in raw]
    else:
        items = [item.strip() for item in as_text(raw).split(",")]
    if not items or "" in items:
        raise Invalid("expected a comma-separated list without empty entries")
    allowed = tuple(s.value for s in DeviceListStrategy)
    unknown = [item for item in items if item not in allowed]
    if unknown:
        raise Invalid(f"unknown strategy {unknown[0]!r}; allowed: {', '.join(allowed)}")
    strategies = tuple(DeviceListStrategy(item) for item in dict.fromkeys(items))
    cdi = {DeviceListStrategy.CDI_ANNOTATIONS, DeviceListStrategy.CDI_CRI}
    if cdi <= set(strategies):
        raise Invalid("cdi-annotations and cdi-cri cannot be combined")
    return strategies


def parse_healthchecks(raw: object) -> str:
    """A comma list of XIDs, ``xids`` and ``all`` (or a YAML list of them), checked here so that
    an error names the setting as it was given."""
    if isinstance(raw, list):
        text = ",".join(parse_healthchecks(item) for item in raw)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        text = str(raw)
    else:
        text = as_text(raw)
    try:
        HealthPolicy.from_env_values(text, "")
    except HealthCheckSpecError as exc:
        raise Invalid(exc.reason) from None
    return text


def parse_resource_name(raw: object) -> str:
    try:
        return resource_name(as_text(raw))
    except ValueError as exc:
        raise Invalid(str(exc)) from None


def parse_metrics_address(raw: object) -> tuple[str, int]:
    text = as_text(raw)
    host, colon, port_text = text.rpartition(":")
    if not colon:
        raise Invalid(f"expected HOST:PORT (e.g. ':9400'), got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        import ipaddress  # noqa: PLC0415 - only for a bracketed host

        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise Invalid(f"{host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise Invalid(f"an IPv6 host must be in brackets, e.g. '[::1]:9400', got {text!r}")
    elif host and not _HOSTNAME_RE.fullmatch(host):
        raise Invalid(f"{host!r} is not a valid host name or address")
    if not (port_text.isascii() and port_text.isdecimal()) or not 0 <= int(port_text) <= 65535:
        raise Invalid(f"port must be a number from 0 to 65535, got {port_text!r}")
    return host, int(port_text)


def parse_dra_gpus(raw: object) -> str:
    if isinstance(raw, list):
        items = [str(item) for item in raw if not isinstance(item, bool)]
        if len(items) != len(raw) or not items:
            raise Invalid("expected none, all or a list of GPU indexes and UUIDs")
        return ",".join(items)
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    text = as_text(raw).strip()
    if not text:
        raise Invalid("must not be empty (none, all, or GPU indexes and UUIDs)")
    return text


def parse_driver_name(raw: object) -> str:
    name = as_text(raw)
    if len(name) > 63 or not _DNS_SUBDOMAIN_RE.fullmatch(name):
        raise Invalid(f"must be a lower-case DNS subdomain of at most 63 characters, got {name!r}")
    return name
