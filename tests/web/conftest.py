"""Fixtures the web tests share: two throw-away PKIs (a CA each, with a server and a client
certificate it signed), made once per module."""

from __future__ import annotations

import pytest
from support.tls import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A second PKI: its CA signed none of :func:`pki`'s certificates."""
    return make_pki(tmp_path_factory.mktemp("other"))
