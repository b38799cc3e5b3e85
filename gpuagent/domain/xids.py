"""What an XID means and what it asks of the operator, per NVIDIA's XID catalog.

Each entry carries the catalog's immediate-action bucket. Only XIDs whose bucket is an action on
the application (``RESTART_APP``) or nothing at all (``IGNORE``) leave the GPU allocatable; every
other bucket, and any XID not listed, makes it unhealthy until the driver reports it recovered.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Resolution(Enum):
    """The catalog's immediate action."""

    IGNORE = "IGNORE"
    RESTART_APP = "RESTART_APP"
    RESET_GPU = "RESET_GPU"
    RESTART_BM = "RESTART_BM"  # reboot the node
    CONTACT_SUPPORT = "CONTACT_SUPPORT"

    @property
    def gpu_usable(self) -> bool:
        """Whether new work may still be scheduled on the GPU."""
        return self in (Resolution.IGNORE, Resolution.RESTART_APP)


@dataclass(frozen=True, slots=True)
class Xid:
    code: int
    text: str
    resolution: Resolution


_R = Resolution
CATALOG: dict[int, Xid] = {
    x.code: x
    for x in (
        Xid(8, "GPU stopped processing", _R.RESTART_APP),
        Xid(13, "Graphics Engine Exception", _R.RESTART_APP),
        Xid(31, "GPU memory page fault", _R.RESTART_APP),
        Xid(32, "Invalid or corrupted push buffer stream", _R.RESTART_APP),
        Xid(38, "Driver firmware error", _R.RESET_GPU),
        Xid(43, "GPU stopped processing", _R.RESTART_APP),
        Xid(45, "Preemptive cleanup, due to previous errors", _R.IGNORE),
        Xid(48, "Double Bit ECC Error", _R.RESET_GPU),
        Xid(61, "Internal micro-controller breakpoint/warning", _R.RESET_GPU),
        Xid(62, "Internal micro-controller halt", _R.RESET_GPU),
        Xid(63, "ECC page retirement or row remapping recording event", _R.RESET_GPU),
        Xid(64, "ECC page retirement or row remapper recording failure", _R.RESET_GPU),
        Xid(68, "NVDEC0 Exception", _R.RESTART_APP),
        Xid(69, "Graphics Engine class error", _R.RESTART_APP),
        Xid(74, "NVLINK Error", _R.RESET_GPU),
        Xid(79, "GPU has fallen off the bus", _R.RESTART_BM),
        Xid(92, "High single-bit ECC error rate", _R.CONTACT_SUPPORT),
        Xid(94, "Contained ECC error", _R.RESTART_APP),
        Xid(95, "Uncontained ECC error", _R.RESET_GPU),
        Xid(109, "Context Switch Timeout Error", _R.RESET_GPU),
        Xid(119, "GSP RPC Timeout", _R.RESET_GPU),
        Xid(120, "GSP Error", _R.RESET_GPU),
        Xid(121, "C2C Link corrected error", _R.IGNORE),
        Xid(140, "Unrecovered ECC Error", _R.RESET_GPU),
        Xid(154, "GPU Recovery Action Changed", _R.IGNORE),
    )
}

UNKNOWN_TEXT = "Unknown XID"


def lookup(code: int) -> Xid:
    """The catalog entry for ``code``; an unlisted XID is treated as needing support."""
    return CATALOG.get(code, Xid(code, UNKNOWN_TEXT, Resolution.CONTACT_SUPPORT))


# Application errors by the catalog, plus NVIDIA's device plugin's own ignore list (which also
# ignores 109, a RESET_GPU XID in the catalog; we keep that default for compatibility — enable it
# with DP_ENABLE_HEALTHCHECKS=109).
NVIDIA_PLUGIN_IGNORED: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
APPLICATION_XIDS: frozenset[int] = NVIDIA_PLUGIN_IGNORED | frozenset(
    x.code for x in CATALOG.values() if x.resolution.gpu_usable
)
