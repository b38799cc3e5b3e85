"""Every option, by the subsystem it configures, one module each: :mod:`.kubelet` (the device
plugin), :mod:`.driver`, :mod:`.metrics` (the HTTP server), :mod:`.nodefiles` (the CDI spec, the
node labels), :mod:`.dra`, :mod:`.apiserver` (credentials, the node's health), :mod:`.accounting`
(per-container GPU use) and :mod:`.agent` (the config file, logging, the switches).

To add an option, add it to the group that owns it (its subsystem's module; a new subsystem gets a
new module here and a place in the groups' import-linter contract), then list it in
:data:`gpuagent.config.options.OPTIONS` at its place in ``--help``; a test fails if an option of a
group is missing there. The groups import only :mod:`gpuagent.config.option`,
:mod:`gpuagent.config.values` and the domain, never each other."""
