"""Package the Helm chart with the version of the image it deploys, or push a package.

``package``: a copy of ``deploy/helm/gpuagent`` whose ``version`` and ``appVersion`` are the
given version (the image tag the chart deploys by default) and whose ``image.repository`` is the
given image, linted (strict) and packaged as ``DIR/gpuagent-VERSION.tgz``.

``push``: the archive to an OCI registry (``oci://ghcr.io/OWNER/charts``), logged in with
``REGISTRY_USER`` and ``REGISTRY_PASSWORD`` from the environment (never from the command line).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "gpuagent"


def helm() -> Any:
    try:
        import helm_python  # noqa: PLC0415
    except ImportError:
        raise SystemExit("helm-chart: needs helm-python-sdk (the test extra)") from None
    return helm_python


def _replace_line(text: str, pattern: str, line: str, what: str) -> str:
    """``text`` with the one line matching ``pattern`` replaced (comments elsewhere kept)."""
    new, count = re.subn(pattern, line, text, count=1, flags=re.MULTILINE)
    if count != 1:
        raise SystemExit(f"helm-chart: {what} not found")
    return new


def package(version: str, image: str, destination: Path) -> Path:
    """The chart for ``image:version``, packaged into ``destination``."""
    if not re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", version):
        raise SystemExit(f"helm-chart: {version!r} is not a semantic version")
    h = helm()
    destination.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "gpuagent"
        shutil.copytree(CHART, chart)
        meta = chart / "Chart.yaml"
        text = meta.read_text(encoding="utf-8")
        text = _replace_line(text, r"^version: .*$", f"version: {version}", "Chart.yaml version")
        text = _replace_line(
            text, r"^appVersion: .*$", f'appVersion: "{version}"', "Chart.yaml appVersion"
        )
        meta.write_text(text, encoding="utf-8")
        values = chart / "values.yaml"
        text = _replace_line(
            values.read_text(encoding="utf-8"),
            r"^  repository: .*$",
            f"  repository: {image}",
            "values.yaml image.repository",
        )
        values.write_text(text, encoding="utf-8")
        report = h.lint(chart, strict=True, namespace="kube-system")
        if report["errors"]:
            raise SystemExit("helm-chart: lint: " + "; ".join(report["errors"]))
        return Path(h.package(chart, destination=destination))


def push(archive: Path, remote: str) -> str:
    """Push ``archive`` to ``remote``; returns what the registry answered, as JSON."""
    if not remote.startswith("oci://"):
        raise SystemExit(f"helm-chart: {remote!r} is not an oci:// reference")
    user, password = os.environ.get("REGISTRY_USER"), os.environ.get("REGISTRY_PASSWORD")
    if not user or not password:
        raise SystemExit("helm-chart: REGISTRY_USER and REGISTRY_PASSWORD must be set")
    h = helm()
    with h.RegistryClient() as client:
        client.login(remote.removeprefix("oci://").split("/", 1)[0], user, password)
        result = client.push(archive, remote)
    return json.dumps(result, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pack = commands.add_parser("package", help="package the chart")
    pack.add_argument("--version", required=True, help="chart version and image tag")
    pack.add_argument("--image", required=True, help="image repository, without the tag")
    pack.add_argument("destination", type=Path)
    upload = commands.add_parser("push", help="push a packaged chart")
    upload.add_argument("archive", type=Path)
    upload.add_argument("remote", help="oci://REGISTRY/PATH")
    args = parser.parse_args(argv)
    if args.command == "package":
        print(package(args.version, args.image, args.destination))
    else:
        print(push(args.archive, args.remote))
    return 0


if __name__ == "__main__":
    sys.exit(main())
