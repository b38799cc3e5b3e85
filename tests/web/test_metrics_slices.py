"""How the /metrics renderer spends its time: the device part cached per snapshot version, the
gzip prefix compressed once, and a render in slices that hand the loop back.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Generator
from dataclasses import replace
from typing import Any

import pytest
from support.metricstext import renderer
from support.synthetic import synthetic_snapshot

from gpuagent.state.counters import (
    AgentCounters,
    ReloadStats,
)
from gpuagent.web import layout, metrics
from gpuagent.web.devicepart import hand_back


def test_device_part_cached_per_snapshot_version() -> None:
    r = renderer()
    snapshot = synthetic_snapshot(2, version=5)
    first = r.devices(snapshot)
    assert r.devices(snapshot) is first
    assert r.devices(replace(snapshot)) is first  # same version: same part
    assert r.device_renders == 1
    newer = r.devices(replace(snapshot, version=6))
    assert newer is not first
    assert r.device_renders == 2


def test_agent_part_is_fresh_on_every_scrape() -> None:
    r = renderer()
    snapshot = synthetic_snapshot(1)
    for ok in (False, True, False):
        counters = AgentCounters(reloads=ReloadStats(last_successful=ok))
        expected = b"gpuagent_config_last_reload_successful %d\n" % ok
        assert expected in r.agent(snapshot, counters)


@pytest.mark.parametrize("tail", [b"", b"x\n", b"gpuagent_gpus 8\n" * 500])
def test_gzip_prefix_plus_tail_is_one_valid_stream(tail: bytes) -> None:
    part = renderer().devices(synthetic_snapshot(8, replicas=2))
    for _ in range(2):  # the cached segments are reused, not consumed
        assert gzip.decompress(b"".join(part.gzip(tail))) == part.text + tail


@pytest.mark.parametrize("replicas", [0, 128])
def test_gzip_prefix_is_compressed_once_per_version(replicas: int) -> None:
    r = renderer()
    base = synthetic_snapshot(8, replicas=replicas)
    part = r.devices(base)
    first = part.gzip(b"a\n")
    again = part.gzip(b"tail\n")
    assert again[1] is first[1]  # the device part's deflate stream, shared by every scrape
    assert gzip.decompress(b"".join(again)) == part.text + b"tail\n"
    assert r.devices(replace(base, version=base.version)) is part
    newer = r.devices(replace(base, version=base.version + 1))
    assert newer is not part
    assert gzip.decompress(b"".join(newer.gzip(b""))) == newer.text


class Ticker:
    """Counts the turns the event loop gives other tasks while a render or compression runs."""

    def __init__(self) -> None:
        self.turns = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)

    def stop(self) -> int:
        self._task.cancel()
        return self.turns


async def test_a_scrapes_render_hands_the_loop_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice of no time: the render hands the loop back after every family, and the scrapes
    that ask for that version meanwhile share the one render; the text is the same as at once."""
    monkeypatch.setattr(metrics, "SLICE_S", 0.0)
    snapshot = synthetic_snapshot(4, replicas=3)
    r = renderer()
    ticker = Ticker()
    parts = await asyncio.gather(*(r.devices_async(snapshot) for _ in range(3)))
    turns = ticker.stop()
    assert parts[0] is parts[1] is parts[2]
    assert r.device_renders == 1
    assert turns >= len(parts[0].chunks) - 1
    assert parts[0].text == renderer().devices(snapshot).text
    assert await r.devices_async(snapshot) is parts[0]  # cached


async def test_a_new_layout_is_built_in_steps_handing_the_loop_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The label layout (rebuilt when pods come or go: ~6 ms at 50 containers a GPU) is built on
    the loop in steps, other tasks running between every two; a version whose pods did not
    change reuses it."""
    ticker = Ticker()
    turns_at_step: list[int] = []
    steps = layout.layout_steps

    def recording(*args: Any, **kwargs: Any) -> Generator[None, None, layout.Layout]:
        inner = steps(*args, **kwargs)
        while True:
            turns_at_step.append(ticker.turns)
            try:
                next(inner)
            except StopIteration as done:
                built: layout.Layout = done.value
                return built
            yield

    monkeypatch.setattr(metrics, "layout_steps", recording)
    snapshot = synthetic_snapshot(2, replicas=2)
    r = renderer()
    part = await r.devices_async(snapshot)
    await r.devices_async(replace(snapshot, version=snapshot.version + 1))
    ticker.stop()
    assert len(turns_at_step) == 4  # three hand-backs, one build
    assert turns_at_step == sorted(set(turns_at_step))  # the loop ran between every two steps
    assert r.layouts == 1
    assert part.text == renderer().devices(snapshot).text


async def test_a_scrape_that_goes_away_leaves_the_render_to_the_others() -> None:
    snapshot = synthetic_snapshot(2, replicas=2)
    r = renderer()
    gone = asyncio.create_task(r.devices_async(snapshot))
    staying = asyncio.create_task(r.devices_async(snapshot))
    await asyncio.sleep(0)
    gone.cancel()
    part = await staying
    assert part.text == renderer().devices(snapshot).text
    assert r.device_renders == 1


async def test_an_older_render_finishing_late_does_not_replace_a_newer_one() -> None:
    base = synthetic_snapshot(2)
    newer = replace(base, version=base.version + 1)
    r = renderer()
    late = asyncio.create_task(r.devices_async(base))
    part = r.devices(newer)
    await late
    assert r.devices(newer) is part


async def test_a_slice_hands_the_loop_back_behind_the_timers_due() -> None:
    """Between two slices of a render, what fell due during the first (a timer: the kubelet's
    gRPC deadline, a probe) runs before the second ("sleep(0)" resumed the task first)."""
    loop = asyncio.get_running_loop()
    fired: list[str] = []
    loop.call_at(loop.time(), fired.append, "due")  # fell due during the slice
    await hand_back()
    assert fired == ["due"]


async def test_gzip_is_compressed_in_pieces_once() -> None:
    """Compression hands the loop back between pieces; scrapes asking meanwhile share it, and the
    stream is the same as compressing at once."""
    part = renderer(series_per_container=True).devices(synthetic_snapshot(8, replicas=40))
    assert part.size > 4 * 64 * 1024
    ticker = Ticker()
    await asyncio.gather(part.deflate(0.0), part.deflate(0.0))
    assert ticker.stop() >= part.size // (64 * 1024)
    stream = part.gzip(b"tail\n")
    assert gzip.decompress(b"".join(stream)) == part.text + b"tail\n"
    assert part.gzip(b"")[1] is stream[1]
