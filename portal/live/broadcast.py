"""Pushing events to open sockets through the Channels layer. Groups: `cluster` (everyone
logged in: allocations, job summaries), `job-<id>` (the job's owner and staff: progress, logs,
state), and for device samples `samples` (the sockets that follow every node) and
`samples-node-<id>` (those that follow that node or some of its devices). An event is encoded
as JSON once here, not once per socket: the consumer writes the text as it is. Sending never
fails the caller: live updates are a view of the database, and a browser that missed one
catches up on its next snapshot. It imports no portal app: callers hand it what to send.

A job's state goes to the boards as a `live.jobs` message: the jobs' summaries, each encoded
once, which a socket that is behind keeps only the newest of (portal.live.outbox). A scheduling
cycle that changes many jobs (each new job moves every queued one's place) sends them as one
message (`jobs_changed`), not one per job: one per job, a burst of submissions made every socket
pop and write thousands of messages, and the boards fell seconds behind. With
BUNGEE_LIVE_COALESCE off each job goes out alone as a `job` message, as before."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet

from portal.live.outbox import jobs_message
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


def jobs_changed(jobs: QuerySet[Job]) -> None:
    """`job_changed` for every job of `jobs` (a query with what Job.summary reads, as
    portal.jobs.models.listed gives), read together and sent to the boards as one message."""
    transaction.on_commit(lambda: _send_jobs(jobs), robust=True)


def _coalescing() -> bool:
    return bool(settings.BUNGEE.live_coalesce)


def _send_job(job: Job) -> None:
    with _in_order(job.pk):
        job.refresh_from_db()
        _send_summaries([job])


def _send_jobs(jobs: QuerySet[Job]) -> None:
    if not _coalescing():
        # Plain rows: _send_job refreshes each, and a refresh leaves an annotation as it was read.
        for job in jobs.model.objects.filter(pk__in=jobs.values_list("pk", flat=True)):
            _send_job(job)
        return
    job_ids = sorted(jobs.values_list("pk", flat=True))
    if not job_ids:
        return
    # Each job's lock, taken in id order, as _send_job takes one: the read below is the newest.
    with ExitStack() as held:
        for job_id in job_ids:
            held.enter_context(_in_order(job_id))
        _send_summaries(list(jobs.filter(pk__in=job_ids).order_by("pk")))


def _send_summaries(jobs: Iterable[Job]) -> None:
    """Each job's summary to every board and its state to its followers, in one trip."""
    boards: list[tuple[int, str]] = []
    messages: list[tuple[str, dict[str, Any]]] = []
    for job in jobs:
        summary = job.summary()
        boards.append((job.pk, encoded(summary)))
        messages.append((job_group(job.pk), {"type": "live.event", "text": encoded(
            {"type": "job_state", "job": summary, "message": job.message, "pin_problem": job.pin_problem})}))
    if not boards:
        return
    if _coalescing():
        whole = {"type": "live.jobs", "jobs": boards, "text": jobs_message([text for _, text in boards])}
        _send_each(((CLUSTER_GROUP, whole), *messages))
        return
    # Each job alone, as a `job` message that every socket writes as it comes.
    alone = [(CLUSTER_GROUP, {"type": "live.event", "text": jobs_message([text])}) for _, text in boards]
    _send_each(tuple(message for pair in zip(alone, messages, strict=True) for message in pair))


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
