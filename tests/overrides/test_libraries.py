"""The library overrides still fit their libraries: the versions they were written against are
the ones pyproject.toml requires and the ones installed, and every private name they use is
still there, taking the same arguments."""

from __future__ import annotations

import importlib
import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from gpuagent import overrides

PYPROJECT = Path(__file__).parents[2] / "pyproject.toml"


def _required() -> dict[str, SpecifierSet]:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    requirements = [Requirement(d) for d in dependencies]
    return {r.name: r.specifier for r in requirements}


@pytest.mark.parametrize("distribution", sorted(overrides.PINS))
def test_the_overrides_were_written_for_the_required_and_installed_version(
    distribution: str,
) -> None:
    written_for = SpecifierSet(overrides.PINS[distribution])
    assert _required()[distribution] == written_for, (
        f"pyproject.toml requires another {distribution} than gpuagent/overrides/ was written "
        "against: check each of its uses of the library, then update PINS and the docstring"
    )
    assert written_for.contains(version(distribution), prereleases=True)


@pytest.mark.parametrize(
    ("module", "attribute", "parameters"),
    overrides.PRIVATE,
    ids=[f"{m}.{a}" for m, a, _ in overrides.PRIVATE],
)
def test_each_private_name_is_still_there(
    module: str, attribute: str, parameters: tuple[str, ...] | None
) -> None:
    owner: object = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    annotations = inspect.get_annotations(owner) if isinstance(owner, type) else {}
    assert hasattr(owner, name) or name in annotations, f"{module}.{attribute} is gone"
    if parameters is not None:
        signature = inspect.signature(getattr(owner, name))
        assert tuple(signature.parameters) == parameters


def test_the_docstring_names_every_private_name_and_version() -> None:
    doc = overrides.__doc__ or ""
    for _, attribute, _ in overrides.PRIVATE:
        assert attribute.rsplit(".", 1)[-1] in doc, attribute
    for distribution, specifier in overrides.PINS.items():
        assert f"{distribution}{specifier}" in doc.replace("[grpclib]", ""), distribution
