"""Cluster endpoints for people: device history, the workload catalogue, and draining a node
(staff). The board's view (who holds which device) and the agents' endpoints are in
portal.jobs.agents."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from django.http import HttpRequest
from django.utils import timezone
from ninja import Field, Router, Schema
from pydantic import StrictFloat

from elastic.wire import MAX_DRAIN_S, NODE_NAME_PATTERN
from elastic.workloads import CATALOGUE
from portal.auth import require_staff, user_auth
from portal.cluster import drain
from portal.cluster.models import Device, DeviceSample, Node
from portal.errors import ApiError, not_found

cluster_router = Router(auth=user_auth, tags=["cluster"])

MAX_HISTORY_MINUTES = 24 * 60
HistoryMinutes = Annotated[
    int, Field(ge=1, le=MAX_HISTORY_MINUTES, description="how far back, in minutes (at most a day)")
]


class SampleOut(Schema):
    taken_at: Any
    utilization_pct: float
    memory_used_bytes: int
    temperature_c: float | None
    power_w: float | None


@cluster_router.get(
    "/devices/{int:device_id}/samples", response=list[SampleOut], summary="A device's sample history"
)
def device_samples(request: HttpRequest, device_id: int, minutes: HistoryMinutes = 60) -> Any:
    if not Device.objects.filter(pk=device_id).exists():
        raise not_found(f"device {device_id}")
    since = timezone.now() - timedelta(minutes=minutes)
    return list(DeviceSample.objects.filter(device_id=device_id, taken_at__gte=since).order_by("taken_at"))


@cluster_router.get("/cluster/history", summary="Every device's sample history, for sparklines")
def cluster_history(request: HttpRequest, minutes: HistoryMinutes = 10) -> dict[str, list[list[float]]]:
    """Device id to [[unix time, utilisation %, memory used bytes], ...], oldest first."""
    since = timezone.now() - timedelta(minutes=minutes)
    history: dict[str, list[list[float]]] = {}
    rows = DeviceSample.objects.filter(taken_at__gte=since).order_by("taken_at").values_list(
        "device_id", "taken_at", "utilization_pct", "memory_used_bytes"
    )
    for device_id, taken_at, utilization, memory in rows:
        history.setdefault(str(device_id), []).append([taken_at.timestamp(), utilization, memory])
    return history


class WorkloadOut(Schema):
    name: str
    title: str
    description: str
    hyperparameters: dict[str, Any]


@cluster_router.get("/workloads", response=list[WorkloadOut], summary="The workload catalogue", tags=["catalogue"])
def workloads(request: HttpRequest) -> list[dict[str, Any]]:
    return [
        {"name": w.name, "title": w.title, "description": w.description, "hyperparameters": w.schema()}
        for w in CATALOGUE.values()
    ]


class DrainIn(Schema):
    deadline_s: StrictFloat = Field(  # strict: JSON true is not a number of seconds
        default=60.0, gt=0, le=MAX_DRAIN_S, allow_inf_nan=False, description="how long the node's jobs have to move off it before its agent "
        "stops what is left and exits"
    )


class NodeOut(Schema):
    name: str
    state: str = Field(description="online, unreachable, draining, drained or lost")
    drain_cause: str = Field(description="why it drains or drained, as a job's timeline says it; empty otherwise")
    drain_deadline_at: Any = Field(description="when a draining node's devices leave")
    last_seen_at: Any


def _node_out(node: Node) -> dict[str, Any]:
    return {
        "name": node.name, "state": node.state,
        "drain_cause": drain.cause_text(node) if node.drain_cause else "",
        "drain_deadline_at": node.drain_deadline_at, "last_seen_at": node.last_seen_at,
    }


@cluster_router.get("/nodes", response=list[NodeOut], summary="The nodes and their states")
def nodes(request: HttpRequest) -> list[dict[str, Any]]:
    return [_node_out(node) for node in Node.objects.all()]


@cluster_router.post("/nodes/{name}/drain", response=NodeOut, summary="Drain a node (staff)")
def drain_node(request: HttpRequest, name: str, payload: DrainIn | None = None) -> dict[str, Any]:
    """The node leaves gracefully: the scheduler plans its jobs without it at once (each shrinks
    in place at its next step, or saves its step and waits for devices), and its agent exits
    once its workers are gone, or at the deadline. 409 if the node is not online."""
    require_staff(request.user, "drain a node")
    # A name no node can have (a NUL, which PostgreSQL cannot even compare) names no node.
    node = Node.objects.filter(name=name).first() if re.fullmatch(NODE_NAME_PATTERN, name) else None
    if node is None:
        raise not_found(f"node {name!r}")
    deadline_s = payload.deadline_s if payload is not None else DrainIn().deadline_s
    if not drain.drain(node, deadline_s):
        node.refresh_from_db()
        if node.state != Node.State.DRAINING:
            raise ApiError(409, "conflict", f"node {name!r} is {node.get_state_display()}: only an online node drains")
    node.refresh_from_db()
    return _node_out(node)
