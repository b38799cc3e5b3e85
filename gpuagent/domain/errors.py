"""The errors every layer shares: a setting at fault, and resources that cannot be advertised."""

from __future__ import annotations

__all__ = ["ResourceError", "SettingError"]


class SettingError(ValueError):
    """An invalid setting. ``key`` names it where the user wrote it (a flag, an environment
    variable, a config-file key, a key inside a file the settings point at); ``str()`` is
    ``"<key>: <reason>"``.

    The base of every keyed error (the config, web-config and sim-config errors), so the entry
    point reports each the same way and exits 2.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class ResourceError(Exception):
    """The node's devices cannot be advertised under the settings (e.g. ``single`` with two
    MIG profiles); the message says which GPUs disagree."""
