"""The node's files besides the CDI spec: node-feature-discovery's feature file, the node's
labels (:mod:`gpuagent.nodefiles.labelkeeper`), unless ``--node-labels=false``. Simulated GPUs do
not reach the host's real node-feature-discovery directory by default, and a simulated node's
machine type is its host's (under the simulated /sys) unless ``--machine-type-file`` names
another."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuagent.app.part import Context, Part, Task

if TYPE_CHECKING:  # imported off the loop before the part starts
    from gpuagent.nodefiles.labelkeeper import LabelTarget, NodeFiles

__all__ = ["NodeFilesPart", "build"]


class NodeFilesPart(Part):
    name = "node-files"
    imports = ("gpuagent.nodefiles.labelkeeper",)

    def __init__(self, context: Context) -> None:
        self._context = context
        self.files: NodeFiles | None = None

    async def start(self) -> None:
        from gpuagent.nodefiles.labelkeeper import NodeFiles  # noqa: PLC0415

        self.files = NodeFiles(self._context.store, labels=self._labels())

    def tasks(self) -> Mapping[str, Task]:
        assert self.files is not None
        return {"node-files": self.files.run} if self.files.wanted else {}

    def _labels(self) -> LabelTarget | None:
        from gpuagent.nodefiles.hostfacts import DEFAULT_MACHINE_TYPE_FILE  # noqa: PLC0415
        from gpuagent.nodefiles.labelkeeper import LabelTarget  # noqa: PLC0415
        from gpuagent.nodefiles.labels import DEFAULT_FEATURES_FILE  # noqa: PLC0415

        settings, sysfs_root = self._context.settings, self._context.sysfs_root
        simulated = self._context.simulator is not None
        if not settings.node_labels or (
            simulated and settings.node_labels_file == DEFAULT_FEATURES_FILE
        ):
            return None
        machine = settings.machine_type_file
        if simulated and machine == DEFAULT_MACHINE_TYPE_FILE:
            machine = sysfs_root / DEFAULT_MACHINE_TYPE_FILE.relative_to("/sys")
        return LabelTarget(
            path=settings.node_labels_file, machine_type_file=machine, sysfs_root=sysfs_root
        )


def build(context: Context) -> NodeFilesPart:
    return NodeFilesPart(context)
