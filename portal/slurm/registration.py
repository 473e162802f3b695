"""What the Slurm pool's token may register: only the nodes of agent jobs the pool submitted
(portal.slurm.models.SlurmAgentJob, the pool's record, kept from squeue on every pass), each job
once while its node lives, with at most the devices the pool asks Slurm for an agent (its gres's
count). A leaked pool token then cannot add a made-up node: its name must be an agent job of the
pool's, under the Slurm node squeue puts it on once the pool has seen it start. Used through
portal.cluster.binding.add_pool_rules (apps.py)."""

from __future__ import annotations

import functools
import re

from django.conf import settings

from portal.cluster.binding import LIVE_STATES, PoolRule
from portal.cluster.models import Node
from portal.errors import forbidden
from portal.slurm.config import PoolConfig, pool_config
from portal.slurm.models import SlurmAgentJob


def rule_for(pool: str) -> PoolRule | None:
    """The rule of pool `pool` if it is this portal's Slurm pool and the pool is on, else None."""
    raw = settings.BUNGEE_SLURM
    if not raw.enabled or raw.pool != pool:
        return None
    return functools.partial(check_agent_job, pool_config(raw))


def check_agent_job(config: PoolConfig, name: str, devices: int) -> None:
    """Raises ApiError 403 unless `name` is the node of an agent job the pool submitted
    (elastic.wire.slurm_node_name: POOL-HOST-jobID), under the host squeue gives it if the pool
    has seen it start, no other node of that job lives (online, unreachable or draining), and
    `devices` is at most what the pool asked for."""
    found = re.fullmatch(rf"{re.escape(config.pool)}-(?P<host>.+)-job(?P<job_id>[0-9]{{1,18}})", name)
    if found is None:
        raise forbidden(
            f"pool {config.pool!r} registers only its agent jobs' nodes, named {config.pool}-HOST-jobID; not {name!r}"
        )
    job_id = int(found["job_id"])
    row = SlurmAgentJob.objects.select_for_update().filter(slurm_job_id=job_id).first()
    if row is None:
        raise forbidden(
            f"node {name!r}: the Slurm pool submitted no agent job {job_id} that is still queued or running"
        )
    if row.node_name and row.node_name != name:
        raise forbidden(f"node {name!r}: agent job {job_id} runs as node {row.node_name!r} (squeue's host)")
    live = (
        Node.objects.filter(name__startswith=f"{config.pool}-", name__endswith=f"-job{job_id}", state__in=LIVE_STATES)
        .exclude(name=name)
        .values_list("name", flat=True)
        .first()
    )
    if live is not None:
        raise forbidden(f"node {name!r}: agent job {job_id} registered already, as node {live!r}")
    if devices > config.devices_per_agent:
        raise forbidden(
            f"node {name!r} registers {devices} devices; the pool asked Slurm for {config.devices_per_agent} "
            f"(BUNGEE_SLURM_GRES {config.gres})"
        )
