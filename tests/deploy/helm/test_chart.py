"""The chart as Helm sees it: it lints; values.schema.json refuses a wrong type, a value outside
an enum and an unknown key at install, naming the key; its version is the project's; the release
packages it with the image's version and repository (scripts/helm-chart).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.helm.rendering import (
    CHART,
    agent_container,
    check_config,
    data,
    helm,
    named,
    render,
    render_error,
)
from deploy.kustomize import ROOT

PROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
    "version"
]


def chart_yaml() -> dict[str, Any]:
    loaded = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def test_the_chart_lints_strict() -> None:
    report = helm().lint(CHART, strict=True, namespace="kube-system", kube_version="v1.29.0")
    assert report["errors"] == [], report
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [], problems


def test_lint_sees_a_broken_value() -> None:
    report = helm().lint(CHART, {"migStrategy": "sometimes"}, strict=True, namespace="kube-system")
    assert any("/migStrategy" in error for error in report["errors"]), report


def test_the_chart_and_its_image_are_the_projects_version() -> None:
    meta = chart_yaml()
    assert meta["version"] == meta["appVersion"] == PROJECT_VERSION
    ctr = agent_container(named(render(), "DaemonSet", "gpuagent"))
    assert ctr["image"] == f"ghcr.io/gpuagent/gpuagent:{PROJECT_VERSION}"
    kustomization = yaml.safe_load((ROOT / "manifests/base/kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    assert ctr["image"] == f"{image['newName']}:{image['newTag']}"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"migStrategy": "sometimes"}, "at '/migStrategy': value must be one of"),
        ({"failOnInitError": "yes"}, "at '/failOnInitError': got string, want null or boolean"),
        ({"deviceListStrategy": "envvar,cdi"}, "at '/deviceListStrategy'"),
        ({"deviceIDStrategy": "serial"}, "at '/deviceIDStrategy': value must be one of"),
        ({"gfd": {"enabled": "true"}}, "at '/gfd/enabled': got string, want boolean"),
        ({"service": {"port": "9400"}}, "at '/service/port': got string, want integer"),
        ({"service": {"address": "0.0.0.0"}}, "at '/service/address'"),
        ({"dra": {"mig": "sometimes"}}, "at '/dra/mig': value must be one of"),
        ({"dra": {"sharing": "time-slicing"}}, "at '/dra/sharing': value must be one of"),
        ({"mps": {"computeMode": "default"}}, "at '/mps/computeMode': value must be one of"),
        ({"mps": {"root": "run/nvidia/mps"}}, "at '/mps/root'"),
        ({"mps": {"enableHostPID": "true"}}, "at '/mps/enableHostPID': got string, want boolean"),
        ({"accounting": {"enable": True}}, "additional properties 'enable' not allowed"),
        ({"arguments": ["-f", "counters.csv"]}, "additional properties 'arguments' not allowed"),
        ({"config": {"map": {"a": 1}}}, "at '/config/map/a': got number, want string"),
        ({"config": {"fallbackStrategies": ["first"]}}, "at '/config/fallbackStrategies/0'"),
    ],
)
def test_the_schema_refuses_a_wrong_value_naming_its_key(values: Any, message: str) -> None:
    error = render_error(values)
    assert "values don't meet the specifications of the schema" in error
    assert message in error, error


def test_dra_shares_need_dra_gpus_and_take_mixed_mig() -> None:
    """dra.sharing=mps without DRA GPUs, or with MIG made on demand, is refused at install, naming
    both values (the agent would refuse it at start); with mig-strategy mixed it renders, as the
    agent takes it (DRA shares whole GPUs only, unlike the device plugin's MPS replicas)."""
    error = render_error({"dra": {"sharing": "mps"}})
    assert "dra.sharing=mps" in error, error
    assert "set dra.gpus" in error, error
    error = render_error({"dra": {"gpus": "all", "sharing": "mps", "mig": "dynamic"}})
    assert "dra.sharing=mps with dra.mig=dynamic" in error, error
    docs = render({"dra": {"gpus": "all", "sharing": "mps"}, "migStrategy": "mixed"})
    assert named(docs, "DaemonSet", "gpuagent")


def test_every_key_of_values_yaml_is_in_the_schema() -> None:
    """values.yaml and values.schema.json describe the same keys (the schema's only extra key
    is Helm's ``global``)."""
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))

    def walk(values: Any, schema: Any, path: str) -> None:
        if not isinstance(values, dict) or "properties" not in schema:
            return
        unknown = set(values) - set(schema["properties"])
        assert not unknown, (path, unknown)
        for key, value in values.items():
            walk(value, schema["properties"][key], f"{path}.{key}")

    walk(values, schema, "")
    assert set(schema["properties"]) - set(values) == {"global"}
    helm().Chart.load(CHART).validate_schema(values)


