"""The agent's shared state: the versioned store of snapshot and plan, and the counters.

Every adapter reads from and publishes into it; readers wait on the event loop for newer
versions, and the counters take increments from worker threads. The values it holds are the
domain's (:mod:`gpuagent.domain`), which itself has no loop and no threads.
"""
