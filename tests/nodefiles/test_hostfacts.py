"""What the host reports for node labels: machine type, PCI classes, vGPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuagent.nodefiles.hostfacts import Vgpu, read_host_facts, vgpu_from_config

BUS = "00000000:05:00.0"


def config_space(*, capabilities: list[tuple[int, bytes]] | None = None) -> bytes:
    """256 bytes of PCI configuration space with a capability list at 0x40, 0x60, …"""
    config = bytearray(256)
    config[0:2] = b"\xde\x10"
    if capabilities:
        config[0x06] = 0x10  # status: capability list present
        config[0x34] = 0x40
        for n, (ident, body) in enumerate(capabilities):
            at = 0x40 + 0x20 * n
            following = at + 0x20 if n + 1 < len(capabilities) else 0
            config[at : at + 3] = bytes([ident, following, 3 + len(body)])
            config[at + 3 : at + 3 + len(body)] = body
    return bytes(config)


def vgpu_capability(records: bytes) -> bytes:
    """The vendor-specific capability body after id/next/length: 'VF' then records."""
    return b"VF" + records


DRIVER_RECORD = b"\x00\x16" + b"460.16".ljust(10, b"\0") + b"r460_00".ljust(10, b"\0")


def test_a_vgpu_and_its_host_driver() -> None:
    config = config_space(capabilities=[(0x05, b"\0" * 4), (0x09, vgpu_capability(DRIVER_RECORD))])
    assert vgpu_from_config(BUS, config) == Vgpu(BUS, "460.16", "r460_00")


def test_records_before_the_driver_record_are_skipped() -> None:
    records = b"\x07\x04\xaa\xbb" + DRIVER_RECORD
    config = config_space(capabilities=[(0x09, vgpu_capability(records))])
    assert vgpu_from_config(BUS, config) == Vgpu(BUS, "460.16", "r460_00")


@pytest.mark.parametrize(
    "config",
    [config_space(),  # no capability list
     config_space(capabilities=[(0x05, b"\0" * 4)]),  # no vendor-specific capability
     config_space(capabilities=[(0x09, b"XY" + DRIVER_RECORD)])],  # not the vGPU signature
    ids=["no-list", "no-vendor-capability", "other-signature"],
)  # fmt: skip
def test_not_a_vgpu(config: bytes) -> None:
    assert vgpu_from_config(BUS, config) is None


def test_a_looping_capability_list_ends() -> None:
    config = bytearray(config_space(capabilities=[(0x05, b"\0")]))
    config[0x41] = 0x40  # points at itself
    assert vgpu_from_config(BUS, bytes(config)) is None


def test_a_zero_length_record_ends_the_walk() -> None:
    config = config_space(capabilities=[(0x09, vgpu_capability(b"\x07\x00"))])
    assert vgpu_from_config(BUS, config) == Vgpu(BUS, "", "")


def test_an_unprivileged_read_cannot_tell() -> None:
    with pytest.raises(ValueError, match="64 bytes"):
        vgpu_from_config(BUS, config_space()[:64])


def sysfs(root: Path, config: bytes, *, vendor: str = "0x10de") -> Path:
    device = root / "bus/pci/devices/0000:05:00.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text("0x030000\n")
    (device / "config").write_bytes(config)
    return root


def test_read_host_facts(tmp_path: Path) -> None:
    product = tmp_path / "product_name"
    product.write_text("  DGX H100  \n")
    vgpu = config_space(capabilities=[(0x09, vgpu_capability(DRIVER_RECORD))])
    facts = read_host_facts(
        [BUS, "00000000:99:00.0"], machine_type_file=product, sysfs_root=sysfs(tmp_path, vgpu)
    )
    assert facts.machine == "DGX H100"
    assert dict(facts.pci_classes) == {BUS: "0x030000"}
    assert facts.vgpus == (Vgpu("0000:05:00.0", "460.16", "r460_00"),)


def test_read_host_facts_when_things_are_missing(tmp_path: Path) -> None:
    facts = read_host_facts([BUS], machine_type_file=tmp_path / "none", sysfs_root=tmp_path)
    # No list of PCI devices: vGPUs cannot be told (GFD's labeler gives up too).
    assert (facts.machine, dict(facts.pci_classes), facts.vgpus) == ("unknown", {}, None)
    short = read_host_facts(
        [BUS], machine_type_file=tmp_path / "none", sysfs_root=sysfs(tmp_path, b"\0" * 64)
    )
    assert short.vgpus is None  # cannot tell without the whole configuration space
    other = read_host_facts(
        [BUS], sysfs_root=sysfs(tmp_path / "other", b"\0" * 64, vendor="0x8086")
    )
    assert other.vgpus == ()  # not NVIDIA's: not looked at
