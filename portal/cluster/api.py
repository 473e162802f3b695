"""Cluster endpoints for people (state, device history, the workload catalogue) and for agents
(registration and reports, with an agent token, each for the one node it registered: see
portal.cluster.binding)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.http import HttpRequest
from django.utils import timezone
from ninja import Router, Schema

from elastic.wire import AgentReport, NodeRegistration, RegistrationReply
from elastic.workloads import CATALOGUE
from portal.auth import agent_auth, user_auth
from portal.cluster.binding import bind, check_claim, reporting_node
from portal.cluster.ingest import ingest_report, register_node
from portal.cluster.models import Device, DeviceSample
from portal.cluster.state import cluster_state
from portal.errors import ApiError, not_found

cluster_router = Router(auth=user_auth, tags=["cluster"])
agent_router = Router(auth=agent_auth, tags=["agents"])

MAX_HISTORY_MINUTES = 24 * 60


@cluster_router.get("/cluster", summary="Nodes, devices, latest samples and who holds each device")
def get_cluster(request: HttpRequest) -> dict[str, Any]:
    return cluster_state()


class SampleOut(Schema):
    taken_at: Any
    utilization_pct: float
    memory_used_bytes: int
    temperature_c: float | None
    power_w: float | None


@cluster_router.get(
    "/devices/{int:device_id}/samples", response=list[SampleOut], summary="A device's sample history"
)
def device_samples(request: HttpRequest, device_id: int, minutes: int = 60) -> Any:
    if not 1 <= minutes <= MAX_HISTORY_MINUTES:
        raise ApiError(400, "invalid_request", f"minutes must be in [1, {MAX_HISTORY_MINUTES}], not {minutes}")
    if not Device.objects.filter(pk=device_id).exists():
        raise not_found(f"device {device_id}")
    since = timezone.now() - timedelta(minutes=minutes)
    return list(DeviceSample.objects.filter(device_id=device_id, taken_at__gte=since).order_by("taken_at"))


@cluster_router.get("/cluster/history", summary="Every device's sample history, for sparklines")
def cluster_history(request: HttpRequest, minutes: int = 10) -> dict[str, list[list[float]]]:
    """Device id to [[unix time, utilisation %, memory used bytes], ...], oldest first."""
    if not 1 <= minutes <= MAX_HISTORY_MINUTES:
        raise ApiError(400, "invalid_request", f"minutes must be in [1, {MAX_HISTORY_MINUTES}], not {minutes}")
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


@agent_router.post("/register", response=RegistrationReply, summary="An agent registers its node")
def register(request: HttpRequest, payload: NodeRegistration) -> RegistrationReply:
    """The first registration with a token claims the node's name for it; 403 if another token
    holds the name or this token serves another node."""
    token = request.api_token  # type: ignore[attr-defined]
    with transaction.atomic():
        check_claim(payload.name, token)
        node, reply = register_node(payload)
        bind(node, token)
    return reply


@agent_router.post("/report", summary="An agent's periodic report")
def report(request: HttpRequest, payload: AgentReport) -> dict[str, bool]:
    """403 if the report names a node other than the token's; 409 "unknown_node" if the token
    has not registered it and no other token holds it (the agent then registers)."""
    node = reporting_node(payload.node, request.api_token)  # type: ignore[attr-defined]
    ingest_report(node, payload)
    return {"ok": True}
