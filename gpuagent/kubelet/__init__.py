"""The kubelet adapter: DevicePlugin service, registration, restart watch; the only gRPC code."""
