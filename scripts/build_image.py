#!/usr/bin/env python3
"""Build gpuagent's image (Containerfile) with podman, from wheels made on this machine.

    scripts/build-image TAG                 on the Containerfile's base (python:3.12-slim-bookworm)
    scripts/build-image --debian-base TAG   on a base made here from Debian's packages
    scripts/build-image --platform linux/amd64,linux/arm64 TAG      a manifest list
    scripts/build-image --context-only DIR  only the build context (the wheels), nothing built

The build container has no network: gpuagent's wheel is built here, every dependency's wheel for
the image's Python and platforms is downloaded here (pip, with this machine's pip configuration)
and the folder of wheels is the build context.

``--debian-base`` makes the base with mmdebstrap from Debian bookworm's packages: the essential
set and python3, without documentation, locales, perl, iconv modules or the stdlib's tests, and
imports it with ``podman import``. The base is kept under a tag that names its recipe
(``localhost/gpuagent-debian-base:bookworm-<arch>-<hash>``), so a second build skips mmdebstrap;
``--refresh-base`` makes it again (to take Debian's updates).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "Containerfile"
# What the gpuagent wheel is built from (the rest of the tree is not part of the package).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "gpuagent")
# linux/<arch> (OCI, podman) -> Debian architecture and the machine name in wheel tags.
ARCHES = {"amd64": ("amd64", "x86_64"), "arm64": ("arm64", "aarch64")}
# Bookworm's glibc: wheels tagged manylinux_2_5 to manylinux_2_36 run on it.
GLIBC_MINOR = 36
DEBIAN_SUITE = "bookworm"
DEBIAN_PYTHON = "3.11"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SECURITY = "http://deb.debian.org/debian-security"
BASE_REPOSITORY = "localhost/gpuagent-debian-base"
# Never installed (dpkg path filters): documentation but the copyright files, manuals, message
# catalogues, glibc's iconv modules (Python has its own codecs).
PATH_EXCLUDES = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/lib/*/gconv/*",
)
# After installing (python3.11's own set-up compiles every stdlib file it ships): perl, essential
# but used only by maintainer scripts, is purged; the stdlib's test packages and test extension
# modules, pydoc's topic texts, logs and dpkg's backup copies are removed.
CUSTOMIZE = (
    'chroot "$1" dpkg --purge --force-remove-essential --force-depends perl-base',
    'rm -rf "$1"/usr/lib/python3.*/test "$1"/usr/lib/python3.*/pydoc_data'
    ' "$1"/usr/lib/python3.*/lib-dynload/_test* "$1"/usr/lib/python3.*/lib-dynload/_xxtestfuzz*'
    ' "$1"/usr/lib/python3.*/lib-dynload/xxlimited*',
    'rm -rf "$1"/var/log/* "$1"/var/lib/dpkg/*-old "$1"/var/cache/debconf/*-old'
    ' "$1"/var/cache/ldconfig/aux-cache',
)


class BuildError(Exception):
    """A step failed; the message says which and why."""


@dataclass(frozen=True)
class Target:
    """One image platform: the OCI name, Debian's architecture, the wheel tags' machine."""

    platform: str
    debian_arch: str
    machine: str


def targets(spec: str | None) -> list[Target]:
    names = spec.split(",") if spec else [f"linux/{host_arch()}"]
    found: list[Target] = []
    for name in names:
        os_name, _, arch = name.strip().partition("/")
        if os_name != "linux" or arch not in ARCHES:
            known = ", ".join(f"linux/{a}" for a in ARCHES)
            raise BuildError(f"--platform {name}: not one of {known}")
        found.append(Target(f"linux/{arch}", *ARCHES[arch]))
    return found


def host_arch() -> str:
    machine = platform.machine()
    for arch, (_, wheel_machine) in ARCHES.items():
        if machine == wheel_machine:
            return arch
    raise BuildError(f"this machine ({machine}) is not one of {', '.join(ARCHES)}")


def default_base() -> str:
    """The Containerfile's ``ARG BASE=`` default."""
    text = CONTAINERFILE.read_text(encoding="utf-8")
    match = re.search(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
    if match is None:
        raise BuildError(f"{CONTAINERFILE}: no 'ARG BASE=' line")
    return match.group(1)


def python_of(base: str) -> str:
    """The Python version of a python:X.Y-... base image."""
    match = re.search(r"/python:(\d+\.\d+)", base)
    if match is None:
        raise BuildError(f"the Python version of base {base} is unknown (expected python:X.Y-…)")
    return match.group(1)


# ----- running things -----------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"build-image: {message}", file=sys.stderr, flush=True)


def run(
    cmd: Sequence[str], *, what: str, capture: bool = False, env: dict[str, str] | None = None
) -> str:
    """Run a command; its output goes to stderr unless captured. Fails with its last lines."""
    result = subprocess.run(
        list(cmd),
        stdout=subprocess.PIPE if capture else sys.stderr,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
        env={**os.environ, **env} if env else None,
    )
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-20:])
        raise BuildError(f"{what} failed (exit {result.returncode}): {' '.join(cmd)}\n{tail}")
    if result.stderr and not capture:
        sys.stderr.write(result.stderr)
    return result.stdout if capture else ""


