"""The HTTP adapter: /metrics, probes and (in simulation) fault injection; the only aiohttp code."""
