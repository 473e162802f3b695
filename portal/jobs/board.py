"""The cluster as everyone sees it on the board: nodes, devices, their latest sample, which job
holds each device, and the active jobs."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from portal.cluster.drain import cause_text
from portal.cluster.models import Device, Node
from portal.cluster.state import device_holder, latest_samples
from portal.jobs.models import Allocation, Job, listed
from portal.jobs.states import ACTIVE_STATES


def active_jobs() -> list[dict[str, Any]]:
    """Every queued, running or resizing job's summary, oldest first: the board's rows."""
    return [job.summary() for job in listed(Job.objects.filter(state__in=ACTIVE_STATES)).order_by("created_at")]


def cluster_state() -> dict[str, Any]:
    devices = list(Device.objects.select_related("node").order_by("node__name", "index"))
    allocation_of = {a.device_id: a for a in Allocation.objects.select_related("job__owner").all()}
    samples = latest_samples([d.pk for d in devices])
    nodes: dict[int, dict[str, Any]] = {}
    for node in Node.objects.all():
        nodes[node.pk] = {
            "id": node.pk,
            "name": node.name,
            "address": node.address,
            "backend": node.backend,
            "state": node.state,
            "last_seen_at": node.last_seen_at.isoformat(),
            "drain_cause": cause_text(node) if node.drain_cause else "",
            "drain_deadline_at": node.drain_deadline_at.isoformat() if node.drain_deadline_at else None,
            "devices": [],
        }
    for device in devices:
        allocation = allocation_of.get(device.pk)
        nodes[device.node_id]["devices"].append(
            {
                "id": device.pk,
                "index": device.index,
                "name": device.name,
                "kind": device.kind,
                "memory_total_bytes": device.memory_total_bytes,
                "holder": device_holder(device, allocation is not None),
                "job": None if allocation is None else {
                    "id": allocation.job_id,
                    "name": allocation.job.name,
                    "owner": allocation.job.owner.get_username(),
                    "rank": allocation.rank,
                },
                "sample": samples.get(device.pk),
            }
        )
    # The live socket sends this after it joined its groups: a board that was away (its socket
    # reconnected) or loaded just before takes its jobs from here, and misses no change between.
    return {
        "nodes": list(nodes.values()),
        "jobs": active_jobs(),
        "unreachable_timeout_s": settings.BUNGEE.unreachable_timeout_s,
    }
