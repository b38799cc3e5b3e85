"""Resource and socket naming."""

from __future__ import annotations


def socket_name(resource_name: str) -> str:
    """The plugin socket's file name for a resource, as NVIDIA's plugin names it.

    ``nvidia.com/gpu`` → ``nvidia-gpu.sock``; other vendors' domains are spelled out so two agents
    serving different resources never collide.
    """
    domain, _, name = resource_name.partition("/")
    prefix = "nvidia" if domain == "nvidia.com" else domain.replace(".", "_")
    return f"{prefix}-{name}.sock"
