"""The poller's heartbeat and the readings too old to serve, by a clock the test sets."""

from __future__ import annotations

from dataclasses import replace

from structlog.testing import capture_logs
from support.clock import FakeClock
from support.nodes import gpu, mig, node

from gpuagent.domain.devices import Condition, GpuHealth, Telemetry
from gpuagent.domain.health import UNRESPONSIVE
from gpuagent.domain.usage import ProcessReading
from gpuagent.gpu.freshness import Freshness
from gpuagent.state.store import DeviceStore

LIMIT = 25.0
READ = Telemetry(power_w=529.225, temperature_c=41.0)


def read_node() -> DeviceStore:
    """Two GPUs with readings; GPU 1 with a MIG device and its processes."""
    store = DeviceStore()
    with_migs = replace(
        gpu(1, migs=[replace(mig(1, 1), telemetry=READ)]),
        telemetry=READ,
        processes=ProcessReading(),
    )
    store.update(lambda _: node(replace(gpu(0), telemetry=READ), with_migs))
    return store


def test_readings_are_dropped_once_older_than_the_limit_and_come_back_when_read() -> None:
    store, clock = read_node(), FakeClock(1000.0)
    freshness = Freshness(store, LIMIT, clock)
    freshness.read(0)
    freshness.read(1)
    clock.now += LIMIT
    freshness.read(0)  # GPU 0 read again; GPU 1 not
    freshness.polled()
    assert [g.telemetry for g in store.snapshot.gpus] == [READ, READ]  # at the limit: served
    clock.now += 0.5
    with capture_logs() as logs:
        freshness.polled()
        freshness.polled()  # once per GPU, not once per poll
    first, second = store.snapshot.gpus
    assert first.telemetry == READ
    assert (second.telemetry, second.processes) == (Telemetry(), None)
    assert second.mig_devices[0].telemetry == Telemetry()
    assert store.counters.polled_at == clock.now
    assert [(e["event"], e["gpu"], e["read_s_ago"]) for e in logs] == [
        ("gpu readings too old; not served until the gpu is read again", 1, LIMIT + 0.5)
    ]
    with capture_logs() as logs:
        freshness.read(1)
        freshness.read(1)
    assert [e["event"] for e in logs] == ["gpu readings current again"]


def test_an_unresponsive_gpu_is_not_logged_again() -> None:
    """A GPU judged unresponsive has dropped its readings and said why: no second line."""
    store, clock = read_node(), FakeClock(1000.0)
    freshness = Freshness(store, LIMIT, clock)
    freshness.read(1)
    hung = GpuHealth((Condition(UNRESPONSIVE, "no answer within 10s"),))
    store.update(lambda s: replace(s, gpus=(s.gpus[0], replace(s.gpus[1], health=hung))))
    clock.now += LIMIT + 1
    with capture_logs() as logs:
        freshness.polled()
    assert logs == []
    assert store.snapshot.gpus[1].telemetry == Telemetry()


def test_the_heartbeat_is_kept_before_any_gpu_is_read() -> None:
    store, clock = DeviceStore(), FakeClock(5.0)
    assert store.counters.polled_at is None
    Freshness(store, LIMIT, clock).polled()
    assert store.counters.polled_at == 5.0
