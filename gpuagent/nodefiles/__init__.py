"""The files the agent keeps current on the node for other programs.

* The CDI spec the container runtime reads (:mod:`~gpuagent.nodefiles.cdi`, kept by
  :mod:`~gpuagent.nodefiles.cdikeeper`): what it holds (:mod:`~gpuagent.nodefiles.cdicontent`),
  with the driver's files found under the driver root (:mod:`~gpuagent.nodefiles.cdidriver`,
  :mod:`~gpuagent.nodefiles.driverfiles`), a failed write tried again after a backoff
  (:mod:`~gpuagent.nodefiles.writeretry`).
* The node-feature-discovery feature file with GPU feature discovery's labels
  (:mod:`~gpuagent.nodefiles.labels`, kept by :mod:`~gpuagent.nodefiles.labelkeeper`), from the
  snapshot and what the host says about itself (:mod:`~gpuagent.nodefiles.hostfacts`).

Both are written from the devices as described (:mod:`~gpuagent.nodefiles.described`), atomically
and only when their content changes (:mod:`~gpuagent.nodefiles.atomicfile`); DRA's per-claim
specs (:mod:`gpuagent.dra.claims`) reuse the node's spec and the same atomic writes.
"""
