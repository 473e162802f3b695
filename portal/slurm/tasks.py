"""The pool's Celery task, run by the beat every BUNGEE_SLURM_EVERY_S when the pool is on, and
at once when demand appears (portal.trigger.request_pool_pass). One pass at a time, through a
Redis lock: Celery may deliver the task twice, and two passes side by side would both submit for
the same demand. A request that arrives while a pass runs waits (portal.trigger.PoolRequests),
and the running pass goes round once more for all of them, so no event waits for the beat."""

from __future__ import annotations

import getpass
import logging
from collections.abc import Callable
from typing import Protocol

from celery import shared_task
from redis.exceptions import LockError

from portal.redis import client, key
from portal.slurm.commands import SlurmCommands
from portal.slurm.config import pool_config
from portal.slurm.pool import PassResult, run_pass
from portal.trigger import PoolRequests

log = logging.getLogger(__name__)

MAX_ROUNDS = 5
"""Passes one task runs back to back for requests that keep coming; one still waiting after them
is queued as a task of its own."""


class Lock(Protocol):
    def reacquire(self) -> bool: ...


def run_passes(requests: PoolRequests, lock: Lock, run: Callable[[], PassResult], beat: bool) -> list[PassResult]:
    """Under `lock` (held by the caller): passes while a request waits, each taking the requests
    in before it starts, at most MAX_ROUNDS; the beat's first pass runs whether one waits or not.
    Returns the passes' results (none: a task whose request an earlier pass took in)."""
    results: list[PassResult] = []
    for round_ in range(MAX_ROUNDS):
        if requests.take() is None and not (beat and round_ == 0):
            break
        lock.reacquire()
        results.append(run())
    return results


@shared_task(name="portal.slurm.tasks.size_pool", ignore_result=True)
def size_slurm_pool(reason: str = "") -> dict[str, list[int]] | None:
    """Passes of the pool (portal.slurm.pool): one for the beat (`reason` empty), or one for each
    round of waiting requests. Returns the Slurm jobs they submitted and cancelled, or None if the
    pool is off or another pass holds the lock (it takes the waiting request in before it lets
    go)."""
    config = pool_config()
    if not config.enabled:
        return None
    # A pass makes at most max_agents + 2 commands, each bounded: the lock outlives the longest.
    lock_s = config.command_timeout_s * (config.max_agents + 3) + 10
    lock = client().lock(key("slurm", "pool", "lock"), timeout=lock_s, blocking=False)
    if not lock.acquire():
        log.debug("slurm pool: another pass is running (asked: %s)", reason or "the beat")
        return None
    requests = PoolRequests.of_this_deployment()
    try:
        results = run_passes(requests, lock, lambda: run_pass(
            config, SlurmCommands(config.command_timeout_s), getpass.getuser()), beat=not reason)
    finally:
        try:
            lock.release()
        except LockError:
            log.warning("slurm pool: the pass outlived its lock (%.0f s)", lock_s)
    if requests.waiting():
        # Asked after the last round looked, its own task perhaps turned away by the lock.
        size_slurm_pool.delay("asked during the last pass")
    return {
        "submitted": [job for result in results for job in result.submitted],
        "cancelled": [job for result in results for job in result.cancelled],
    }
