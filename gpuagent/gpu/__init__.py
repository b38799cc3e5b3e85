"""The GPU adapter: the NVML backend (the only pynvml importer) and the simulated driver."""
