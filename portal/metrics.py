"""`GET /metrics`: the platform in the Prometheus text format, for operators.

Every figure is read from the database at scrape time by one collector (prometheus_client's
custom-collector interface), so any portal process answers the same and nothing is lost when
one restarts: counters and histograms count what the database holds (history pruned away
leaves them, as a counter reset does, which Prometheus's rate() handles).

Labels are bounded: jobs appear only while queued or running (job_id, user), devices by node,
index and UUID (with `Hostname` and `UUID` as NVIDIA's DCGM exporter names them, so the two
join), resizes by reason (a fixed set). Access takes a bearer token of role `metrics`
(`manage.py create_token USER --role metrics`) or a staff session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from django.db.models import Count, DurationField, ExpressionWrapper, F, OuterRef, Q, QuerySet, Subquery, Sum
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from portal.accounts.models import ApiToken
from portal.cluster.models import Device, DeviceSample, Node, ReportRefusals
from portal.errors import ApiError
from portal.jobs.models import Job, ResizeEvent, Worker
from portal.jobs.states import ACTIVE_STATES, JobState
from portal.scheduling.models import SchedulerDecision

PAUSE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LAND_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
DECISION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
FAILURE_REASONS = ("failed", "node lost", "agent restart: gone")
"""Worker exit reasons that are failures (elastic's exit reason "failed", and the portal's own
for workers it found gone); "completed", "stopped", "left" and "user_error" are not."""


def _histogram(
    name: str,
    documentation: str,
    rows: QuerySet[Any],
    field: str,
    bounds: Sequence[float],
    unit: Callable[[float], Any] = lambda seconds: seconds,
    seconds: Callable[[Any], float] = float,
) -> Metric:
    """A histogram of `field` over `rows`, counted and summed by the database in one query: a
    scrape reads no rows, however long the history. `bounds` are in seconds; `unit` turns one
    into the field's own unit, `seconds` turns the field's sum back."""
    by_bound = {f"le_{i}": Count("pk", filter=Q(**{f"{field}__lte": unit(bound)})) for i, bound in enumerate(bounds)}
    row = rows.aggregate(n=Count("pk"), total=Sum(field), **by_bound)
    buckets = [(str(bound), row[f"le_{i}"]) for i, bound in enumerate(bounds)]
    total = 0.0 if row["total"] is None else seconds(row["total"])
    return HistogramMetricFamily(name, documentation, buckets=[*buckets, ("+Inf", row["n"])], sum_value=total)


class PlatformCollector(Collector):
    """The platform's jobs, devices, resizes and scheduler as Prometheus metrics."""

    def collect(self) -> Iterator[Metric]:
        yield from self._jobs()
        yield from self._devices()
        yield from self._resizes()
        yield from self._scheduler()

    def _jobs(self) -> Iterator[Metric]:
        by_state = GaugeMetricFamily("bungee_jobs", "Jobs by state", labels=["state"])
        counts = dict(Job.objects.values_list("state").annotate(n=Count("pk")).values_list("state", "n"))
        for state in JobState:
            by_state.add_metric([state.value], counts.get(state.value, 0))
        yield by_state
        workers = GaugeMetricFamily("bungee_job_workers", "Workers of a queued or running job", labels=["job_id", "user"])
        rate = GaugeMetricFamily(
            "bungee_job_samples_per_second", "Training throughput of a running job", labels=["job_id", "user"]
        )
        steps = GaugeMetricFamily("bungee_job_steps_done", "Steps a queued or running job has trained", labels=["job_id", "user"])
        active = (
            Job.objects.filter(state__in=ACTIVE_STATES)
            .select_related("owner")
            .annotate(allocated=Count("allocations"))
            .order_by("pk")
        )
        for job in active:
            labels = [str(job.pk), job.owner.get_username()]
            workers.add_metric(labels, job.allocated)
            steps.add_metric(labels, job.steps_done)
            if job.samples_per_s is not None:
                rate.add_metric(labels, job.samples_per_s)
        yield workers
        yield rate
        yield steps
        failures = CounterMetricFamily("bungee_worker_failures", "Workers that ended by a failure (a crash, a kill)")
        failures.add_metric([], Worker.objects.filter(reason__in=FAILURE_REASONS).count())
        yield failures

    def _devices(self) -> Iterator[Metric]:
        newest = DeviceSample.objects.filter(device=OuterRef("pk")).order_by("-taken_at")
        devices = (
            Device.objects.filter(present=True, node__state=Node.State.ONLINE)
            .select_related("node")
            .annotate(utilization=Subquery(newest.values("utilization_pct")[:1]))
            .annotate(memory_used=Subquery(newest.values("memory_used_bytes")[:1]))
            .order_by("node__name", "index")
        )
        labels = ["node", "device", "UUID", "Hostname", "kind"]
        utilization = GaugeMetricFamily(
            "bungee_device_utilization_ratio", "Latest utilisation of a device, 0 to 1", labels=labels
        )
        memory = GaugeMetricFamily("bungee_device_memory_used_bytes", "Latest memory in use on a device", labels=labels)
        owner = GaugeMetricFamily("bungee_device_owner_present", "1 while a device's owner uses it", labels=labels)
        for device in devices:
            values = [device.node.name, str(device.index), device.uuid, device.node.address, device.kind]
            if device.utilization is not None:
                utilization.add_metric(values, device.utilization / 100.0)
            if device.memory_used is not None:
                memory.add_metric(values, device.memory_used)
            owner.add_metric(values, 1.0 if device.owner_present else 0.0)
        yield utilization
        yield memory
        yield owner
        refused = CounterMetricFamily(
            "bungee_agent_report_items_refused",
            "Items of a node's reports the portal refused: not valid, about a worker the node does not hold, "
            "or about a job that does not exist",
            labels=["node", "reason"],
        )
        for node_name, reason, count in ReportRefusals.objects.values_list("node__name", "reason", "count"):
            refused.add_metric([node_name, reason], count)
        yield refused
        nodes = GaugeMetricFamily("bungee_nodes", "Nodes by state", labels=["state"])
        counts = dict(Node.objects.values_list("state").annotate(n=Count("pk")).values_list("state", "n"))
        for state in Node.State:
            nodes.add_metric([state.value], counts.get(state.value, 0))
        yield nodes

    def _resizes(self) -> Iterator[Metric]:
        total = CounterMetricFamily("bungee_resizes", "Resizes asked, by reason", labels=["reason"])
        for reason, n in ResizeEvent.objects.values_list("reason").annotate(n=Count("pk")).order_by("reason"):
            total.add_metric([reason], n)
        yield total
        done = ResizeEvent.objects.filter(completed_at__isnull=False)
        yield _histogram(
            "bungee_resize_pause_seconds", "Training paused by a resize (last step before to first after)",
            done.filter(pause_s__isnull=False), "pause_s", PAUSE_BUCKETS,
        )  # fmt: skip
        land = ExpressionWrapper(F("completed_at") - F("requested_at"), output_field=DurationField())
        yield _histogram(
            "bungee_resize_land_seconds", "From a resize being asked to its first step on the new workers",
            done.annotate(land=land), "land", LAND_BUCKETS, lambda bound: timedelta(seconds=bound),
            lambda total: total.total_seconds(),
        )  # fmt: skip

    def _scheduler(self) -> Iterator[Metric]:
        # One row a cycle (every few seconds, for as long as history is kept): counted in the
        # database, not read.
        yield _histogram(
            "bungee_scheduler_decision_seconds", "Time the policy took to plan a cycle",
            SchedulerDecision.objects.all(), "decision_ms", DECISION_BUCKETS, lambda bound: bound * 1000,
            lambda total: total / 1000,
        )  # fmt: skip


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(PlatformCollector())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus text; 401 without credentials, 403 for a token of another role."""
    denied = _denied(request)
    if denied is not None:
        response = JsonResponse(denied.body(), status=denied.status)
        if denied.status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="bungee metrics"'
        return response
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def _denied(request: HttpRequest) -> ApiError | None:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        found = ApiToken.lookup(header.removeprefix("Bearer ").strip())
        if found is None:
            return ApiError(401, "unauthenticated", "unknown or revoked token")
        if found.role != ApiToken.Role.METRICS:
            return ApiError(403, "forbidden", f"this token's role is {found.role!r}; /metrics takes role 'metrics'")
        return None
    if request.user.is_authenticated:
        return None if request.user.is_staff else ApiError(403, "forbidden", "/metrics is for staff and metrics tokens")
    return ApiError(401, "unauthenticated", "send a bearer token of role 'metrics' (manage.py create_token --role metrics)")
