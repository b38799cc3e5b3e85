"""docs/health.md shows what Kubernetes sees of a fault as kubectl prints it: the examples there are
rendered from the objects the writer stores in the API-server stand-in, not written by hand."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.kubectlview import describe_node, get_events
from support.noderig import WALL0, Rig

from gpuagent.domain.devices import Condition

DOC = Path(__file__).parents[2] / "docs" / "health.md"


def fenced(text: str) -> str:
    return f"```\n{text}\n```"


async def test_the_kubectl_examples_in_health_md_are_what_the_writer_wrote(
    make_rig: Callable[..., Any],
) -> None:
    rig: Rig = await make_rig()
    await rig.settle(0.2)
    await rig.clock.advance(100.0)  # 00:01:40: XID 79 on GPU 3, held by a pod
    await rig.fail(3, Condition("xid", "79"), Condition("recovery_action", "gpu_reset"))
    await rig.settle(12.0)
    now = WALL0 + rig.clock.now()
    node_events = rig.server.node_events()
    describe = describe_node(rig.server.node_stored(), node_events, now)
    await rig.clock.advance(600.0)  # the driver asks for no action any more: recovered
    await rig.heal(3)
    await rig.settle(45.0)
    now = WALL0 + rig.clock.now()
    on_node = get_events(rig.server.node_events(), now)
    (pod_event,) = [e for e in rig.server.events.values() if e["regarding"]["kind"] == "Pod"]
    on_pod = get_events([pod_event], now)
    text = DOC.read_text(encoding="utf-8")
    for block in (describe, on_node, on_pod):
        assert fenced(block) in text, f"docs/health.md lacks, verbatim:\n{fenced(block)}"
