"""The container-runtime adapter: which container a GPU process runs in, and that container's names.

* :mod:`~gpuagent.runtime.procfs` reads ``<proc-root>/<pid>/cgroup`` (the domain parses it);
* :mod:`~gpuagent.runtime.cri` asks the container runtime's CRI API (``runtime.v1``) for the pod
  and container names behind a container ID;
* :mod:`~gpuagent.runtime.accountant` joins both to the driver's per-process readings and keeps
  the snapshot's per-container usage current.
"""
