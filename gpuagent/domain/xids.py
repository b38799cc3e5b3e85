"""NVIDIA's XID catalog: every XID code, its message text and the catalog's immediate action.

One table, shared by the health policy (which XIDs make a GPU unhealthy) and the metrics (the
``err_msg`` label and which XIDs are known). Facts, from two public sources:

- the message **texts** are dcgm-exporter's XID table (``err_msg`` on ``DCGM_FI_DEV_XID_ERRORS``),
  so dashboards and alerts keyed on them keep matching;
- the **immediate action** is the "Resolution Bucket (Immediate Action)" column of NVIDIA's XID
  catalog for Ampere and newer GPUs (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html).
  XIDs 162-172 have no bucket in the catalog (:attr:`Action.NONE`).

The health policy built on it is in :mod:`gpuagent.domain.health` and docs/health.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Action(Enum):
    """The catalog's immediate action ("resolution bucket") after an XID."""

    IGNORE = "IGNORE"  # no action required
    RESTART_APP = "RESTART_APP"  # restart the application; no GPU reset or reboot needed
    RESTART_VM = "RESTART_VM"  # restart the VM that owns the GPU
    RESET_GPU = "RESET_GPU"  # reset the GPU (a reboot if that does not help)
    RESTART_BM = "RESTART_BM"  # restart the bare-metal node
    CONTACT_SUPPORT = "CONTACT_SUPPORT"  # unused on current GPUs, or needs investigation
    CHECK_MECHANICALS = "CHECK_MECHANICALS"  # check seating and power connections
    CHECK_UVM = "CHECK_UVM"  # reset the GPU if UVM/vGPU is used, else ignore
    UPDATE_SWFW = "UPDATE_SWFW"  # update driver and firmware (vGPU start errors)
    WORKFLOW_XID_45 = "WORKFLOW_XID_45"  # follow the other XID; solo: restart Fabric Manager
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"  # solo: reset the GPU; with 63/64: drain and reset
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"  # decode the NVLink error registers
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"  # decode per the catalog's 144-150 table
    XID_154 = "XID_154"  # informational: the recovery action it names is the action
    NONE = "NONE"  # the catalog names no bucket (XIDs 162-172)


# Kept for callers written against the earlier name.
Resolution = Action


@dataclass(frozen=True, slots=True)
class Xid:
    """One catalog entry: the XID, dcgm-exporter's text for it and the catalog's action."""

    code: int
    text: str
    action: Action

    @property
    def resolution(self) -> Action:
        """The same as :attr:`action` (the earlier name)."""
        return self.action


#: The lowest and highest value accepted as an XID. NVIDIA numbers XIDs from 1 up (the catalog
#: ends at 172); an event value outside this range (0, or 64-bit junk) is not evidence of anything.
MIN_XID = 1
MAX_XID = 999
UNKNOWN_TEXT = "Unknown XID"
NO_ERROR_TEXT = "No Error"

