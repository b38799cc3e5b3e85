"""The I/O-free core: devices, health policy, allocation policy and the plan.

Nothing in this package performs I/O, waits on an event loop, starts a thread or imports an
adapter (the store that holds these values is :mod:`gpuagent.state`); the edges (NVML, gRPC,
HTTP) translate their protocols into these types and back.
"""
