"""``gpuagent`` command line entry point."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuagent.app.agent import Agent
    from gpuagent.config import Settings

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Parse settings, run the agent on uvloop, and return the process exit code.

    The cyclic collector is off while the agent's modules are imported and it starts (the
    agent turns it back on once started, see ``Agent(own_process=True)``): start-up builds
    long-lived objects and next to no cyclic garbage, and the collections cost ~12 ms of the
    time to registration.
    """
    gc.disable()
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    finally:
        gc.enable()


def _main(args: list[str]) -> int:
    # Before anything imports betterproto2: its version without importlib.metadata's imports.
    from gpuagent.overrides import protoversion  # noqa: PLC0415

    protoversion.install()
    # Imported here, with the collector off (see main).
    import uvloop  # noqa: PLC0415

    from gpuagent import logs  # noqa: PLC0415
    from gpuagent.app.agent import Agent  # noqa: PLC0415
    from gpuagent.config import load_settings  # noqa: PLC0415
    from gpuagent.config.planning import (  # noqa: PLC0415
        check_on_the_host,
        load_simulator,
        load_web_config,
        make_plan,
    )
    from gpuagent.domain.errors import SettingError  # noqa: PLC0415

    def settings_source() -> Settings:
        return load_settings(args, os.environ, stderr_isatty=sys.stderr.isatty())

    try:
        settings = _answering(settings_source)
        plan = make_plan(settings)
        if settings.check_config is not None:
            load_web_config(settings)
            load_simulator(settings)
            check_on_the_host(settings, plan)
            print(json.dumps(settings.as_dict(), indent=2), flush=True)
            return EXIT_OK
        logs.configure(settings.log_format, settings.log_level)
        agent = Agent(
            settings,
            plan=plan,
            simulator=load_simulator(settings),
            settings_source=settings_source,
            own_process=True,
        )
    except SettingError as exc:
        print(f"gpuagent: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except BrokenPipeError:
        return _stdout_closed()
    return uvloop.run(_run(agent, settings))


def _answering(settings_source: Callable[[], Settings]) -> Settings:
    """The settings; ``--help`` and ``--version`` answer on stdout and exit here, flushed first
    so that a reader who closed it is met here (:func:`_stdout_closed`), not at the exit."""
    try:
        return settings_source()
    except SystemExit as exc:
        if exc.code in (0, None):
            sys.stdout.flush()
        raise


def _stdout_closed() -> int:
    """The reader of an answer on stdout closed it early (``--check-config FILE | head -1``).

    What was asked is answered, so the exit code is the answer's: 0 (a configuration error is
    said on stderr, never here), not the 141 of a death by SIGPIPE, which would fail a
    ``set -o pipefail`` script over a valid file. No traceback; stdout goes to /dev/null so the
    interpreter's own flush at exit cannot fail again.
    """
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK


async def _run(agent: Agent, settings: Settings) -> int:
    import asyncio  # noqa: PLC0415

    import structlog  # noqa: PLC0415

    from gpuagent.app.supervisor import FatalError  # noqa: PLC0415
    from gpuagent.domain.errors import SettingError  # noqa: PLC0415

    log = structlog.get_logger("gpuagent")
    log.info("running with config", config=json.loads(json.dumps(settings.as_dict())))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second signal; exiting now", signal=signum.name)
            os._exit(EXIT_FAILURE)
        log.info("signal received; shutting down", signal=signum.name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, agent.request_reload)
    try:
        await agent.run(stop)
    except SettingError as exc:
        log.error("configuration error", error=str(exc))
        return EXIT_CONFIG
    except FatalError as exc:
        log.error("fatal", error=str(exc))
        return EXIT_FAILURE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
