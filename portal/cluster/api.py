"""Cluster endpoints for people: device history and the workload catalogue. The board's view
(who holds which device) and the agents' endpoints are in portal.jobs.agents."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from django.http import HttpRequest
from django.utils import timezone
from ninja import Field, Router, Schema

from elastic.workloads import CATALOGUE
from portal.auth import user_auth
from portal.cluster.models import Device, DeviceSample
from portal.errors import not_found

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
