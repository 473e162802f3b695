"""The pool's Celery task, run by the beat every BUNGEE_SLURM_EVERY_S when the pool is on. One
pass at a time, through a Redis lock: Celery may deliver the task twice, and two passes side by
side would both submit for the same demand."""

from __future__ import annotations

import getpass
import logging

from celery import shared_task
from redis.exceptions import LockError

from portal.redis import client, key
from portal.slurm.commands import SlurmCommands
from portal.slurm.config import pool_config
from portal.slurm.pool import run_pass

log = logging.getLogger(__name__)


@shared_task(name="portal.slurm.tasks.size_pool", ignore_result=True)
def size_slurm_pool() -> dict[str, list[int]] | None:
    """One pass (portal.slurm.pool); returns the Slurm jobs it submitted and cancelled, or None
    if the pool is off or another pass holds the lock."""
    config = pool_config()
    if not config.enabled:
        return None
    # A pass makes at most max_agents + 2 commands, each bounded: the lock outlives the longest.
    lock_s = config.command_timeout_s * (config.max_agents + 3) + 10
    lock = client().lock(key("slurm", "pool", "lock"), timeout=lock_s, blocking=False)
    if not lock.acquire():
        log.debug("slurm pool: another pass is running")
        return None
    try:
        result = run_pass(config, SlurmCommands(config.command_timeout_s), getpass.getuser())
    finally:
        try:
            lock.release()
        except LockError:
            log.warning("slurm pool: the pass outlived its lock (%.0f s)", lock_s)
    return {"submitted": result.submitted, "cancelled": result.cancelled}
