"""The Slurm pool as the Scheduler page shows it: on or off, its agents by phase at the last pass,
what the jobs want beyond the cluster, the last thing it did, the last thing that failed."""

from __future__ import annotations

from typing import Any

from portal.slurm.config import pool_config
from portal.slurm.models import SlurmPoolEvent, SlurmPoolPass

RECENT = 8


def pool_view() -> dict[str, Any] | None:
    """The page's Slurm section, or None when the pool is off and has never done anything."""
    enabled = pool_config().enabled
    events = list(SlurmPoolEvent.objects.all()[:RECENT])
    if not enabled and not events:
        return None
    actions = SlurmPoolEvent.objects.exclude(kind=SlurmPoolEvent.Kind.ERROR)
    return {
        "enabled": enabled,
        "last_pass": SlurmPoolPass.objects.first(),
        "last_action": actions.first(),
        "last_error": SlurmPoolEvent.objects.filter(kind=SlurmPoolEvent.Kind.ERROR).first(),
        "recent": events,
    }
