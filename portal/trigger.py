"""Asking the scheduler, and the Slurm pool, to run once the current transaction commits, so that
they see the change that made the request. The tasks are sent by name: any app may ask without
importing the scheduler or the pool (portal apps depend one way: scheduling -> jobs -> cluster,
and the pool reads jobs and cluster)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db import transaction

from portal.celery import app
from portal.redis import client, key

log = logging.getLogger(__name__)

SCHEDULE_TASK = "portal.scheduling.tasks.schedule"
POOL_TASK = "portal.slurm.tasks.size_pool"
POOL_REQUEST_TTL_S = 120
"""How long a request for a pool pass holds back the next ones if no pass takes it in (its task
lost with a Celery worker killed): after that, a new event asks again; the beat's pass takes a
request in as well."""


def request_schedule(reason: str) -> None:
    def send() -> None:
        try:
            if app.conf.task_always_eager:
                app.tasks[SCHEDULE_TASK].apply(args=[reason])
            else:
                app.send_task(SCHEDULE_TASK, args=[reason])
        except Exception:  # a broker outage must not fail the request; the beat tick catches up
            log.exception("could not queue the scheduler (%s); the next tick will run it", reason)

    transaction.on_commit(send)


WAKE_MARGIN_S = 0.5
"""How long after a deadline its cycle runs: a cycle at the very instant would find the deadline
not yet passed (clocks of the database and of the Celery worker differ by milliseconds)."""


def request_schedule_at(reason: str, when: datetime) -> None:
    """Asks the scheduler to run once `when` has passed (a generation's deadline), so that a
    deadline takes effect without the beat: the beat is the safety net, not the clock. Nothing
    with eager Celery (tests in one process), where a task cannot wait."""
    if app.conf.task_always_eager:
        return

    def send() -> None:
        try:
            app.send_task(SCHEDULE_TASK, args=[reason], eta=when + timedelta(seconds=WAKE_MARGIN_S))
        except Exception:  # as request_schedule: the beat tick catches up
            log.exception("could not queue the scheduler for %s (%s); the next tick will run it", when, reason)

    transaction.on_commit(send)


class PoolRequests:
    """Requests for a pass of the Slurm pool, as one Redis key with an expiry: at most one pass
    waits, whatever the number of events. `ask` sets the key if it is not set (then, and only
    then, the caller queues the task); the pass that runs for it `take`s the key in before it
    reads anything, so that an event after that asks again: a pass in flight and one waiting at
    most."""

    def __init__(self, redis_client: redis.Redis, name: str, ttl_s: float = POOL_REQUEST_TTL_S) -> None:
        self.redis = redis_client
        self.name = name
        self.ttl_s = ttl_s

    @classmethod
    def of_this_deployment(cls) -> PoolRequests:
        return cls(client(), key("slurm", "pool", "requested"))

    def ask(self, reason: str) -> bool:
        """Asks for a pass; returns whether this is the waiting one (False: one waits already,
        and it will see what this one would have)."""
        return bool(self.redis.set(self.name, reason, nx=True, px=int(self.ttl_s * 1000)))

    def take(self) -> str | None:
        """Takes the waiting request in; returns its reason, or None if none waits."""
        reason = self.redis.getdel(self.name)
        return None if reason is None else str(reason)

    def waiting(self) -> bool:
        return bool(self.redis.exists(self.name))


def request_pool_pass(reason: str) -> None:
    """Asks the Slurm pool for a pass where demand may have appeared that the cluster cannot meet
    (a job submitted or queued again, a resize asking for more, a node draining, drained or lost,
    a device's owner back), once the transaction commits. Nothing where no pool is configured, or
    where the pool acts on its beat only (BUNGEE_SLURM_ON_DEMAND off)."""
    pool = settings.BUNGEE_SLURM
    if not (pool.enabled and pool.on_demand):
        return

    def send() -> None:
        try:
            if not PoolRequests.of_this_deployment().ask(reason):
                return
            if app.conf.task_always_eager:
                app.tasks[POOL_TASK].apply(kwargs={"reason": reason})
            else:
                app.send_task(POOL_TASK, kwargs={"reason": reason})
        except Exception:  # a broker outage must not fail the request; the pool's beat catches up
            log.exception("could not queue a pass of the Slurm pool (%s); its beat will run one", reason)

    transaction.on_commit(send)
