"""The agent's parts, a module each: how the part is built from the agent's context, what it
imports off the loop, what it starts, its root tasks and how it closes
(:class:`~gpuagent.app.part.Part`). The agent lists them in their order
(:data:`gpuagent.app.agent.PARTS`)."""
