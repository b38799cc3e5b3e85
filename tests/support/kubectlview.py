"""Objects from the API-server stand-in as ``kubectl describe node`` and ``kubectl get events``
print them (kubectl's columns, time formats and ages), for the examples in docs/health.md."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

__all__ = ["describe_node", "get_events"]


def _seconds(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _rfc1123z(text: str) -> str:
    return datetime.fromtimestamp(_seconds(text), UTC).strftime("%a, %d %b %Y %H:%M:%S +0000")


def human_duration(seconds: float) -> str:
    """apimachinery's ``duration.HumanDuration``, up to hours."""
    whole = int(seconds)
    if whole < 0:
        return "0s"
    if whole < 120:
        return f"{whole}s"
    minutes = whole // 60
    if minutes < 10:
        rest = whole % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    return f"{minutes // 60}h{minutes % 60}m"


def _table(rows: Sequence[Sequence[str]], *, indent: str, padding: int) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        indent
        + "".join(cell.ljust(w + padding) for cell, w in zip(row[:-1], widths, strict=True))
        + row[-1]
        for row in rows
    ]


def _regarding(event: Mapping[str, Any]) -> Mapping[str, Any]:
    found: Mapping[str, Any] = event.get("regarding") or event.get("involvedObject") or {}
    return found


def _age(event: Mapping[str, Any], now: float) -> str:
    first = human_duration(now - _seconds(event["eventTime"]))
    series = event.get("series")
    if series:
        last = human_duration(now - _seconds(series["lastObservedTime"]))
        return f"{last} (x{series['count']} over {first})"
    return first


def describe_node(node: Mapping[str, Any], events: Iterable[Mapping[str, Any]], now: float) -> str:
    """The ``Conditions:`` and ``Events:`` sections of ``kubectl describe node``."""
    header = ["Type", "Status", "LastHeartbeatTime", "LastTransitionTime", "Reason", "Message"]
    conditions = [header, ["-" * len(h) for h in header]]
    for c in node["status"]["conditions"]:
        beat, moved = _rfc1123z(c["lastHeartbeatTime"]), _rfc1123z(c["lastTransitionTime"])
        conditions.append([c["type"], c["status"], beat, moved, c["reason"], c["message"]])
    lines = ["Conditions:", *_table(conditions, indent="  ", padding=2)]
    table = [("Type", "Reason", "Age", "From", "Message"),
             ("----", "------", "----", "----", "-------")]  # fmt: skip
    for e in events:
        table.append((e["type"], e["reason"], _age(e, now), e["reportingController"], e["note"]))
    return "\n".join([*lines, "Events:", *_table(table, indent="  ", padding=2)])


def get_events(events: Iterable[Mapping[str, Any]], now: float) -> str:
    """``kubectl get events`` (in one namespace): last seen, type, reason, object, message."""
    rows = [("LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE")]
    ordered = sorted(events, key=lambda e: (e.get("series") or {}).get("lastObservedTime")
                     or e["eventTime"])  # fmt: skip
    for e in ordered:
        series = e.get("series")
        last = series["lastObservedTime"] if series else e["eventTime"]
        ref = _regarding(e)
        note = e.get("note") or e.get("message", "")
        seen = human_duration(now - _seconds(last))
        rows.append((seen, e["type"], e["reason"], f"{ref['kind'].lower()}/{ref['name']}", note))
    return "\n".join(_table(rows, indent="", padding=3))
