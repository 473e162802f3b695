"""The cluster as everyone sees it: nodes, devices, their latest sample (kept in Redis) and who
holds each device."""

from __future__ import annotations

import json
from typing import Any

from portal.cluster.models import Device, Node
from portal.jobs.models import Allocation
from portal.redis import client, key


def latest_key(device_id: int) -> str:
    return key("device", device_id, "latest")


def latest_samples(device_ids: list[int]) -> dict[int, dict[str, Any]]:
    if not device_ids:
        return {}
    values = client().mget([latest_key(d) for d in device_ids])
    return {d: json.loads(v) for d, v in zip(device_ids, values, strict=True) if v}


def device_holder(device: Device, allocation: Allocation | None) -> str:
    """free, job (held by one of our jobs), owner (its owner took it back) or lost."""
    if not device.present or device.node.state == Node.State.LOST:
        return "lost"
    if device.owner_present:
        return "owner"
    return "job" if allocation is not None else "free"


def allocations() -> list[dict[str, Any]]:
    return [
        {"device_id": a.device_id, "job_id": a.job_id, "rank": a.rank, "generation": a.generation}
        for a in Allocation.objects.all()
    ]


def cluster_state() -> dict[str, Any]:
    devices = list(Device.objects.select_related("node").order_by("node__name", "index"))
    allocation_of = {
        a.device_id: a for a in Allocation.objects.select_related("job__owner").all()
    }
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
                "holder": device_holder(device, allocation),
                "job": None if allocation is None else {
                    "id": allocation.job_id,
                    "name": allocation.job.name,
                    "owner": allocation.job.owner.get_username(),
                    "rank": allocation.rank,
                },
                "sample": samples.get(device.pk),
            }
        )
    return {"nodes": list(nodes.values())}
