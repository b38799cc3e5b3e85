"""Every option, by the subsystem it configures, one module each: :mod:`.kubelet` (the device
plugin), :mod:`.mps` (MPS sharing's daemons), :mod:`.driver`, :mod:`.metrics` (the HTTP
server), :mod:`.nodefiles` (the CDI spec, the node labels), :mod:`.dra`, :mod:`.apiserver`
(credentials, the node's health), :mod:`.accounting` (per-container GPU use) and :mod:`.agent`
(the config file, logging, the switches).

A setting is its option here, in the group that owns it (its subsystem's module; a new subsystem
gets a new module here and a place in the groups' import-linter contract), with its parser and
default, and its field in :class:`~gpuagent.config.settings.Settings`, at its place in ``--help``
(``example: float = setting(driver.EXAMPLE)``); docs/architecture.md has the recipe, and a test
fails if an option of a group has no field. The groups import only :mod:`gpuagent.config.option`,
:mod:`gpuagent.config.values` and the domain, never each other."""
