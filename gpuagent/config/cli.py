"""The command line: the argument parser built from an option table (:data:`OPTIONS`, unless
given) and ``--version``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from gpuagent.config.option import CONFIG_VERSION, Option
from gpuagent.config.options import OPTIONS
from gpuagent.config.spellings import closest_flag

__all__ = ["build_parser", "normalize_bool_flags"]


class _StoreWithFlag(argparse.Action):
    """Store ``(option string as typed, value)`` so errors can name the spelling the user used."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, (option_string or self.option_strings[0], values))


class _Version(argparse.Action):
    """``--version``: the installed version, read only when asked for (importing
    :mod:`importlib.metadata` would cost every start)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        import importlib.metadata  # noqa: PLC0415

        try:
            version = importlib.metadata.version("gpuagent")
        except importlib.metadata.PackageNotFoundError:
            version = "0+unknown"
        sys.stdout.write(f"gpuagent {version}\n")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line with a pointer to ``--help`` (argparse prints
    the whole usage, ~30 lines, above it), and a misspelt flag gets the closest one named."""

    # (typeshed overloads it on the namespace type; this one keeps argparse.Namespace)
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:  # (parse_args would say only "unrecognized arguments")
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._closest(extras)}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")

    def _closest(self, extras: Sequence[str]) -> str:
        for extra in extras:
            if extra.startswith("--"):
                close = closest_flag(extra.split("=", 1)[0])
                if close:
                    return f" (did you mean {close}?)"
        return ""


def build_parser(options: Sequence[Option[Any]] = OPTIONS) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gpuagent",
        description="Kubernetes GPU node agent: device plugin, GPU health and metrics.",
        epilog="Every option is also settable as GPUAGENT_<OPTION> in the environment and, "
        f"except --config, as a key of the config file (version: {CONFIG_VERSION}). "
        "Precedence: flag > environment > config file > default. "
        "Boolean flags take --name or --name=true|false.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action=_Version, help="show program's version number and exit")
    for opt in options:
        help_text = f"{opt.help} [env {', '.join(opt.env_names)}]"
        parser.add_argument(
            f"--{opt.name}",
            *opt.aliases,
            dest=opt.dest,
            action=_StoreWithFlag,
            nargs="?" if opt.is_bool else None,
            metavar="true|false" if opt.is_bool else opt.metavar,
            help=help_text,
        )
    return parser


def normalize_bool_flags(
    argv: Sequence[str], options: Sequence[Option[Any]] = OPTIONS
) -> list[str]:
    """Rewrite a bare boolean flag to ``--name=true`` so it never consumes the next argument."""
    bare = {
        spelling for opt in options if opt.is_bool for spelling in (f"--{opt.name}", *opt.aliases)
    }
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return [*out, *argv[i:]]
        out.append(f"{arg}=true" if arg in bare else arg)
    return out
