"""Celery tasks. `schedule` runs on every event that matters and on the beat tick; only one runs
at a time, through a Redis lock. A request that arrives while a cycle runs sets a flag, and the
running cycle goes round once more, so no event waits for the next tick."""

from __future__ import annotations

import logging

import redis
from celery import shared_task
from django.db.models import Q

from portal import redis_users
from portal.cluster.models import Node
from portal.jobs.models import Job, Worker
from portal.jobs.states import ACTIVE_STATES
from portal.redis import client, key
from portal.scheduling.cycle import run_cycle

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 10
"""The scheduler lock's life, renewed before each round: a cycle takes well under a second, and
a Celery worker killed in the middle of one (its lock left behind) holds the next cycles back
at most this long (the soak measured 62 s with 60)."""
MAX_ROUNDS = 5
RETRY_MARGIN_MS = 500
"""A request that found the lock held is run again this long after the lock's expiry."""


@shared_task(name="portal.scheduling.tasks.schedule", ignore_result=True)
def schedule(reason: str = "") -> dict[str, list[int]]:
    """Run scheduling cycles until no request is pending; returns what the last one changed."""
    redis = client()
    redis.set(key("scheduler", "pending"), "1")
    lock = redis.lock(key("scheduler", "lock"), timeout=LOCK_TIMEOUT_S, blocking=False)
    if not lock.acquire():
        log.debug("scheduler busy; the running cycle will pick up %r", reason)
        retry_once_the_lock_expires(redis)
        return {"changed": [], "launched": []}
    try:
        result = None
        for _ in range(MAX_ROUNDS):
            if not redis.getdel(key("scheduler", "pending")):
                break
            lock.reacquire()
            result = run_cycle()
        return {
            "changed": result.changed_jobs if result else [],
            "launched": result.launched_jobs if result else [],
        }
    finally:
        lock.release()
        if redis.get(key("scheduler", "pending")):
            schedule.delay("requested during the last cycle")


def retry_once_the_lock_expires(redis: redis.Redis) -> None:
    """The running cycle goes round once more for a request that found the lock held (the
    pending flag), unless the process running it died holding the lock (a Celery worker killed
    mid-cycle): then nothing ran the request before the beat's next tick, and nothing at all with
    the beat down too (a pin asked while both were away was never applied). So the request is
    asked again for when the lock expires; at most one such retry waits at a time."""
    left_ms = max(0, redis.pttl(key("scheduler", "lock")))
    due_ms = left_ms + RETRY_MARGIN_MS
    if redis.set(key("scheduler", "retry"), "1", nx=True, px=due_ms):
        schedule.apply_async(("a request found the scheduler's lock held",), countdown=due_ms / 1000)


@shared_task(name="portal.scheduling.tasks.tick", ignore_result=True)
def tick() -> None:
    """The beat: the Redis users made again (a Redis that restarted empty lost them) and those of
    jobs that ended and stopped removed, then schedule, which first notices lost nodes and
    generations past their deadline."""
    try:
        # An ended job's workers that still run (stopping, saving) keep their user.
        redis_users.sync(
            Job.objects.filter(Q(state__in=ACTIVE_STATES) | Q(workers__state=Worker.State.RUNNING))
            .distinct().values_list("pk", flat=True),
            dict(Node.objects.exclude(redis_password_sha256="").values_list("name", "redis_password_sha256")),
        )
    except redis.RedisError as err:
        log.warning("could not make the Redis users again: %s", err)
    schedule("tick")
