"""Errors of settings: one that names the key at fault; a bare reason while a value is parsed."""

from __future__ import annotations

from gpuagent.domain.errors import SettingError

__all__ = ["ConfigError", "Invalid"]


class ConfigError(SettingError):
    """An invalid setting; ``key`` names the flag, environment variable or config key at fault."""


class Invalid(Exception):
    """A raw value failed validation; the message is the reason."""