_A = Action
CATALOG: dict[int, Xid] = {
    x.code: x
    for x in (
        Xid(1, "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
        Xid(2, "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
        Xid(3, "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
        Xid(4, "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
        Xid(5, "Unused", _A.CONTACT_SUPPORT),
        Xid(6, "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
        Xid(7, "Invalid or corrupted push buffer address", _A.CONTACT_SUPPORT),
        Xid(8, "GPU stopped processing", _A.RESTART_APP),
        Xid(9, "Driver error programming GPU", _A.CONTACT_SUPPORT),
        Xid(10, "Unused", _A.CONTACT_SUPPORT),
        Xid(11, "Invalid or corrupted push buffer stream", _A.RESTART_APP),
        Xid(12, "Driver error handling GPU exception", _A.CONTACT_SUPPORT),
        Xid(13, "Graphics Engine Exception", _A.RESTART_APP),
        Xid(14, "Unused", _A.IGNORE),
        Xid(15, "Unused", _A.CONTACT_SUPPORT),
        Xid(16, "Display engine hung", _A.CONTACT_SUPPORT),
        Xid(17, "Unused", _A.CONTACT_SUPPORT),
        Xid(18, "Bus mastering disabled in PCI Config Space", _A.CONTACT_SUPPORT),
        Xid(19, "Display Engine error", _A.CONTACT_SUPPORT),
        Xid(20, "Invalid or corrupted Mpeg push buffer", _A.CONTACT_SUPPORT),
        Xid(21, "Invalid or corrupted Motion Estimation push buffer", _A.CONTACT_SUPPORT),
        Xid(22, "Invalid or corrupted Video Processor push buffer", _A.CONTACT_SUPPORT),
        Xid(23, "Unused", _A.CONTACT_SUPPORT),
        Xid(24, "GPU semaphore timeout", _A.CONTACT_SUPPORT),
        Xid(25, "Invalid or illegal push buffer stream", _A.RESTART_APP),
        Xid(26, "Framebuffer timeout", _A.CONTACT_SUPPORT),
        Xid(27, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(28, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(29, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(30, "GPU semaphore access error", _A.CONTACT_SUPPORT),
        Xid(31, "GPU memory page fault", _A.RESTART_APP),
        Xid(32, "Invalid or corrupted push buffer stream", _A.RESTART_APP),
        Xid(33, "Internal micro-controller error", _A.CONTACT_SUPPORT),
        Xid(34, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(35, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(36, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(37, "Driver firmware error", _A.IGNORE),
        Xid(38, "Driver firmware error", _A.IGNORE),
        Xid(39, "Unused", _A.RESTART_APP),
        Xid(40, "Unused", _A.RESTART_APP),
        Xid(41, "Unused", _A.RESTART_APP),
        Xid(42, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(43, "GPU stopped processing", _A.IGNORE),
        Xid(44, "Graphics Engine fault during context switch", _A.IGNORE),
        Xid(
            45,
            "Preemptive cleanup, due to previous errors -- "
            "Most likely to see when running multiple cuda",
            _A.WORKFLOW_XID_45,
        ),
        Xid(46, "GPU stopped processing", _A.RESET_GPU),
        Xid(47, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(48, "Double Bit ECC Error", _A.WORKFLOW_XID_48),
        Xid(49, "Unused", _A.CONTACT_SUPPORT),
        Xid(50, "Unused", _A.CONTACT_SUPPORT),
        Xid(51, "Unused", _A.CONTACT_SUPPORT),
        Xid(52, "Unused", _A.CONTACT_SUPPORT),
        Xid(53, "Unused", _A.CONTACT_SUPPORT),
        Xid(54, "Auxiliary power is not connected to the GPU board", _A.CHECK_MECHANICALS),
        Xid(55, "Unused", _A.CONTACT_SUPPORT),
        Xid(56, "Display Engine error", _A.CONTACT_SUPPORT),
        Xid(57, "Error programming video memory interface", _A.CONTACT_SUPPORT),
        Xid(58, "Unstable video memory interface detected", _A.CONTACT_SUPPORT),
        Xid(59, "Internal micro-controller error", _A.CONTACT_SUPPORT),
        Xid(60, "Video processor exception", _A.RESTART_APP),
        Xid(61, "Internal micro-controller breakpoint/warning", _A.CONTACT_SUPPORT),
        Xid(62, "Internal micro-controller halt", _A.RESET_GPU),
        Xid(63, "ECC page retirement or row remapping recording event", _A.IGNORE),
        Xid(64, "ECC page retirement or row remapper recording failure", _A.RESET_GPU),
        Xid(65, "Video processor exception", _A.CONTACT_SUPPORT),
        Xid(66, "Illegal access by driver", _A.IGNORE),
        Xid(67, "Illegal access by driver", _A.IGNORE),
        Xid(68, "NVDEC0 Exception", _A.RESTART_APP),
        Xid(69, "Graphics Engine class error", _A.RESTART_APP),
        Xid(70, "CE3: Unknown Error", _A.RESTART_APP),
        Xid(71, "CE4: Unknown Error", _A.RESTART_APP),
        Xid(72, "CE5: Unknown Error", _A.RESTART_APP),
        Xid(73, "NVENC2 Error", _A.CONTACT_SUPPORT),
        Xid(74, "NVLINK Error", _A.WORKFLOW_NVLINK_ERR),
        Xid(75, "CE6: Unknown Error", _A.RESTART_APP),
        Xid(76, "CE7: Unknown Error", _A.RESTART_APP),
        Xid(77, "CE8: Unknown Error", _A.RESTART_APP),
        Xid(78, "vGPU Start Error", _A.UPDATE_SWFW),
        Xid(79, "GPU has fallen off the bus", _A.RESTART_BM),
        Xid(80, "Corrupted data sent to GPU", _A.RESTART_APP),
        Xid(81, "VGA Subsystem Error", _A.CONTACT_SUPPORT),
        Xid(82, "NVJPG0 Error", _A.RESTART_APP),
        Xid(83, "NVDEC1 Error", _A.RESTART_APP),
        Xid(84, "NVDEC2 Error", _A.RESTART_APP),
        Xid(85, "CE9: Unknown Error", _A.RESTART_APP),
        Xid(86, "OFA Exception", _A.RESTART_APP),
        Xid(87, "Reserved", _A.CONTACT_SUPPORT),
        Xid(88, "NVDEC3 Error", _A.RESTART_APP),
        Xid(89, "NVDEC4 Error", _A.RESTART_APP),
        Xid(90, "Reserved", _A.CONTACT_SUPPORT),
        Xid(91, "Reserved", _A.CONTACT_SUPPORT),
        Xid(92, "High single-bit ECC error rate", _A.IGNORE),
        Xid(93, "Non-fatal violation of provisioned InfoROM wear limit", _A.IGNORE),
        Xid(94, "Contained ECC error", _A.RESTART_APP),
        Xid(95, "Uncontained ECC error", _A.RESET_GPU),
        Xid(96, "NVDEC5 Error", _A.RESTART_APP),
        Xid(97, "NVDEC6 Error", _A.RESTART_APP),
        Xid(98, "NVDEC7 Error", _A.RESTART_APP),
        Xid(99, "NVJPG1 Error", _A.RESTART_APP),
        Xid(100, "NVJPG2 Error", _A.RESTART_APP),
        Xid(101, "NVJPG3 Error", _A.RESTART_APP),
        Xid(102, "NVJPG4 Error", _A.RESTART_APP),
        Xid(103, "NVJPG5 Error", _A.RESTART_APP),
        Xid(104, "NVJPG6 Error", _A.RESTART_APP),
        Xid(105, "NVJPG7 Error", _A.RESTART_APP),
        Xid(106, "SMBPBI Test Message", _A.IGNORE),
        Xid(107, "SMBPBI Test Message Silent", _A.IGNORE),
        Xid(108, "Reserved", _A.IGNORE),
        Xid(109, "Context Switch Timeout Error", _A.RESET_GPU),
        Xid(110, "Security Fault Error", _A.RESET_GPU),
        Xid(111, "Display Bundle Error Event", _A.CONTACT_SUPPORT),
        Xid(112, "Display Supervisor Error", _A.CONTACT_SUPPORT),
        Xid(113, "DP Link Training Error", _A.CONTACT_SUPPORT),
        Xid(114, "Display Pipeline Underflow Error", _A.CONTACT_SUPPORT),
        Xid(115, "Display Core Channel Error", _A.CONTACT_SUPPORT),
        Xid(116, "Display Window Channel Error", _A.CONTACT_SUPPORT),
        Xid(117, "Display Cursor Channel Error", _A.CONTACT_SUPPORT),
        Xid(118, "Display Pixel Pipeline Error", _A.CONTACT_SUPPORT),
        Xid(119, "GSP RPC Timeout", _A.RESET_GPU),
        Xid(120, "GSP Error", _A.RESET_GPU),
        Xid(121, "C2C Link Error", _A.IGNORE),
        Xid(122, "SPI PMU RPC Read Failure", _A.CONTACT_SUPPORT),
        Xid(123, "SPI PMU RPC Write Failure", _A.CONTACT_SUPPORT),
        Xid(124, "SPI PMU RPC Erase Failure", _A.CONTACT_SUPPORT),
        Xid(125, "Inforom FS Failure", _A.CONTACT_SUPPORT),
        Xid(126, "Robust Channel CE10 Error", _A.RESTART_APP),
        Xid(127, "Robust Channel CE11 Error", _A.RESTART_APP),
        Xid(128, "Robust Channel CE12 Error", _A.RESTART_APP),
        Xid(129, "Robust Channel CE13 Error", _A.RESTART_APP),
        Xid(130, "Robust Channel CE14 Error", _A.RESTART_APP),
        Xid(131, "Robust Channel CE15 Error", _A.RESTART_APP),
        Xid(132, "Robust Channel CE16 Error", _A.RESTART_APP),
        Xid(133, "Robust Channel CE17 Error", _A.RESTART_APP),
        Xid(134, "Robust Channel CE18 Error", _A.RESTART_APP),
        Xid(135, "Robust Channel CE19 Error", _A.RESTART_APP),
        Xid(136, "ALI Training Fail", _A.RESET_GPU),
        Xid(137, "NVLink Privilege Error", _A.IGNORE),
        Xid(138, "Robust Channel DLA Error", _A.CONTACT_SUPPORT),
        Xid(139, "Robust Channel OFA1 Error", _A.RESTART_APP),
        Xid(140, "Unrecovered ECC Error", _A.RESET_GPU),
        Xid(141, "Robust Channel Fast Path Error", _A.IGNORE),
        Xid(142, "Robust Channel NVENVC3 Error", _A.CONTACT_SUPPORT),
        Xid(143, "GPU Initialization Failure", _A.RESET_GPU),
        Xid(144, "NVLINK: Saw Error", _A.WORKFLOW_NVLINK5_ERR),
        Xid(145, "NVLINK: RLW Error", _A.WORKFLOW_NVLINK5_ERR),
        Xid(146, "NVLINK: TLW Error", _A.WORKFLOW_NVLINK5_ERR),
        Xid(147, "NVLINK: TREX Error", _A.WORKFLOW_NVLINK5_ERR),
        Xid(148, "NVLINK: NVLPW_CTRL Error", _A.WORKFLOW_NVLINK5_ERR),
        Xid(149, "NVLINK: NETIR Error", _A.WORKFLOW_NVLINK5_ERR),
        Xid(150, "NVLINK: MSE Error", _A.WORKFLOW_NVLINK5_ERR),
        Xid(151, "Robust Channel Key rotation Error", _A.RESTART_VM),
        Xid(152, "Robust Channel DLA SMMU Error", _A.IGNORE),
        Xid(153, "Robust Channel DLA timeout Error", _A.IGNORE),
        Xid(154, "GPU Recovery Action Changed", _A.XID_154),
        Xid(155, "NVLINK: SW Defined Error", _A.RESET_GPU),
        Xid(156, "Resource Retirement Event", _A.RESET_GPU),
        Xid(157, "Resource Retirement Failure", _A.IGNORE),
        Xid(158, "GPU Fatal Timeout", _A.RESET_GPU),
        Xid(159, "Robust Channel CHI Non-Data Error", _A.CHECK_UVM),
        Xid(160, "Channel Retirement Event", _A.IGNORE),
        Xid(161, "Channel Retirement Failure", _A.IGNORE),
        Xid(162, "Power Smoothing HW Circuitry Reengaged", _A.NONE),
        Xid(163, "Power Smoothing HW Circuitry Disengaged", _A.NONE),
        Xid(164, "Power Smoothing HW Circuitry Low Lifetime", _A.NONE),
        Xid(165, "Power Smoothing HW Circuitry Lifetime Exhausted", _A.NONE),
        Xid(166, "NVLINK Secure Crypto Error", _A.NONE),
        Xid(167, "PCIE Fatal Timeout", _A.NONE),
        Xid(168, "Reduced GPU Memory Capacity (Errors found in write protection region)", _A.NONE),
        Xid(169, "Internal micro-controller halt", _A.NONE),
        Xid(170, "NVLINK: Interrupt seen in CC mode", _A.NONE),
        Xid(171, "Uncorrectable DRAM Error", _A.NONE),
        Xid(172, "Uncorrectable SRAM Error", _A.NONE),
    )
}

_NO_ERROR = Xid(0, NO_ERROR_TEXT, Action.NONE)


def lookup(code: int) -> Xid:
    """The catalog entry for ``code``.

    An XID the catalog does not list gets :data:`UNKNOWN_TEXT` and :attr:`Action.CONTACT_SUPPORT`;
    ``0`` (no XID yet, as ``DCGM_FI_DEV_XID_ERRORS`` reports it) gets :data:`NO_ERROR_TEXT`.
    """
    if code == 0:
        return _NO_ERROR
    return CATALOG.get(code, Xid(code, UNKNOWN_TEXT, Action.CONTACT_SUPPORT))


def is_known(code: int) -> bool:
    """Whether ``code`` is an XID of the catalog (so it has its own text)."""
    return code in CATALOG


def is_valid(code: int) -> bool:
    """Whether ``code`` can be an XID at all (``MIN_XID`` to ``MAX_XID``)."""
    return MIN_XID <= code <= MAX_XID
