"""Pushing events to open sockets through the Channels layer. Groups: `cluster` (everyone
logged in: allocations, job summaries), `job-<id>` (the job's owner and staff: progress, logs,
state), and for device samples `samples` (the sockets that follow every node) and
`samples-node-<id>` (those that follow that node or some of its devices). An event is encoded
as JSON once here, not once per socket: the consumer writes the text as it is. Sending never
fails the caller: live updates are a view of the database, and a browser that missed one
catches up on its next snapshot. It imports no portal app: callers hand it what to send."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from portal.live.samples import taken_together
from portal.redis import client, key

if TYPE_CHECKING:
    from portal.jobs.models import Job

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"
SAMPLES_GROUP = "samples"
ORDER_LOCK_S = 5.0
"""The life of a job's send lock: a process killed while it held the lock holds the job's next
updates back at most this long."""
ORDER_WAIT_S = 2.0
"""The longest a job update waits for that lock; then it is sent without it (and logged)."""


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


def node_samples_group(node_id: int) -> str:
    return f"samples-node-{node_id}"


def encoded(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))


def _send_each(messages: tuple[tuple[str, dict[str, Any]], ...]) -> None:
    """Each (group, message), in order, in one trip to the event loop."""
    layer = get_channel_layer()
    if layer is None:
        return

    async def to_every_group() -> None:
        for group, message in messages:
            await layer.group_send(group, message)

    try:
        async_to_sync(to_every_group)()
    except Exception:
        log.exception("live update to %s failed", ", ".join(group for group, _ in messages))


def send(group: str, event: dict[str, Any]) -> None:
    _send_each(((group, {"type": "live.event", "text": encoded(event)}),))


def samples(node_id: int, node_name: str, rows: list[dict[str, Any]]) -> None:
    """One node's samples of one report, as one message (`portal.live.samples.changed` says what
    each row holds; `taken_together` takes out a `taken_at` they share), to the sockets that
    follow every node and to those that follow this one. Only the latter's message carries the
    rows beside the text, for a socket that follows some of the node's devices: the layer packs
    a message once per socket, and 50 sockets following 1,024 devices packed 50 copies."""
    if not rows:
        return
    taken_at, rows = taken_together(rows)
    head = {"type": "samples", "node": node_name} | ({} if taken_at is None else {"taken_at": taken_at})
    whole = {"type": "live.samples", "node_id": node_id, "head": head, "text": encoded(head | {"samples": rows})}
    _send_each(((SAMPLES_GROUP, whole), (node_samples_group(node_id), whole | {"rows": rows})))


def job_changed(job: Job) -> None:
    """Sends the job as the database has it now to every board and to the job's followers. The
    read and the send are one step for each job across every process (a lock in Redis): the
    portal and the Celery worker both send a job's updates, and one that had read the job before
    the other's change and sent after it left every page showing the older job (a browser keeps
    the last `job` message it got, and nothing newer may come for a long time).

    Called inside a transaction, it sends once that commits, and not at all if it rolls back:
    sent before the commit, the change was on the pages before any other process could read it,
    and one that read the job in between sent the older job last."""
    transaction.on_commit(lambda: _send_job(job), robust=True)


def _send_job(job: Job) -> None:
    with _in_order(job.pk):
        job.refresh_from_db()
        summary = job.summary()
        send(CLUSTER_GROUP, {"type": "job", "job": summary})
        send(job_group(job.pk), {"type": "job_state", "job": summary, "message": job.message,
                                 "pin_problem": job.pin_problem})


@contextmanager
def _in_order(job_id: int) -> Iterator[None]:
    """Holds the job's send lock (at most ORDER_WAIT_S to get it): without Redis, or past the
    wait, the update goes out unordered rather than not at all."""
    lock = client().lock(key("live", "job", job_id), timeout=ORDER_LOCK_S, blocking_timeout=ORDER_WAIT_S)
    try:
        held = lock.acquire()
    except redis.RedisError as err:
        log.warning("job %s: its update goes out unordered: %s", job_id, err)
        held = False
    else:
        if not held:
            log.warning("job %s: its update goes out unordered: its send lock was held %s s", job_id, ORDER_WAIT_S)
    try:
        yield
    finally:
        if held:
            try:
                lock.release()
            except redis.RedisError as err:  # LockError included: it outlived ORDER_LOCK_S
                log.warning("job %s: releasing its send lock: %s", job_id, err)


def allocation_changed(allocations: list[dict[str, Any]]) -> None:
    """Every device held by a job (portal.jobs.lifecycle.allocation_rows) to every board."""
    send(CLUSTER_GROUP, {"type": "allocations", "allocations": allocations})


def node_changed(
    name: str, state: str, last_seen_at: datetime, cause: str = "", deadline_at: datetime | None = None
) -> None:
    """A node's state changed (online, agent unreachable, draining, drained, lost): to every
    board, which says how long a node has been silent, or why and by when it drains."""
    send(CLUSTER_GROUP, {
        "type": "node", "name": name, "state": state, "last_seen_at": last_seen_at.isoformat(),
        "drain_cause": cause, "drain_deadline_at": deadline_at.isoformat() if deadline_at else None,
    })
