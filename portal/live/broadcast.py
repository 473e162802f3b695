"""Pushing events to open sockets through the Channels layer. Two kinds of group: `cluster`
(everyone logged in: device samples, allocations, job summaries) and `job-<id>` (the job's
owner and staff: progress, logs, state). Sending never fails the caller: live updates are a
view of the database, and a browser that missed one catches up on its next snapshot. It imports
no portal app: callers hand it what to send."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

if TYPE_CHECKING:
    from portal.jobs.models import Job

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


def send(group: str, event: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": "live.event", "event": event})
    except Exception:
        log.exception("live update to %s failed", group)


def job_changed(job: Job) -> None:
    job.refresh_from_db()
    summary = job.summary()
    send(CLUSTER_GROUP, {"type": "job", "job": summary})
    send(job_group(job.pk), {"type": "job_state", "job": summary, "message": job.message,
                             "pin_problem": job.pin_problem})


def allocation_changed(allocations: list[dict[str, Any]]) -> None:
    """Every device held by a job (portal.jobs.lifecycle.allocation_rows) to every board."""
    send(CLUSTER_GROUP, {"type": "allocations", "allocations": allocations})
