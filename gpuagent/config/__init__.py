"""Command line, environment and config-file settings, resolved with flag > env > file > default.

The package by noun: :mod:`.option` (what an option is: flag, key, environment names, help),
:mod:`.groups` (the options, by the subsystem they configure), :mod:`.options` (all of them),
:mod:`.values` (parsers of one raw value), :mod:`.sharing` (NVIDIA's time-slicing block),
:mod:`.cli` (the argument parser), :mod:`.sources` (flags, environment, the config file),
:mod:`.errors`, :mod:`.settings` (the resolved type) and :mod:`.load` (putting them together);
:mod:`.planning` says what resolved settings mean for the agent (the plan the store keeps).
"""

from gpuagent.config.errors import ConfigError
from gpuagent.config.groups.nodefiles import CDI_SPEC_TOOLKIT
from gpuagent.config.load import load_settings
from gpuagent.config.options import FILE_KEYS, OPTIONS
from gpuagent.config.settings import Settings
from gpuagent.config.sharing import parse_sharing, sharing_block

__all__ = [
    "ConfigError",
    "Settings",
    "load_settings",
    "parse_sharing",
    "sharing_block",
    "OPTIONS",
    "FILE_KEYS",
    "CDI_SPEC_TOOLKIT",
]
