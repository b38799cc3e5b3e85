"""Settings resolved with flag > environment > config file > default.

Each field of :class:`Settings` that takes its value from an option
(:func:`~gpuagent.config.option.setting`) gets it from the first source that gives the option, as
the option parses it, else the option's default. Then, once every value parses, the rules no
single option states: the config file read, the defaults that follow another setting or the
terminal, and the combinations refused. An error names the setting as the operator gave it.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from gpuagent.config.cli import build_parser, normalize_bool_flags
from gpuagent.config.errors import ConfigError
from gpuagent.config.groups.agent import CHECK_CONFIG, CONFIG
from gpuagent.config.option import bindings, options_of
from gpuagent.config.settings import Settings
from gpuagent.config.sources import Sources, check_environment
from gpuagent.domain.dra import DraMig
from gpuagent.domain.drashare import DraSharing
from gpuagent.domain.resources import MigStrategy

__all__ = ["load_as", "load_settings"]

S = TypeVar("S", bound=Settings)


def load_settings(
    argv: Sequence[str], environ: Mapping[str, str], *, stderr_isatty: bool = False
) -> Settings:
    """Resolve settings from ``argv`` (without the program name), ``environ`` and the config file.

    Raises ConfigError for any invalid value; argparse exits 2 on usage errors and 0 for
    --help and --version.
    """
    return load_as(Settings, argv, environ, stderr_isatty=stderr_isatty)


def load_as(
    kind: type[S], argv: Sequence[str], environ: Mapping[str, str], *, stderr_isatty: bool = False
) -> S:
    """:func:`load_settings` for ``kind``, :class:`Settings` or a subclass that adds fields (whose
    options join the command line, the environment and the config file's keys)."""
    options = options_of(kind)
    flags = build_parser(options).parse_args(normalize_bool_flags(argv, options))
    check_environment(environ, options)
    sources = Sources(flags, environ, options)
    _read_config_file(sources)
    parsed = {opt.name: sources.get(opt, opt.default) for opt in options}
    values: dict[str, Any] = {b.field: b.value(parsed[b.option.name]) for b in bindings(kind)}
    settings = kind(**values, node_name=_node_name(environ), origins=sources.origins())
    settings = _followed(settings, stderr_isatty=stderr_isatty)
    _check_simulation(settings)
    _check_dra(settings)
    _check_mps(settings)
    return _node_health(settings)


def _read_config_file(sources: Sources) -> None:
    """Read the config file: ``--check-config``'s when given, else ``--config``'s, if any."""
    check_config = sources.get(CHECK_CONFIG, None)
    path = check_config or sources.get(CONFIG, None)
    if path is not None:
        sources.load_file(path, sources.label(CHECK_CONFIG if check_config else CONFIG))


def _node_name(environ: Mapping[str, str]) -> str:
    return environ.get("NODE_NAME", "").strip() or socket.gethostname()


def _followed(settings: S, *, stderr_isatty: bool) -> S:
    """``settings`` with what follows from the others, where the operator did not say: the
    config file read (``--check-config``'s file is the config file), the kubelet's socket in
    ``--socket-dir``, console logs on a terminal."""
    given = settings.origins
    kubelet_socket = settings.kubelet_socket
    if "kubelet_socket" not in given:
        kubelet_socket = settings.socket_dir / "kubelet.sock"
    log_format = settings.log_format
    if "log_format" not in given and stderr_isatty:
        log_format = "console"
    return replace(
        settings,
        config_file=settings.check_config or settings.config_file,
        kubelet_socket=kubelet_socket,
        log_format=log_format,
    )


def _check_simulation(settings: Settings) -> None:
    if settings.simulate is not None and settings.sim_config is not None:
        raise ConfigError(
            settings.named("sim_config"), f"cannot be combined with {settings.named('simulate')}"
        )


def _check_dra(settings: Settings) -> None:
    """``--dra-gpus`` and ``--dra-mig`` are refused where they contradict the rest: a GPU for DRA
    would be offered nowhere without Kubernetes (DRA needs the kubelet and the API server), and
    MIG made on demand for no DRA GPU would only take CAP_SYS_ADMIN for nothing."""
    no_dra = settings.dra_gpus.strip().lower() == "none"
    if not settings.kubernetes and not no_dra:
        raise ConfigError(
            settings.named("dra_gpus"),
            f"cannot be combined with {settings.named('kubernetes')} false: DRA serves GPUs "
            "through the kubelet and the API server",
        )
    if settings.dra_mig is DraMig.DYNAMIC and no_dra:
        raise ConfigError(
            settings.named("dra_mig"),
            f"dynamic cannot be combined with {settings.named('dra_gpus')} none: MIG devices are "
            "made on demand only for GPUs served through DRA",
        )
    _check_dra_sharing(settings, no_dra=no_dra)


def _check_dra_sharing(settings: Settings, *, no_dra: bool) -> None:
    """``--dra-sharing mps`` shares whole GPUs served through DRA: refused with no GPU for DRA,
    and with ``--dra-mig dynamic`` (a partitionable GPU's devices consume its counters, and MIG
    devices cannot be shared through MPS)."""
    if settings.dra_sharing is DraSharing.NONE:
        return
    if no_dra:
        raise ConfigError(
            settings.named("dra_sharing"),
            f"mps cannot be combined with {settings.named('dra_gpus')} none: only GPUs served "
            "through DRA are shared this way",
        )
    if settings.dra_mig is DraMig.DYNAMIC:
        raise ConfigError(
            settings.named("dra_sharing"),
            f"mps cannot be combined with {settings.named('dra_mig')} dynamic: MIG devices "
            "cannot be shared through MPS, and a GPU published partitionable is not shared",
        )


def _check_mps(settings: Settings) -> None:
    """MPS sharing is refused with ``--mig-strategy mixed``, as NVIDIA's plugin refuses it: MIG
    devices cannot be shared through MPS."""
    if settings.sharing.mps.enabled and settings.mig_strategy is MigStrategy.MIXED:
        raise ConfigError(
            f"{settings.named('sharing')} mps",
            f"cannot be combined with {settings.named('mig_strategy')} mixed: MIG devices cannot "
            "be shared through MPS (NVIDIA's plugin refuses it too)",
        )


def _node_health(settings: S) -> S:
    """``--kubernetes=false`` turns ``--node-condition`` and ``--events`` off, and cannot be
    combined with ``--taint-unhealthy-node`` (the taint is written through the API server)."""
    if settings.kubernetes:
        return settings
    if settings.taint_unhealthy_node:
        raise ConfigError(
            settings.named("taint_unhealthy_node"),
            f"cannot be combined with {settings.named('kubernetes')} false: the taint is written "
            "through the API server",
        )
    return replace(settings, node_condition=False, events=False)
