"""The one reload path: SIGHUP, or a change of the config file or of the web config's files.

A reload re-reads flags, environment and config file, and the web config (off the loop), checks
the result as a start would and against the node (a ``--dra-gpus`` GPU it does not have), then
applies it as a whole: the live settings (declared on their options) as the next plan, the web
config's users, headers and certificates. What only a restart can change is named in the log.
An invalid configuration is refused as a whole: the running one stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import structlog

from gpuagent.app import policy
from gpuagent.config import ConfigError, Settings
from gpuagent.config.planning import (
    live_settings,
    make_plan,
    reloaded_plan,
    reread_web_config,
    restart_keys,
    use_web_config,
)
from gpuagent.domain.errors import SettingError
from gpuagent.domain.plan import Plan
from gpuagent.state.store import DeviceStore

if TYPE_CHECKING:
    from gpuagent.nodefiles.cdikeeper import CdiSpecKeeper
    from gpuagent.web.webconfig import WebConfig, WebConfigFile

__all__ = ["Node", "Reloads"]

log = structlog.get_logger("gpuagent")

#: A digest of a file's content; None while it cannot be read.
Stamp = bytes | None


class Node(Protocol):
    """What a reload checks the configuration against, and updates first: the started agent's
    GPUs (as the driver counts them) and the CDI spec's keeper (if it keeps the spec)."""

    @property
    def gpu_count(self) -> int: ...

    @property
    def cdi(self) -> CdiSpecKeeper | None: ...


class Reloads:
    """The running settings, and the reloads that change them.

    ``source`` reads the settings again (flags, environment, config file); without it the agent
    does not reload. ``check_interval``: how often the config file and the web config's files are
    read to see whether their content changed (an edit, a ConfigMap's symlink swapped).
    A refused reload is logged once per reason: the same refusal again (the next change of
    another file, a SIGHUP) is counted, not logged.
    """

    def __init__(
        self,
        store: DeviceStore,
        settings: Settings,
        *,
        source: Callable[[], Settings] | None,
        check_interval: float,
        web_config: WebConfigFile | None,
    ) -> None:
        self.settings = settings
        self._store = store
        self._source = source
        self._check_interval = check_interval
        self._web = web_config
        self._requested = asyncio.Event()
        self._refused: str | None = None  # the refusal last logged, until a reload succeeds
        self._baseline: dict[Path, Stamp] | None = None  # the watched files as the start saw them

    @property
    def enabled(self) -> bool:
        return self._source is not None

    def request(self) -> None:
        """Reload soon (SIGHUP); the work is done off the signal handler, the reading off the
        loop."""
        self._requested.set()

    async def look(self) -> None:
        """Read the watched files as they are now (off the loop): a change from here on reloads.
        Done as the agent starts, before it says it has: a change made once it has started is
        never taken for how it started."""
        self._baseline = await asyncio.to_thread(_stamps, self._watched())

    async def run(self, node: Node) -> None:
        """Reload on :meth:`request`, and when a watched file's content changes (a ConfigMap
        update, an edit), or it becomes readable or unreadable, from how :meth:`look` found
        them (read now, without it)."""
        interval = self._check_interval if self._watched() else None
        stamps = self._baseline
        if stamps is None:
            stamps = await asyncio.to_thread(_stamps, self._watched())
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._requested.wait()
            asked = self._requested.is_set()
            self._requested.clear()
            if interval is not None:
                seen, stamps = stamps, await asyncio.to_thread(_stamps, self._watched())
                changed = [p for p, stamp in stamps.items() if p in seen and seen[p] != stamp]
                if not asked and not changed:
                    continue
                if not asked:
                    log.info("config file changed; reloading", path=str(changed[0]))
            await self.reload(node)

    async def reload(self, node: Node) -> list[str] | None:
        """Read the configuration again (off the loop) and apply it; returns the keys that need a
        restart to change, or ``None`` when it is invalid (nothing changes)."""
        try:
            settings, plan, web = await asyncio.to_thread(self._read)
        except SettingError as exc:
            self._refuse(exc)
            return None
        snapshot = self._store.snapshot
        if snapshot.discovered:
            absent = policy.absent_dra_gpus(plan.dra.gpus, snapshot, node.gpu_count)
            if absent is not None:
                self._refuse(ConfigError(settings.named("dra_gpus"), absent))
                return None
        served = reloaded_plan(self._store.plan, live_settings(self.settings, settings))
        web_changed = False
        if web is not None and self._web is not None:
            try:
                web_changed = use_web_config(self._web, web, settings.named("web_config_file"))
            except SettingError as exc:
                self._refuse(exc)
                return None
        if node.cdi is not None and served.writes_cdi_spec and snapshot.discovered:
            # The spec first, then the plan: an Allocate answered with CDI names finds them.
            await node.cdi.sync(snapshot, served.serving.containers)
        return self.apply(settings, served, web_changed=web_changed)

    def apply(self, settings: Settings, plan: Plan, *, web_changed: bool = False) -> list[str]:
        """Serve under ``plan`` (the live part of ``settings``) from now on; returns the keys of
        ``settings`` that need a restart to change. A plan equal to the running one changes
        nothing; the reload counts as changed when it or the web config (``web_changed``, already
        served) did."""
        restart = restart_keys(self.settings, settings)
        self._refused = None
        published = self._store.publish(plan)
        self.settings = live_settings(self.settings, settings)
        changed = published is not None or web_changed
        self._store.counters.reloaded("changed" if changed else "unchanged")
        generation = self._store.plan.generation
        if changed:
            log.info("configuration reloaded", generation=generation, needs_restart=restart)
        else:
            log.info("configuration unchanged", generation=generation, needs_restart=restart)
        if restart:
            log.warning("changed settings take effect only after a restart", keys=restart)
        return restart

    def _refuse(self, error: SettingError) -> None:
        self._store.counters.reloaded("invalid")
        if str(error) != self._refused:
            self._refused = str(error)
            log.error(
                "reloaded configuration is invalid; keeping the running one", error=str(error)
            )

    def _read(self) -> tuple[Settings, Plan, WebConfig | None]:
        """The settings, their plan (checked as at start) and the web config, read again."""
        assert self._source is not None
        settings = self._source()
        plan = make_plan(settings)
        named = settings.named("web_config_file")
        web = reread_web_config(self._web, named) if self._web is not None else None
        return settings, plan, web

    def _watched(self) -> tuple[Path, ...]:
        config = self.settings.config_file
        return (*(() if config is None else (config,)), *(self._web.files() if self._web else ()))


def _stamps(paths: Iterable[Path]) -> dict[Path, Stamp]:
    return {path: _file_stamp(path) for path in paths}


def _file_stamp(path: Path) -> Stamp:
    """A digest of the file's content, or None while it cannot be read. The content, not
    ``stat``: a file rewritten within one tick of the file system's clock (milliseconds) at the
    same size has the same times and size, and its change would never be seen."""
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None
