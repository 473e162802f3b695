"""Whether a node's workers live while its agent is silent: every worker refreshes a short-lived
heartbeat key on its job's membership board (elastic.worker.heartbeat). Only what an agent cannot
say is read from there; the agent's reports stay the source of what its workers do."""

from __future__ import annotations

import logging

import redis
from django.conf import settings

from elastic.membership.redis import RedisBoard, heartbeat_key
from elastic.wire import coordination_key, member_key
from portal.redis import client

log = logging.getLogger(__name__)


def beating(node: str, workers: list[tuple[int, int, int | None]]) -> set[tuple[int, int]]:
    """Returns the (job id, device index) of those `workers` (job id, device index, pid) on the
    node named `node` whose heartbeat is fresh and names their pid. None if Redis does not
    answer: then nothing is known to live."""
    if not workers:
        return set()
    prefix = settings.BUNGEE.redis_prefix
    keys = [
        heartbeat_key(coordination_key(job_id, prefix), member_key(node, index))
        for job_id, index, _ in workers
    ]
    try:
        pids = client().mget(keys)
    except redis.RedisError as err:
        log.warning("cannot read the heartbeats of %s's workers: %s", node, err)
        return set()
    return {
        (job_id, index)
        for (job_id, index, pid), beat in zip(workers, pids, strict=True)
        if beat is not None and pid is not None and int(beat) == pid
    }


def tell_to_leave(node: str, workers: list[tuple[int, int, int]]) -> None:
    """Tells each of `workers` (job id, device index, pid) on the node named `node` to leave: it
    reads that at its next heartbeat and stops as on SIGTERM (elastic.worker.heartbeat). For
    workers whose agent is gone, which no signal reaches. Redis not answering is logged: the
    node is lost all the same, and a job planned again elsewhere makes its old workers leave."""
    prefix = settings.BUNGEE.redis_prefix
    try:
        for job_id, index, pid in workers:
            RedisBoard(client(), coordination_key(job_id, prefix)).tell_to_leave(member_key(node, index), pid)
    except redis.RedisError as err:
        log.warning("cannot tell the workers of %s to leave: %s", node, err)
