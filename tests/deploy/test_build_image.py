"""scripts/build-image's Debian base, with stand-ins for podman and mmdebstrap on PATH: a cached
base is reused, and ``--refresh-base`` replaces it and removes the one it replaced unless
something still uses it."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_image.py"

# A podman that keeps its images in a JSON file: {"images": {id: [tags]}, "children": [ids],
# "calls": [argv]}. An image listed in "children" has an image built on it (rmi refuses).
FAKE_PODMAN = r"""#!{python}
import json, sys
state_path = {state!r}
with open(state_path) as f:
    state = json.load(f)
args = sys.argv[1:]
state["calls"].append(args)
images = state["images"]
def find(ref):
    if ref in images:
        return ref
    return next((i for i, tags in images.items() if ref in tags), None)
code = 0
if args[:2] == ["image", "inspect"]:
    found = find(args[-1])
    if found is None:
        code = 125
    else:
        print(found)
elif args[:2] == ["image", "exists"]:
    code = 0 if find(args[-1]) else 1
elif args[0] == "import":
    sys.stdin.buffer.read()
    new = "%064x" % (len(images) + 1)
    images[new] = []
    print(new)
elif args[0] == "tag":
    for tags in images.values():
        if args[2] in tags:
            tags.remove(args[2])
    images[args[1]].append(args[2])
elif args[0] == "rmi":
    found = find(args[1])
    if found in state["children"]:
        print("Error: image used by 1234abcd: image is in use by a container", file=sys.stderr)
        code = 2
    else:
        del images[found]
with open(state_path, "w") as f:
    json.dump(state, f)
sys.exit(code)
"""


@pytest.fixture
def build_image() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("build_image_under_test", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """podman and mmdebstrap stand-ins first on PATH; returns podman's state file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "podman.json"
    state.write_text(json.dumps({"images": {}, "children": [], "calls": []}))
    podman = bin_dir / "podman"
    podman.write_text(FAKE_PODMAN.replace("{python}", sys.executable).replace(
        "{state!r}", repr(str(state))))  # fmt: skip
    mmdebstrap = bin_dir / "mmdebstrap"
    mmdebstrap.write_text("#!/bin/sh\nprintf 'a tarball'\n")
    for tool in (podman, mmdebstrap):
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the build lock's folder
    return state


def images(state: Path) -> dict[str, list[str]]:
    return dict(json.loads(state.read_text())["images"])


def test_a_refreshed_base_removes_the_one_it_replaced(build_image: ModuleType, tools: Path) -> None:
    target = build_image.targets("linux/amd64")[0]
    podman = str(tools.parent / "bin" / "podman")
    tag = build_image.debian_base(podman, target, refresh=False)
    (first,) = images(tools)
    assert images(tools) == {first: [tag]}
    assert build_image.debian_base(podman, target, refresh=False) == tag  # cached
    assert len(images(tools)) == 1
    build_image.debian_base(podman, target, refresh=True)
    (second,) = images(tools)  # the replaced base is gone, not left untagged
    assert second != first
    assert images(tools) == {second: [tag]}


def test_a_replaced_base_still_in_use_stays(
    build_image: ModuleType, tools: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    target = build_image.targets("linux/amd64")[0]
    podman = str(tools.parent / "bin" / "podman")
    tag = build_image.debian_base(podman, target, refresh=False)
    (first,) = images(tools)
    state = json.loads(tools.read_text())
    state["children"] = [first]  # an agent image was built on it
    tools.write_text(json.dumps(state))
    build_image.debian_base(podman, target, refresh=True)
    assert set(images(tools)) == {first, next(i for i in images(tools) if i != first)}
    assert images(tools)[first] == []
    assert f"kept the base it replaced ({first[:12]}): Error: image used by" in (
        capfd.readouterr().err
    )
    assert tag in next(tags for tags in images(tools).values() if tags)


def test_the_labels_that_change_with_each_build_are_given_as_labels(
    build_image: ModuleType,
) -> None:
    """Podman reuses a cached LABEL layer whatever its build arguments say (a rebuild with the
    same wheels kept the revision of the build before it), so the labels that change per build
    are passed as --label too, each with its build argument's value, and every build argument
    the Containerfile declares after its last FROM is given."""
    facts = build_image.build_facts("base:1", "1.2.3", "abc123", "2026-12-04T00:00:00Z")
    labels = dict(facts[i + 1].split("=", 1) for i, a in enumerate(facts) if a == "--label")
    assert labels == {
        "org.opencontainers.image.base.name": "base:1",
        "org.opencontainers.image.version": "1.2.3",
        "org.opencontainers.image.revision": "abc123",
        "org.opencontainers.image.created": "2026-12-04T00:00:00Z",
    }
    given = {facts[i + 1].split("=", 1)[0] for i, a in enumerate(facts) if a == "--build-arg"}
    containerfile = build_image.CONTAINERFILE.read_text(encoding="utf-8")
    declared = set(re.findall(r"^ARG (\w+)", containerfile.rsplit("\nFROM ", 1)[1], re.M))
    assert declared == given
    for name in labels:
        assert f'{name}="${{{value_arg(name)}}}"' in containerfile, name


def value_arg(label: str) -> str:
    """The build argument the Containerfile's LABEL gives ``label`` from."""
    return {"base.name": "BASE", "version": "VERSION", "revision": "REVISION",
            "created": "CREATED"}[label.removeprefix("org.opencontainers.image.")]  # fmt: skip
