"""A stand-in ``kubectl`` for the shell the docs give operators: the few commands they use, with
kubectl's argument rules and failures, over Node objects kept in a JSON file.

Run as a program (``python fake_kubectl.py ARGS``) with ``FAKE_KUBECTL_STATE`` naming the file
(``{"nodes": [<Node>, ...]}``); :func:`install` writes a ``kubectl`` on a directory for ``PATH``.
Supported: ``get nodes|node NAME|node/NAME [-o name|-o jsonpath=T]`` (T: ``{.items[*].metadata
.name}`` or ``{range .a.b[*]}{.f}{"\\n"}{end}``), ``patch node NAME --subresource=status
--type=json -p OPS`` (``test`` and ``remove`` ops), and ``taint nodes|node NAME KEY[:EFFECT]-``.
Anything else fails, as an unknown command would.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["install"]

_RANGE = re.compile(r'\{range \.([\w.]+)\[\*\]\}\{\.(\w+)\}\{"\\n"\}\{end\}')


class KubectlError(Exception):
    """What kubectl prints as ``error: ...`` before it exits 1."""


def install(bin_dir: Path, state: Path) -> dict[str, str]:
    """Write ``kubectl`` in ``bin_dir``; return the environment that runs it over ``state``."""
    shim = bin_dir / "kubectl"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    shim.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "FAKE_KUBECTL_STATE": str(state)}


def _node(state: dict[str, Any], name: str) -> dict[str, Any]:
    for node in state["nodes"]:
        if node["metadata"]["name"] == name:
            return node  # type: ignore[no-any-return]
    raise KubectlError(f'nodes "{name}" not found')


def _options(args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Positional arguments, and ``-o``/``-p``/``--x=y`` options by name."""
    positional: list[str] = []
    options: dict[str, str] = {}
    items = iter(args)
    for arg in items:
        if arg in ("-o", "-p"):
            options[arg] = next(items)
        elif arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            options[key] = value
        elif arg.startswith("-"):
            raise KubectlError(f"unknown flag: {arg}")
        else:
            positional.append(arg)
    return positional, options


def _named(positional: Sequence[str], *, types: tuple[str, ...]) -> list[str]:
    """The node names of ``TYPE NAME...`` or ``TYPE/NAME...`` arguments."""
    if not positional:
        raise KubectlError("you must specify the type of resource to get")
    if "/" in positional[0]:
        kinds = {p.split("/", 1)[0] for p in positional}
        if not kinds <= set(types):
            raise KubectlError(f"invalid resource type {positional[0]}")
        return [p.split("/", 1)[1] for p in positional]
    if positional[0] not in types:
        raise KubectlError(f"the server doesn't have a resource type {positional[0]!r}")
    return list(positional[1:])


def _jsonpath(template: str, objects: Sequence[dict[str, Any]], *, listed: bool) -> str:
    if template == "{.items[*].metadata.name}" and listed:
        return " ".join(o["metadata"]["name"] for o in objects)
    match = _RANGE.fullmatch(template)
    if match is None or listed:
        raise KubectlError(f"template not supported by the stand-in: {template}")
    out = []
    for obj in objects:
        items: Any = obj
        for part in match.group(1).split("."):
            items = items.get(part, {}) if isinstance(items, dict) else {}
        out += [f"{item.get(match.group(2), '')}\n" for item in items or []]
    return "".join(out)


def _get(state: dict[str, Any], args: Sequence[str]) -> str:
    positional, options = _options(args)
    names = _named(positional, types=("node", "nodes"))
    listed = not names
    objects = state["nodes"] if listed else [_node(state, n) for n in names]
    output = options.get("-o", "")
    if output == "name":
        return "".join(f"node/{o['metadata']['name']}\n" for o in objects)
    if output.startswith("jsonpath="):
        return _jsonpath(output.removeprefix("jsonpath="), objects, listed=listed)
    raise KubectlError(f"output format not supported by the stand-in: {output!r}")


def _patch(state: dict[str, Any], args: Sequence[str]) -> str:
    positional, options = _options(args)
    (name,) = _named(positional, types=("node", "nodes"))
    node = _node(state, name)
    if options.get("--type") != "json" or options.get("--subresource") != "status":
        raise KubectlError("the stand-in patches only a node's status with a JSON patch")
    for op in json.loads(options["-p"]):
        parts = op["path"].strip("/").split("/")
        if parts[:2] != ["status", "conditions"]:
            raise KubectlError(f"the stand-in patches only status.conditions: {op['path']}")
        conditions = node["status"]["conditions"]
        index = int(parts[2])
        if index >= len(conditions):
            raise KubectlError("the server rejected our request: index out of range")
        if op["op"] == "test":
            if conditions[index].get(parts[3]) != op["value"]:
                raise KubectlError("the server rejected our request: test operation failed")
        elif op["op"] == "remove":
            del conditions[index]
        else:
            raise KubectlError(f"the stand-in does not apply {op['op']!r}")
    return f"node/{name} patched\n"


def _taint(state: dict[str, Any], args: Sequence[str]) -> str:
    positional, _ = _options(args)
    if not positional or positional[0] not in ("node", "nodes"):
        kind = positional[0] if positional else ""
        raise KubectlError(f'invalid resource type {kind}, only ["node" "nodes"] are supported')
    names = [p for p in positional[1:] if ":" not in p and "=" not in p and not p.endswith("-")]
    removals = [p.removesuffix("-") for p in positional[1:] if p.endswith("-")]
    if not names or not removals:
        raise KubectlError("the stand-in removes taints: taint nodes NAME KEY[:EFFECT]-")
    out = ""
    for name in names:
        node = _node(state, name)
        taints = node.setdefault("spec", {}).setdefault("taints", [])
        for removal in removals:
            key, _, effect = removal.partition(":")
            kept = [t for t in taints if not (t["key"] == key and effect in ("", t["effect"]))]
            if len(kept) == len(taints):
                raise KubectlError(f'taint "{removal}" not found')
            taints[:] = kept
        out += f"node/{name} untainted\n"
    return out


def main(args: Sequence[str]) -> int:
    path = Path(os.environ["FAKE_KUBECTL_STATE"])
    state = json.loads(path.read_text())
    commands = {"get": _get, "patch": _patch, "taint": _taint}
    try:
        if not args or args[0] not in commands:
            raise KubectlError(f"unknown command {args[0] if args else ''!r}")
        sys.stdout.write(commands[args[0]](state, args[1:]))
    except KubectlError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    path.write_text(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
