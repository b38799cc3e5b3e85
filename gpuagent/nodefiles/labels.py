"""Node labels in the manner of NVIDIA's GPU feature discovery, as a node-feature-discovery file.

:func:`node_labels` computes GFD's labels (``internal/lm`` in NVIDIA/k8s-device-plugin) from a
snapshot and the resource settings; :func:`sync_features` writes them atomically as ``key=value``
lines into NFD's ``features.d`` directory, which NFD's ``local`` source turns into node labels.

Inputs: the driver's versions (``cuda.driver*``, ``cuda.runtime*``), each GPU's name, memory,
compute capability, MIG support and MIG devices with their attributes, all read by the NVML
backend; the machine type, PCI classes and vGPUs the host reports
(:mod:`gpuagent.nodefiles.hostfacts`).

Differences from GFD, each deliberate: no ``gfd.timestamp`` (it would rewrite the file on every
pass, and NFD relabels on every change); values are sanitised and cut to 63 characters, so that
NFD accepts them (GFD writes ``gpu.machine`` unsanitised); on a node with several GPU models the
labels describe the most numerous model (GFD: whichever its map yields last); with per-GPU replica
counts ``gpu.replicas`` is the smallest; where a value cannot be read the label is left out or
``unknown`` instead of GFD failing as a whole (``gpu.mode`` without a readable PCI class; vGPU
labels without the full PCI configuration space); no ``gpu.clique`` / ``gpu.imex-domain``
(GB200 NVL fabric); ``mig.capable`` is guessed from the product names when no GPU's driver
answer is known (GFD reads it from NVML and fails without it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuagent.domain.devices import Gpu, MigDevice
from gpuagent.domain.naming import mig_resource_name
from gpuagent.domain.resources import MigStrategy, ResourceSettings
from gpuagent.domain.snapshot import Snapshot
from gpuagent.nodefiles.atomicfile import remove_if_present, write_if_changed
from gpuagent.nodefiles.hostfacts import HostFacts

__all__ = [
    "DEFAULT_FEATURES_FILE",
    "arch_family",
    "node_labels",
    "render_features",
    "sync_features",
]

DEFAULT_FEATURES_FILE = Path("/etc/kubernetes/node-feature-discovery/features.d/gpuagent")
GPU = "nvidia.com/gpu"  # GFD labels full GPUs under this name whatever the resource is called
MAX_VALUE = 63
DEFAULT_SETTINGS = ResourceSettings()
# Products with MIG mode, for when no GPU's driver answer is at hand (``Gpu.mig_capable``).
_MIG_PRODUCTS = re.compile(
    r"\b(A100|A800|A30|H100|H800|H200|H20|GH200|B100|B200|B300|GB200|GB300)\b"
)
_NOT_IN_VALUE = re.compile(r"[^A-Za-z0-9._ -]")
_COMPUTE_CAPABILITY = re.compile(r"(\d+)\.(\d+)")
_PROFILE = re.compile(r"(?:(\d+)c\.)?(\d+)g\.")
# PCI class codes: a VGA controller runs in graphics (display) mode, a 3D controller in compute.
GPU_MODES = {"0x030000": "graphics", "0x030200": "compute"}


def arch_family(major: int, minor: int) -> str:
    """GFD's ``gpu.family`` for a compute capability (``getArchFamily``)."""
    families = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper"}
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    if major in (10, 12):
        return "blackwell"
    return families.get(major, "undefined")


def node_labels(
    snapshot: Snapshot,
    settings: ResourceSettings = DEFAULT_SETTINGS,
    *,
    host: HostFacts | None = None,
) -> dict[str, str]:
    """The node's GFD labels; empty without GPUs.

    ``host`` gives ``gpu.machine``, ``gpu.mode`` and the vGPU labels (without it they are left
    out). Values are sanitised as GFD does (spaces become ``-``) and cut to 63 characters.
    """
    gpus = sorted(snapshot.gpus, key=lambda g: g.index)
    if not gpus:
        return {}
    labels: dict[str, str] = {}
    labels.update(_version_labels(snapshot.driver.version, snapshot.driver.cuda_version))
    if host is not None:
        labels.update(_host_labels(gpus, host))
    labels["nvidia.com/mig.capable"] = str(_mig_capable(gpus)).lower()
    mps = settings.mps.enabled
    # GFD: true with MPS sharing unless a GPU is in MIG mode (it then fails as a whole).
    labels["nvidia.com/mps.capable"] = str(mps and not any(g.mig_enabled for g in gpus)).lower()
    strategy = "mps" if mps else "time-slicing" if settings.time_slicing.enabled else "none"
    labels["nvidia.com/gpu.sharing-strategy"] = strategy
    labels.update(_gpu_labels(gpus, settings))
    if settings.mig_strategy is MigStrategy.SINGLE:
        labels["nvidia.com/mig.strategy"] = "single"
        labels.update(_single_labels(gpus, settings))
    elif settings.mig_strategy is MigStrategy.MIXED:
        labels["nvidia.com/mig.strategy"] = "mixed"
        labels.update(_mixed_labels(gpus, settings))
    return labels