def need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise BuildError(f"{tool} not found (Debian: apt-get install {package})")
    return path


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """One holder at a time on this machine (two builds must not both make the same base)."""
    path = Path(tempfile.gettempdir()) / f"gpuagent-build-image-{name}.lock"
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ----- the Debian base ----------------------------------------------------------------------------


def mmdebstrap_command(target: Target) -> list[str]:
    return [
        "mmdebstrap",
        "--variant=essential",
        "--include=python3",
        f"--architectures={target.debian_arch}",
        # Merged /usr without the usrmerge package (which needs perl).
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        *(f"--dpkgopt={option}" for option in PATH_EXCLUDES),
        *(f"--customize-hook={hook}" for hook in CUSTOMIZE),
        "--quiet",
        DEBIAN_SUITE,
        "-",  # the tarball on stdout
    ]


def base_tag(target: Target) -> str:
    """The base's tag: suite, architecture and a hash of the whole recipe."""
    recipe = json.dumps(mmdebstrap_command(target)).encode()
    digest = hashlib.sha256(recipe).hexdigest()[:12]
    return f"{BASE_REPOSITORY}:{DEBIAN_SUITE}-{target.debian_arch}-{digest}"


def image_exists(podman: str, ref: str) -> bool:
    result = subprocess.run(
        [podman, "image", "exists", ref], capture_output=True, check=False, text=True
    )
    return result.returncode == 0


def image_id(podman: str, ref: str) -> str | None:
    """The ID of the image ``ref`` names, or ``None`` when there is none."""
    result = subprocess.run(
        [podman, "image", "inspect", "--format", "{{.Id}}", ref],
        capture_output=True, check=False, text=True,
    )  # fmt: skip
    return (result.stdout.strip() or None) if result.returncode == 0 else None


def retire(podman: str, image: str) -> None:
    """Remove a base that a refreshed one replaced, unless something still uses it (an image
    built on it, another tag): then it stays, and the log says why."""
    result = subprocess.run([podman, "rmi", image], capture_output=True, check=False, text=True)
    if result.returncode == 0:
        log(f"removed the base it replaced ({image[:12]})")
        return
    why = (result.stderr.strip().splitlines() or ["podman rmi failed"])[-1]
    log(f"kept the base it replaced ({image[:12]}): {why}")


