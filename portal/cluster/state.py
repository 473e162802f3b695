"""Nodes and devices as everyone sees them: the latest sample of each device (kept in Redis) and
whether it is usable. Which job holds a device is the jobs' to say (portal.jobs.board)."""

from __future__ import annotations

import json
from typing import Any

from portal.cluster.models import Device, Node
from portal.redis import client, key


def latest_key(device_id: int) -> str:
    return key("device", device_id, "latest")


def latest_samples(device_ids: list[int]) -> dict[int, dict[str, Any]]:
    if not device_ids:
        return {}
    values = client().mget([latest_key(d) for d in device_ids])
    return {d: json.loads(v) for d, v in zip(device_ids, values, strict=True) if v}


def device_holder(device: Device, held: bool) -> str:
    """free, job (held by one of our jobs), owner (its owner took it back), drained (its node
    left gracefully) or lost."""
    if device.node.state == Node.State.DRAINED:
        return "drained"
    if not device.present or device.node.state == Node.State.LOST:
        return "lost"
    if device.owner_present:
        return "owner"
    return "job" if held else "free"