def render_features(labels: Mapping[str, str]) -> bytes:
    """NFD's feature-file format: ``key=value`` lines, sorted."""
    return "".join(f"{key}={labels[key]}\n" for key in sorted(labels)).encode()


def sync_features(labels: Mapping[str, str], path: Path = DEFAULT_FEATURES_FILE) -> bool:
    """Write the feature file atomically if it changed; remove it when ``labels`` is empty.

    Returns whether the file changed. Raises :class:`OSError`.
    """
    if not labels:
        return remove_if_present(path)
    return write_if_changed(path, render_features(labels))


def _value(text: str) -> str:
    """A label value as GFD's ``sanitise`` makes it, at most 63 characters."""
    cleaned = "-".join(_NOT_IN_VALUE.sub("", text).split())[:MAX_VALUE]
    return cleaned.strip("-_.")


def _version_labels(driver: str, cuda: tuple[int, int] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    parts = driver.split(".")
    if 2 <= len(parts) <= 3 and all(p.isdigit() for p in parts):
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
        out |= {
            "nvidia.com/cuda.driver.major": major,
            "nvidia.com/cuda.driver.minor": minor,
            "nvidia.com/cuda.driver.rev": rev,
            "nvidia.com/cuda.driver-version.major": major,
            "nvidia.com/cuda.driver-version.minor": minor,
            "nvidia.com/cuda.driver-version.revision": rev,
            "nvidia.com/cuda.driver-version.full": driver,
        }
    if cuda is not None:
        major_c, minor_c = (str(v) for v in cuda)
        out |= {
            "nvidia.com/cuda.runtime.major": major_c,
            "nvidia.com/cuda.runtime.minor": minor_c,
            "nvidia.com/cuda.runtime-version.major": major_c,
            "nvidia.com/cuda.runtime-version.minor": minor_c,
            "nvidia.com/cuda.runtime-version.full": f"{major_c}.{minor_c}",
        }
    return out


def _host_labels(gpus: Sequence[Gpu], host: HostFacts) -> dict[str, str]:
    """``gpu.machine``, ``gpu.mode`` (the first GPU's PCI class, as GFD) and the vGPU labels."""
    labels = {
        "nvidia.com/gpu.machine": _value(host.machine),
        "nvidia.com/gpu.mode": GPU_MODES.get(
            host.pci_classes.get(gpus[0].pci_bus_id, ""), "unknown"
        ),
    }
    if host.vgpus is not None:  # GFD writes it whenever it could look: false without vGPUs
        labels["nvidia.com/vgpu.present"] = "true" if host.vgpus else "false"
    if host.vgpus:
        last = host.vgpus[-1]  # GFD keeps the last device's values
        if last.host_driver_version:
            labels["nvidia.com/vgpu.host-driver-version"] = _value(last.host_driver_version)
            labels["nvidia.com/vgpu.host-driver-branch"] = _value(last.host_driver_branch)
    return labels


def _mig_capable(gpus: Sequence[Gpu]) -> bool:
    """Whether any GPU supports MIG, as the driver answered (GFD: ``IsMigCapable`` of any GPU).

    Only when no GPU's answer is known is it guessed from MIG mode and the product names.
    """
    answers = [g.mig_capable for g in gpus if g.mig_capable is not None]
    if answers:
        return any(answers)
    return any(g.mig_enabled or g.mig_devices or _MIG_PRODUCTS.search(g.name) for g in gpus)


def _sharing(settings: ResourceSettings, name: str) -> tuple[int, bool]:
    """(replicas, renamed) for a resource, from the sharing rules naming it (MPS's or
    time-slicing's)."""
    sharing = settings.replication
    rules = [r for r in sharing.resources if r.name == name]
    if not rules:
        return 1, False
    renamed = sharing.rename_by_default or any(r.rename for r in rules)
    return min(r.replicas for r in rules), renamed


def _product(parts: Sequence[str], replicas: int, renamed: bool) -> str:
    words = [_value(p) for p in parts if p]
    if replicas > 1 and not renamed:
        words.append("SHARED")
    return _value("-".join(words))


def _gpu_labels(gpus: Sequence[Gpu], settings: ResourceSettings) -> dict[str, str]:
    counts = Counter(g.name for g in gpus)
    first_index = {g.name: g.index for g in reversed(gpus)}
    model = max(counts, key=lambda name: (counts[name], -first_index[name]))
    same = [g for g in gpus if g.name == model]
    first = same[0]
    if all(g.mig_enabled for g in same):
        replicas, renamed = 0, False  # GFD labels MIG-mode GPUs "without sharing"
    else:
        replicas, renamed = _sharing(settings, settings.resource_name)
    labels = {
        f"{GPU}.product": _product([model], replicas, renamed),
        f"{GPU}.count": str(len(same)),
        f"{GPU}.replicas": str(replicas),
    }
    if first.memory_mib:
        labels[f"{GPU}.memory"] = str(first.memory_mib)
    found = _COMPUTE_CAPABILITY.fullmatch(first.compute_capability)
    if found and int(found[1]) > 0:
        major, minor = int(found[1]), int(found[2])
        labels[f"{GPU}.family"] = arch_family(major, minor)
        labels[f"{GPU}.compute.major"] = str(major)
        labels[f"{GPU}.compute.minor"] = str(minor)
    return labels


def _mig_labels(
    key: str, gpu: Gpu, mig: MigDevice, *, count: int, settings: ResourceSettings, sharing_of: str
) -> dict[str, str]:
    replicas, renamed = _sharing(settings, sharing_of)
    labels = {
        # "+" is not valid in a label value: spelled "." as in the resource name.
        f"{key}.product": _product(
            [gpu.name, "MIG", mig.profile.replace("+", ".")], replicas, renamed
        ),
        f"{key}.count": str(count),
        f"{key}.replicas": str(replicas),
        f"{key}.memory": str(mig.memory_mib),
    }
    found = _PROFILE.match(mig.profile)
    if found:
        g_slices = found[2]
        labels[f"{key}.slices.gi"] = g_slices
        labels[f"{key}.slices.ci"] = found[1] or g_slices
    attributes = mig.attributes
    if attributes is not None:
        labels |= {
            f"{key}.multiprocessors": str(attributes.multiprocessors),
            f"{key}.engines.copy": str(attributes.copy_engines),
            f"{key}.engines.decoder": str(attributes.decoders),
            f"{key}.engines.encoder": str(attributes.encoders),
            f"{key}.engines.jpeg": str(attributes.jpeg_engines),
            f"{key}.engines.ofa": str(attributes.ofa_engines),
        }
    return labels


def _single_labels(gpus: Sequence[Gpu], settings: ResourceSettings) -> dict[str, str]:
    in_mig = [g for g in gpus if g.mig_enabled]
    if not in_mig:
        return {}  # like mig-strategy none
    migs = [(g, m) for g in in_mig for m in g.mig_devices]
    profiles = {m.profile for _, m in migs}
    if len(in_mig) != len(gpus) or any(not g.mig_devices for g in in_mig) or len(profiles) != 1:
        return {
            f"{GPU}.product": _value(f"{in_mig[0].name}-MIG-INVALID"),
            f"{GPU}.count": "0",
            f"{GPU}.replicas": "0",
            f"{GPU}.memory": "0",
        }
    gpu, mig = migs[0]
    return _mig_labels(
        GPU, gpu, mig, count=len(migs), settings=settings, sharing_of=settings.resource_name
    )


def _mixed_labels(gpus: Sequence[Gpu], settings: ResourceSettings) -> dict[str, str]:
    first: dict[str, tuple[Gpu, MigDevice]] = {}
    counts: Counter[str] = Counter()
    for gpu in gpus:
        if not gpu.mig_enabled:
            continue
        for mig in gpu.mig_devices:
            try:
                name = mig_resource_name(mig.profile, settings.domain)
            except ValueError:
                continue
            first.setdefault(name, (gpu, mig))
            counts[name] += 1
    labels: dict[str, str] = {}
    for name, (gpu, mig) in sorted(first.items()):
        labels.update(
            _mig_labels(name, gpu, mig, count=counts[name], settings=settings, sharing_of=name)
        )
    return labels