def debian_base(podman: str, target: Target, refresh: bool) -> str:
    tag = base_tag(target)
    with locked("debian-base"):
        previous = image_id(podman, tag)
        if previous is not None and not refresh:
            log(f"base {tag} (cached)")
            return tag
        need("mmdebstrap", "mmdebstrap")
        sources = [
            f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE} main",
            f"deb {DEBIAN_MIRROR} {DEBIAN_SUITE}-updates main",
            f"deb {DEBIAN_SECURITY} {DEBIAN_SUITE}-security main",
        ]
        log(f"making base {tag} with mmdebstrap ({DEBIAN_SUITE}, {target.debian_arch})")
        started = time.monotonic()
        changes = [
            f"LABEL org.opencontainers.image.description=Debian {DEBIAN_SUITE} essential set"
            " and python3, made by gpuagent's scripts/build-image",
            f"LABEL org.opencontainers.image.created={utc_now()}",
            'CMD ["python3"]',
        ]
        # Imported untagged, and tagged only once mmdebstrap has succeeded: a cut-off tarball
        # must never be taken for the cached base.
        with subprocess.Popen(
            [*mmdebstrap_command(target), *sources],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        ) as strap:
            assert strap.stdout is not None
            imported = subprocess.run(
                [podman, "import", "--quiet", "--arch", target.debian_arch,
                 *(f"--change={c}" for c in changes), "-"],
                stdin=strap.stdout, capture_output=True, text=True, check=False,
            )  # fmt: skip
            strap.stdout.close()
            made = strap.wait()
        image = imported.stdout.strip()
        if made != 0 or imported.returncode != 0:
            if imported.returncode == 0:
                run([podman, "rmi", image], what="removing the incomplete base")
                raise BuildError(f"mmdebstrap failed (exit {made}); its messages are above")
            raise BuildError(f"podman import failed: {imported.stderr.strip()}")
        run([podman, "tag", image, tag], what="tagging the base")
        log(f"base {tag} made in {time.monotonic() - started:.0f} s")
        if previous is not None and previous != image_id(podman, tag):
            retire(podman, previous)  # --refresh-base: the tag moved; the old one is untagged
        return tag


# ----- the build context: wheels ------------------------------------------------------------------


def pip(python: str, *args: str, what: str, env: dict[str, str] | None = None) -> None:
    run([python, "-m", "pip", *args, "--disable-pip-version-check", "--quiet"], what=what, env=env)


def make_context(python: str, context: Path, python_version: str, plats: list[Target]) -> str:
    """Write ``context/wheels``: gpuagent's wheel, every dependency's for each platform, pip's.
    Returns gpuagent's version (from its wheel's name)."""
    wheels = context / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpuagent-src-") as tmp:
        # A copy of the package's sources with their times, never a stale build/ of the tree.
        for name in SOURCES:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, Path(tmp) / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
            else:
                shutil.copy2(source, Path(tmp) / name)
        # The wheel's own files get the sources' newest time, not the build's: the same tree
        # makes the same wheel, byte for byte, so the image's layers stay cached.
        newest = max(f.stat().st_mtime for f in Path(tmp).rglob("*") if f.is_file())
        pip(python, "wheel", "--no-deps", "--wheel-dir", str(wheels), tmp,
            what="building gpuagent's wheel",
            env={"SOURCE_DATE_EPOCH": str(int(newest))})  # fmt: skip
    (wheel,) = wheels.glob("gpuagent-*.whl")
    version = wheel.name.split("-")[1]
    abi = "cp" + python_version.replace(".", "")
    tags = ["--python-version", python_version, "--implementation", "cp", "--abi", abi]
    for target in plats:
        log(f"wheels for Python {python_version} on {target.platform}")
        platforms = [arg for tag in manylinux_tags(target.machine) for arg in ("--platform", tag)]
        pip(python, "download", "--only-binary=:all:", "--dest", str(wheels), *tags, *platforms,
            str(wheel), "pip", what=f"downloading the wheels for {target.platform}")  # fmt: skip
    return version


def manylinux_tags(machine: str) -> list[str]:
    """Every manylinux platform tag a wheel for bookworm's glibc may carry, newest first (pip
    does not infer the older ones from a ``--platform manylinux_2_36_…``)."""
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(GLIBC_MINOR, 4, -1)]
    legacy = ["manylinux2014"] + (["manylinux2010", "manylinux1"] if machine == "x86_64" else [])
    return tags + [f"{name}_{machine}" for name in legacy]


