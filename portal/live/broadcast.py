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
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from portal.live.samples import taken_together

if TYPE_CHECKING:
    from portal.jobs.models import Job

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"
SAMPLES_GROUP = "samples"


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
    job.refresh_from_db()
    summary = job.summary()
    send(CLUSTER_GROUP, {"type": "job", "job": summary})
    send(job_group(job.pk), {"type": "job_state", "job": summary, "message": job.message,
                             "pin_problem": job.pin_problem})


def allocation_changed(allocations: list[dict[str, Any]]) -> None:
    """Every device held by a job (portal.jobs.lifecycle.allocation_rows) to every board."""
    send(CLUSTER_GROUP, {"type": "allocations", "allocations": allocations})
