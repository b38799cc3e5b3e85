"""The DRA side: the kubelet plugin (registration with the plugin watcher, the DRA and health
services), prepared claims on disk, and the side assembled with the ResourceSlice publisher
(:mod:`~gpuagent.dra.side`)."""