# ----- the image ----------------------------------------------------------------------------------


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def revision() -> str:
    result = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def build_facts(base: str, version: str, revision: str, created: str) -> list[str]:
    """podman build's arguments for what this build is: the Containerfile's build arguments, and
    the labels that depend on them given again as ``--label``. Podman (4.3) reuses a cached
    ``LABEL`` layer whatever its build arguments now say, so a rebuild whose wheels did not change
    kept the version, revision and date of the build that made the cache; ``--label`` is applied
    to the image's configuration at every build."""
    facts = {"BASE": base, "VERSION": version, "REVISION": revision, "CREATED": created}
    labels = {
        "org.opencontainers.image.base.name": base,
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.created": created,
    }
    return [
        *(arg for name, value in facts.items() for arg in ("--build-arg", f"{name}={value}")),
        *(arg for name, value in labels.items() for arg in ("--label", f"{name}={value}")),
    ]


def image_size(podman: str, ref: str) -> int:
    return int(run([podman, "image", "inspect", "--format", "{{.Size}}", ref],
                   what="podman image inspect", capture=True).strip())  # fmt: skip


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def build(args: argparse.Namespace) -> None:
    plats = targets(args.platform)
    python = sys.executable  # its pip (scripts/build-image runs PYTHON, else .venv's, else python3)
    if args.context_only is not None:
        base = default_base()
        version = make_context(python, args.context_only, python_of(base), plats)
        log(f"build context for gpuagent {version} on {base} written to {args.context_only}")
        return
    podman = need("podman", "podman")
    started = time.monotonic()
    bases = (
        {t.platform: debian_base(podman, t, args.refresh_base) for t in plats}
        if args.debian_base
        else dict.fromkeys((t.platform for t in plats), default_base())
    )
    python_version = DEBIAN_PYTHON if args.debian_base else python_of(default_base())
    base_done = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuagent-image-") as context:
        version = make_context(python, Path(context), python_version, plats)
        manifest = len(plats) > 1
        if manifest and image_exists(podman, args.tag):
            run([podman, "manifest", "rm", args.tag], what="removing the old manifest list")
        for target in plats:
            log(f"building {args.tag} for {target.platform} on {bases[target.platform]}")
            run([
                podman, "build", "--network", "none", "--platform", target.platform,
                "--file", str(CONTAINERFILE),
                *build_facts(bases[target.platform], version, revision(), utc_now()),
                "--manifest" if manifest else "--tag", args.tag,
                context,
            ], what=f"podman build for {target.platform}")  # fmt: skip
    done = time.monotonic()
    if manifest:
        log(f"{args.tag}: a manifest list for {', '.join(t.platform for t in plats)}")
    else:
        size = image_size(podman, args.tag)
        base_size = image_size(podman, bases[plats[0].platform])
        log(
            f"{args.tag}: {megabytes(size)}; base {bases[plats[0].platform]} "
            f"{megabytes(base_size)}; the agent's layers add {megabytes(size - base_size)}"
        )
    log(f"base ready in {base_done - started:.0f} s, agent built in {done - base_done:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/build-image",
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        epilog="More in docs/install.md (The container image).",
    )
    parser.add_argument("tag", metavar="TAG", nargs="?", help="the image's name")
    parser.add_argument(
        "--debian-base",
        action="store_true",
        help="build on a base made from Debian's packages (mmdebstrap) instead of pulling one",
    )
    parser.add_argument(
        "--refresh-base",
        action="store_true",
        help="with --debian-base: make the base again even if one is cached",
    )
    parser.add_argument(
        "--platform",
        help="linux/amd64, linux/arm64 or both, comma-separated (default: this machine's)",
    )
    parser.add_argument(
        "--context-only",
        metavar="DIR",
        type=Path,
        help="only write the build context for the default base (DIR/wheels), build nothing",
    )
    args = parser.parse_args(argv)
    if (args.tag is None) == (args.context_only is None):
        parser.error("give either TAG or --context-only DIR")
    if args.context_only is not None and args.debian_base:
        parser.error("--context-only writes the context for the default base; drop --debian-base")
    try:
        build(args)
    except BuildError as error:
        log(str(error))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
