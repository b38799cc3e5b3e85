"""The GitHub workflows: CI on every push, and the release a version tag makes.

actionlint (a binary wheel in the test extra, with ShellCheck for the ``run:`` scripts) checks
them; the rules it does not know are checked here: every action pinned by commit, no permission
beyond what a job uses, and a release that refuses a tag other than the project's version.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from deploy.kustomize import ROOT, run, tool

WORKFLOWS = ROOT / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"
# What each release job may do: read the tree; push the image and attest it; push the Helm chart;
# publish the release and attest the Python artefacts. Nothing else, and nothing at the
# workflow's level.
RELEASE_PERMISSIONS = {
    "ci": {"contents": "read"},
    "dist": {"contents": "read"},
    "image": {
        "contents": "read",
        "packages": "write",
        "id-token": "write",
        "attestations": "write",
    },
    "chart": {"contents": "read", "packages": "write"},
    "release": {"contents": "write", "id-token": "write", "attestations": "write"},
}


def load(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    # YAML 1.1 reads the key "on" as true.
    loaded["on"] = loaded.pop(True, loaded.get("on"))
    return loaded


def test_workflows_pass_actionlint() -> None:
    workflows = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    assert {Path(p).name for p in workflows} == {"ci.yml", "release.yml"}
    result = run(tool("actionlint"), "-no-color", f"-shellcheck={tool('shellcheck')}", *workflows)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_finds_a_broken_workflow(tmp_path: Path) -> None:
    """The check above can fail: an unknown permission, an undefined job output and an unquoted
    variable in a script are each reported."""
    broken = tmp_path / "broken.yml"
    text = RELEASE.read_text(encoding="utf-8")
    text = text.replace("packages: write", "packagez: write", 1)
    text = text.replace("needs.dist.outputs.version", "needs.dist.outputs.versio", 1)
    text = text.replace('>> "$GITHUB_OUTPUT"', ">> $GITHUB_OUTPUT", 1)
    broken.write_text(text, encoding="utf-8")
    result = run(tool("actionlint"), "-no-color", f"-shellcheck={tool('shellcheck')}", str(broken))
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'unknown permission scope "packagez"' in result.stdout
    assert 'property "versio" is not defined' in result.stdout
    assert "SC2086" in result.stdout


def uses(workflow: dict[str, Any]) -> list[str]:
    found = []
    for job in workflow["jobs"].values():
        if "uses" in job:
            found.append(job["uses"])
        found += [step["uses"] for step in job.get("steps", []) if "uses" in step]
    return found


def test_every_action_is_pinned_by_commit() -> None:
    for path in WORKFLOWS.glob("*.yml"):
        text = path.read_text(encoding="utf-8")
        for ref in uses(load(path)):
            if ref.startswith("./"):
                assert (ROOT / ref).is_file(), ref
                continue
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", ref), f"{path.name}: {ref}"
            # The release the commit is, named beside it for the reader and for updates.
            assert re.search(rf"{re.escape(ref)}  # v\d+\.\d+\.\d+\n", text), ref


def test_the_release_grants_each_job_only_what_it_uses() -> None:
    release = load(RELEASE)
    assert release["on"] == {"push": {"tags": ["v*"]}}
    assert release["permissions"] == {}
    granted = {name: job.get("permissions") for name, job in release["jobs"].items()}
    assert granted == RELEASE_PERMISSIONS
    # The whole suite passes before anything is built; the image and the release follow.
    jobs = release["jobs"]
    assert jobs["ci"]["uses"] == "./.github/workflows/ci.yml"
    assert jobs["dist"]["needs"] == "ci"
    assert jobs["image"]["needs"] == "dist"
    ci = load(WORKFLOWS / "ci.yml")
    assert "workflow_call" in ci["on"]
    assert ci["permissions"] == {"contents": "read"}
    for workflow in (release, ci):
        for job in workflow["jobs"].values():
            for step in job.get("steps", []):
                if step.get("uses", "").startswith("actions/checkout@"):
                    assert step["with"]["persist-credentials"] is False


def test_the_release_publishes_what_the_docs_say(tmp_path: Path) -> None:
    """Both platforms, from the context scripts/build-image writes, built without network, with
    SBOM and provenance; the version check refuses a tag that is not pyproject's version."""
    jobs = load(RELEASE)["jobs"]
    steps = {
        step.get("id") or step.get("name") or step["uses"]: step for step in jobs["image"]["steps"]
    }
    build = steps["build"]["with"]
    assert build["platforms"] == "linux/amd64,linux/arm64"
    assert build["network"] == "none"
    assert build["file"] == "Containerfile"
    assert build["provenance"] == "mode=max"
    assert build["sbom"] is True
    assert f"--context-only {build['context']}" in steps["Build context"]["run"]
    assert "--platform linux/amd64,linux/arm64" in steps["Build context"]["run"]
    (check,) = [s for s in jobs["dist"]["steps"] if s.get("id") == "version"]
    script = tmp_path / "check.sh"
    script.write_text(check["run"], encoding="utf-8")
    output = tmp_path / "output"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "version"
    ]
    for tag, passes in ((f"v{version}", True), (f"{version}", False), ("v9.9.9", False)):
        env = ("env", "-i", f"TAG={tag}", f"GITHUB_OUTPUT={output}", "PATH=/usr/bin:/bin")
        result = run(*env, "bash", "-e", str(script))
        assert (result.returncode == 0) is passes, (tag, result.stdout + result.stderr)
        if not passes:
            assert f"::error::tag {tag} is not v{version}" in result.stdout
    assert f"version={version}\n" in output.read_text(encoding="utf-8")


def test_the_release_pushes_the_chart_beside_the_image() -> None:
    """The chart job packages deploy/helm/gpuagent with the released version and image (the
    script's own test: tests/helm/test_chart.py) and pushes it to <the image's owner>/charts,
    with the helm-python-sdk the tests use; the release notes name it."""
    jobs = load(RELEASE)["jobs"]
    chart = jobs["chart"]
    assert set(chart["needs"]) == {"dist", "image"}
    (step,) = [s for s in chart["steps"] if s.get("id") == "push"]
    assert step["env"]["VERSION"] == "${{ needs.dist.outputs.version }}"
    assert step["env"]["IMAGE"] == "${{ needs.image.outputs.image }}"
    script = step["run"]
    assert 'scripts/helm-chart package --version "$VERSION" --image "$IMAGE"' in script
    assert 'charts="oci://${IMAGE%/*}/charts"' in script
    assert "scripts/helm-chart push" in script
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (pin,) = [r for r in extra["project"]["optional-dependencies"]["test"]
              if r.startswith("helm-python-sdk")]  # fmt: skip
    assert f"pip install --disable-pip-version-check {pin}\n" in script
    assert "chart" in jobs["release"]["needs"]
    (publish,) = [s for s in jobs["release"]["steps"] if s.get("name") == "Publish the release"]
    assert "helm install gpuagent $CHART --version $VERSION" in publish["run"]
