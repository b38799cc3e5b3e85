"""Settings loaded as the agent loads them, from a command line, an environment and a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuagent.config import ConfigError, Settings, load_settings


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "gpuagent.yaml"
    path.write_text(body, encoding="utf-8")
    return path


def load(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Settings:
    return load_settings(argv or [], env or {})


def config_error(argv: list[str] | None = None, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(argv, env)
    return info.value
