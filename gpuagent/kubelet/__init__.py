"""The kubelet adapter: DevicePlugin service, registration, restart watch, pod-resources client."""
