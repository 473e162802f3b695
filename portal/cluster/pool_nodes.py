"""Pool nodes that are gone, pruned: a node registered through a pool token (a Slurm agent job
`slurm-HOST-jobID`, a Kubernetes pod) is named after one allocation and is never registered
again once its agent left. Drained, or lost, and unheard of for POOL_NODE_RETENTION_HOURS, it is
deleted with what was kept for it: its devices and their samples, its report refusals, and the
agent token its registration issued (its Redis user goes at the next scheduler tick,
portal.redis_users.sync). The job history that names it stays: a worker row keeps its node's
name (Worker.node_name) and loses only the link. portal.jobs.history runs it with the rest of
the history; two runs at once delete the same rows, harmlessly."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from portal.accounts.models import ApiToken
from portal.cluster.models import Node

GONE_STATES = (Node.State.DRAINED, Node.State.LOST)


def _pool_prefixes() -> list[str]:
    """The name prefixes of the pools this portal knows: its pool tokens' and its Slurm pool's."""
    pools = set(ApiToken.objects.filter(role=ApiToken.Role.POOL).values_list("pool", flat=True))
    if settings.BUNGEE_SLURM.enabled:
        pools.add(settings.BUNGEE_SLURM.pool)
    return sorted(f"{pool}-" for pool in pools if pool)


def gone_pool_nodes(now: datetime, keep_hours: float) -> list[int]:
    """The ids of the pool nodes drained or lost and unheard of for `keep_hours` (0: none ever):
    those a pool token's registration made, and those named after a known pool whose token was
    deleted since."""
    if not keep_hours:
        return []
    pooled = Q(agent_token__issued_by__isnull=False)
    for prefix in _pool_prefixes():
        pooled |= Q(agent_token__isnull=True, name__startswith=prefix)
    gone = Node.objects.filter(pooled, state__in=GONE_STATES, last_seen_at__lt=now - timedelta(hours=keep_hours))
    return list(gone.values_list("id", flat=True))


def prune_pool_nodes(now: datetime, keep_hours: float, dry_run: bool = False) -> int:
    """Deletes the pool nodes past their retention (see the module's docstring) and the agent
    tokens their registrations issued; returns how many nodes it deleted (a dry run: would)."""
    ids = gone_pool_nodes(now, keep_hours)
    if dry_run or not ids:
        return len(ids)
    with transaction.atomic():
        tokens = list(Node.objects.filter(id__in=ids, agent_token__issued_by__isnull=False)
                      .values_list("agent_token_id", flat=True))
        deleted = Node.objects.filter(id__in=ids, state__in=GONE_STATES).delete()[1].get("cluster.Node", 0)
        ApiToken.objects.filter(id__in=tokens).delete()
    return deleted
