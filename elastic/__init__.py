"""Bungee's Django-free core: job specs, wire messages, workloads, the elastic worker and the
scheduling policies. Nothing here imports Django or the agent."""
