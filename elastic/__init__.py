"""Bungee's Django-free core: job specs, wire messages, workloads, the elastic worker and the
scheduling policies. Nothing here imports Django or the agent."""

__version__ = "0.1.0"
"""Bungee's version, as pyproject.toml gives it; a job's manifest records it."""
