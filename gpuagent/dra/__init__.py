"""The DRA kubelet plugin: registration with the plugin watcher, the DRA and health services."""
