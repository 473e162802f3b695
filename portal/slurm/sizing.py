"""How big Bungee's Slurm pool should be: a pure function from what the jobs want, what the
cluster has and the pool's agent jobs to how many agent jobs to submit and which to cancel. No
Django, no Slurm: portal.slurm.pool reads both and acts on the decision.

Demand, kept simple: the jobs want the sum, over active jobs, of their pin if pinned, else their
maximum (which is at least their minimum); the cluster has its usable devices (present, their
node online, their owner away), those of running pool agents among them. What is wanted beyond
them is unmet, and met by agents of `devices_per_agent` each:

1. An agent job that Slurm runs but whose agent has not registered within `start_timeout_s` is
   cancelled (something is wrong with it: its output says what).
2. Agents on their way (pending in Slurm, or started and not yet registered) count as met
   demand; pending ones beyond the unmet demand are cancelled, newest first, so that the pool
   never has more pending agent jobs than its demand.
3. An agent whose node has held no job for `idle_s` is cancelled if the cluster keeps what the
   jobs want without its devices; the longest idle first.
4. What is still unmet is submitted, up to `max_agents` agent jobs in all, those leaving not
   counted: an agent that drains (preempted, at its time limit) gives its devices back to Slurm,
   and the one that replaces it is pending by the time they are free.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class Phase(enum.StrEnum):
    """Where an agent job is. PENDING -> STARTING (Slurm runs it, its agent has not registered)
    -> ONLINE (its node is known to the portal); any of them -> LEAVING (Slurm is ending it, or
    its node drains) -> gone; STARTING -> gone (cancelled: it never registered); PENDING -> PENDING (requeued)."""

    PENDING = "pending"
    STARTING = "starting"
    ONLINE = "online"
    LEAVING = "leaving"


@dataclass(frozen=True)
class AgentJob:
    slurm_job_id: int
    phase: Phase
    idle_for_s: float = 0.0
    """ONLINE: since its node last held a job (or since it started); STARTING: since it started."""
    usable_devices: int = 0
    """ONLINE: its node's usable devices (counted among the cluster's)."""


@dataclass(frozen=True)
class PoolLimits:
    devices_per_agent: int
    max_agents: int
    idle_s: float
    start_timeout_s: float


@dataclass(frozen=True)
class PoolDecision:
    submit: int
    """How many agent jobs to submit."""
    cancel: dict[int, str] = field(default_factory=dict)
    """Agent jobs to cancel, by Slurm job id, each with why."""
    unmet_devices: int = 0
    """Devices wanted beyond the usable ones."""
    idle: frozenset[int] = frozenset()
    """Those of `cancel` given back because they are idle (their agents are told so)."""


def size_pool(wanted_devices: int, usable_devices: int, agents: Sequence[AgentJob], limits: PoolLimits) -> PoolDecision:
    """What to do with the pool (see the module's docstring). Raises ValueError for limits that
    cannot work (devices_per_agent below 1)."""
    if limits.devices_per_agent < 1:
        raise ValueError(f"devices_per_agent={limits.devices_per_agent!r} must be at least 1")
    unmet = max(0, wanted_devices - usable_devices)
    needed = math.ceil(unmet / limits.devices_per_agent)
    cancel: dict[int, str] = {}

    for agent in agents:
        if agent.phase == Phase.STARTING and agent.idle_for_s >= limits.start_timeout_s:
            cancel[agent.slurm_job_id] = (
                f"started {agent.idle_for_s:.0f} s ago and its agent has not registered "
                f"(BUNGEE_SLURM_START_TIMEOUT_S={limits.start_timeout_s:g}); see its output"
            )
    starting = [a for a in agents if a.phase == Phase.STARTING and a.slurm_job_id not in cancel]
    pending = sorted((a for a in agents if a.phase == Phase.PENDING), key=lambda a: a.slurm_job_id)
    keep = max(0, needed - len(starting))
    for agent in pending[keep:]:
        cancel[agent.slurm_job_id] = (
            f"pending beyond the demand ({unmet} devices unmet, {len(starting)} agents starting)"
        )
    pending = pending[:keep]

    spare = max(0, usable_devices - wanted_devices)
    idle = [a for a in agents if a.phase == Phase.ONLINE and a.idle_for_s >= limits.idle_s]
    given_back: set[int] = set()
    for agent in sorted(idle, key=lambda a: (-a.idle_for_s, a.slurm_job_id)):
        if agent.usable_devices <= spare:
            spare -= agent.usable_devices
            given_back.add(agent.slurm_job_id)
            cancel[agent.slurm_job_id] = (
                f"idle for {agent.idle_for_s:.0f} s (BUNGEE_SLURM_IDLE_S={limits.idle_s:g}) and its "
                f"{agent.usable_devices} devices not wanted"
            )

    alive = sum(1 for a in agents if a.phase != Phase.LEAVING and a.slurm_job_id not in cancel)
    room = max(0, limits.max_agents - alive)
    submit = min(room, max(0, needed - len(starting) - len(pending)))
    return PoolDecision(submit=submit, cancel=cancel, unmet_devices=unmet, idle=frozenset(given_back))
