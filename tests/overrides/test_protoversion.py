"""betterproto2's version read without importlib.metadata: the same version, the same compiler
check, and the generated protos imported with it, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import betterproto2
import pytest

from gpuagent.overrides import protoversion


def test_the_version_is_the_one_importlib_metadata_reads() -> None:
    assert protoversion.installed_version() == version("betterproto2")


@pytest.mark.parametrize("compiler", ["0.10.0", "0.10.1", "0.10.17", "0.9.3", "0.11.0", "1.10.0"])
def test_the_compiler_check_is_betterproto2s(compiler: str) -> None:
    ours = protoversion.compiler_check(betterproto2.__version__)
    try:
        betterproto2.check_compiler_version(compiler)
    except ImportError:
        with pytest.raises(ImportError, match=compiler):
            ours(compiler)
    else:
        ours(compiler)


_PROBE = """
import json, sys
from gpuagent.overrides import protoversion
protoversion.install()
from gpuagent._proto import v1beta1
import betterproto2
print(json.dumps([betterproto2.__version__, "importlib.metadata" in sys.modules]))
"""


def test_in_a_fresh_interpreter_the_protos_import_without_importlib_metadata() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=30
    )
    assert json.loads(out.stdout) == [version("betterproto2"), False]


def test_nothing_is_replaced_once_betterproto2_is_imported() -> None:
    before = sys.modules[protoversion.MODULE]
    protoversion.install()
    assert sys.modules[protoversion.MODULE] is before
