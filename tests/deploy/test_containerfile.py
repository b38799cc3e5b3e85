"""The image recipe: the Containerfile passes hadolint and has the expected shape, and the image
is named in one place that an overlay can point at one's own.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from deploy.kustomize import KUSTOMIZATIONS, MANIFESTS, ROOT, build, image_env, run, tool


def test_containerfile_lint() -> None:
    result = run(tool("hadolint"), "--no-color", "--failure-threshold", "style", "Containerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_containerfile_shape() -> None:
    text = (ROOT / "Containerfile").read_text(encoding="utf-8")
    stages = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert len(stages) >= 2, "multi-stage: build tools stay out of the final image"
    # Both stages on one base: the venv's python is a link to the base's interpreter.
    assert set(stages) == {"${BASE}"}
    (default,) = re.findall(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
    assert "slim" in default
    final = text.rsplit("\nFROM ", 1)[1]
    assert "--from=build" in final
    assert not re.search(r"^RUN ", final, re.MULTILINE), "the final stage only copies the venv"
    assert "--no-index" in text, "the build installs from the context's wheels, no index"
    assert 'ENTRYPOINT ["gpuagent"]' in final
    env = image_env()
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    user = re.findall(r"^USER (\S+)", final, re.MULTILINE)
    assert user, "the image names its user"
    assert user[-1].split(":")[0] not in ("0", "root")
    for label in ("title", "description", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{label}=" in final


def _images(docs: list[dict[str, Any]]) -> set[str]:
    """Every container image a build's pod templates name."""
    found = set()
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for key in ("containers", "initContainers", "ephemeralContainers"):
            found |= {c["image"] for c in pod.get(key, [])}
    return found


def test_the_image_is_named_in_one_place() -> None:
    """The base's ``images:`` entry names the image (its tag: the project's version); the
    DaemonSet holds only the placeholder it replaces, and no overlay names another."""
    kustomization = yaml.safe_load((KUSTOMIZATIONS["base"] / "kustomization.yaml").read_text())
    (entry,) = kustomization["images"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert entry["newTag"] == project["version"]
    reference = f"{entry['newName']}:{entry['newTag']}"
    sources = [p for p in MANIFESTS.rglob("*.yaml") if p.parent != MANIFESTS / "monitoring"]
    placeholders = [
        (path.name, line.split("image:", 1)[1].strip())
        for path in sources
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.match(r"\s*(- )?image:", line)
    ]
    assert placeholders == [("daemonset.yaml", entry["name"])]
    for name, folder in KUSTOMIZATIONS.items():
        assert _images(build(name)) == {reference}, name
        if name != "base":
            text = (folder / "kustomization.yaml").read_text(encoding="utf-8")
            assert "images" not in yaml.safe_load(text), f"{name} names its own image"


def test_an_overlay_points_the_kustomization_at_your_image(tmp_path: Path) -> None:
    """install.md's way to use your own registry: an ``images:`` entry on top of an overlay,
    naming the image by the reference the base gives it."""
    kubectl = tool("kubectl")
    (entry,) = yaml.safe_load((KUSTOMIZATIONS["base"] / "kustomization.yaml").read_text())["images"]
    mine = tmp_path / "my-cluster"
    mine.mkdir()
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZATIONS["prometheus-operator"], mine)],
        "images": [
            {
                "name": entry["newName"],
                "newName": "registry.example.com/gpuagent",
                "newTag": "1.2.3",
            }
        ],
    }
    (mine / "kustomization.yaml").write_text(yaml.safe_dump(overlay), encoding="utf-8")
    result = run(kubectl, "kustomize", str(mine))
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]
    assert _images(docs) == {"registry.example.com/gpuagent:1.2.3"}
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    assert f"- name: {entry['newName']}\n" in install, "install.md's example names that reference"
