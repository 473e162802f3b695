"""Commands to agents, on each node's Redis stream, and membership records, on each job's board
in Redis (elastic.membership). This module only sends: what to send is decided by the job's
lifecycle (portal.jobs.lifecycle), and it imports no portal app. Every command and record names
the job's generation, so that a repeated or late one is harmless (agents and workers ignore what
they have passed)."""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings

from elastic.membership.redis import RedisBoard
from elastic.wire import (
    DrainCommand,
    ExportCommand,
    LaunchCommand,
    Membership,
    StopCommand,
    command_stream,
    coordination_key,
)
from portal.redis import client

STREAM_MAXLEN = 10_000


def stream_for(node_name: str) -> str:
    return command_stream(node_name, settings.BUNGEE.redis_prefix)


def send(node_name: str, command: LaunchCommand | StopCommand | ExportCommand | DrainCommand) -> None:
    client().xadd(
        stream_for(node_name), {"command": command.model_dump_json()}, maxlen=STREAM_MAXLEN, approximate=True
    )


def board(job_id: int) -> RedisBoard:
    """The job's membership board in the portal's Redis."""
    return RedisBoard(client(), coordination_key(job_id, settings.BUNGEE.redis_prefix))


def publish(record: Membership, launches: dict[str, LaunchCommand]) -> None:
    """Puts `record` on its job's board, then sends each node its launch (so that a joiner that
    starts at once finds the record)."""
    board(record.job_id).publish(record)
    for node_name, launch in launches.items():
        send(node_name, launch)


def stop(job_id: int, nodes: Iterable[str], before_generation: int, reason: str) -> None:
    """Asks each of `nodes` to stop the job's workers older than `before_generation`."""
    for node_name in sorted(set(nodes)):
        send(node_name, StopCommand(job_id=job_id, before_generation=before_generation, reason=reason))  # type: ignore[arg-type]


def stop_devices(job_id: int, devices: dict[str, list[int]], before_generation: int, reason: str) -> None:
    """Asks each node of `devices` (node name -> device indices) to stop just the job's workers
    on those devices."""
    for node_name, indices in sorted(devices.items()):
        send(
            node_name,
            StopCommand(job_id=job_id, before_generation=before_generation, reason=reason, devices=sorted(indices)),  # type: ignore[arg-type]
        )