# ----- the release's package ----------------------------------------------------------------------


def test_the_release_packages_the_chart_with_the_images_version_and_repository(
    tmp_path: Path,
) -> None:
    helm()
    script = ROOT / "scripts" / "helm-chart"
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        [str(script), "package", "--version", "9.8.7", "--image", "ghcr.io/owner/repo",
         str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    archive = Path(result.stdout.strip())
    assert archive == tmp_path / "gpuagent-9.8.7.tgz"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        meta = yaml.safe_load(tar.extractfile("gpuagent/Chart.yaml").read())  # type: ignore[union-attr]
    assert (meta["version"], meta["appVersion"]) == ("9.8.7", "9.8.7")
    assert {"gpuagent/values.schema.json", "gpuagent/files/alerts.yaml"} <= names
    with helm().Chart.load(archive) as chart:
        rendered = chart.render(name="gpuagent", namespace="kube-system")
    docs = [
        d
        for path, text in rendered.items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]
    assert agent_container(named(docs, "DaemonSet", "gpuagent"))["image"] == (
        "ghcr.io/owner/repo:9.8.7"
    )
    # The checkout's chart is left as it was.
    assert chart_yaml()["version"] == PROJECT_VERSION


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["package", "--version", "v1.0", "--image", "x", "out"], "is not a semantic version"),
        (["push", "chart.tgz", "ghcr.io/owner"], "is not an oci:// reference"),
        (["push", "chart.tgz", "oci://ghcr.io/owner"], "REGISTRY_USER and REGISTRY_PASSWORD"),
    ],
)
def test_the_release_script_refuses_what_it_cannot_publish(
    args: list[str], message: str, tmp_path: Path
) -> None:
    helm()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    result = subprocess.run(
        [str(ROOT / "scripts" / "helm-chart"), *args],
        capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


# ----- the docs -----------------------------------------------------------------------------------

DOCS = ROOT / "docs"


def _helm_section() -> str:
    text = (DOCS / "migration.md").read_text(encoding="utf-8")
    start = text.index("## With Helm")
    return text[start : text.index("\n## ", start + 1)]


def test_the_migration_table_names_every_key_of_nvidias_chart() -> None:
    """Each key of NVIDIA's chart (tests/deploy/helm/data/nvidia-chart-defaults.yaml, and image) is
    in the key-by-key table, said to be taken, ignored or refused: none is dropped unsaid."""
    section = _helm_section()
    defaults = data("nvidia-chart-defaults.yaml")
    keys = {"image.*"}
    whole = ("affinity", "nfd", "updateStrategy")  # named as a whole
    for key, value in defaults.items():
        nested = isinstance(value, dict) and value and key not in whole
        keys |= {f"{key}.{sub}" for sub in value} if nested else {key}
    keys = {"nfd.*" if k == "nfd" else k for k in keys}
    missing = sorted(k for k in keys if f"`{k}`" not in section)
    assert not missing, f"docs/migration.md (With Helm) does not name {missing}"


def test_the_values_examples_in_the_docs_render_and_the_agent_takes_them(tmp_path: Path) -> None:
    """Every ``yaml`` block of the docs that starts with ``# values.yaml``."""
    blocks = [
        block
        for doc in sorted(DOCS.glob("*.md"))
        for block in re.findall(r"```yaml\n(# values\.yaml.*?)```", doc.read_text(), re.DOTALL)
    ]
    assert blocks, "install.md shows a values file"
    for n, block in enumerate(blocks):
        docs = render(yaml.safe_load(block))
        for ds in (d for d in docs if d["kind"] == "DaemonSet"):
            name = ds["metadata"]["name"]
            check_config(docs, tmp_path / f"{n}-{name}", daemonset=name)
