"""Unix sockets, as both gRPC sides (the device plugin, the DRA plugin) serve and watch them.

:mod:`~gpuagent.sockets.grpcserver` serves a grpclib server on a socket path, from bind to close
(one lifecycle for both sides); :mod:`~gpuagent.sockets.dirwatch` wakes a side when entries of
its socket directories change (inotify, or a poll where the kernel offers none), so that a
restarting kubelet, or a socket removed by someone else, is seen when it happens.
"""
