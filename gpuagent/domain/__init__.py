"""The I/O-free core: devices, health policy, allocation policy and the device-state store.

Nothing in this package performs I/O or imports an adapter; the edges (NVML, gRPC, HTTP) translate
their protocols into these types and back.
"""
