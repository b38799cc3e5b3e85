"""The container-runtime adapter: which container a GPU process runs in, and that container's names.

* :mod:`~gpuagent.runtime.procfs` reads ``<proc-root>/<pid>/cgroup`` (the domain parses it);
* :mod:`~gpuagent.runtime.loglinks` names a container ID's pod and container from the kubelet's
  container log links (``/var/log/containers``: their names only);
* :mod:`~gpuagent.runtime.cri` asks the container runtime's CRI API (``runtime.v1``) for the names
  of the IDs the links do not name (optional: no socket, no calls);
* :mod:`~gpuagent.runtime.accountant` joins them to the driver's per-process readings and keeps
  the snapshot's per-container usage current.
"""
