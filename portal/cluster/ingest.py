"""What agents tell the portal: registration, and the report they send every interval (device
samples, worker events, running workers). The database stays the source of truth; samples'
latest values go to Redis and, downsampled, to the history table."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from elastic.wire import (
    AgentReport,
    DeviceSample,
    NodeRegistration,
    RegistrationReply,
    RunningWorker,
    WorkerEvent,
)
from portal.cluster.models import Device, Node
from portal.cluster.models import DeviceSample as DeviceSampleRow
from portal.cluster.state import latest_key
from portal.jobs.models import Allocation, Job, JobLog, JobMetric, ResizeEvent, Worker
from portal.jobs.states import ACTIVE_STATES, JobState
from portal.live import broadcast
from portal.redis import client, key
from portal.scheduling.dispatch import publish_generation, stop_job_workers, stream_for
from portal.scheduling.trigger import request_schedule

log = logging.getLogger(__name__)

LATEST_SAMPLE_TTL_S = 60
LOG_LINE_LIMIT = 2000
SERVICE_GAP_CAP_S = 10.0
STEP_TIMES_TTL_S = 30


def _at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=UTC)


@dataclass(frozen=True)
class WorkerRow:
    """A running worker as the database has it."""

    id: int
    job_id: int
    device_index: int
    pid: int | None


def workers_gone_at_registration(
    rows: list[WorkerRow], readopted: list[RunningWorker], allocated: set[tuple[int, int]]
) -> tuple[set[int], set[int]]:
    """An agent registered with the workers it re-adopted, `readopted`: returns the ids of the
    `rows` (the workers the portal thought ran on the node) that are gone, and the jobs that must
    be planned again: those that lost a worker here, and those with a device here, (job id,
    device index) in `allocated`, on which no worker runs any more. A row is matched by job,
    device and pid, not by generation and rank, which lag by a "joined" event still on its way."""
    alive = {(worker.job_id, worker.device_index, worker.pid) for worker in readopted}
    gone = {row for row in rows if (row.job_id, row.device_index, row.pid) not in alive}
    kept = {(row.job_id, row.device_index) for row in rows if row not in gone}
    unmanned = {job_id for job_id, index in allocated if (job_id, index) not in kept}
    replan = {row.job_id for row in gone} | unmanned
    return {row.id for row in gone}, replan


def register_node(registration: NodeRegistration) -> tuple[Node, RegistrationReply]:
    """Create or refresh the node and its devices. A device the agent no longer reports is
    marked absent (its history is kept). The workers the agent re-adopted keep running; any
    other worker of the node is gone (workers_gone_at_registration). Asks the scheduler to run."""
    now = timezone.now()
    with transaction.atomic():
        node, _ = Node.objects.update_or_create(
            name=registration.name,
            defaults={
                "address": registration.address,
                "backend": registration.backend,
                "state": Node.State.ONLINE,
                "last_seen_at": now,
            },
        )
        reported = set()
        for info in registration.devices:
            Device.objects.update_or_create(
                node=node,
                index=info.index,
                defaults={
                    "uuid": info.uuid,
                    "name": info.name,
                    "kind": info.kind,
                    "memory_total_bytes": info.memory_total_bytes,
                    "present": True,
                },
            )
            reported.add(info.index)
        node.devices.exclude(index__in=reported).update(present=False)
        rows = [
            WorkerRow(*fields)
            for fields in Worker.objects.filter(node=node, state=Worker.State.RUNNING).values_list(
                "pk", "job_id", "device_index", "pid"
            )
        ]
        allocated = set(
            Allocation.objects.filter(job__state__in=ACTIVE_STATES, device__node=node).values_list(
                "job_id", "device__index"
            )
        )
        gone, replan = workers_gone_at_registration(rows, registration.running, allocated)
        Worker.objects.filter(pk__in=gone).update(
            state=Worker.State.EXITED, reason="agent restart: gone", exited_at=now
        )
        # Their generations must be planned and launched again.
        Job.objects.filter(pk__in=replan, state__in=ACTIVE_STATES).update(restart_requested=True)
        request_schedule(f"node {node.name} registered")
    reply = RegistrationReply(
        node_id=node.pk,
        commands_redis_url=settings.REDIS_URL,
        commands_stream=stream_for(node.name),
        report_interval_s=settings.BUNGEE["REPORT_INTERVAL_S"],
    )
    broadcast.allocation_changed()
    return node, reply


def ingest_report(node: Node, report: AgentReport) -> None:
    now = timezone.now()
    came_back = node.state == Node.State.LOST
    Node.objects.filter(pk=node.pk).update(last_seen_at=now, state=Node.State.ONLINE)
    if came_back:
        request_schedule(f"node {node.name} is back")
    if report.samples:
        _ingest_samples(node, report.samples, now)
    for event in report.events:
        _ingest_event(node, event)


def _ingest_samples(node: Node, samples: list[DeviceSample], now: datetime) -> None:
    devices = {d.index: d for d in node.devices.all()}
    pipe = client().pipeline(transaction=False)
    history_cutoff = now - timedelta(seconds=settings.BUNGEE["SAMPLE_HISTORY_EVERY_S"])
    history: list[DeviceSampleRow] = []
    outgoing = []
    for sample in samples:
        device = devices.get(sample.index)
        if device is None:
            continue
        payload = sample.model_dump(mode="json")
        payload["device_id"] = device.pk
        pipe.set(latest_key(device.pk), json.dumps(payload), ex=LATEST_SAMPLE_TTL_S)
        outgoing.append(payload)
        if sample.owner_present != device.owner_present:
            Device.objects.filter(pk=device.pk).update(
                owner_present=sample.owner_present, owner_since=now if sample.owner_present else None
            )
            what = "took back" if sample.owner_present else "released"
            log.info("device %s: its owner %s it", device, what)
            request_schedule(f"owner {what} {device}")
        if device.last_history_at is None or device.last_history_at <= history_cutoff:
            history.append(
                DeviceSampleRow(
                    device=device,
                    taken_at=_at(sample.taken_at),
                    utilization_pct=sample.utilization_pct,
                    memory_used_bytes=sample.memory_used_bytes,
                    temperature_c=sample.temperature_c,
                    power_w=sample.power_w,
                )
            )
            Device.objects.filter(pk=device.pk).update(last_history_at=now)
    pipe.execute()
    if history:
        DeviceSampleRow.objects.bulk_create(history)
    broadcast.send(broadcast.CLUSTER_GROUP, {"type": "samples", "node": node.name, "samples": outgoing})


def _ingest_event(node: Node, event: WorkerEvent) -> None:
    job = Job.objects.select_related("owner").filter(pk=event.job_id).first()
    if job is None:
        log.warning("event for unknown job %s from %s", event.job_id, node.name)
        return
    handler = _EVENT_HANDLERS[event.kind]
    handler(node, job, event)


def _running_row(node: Node, job: Job, event: WorkerEvent, **fields: Any) -> None:
    """Writes the row of `event`'s worker in its generation as running, with `fields`."""
    Worker.objects.update_or_create(
        job=job,
        generation=event.generation,
        rank=event.rank,
        defaults={
            "node": node,
            "device_index": event.device_index or 0,
            "pid": event.pid,
            "state": Worker.State.RUNNING,
            **fields,
        },
    )


def _on_started(node: Node, job: Job, event: WorkerEvent) -> None:
    _running_row(node, job, event, started_at=_at(event.at))


def _on_joined(node: Node, job: Job, event: WorkerEvent) -> None:
    """A worker formed generation `event.generation` as rank `event.rank`: a joiner that got the
    state, or a survivor that switched (its older row becomes `switched`, same pid)."""
    at = _at(event.at)
    earlier = Worker.objects.filter(
        job=job, node=node, pid=event.pid, state=Worker.State.RUNNING, generation__lt=event.generation
    )
    first = earlier.order_by("generation").first()
    earlier.update(state=Worker.State.SWITCHED)
    _running_row(node, job, event, started_at=first.started_at if first is not None else at, joined_at=at)
    Job.objects.filter(pk=job.pk, active_generation__lt=event.generation).update(
        active_generation=event.generation
    )


def _on_resized(node: Node, job: Job, event: WorkerEvent) -> None:
    """Rank 0's account of a generation taking over: the resize is complete."""
    at = _at(event.at)
    ResizeEvent.objects.filter(job=job, generation=event.generation).update(
        completed_at=at,
        pause_s=event.pause_s,
        step=event.step,
        members_before=event.members_before or [],
        members_after=event.members_after or [],
        bytes_moved=event.bytes_moved,
        phases=event.phases or {},
    )
    job.refresh_from_db()
    if event.generation != job.generation:
        return  # a newer generation is under way
    message = f"running on {job.allocations.count()} workers"
    if job.state == JobState.RESIZING:
        job.claim(JobState.RUNNING, message=message)
    elif job.state == JobState.RUNNING:
        Job.objects.filter(pk=job.pk).update(message=message)
    broadcast.job_changed(job)


def _service_since_last_report(job: Job, generation: int, at: datetime) -> float:
    """Device-seconds the job trained since its previous progress report: the generation's
    world size times the time between (capped, so that a queued stretch does not count)."""
    if job.last_progress_at is None:
        return 0.0
    seconds = min(max((at - job.last_progress_at).total_seconds(), 0.0), SERVICE_GAP_CAP_S)
    workers = (
        ResizeEvent.objects.filter(job=job, generation=generation).values_list("workers_after", flat=True).first()
    )
    return seconds * (workers or 0)


def _on_progress(node: Node, job: Job, event: WorkerEvent) -> None:
    at = _at(event.at)
    # Survivors report under the generation they train in, which lags the newest one while
    # joiners warm up; a report of a generation older than the one that formed is late.
    updated = Job.objects.filter(pk=job.pk, active_generation__lte=event.generation).update(
        steps_done=event.step or 0,
        last_loss=event.loss,
        samples_per_s=event.samples_per_s,
        global_batch=event.global_batch,
        learning_rate=event.lr,
        last_progress_at=at,
        attained_service_s=F("attained_service_s") + _service_since_last_report(job, event.generation, at),
    )
    if updated != 1:
        return
    JobMetric.objects.create(
        job=job,
        generation=event.generation,
        step=event.step or 0,
        epoch=event.epoch,
        loss=event.loss,
        samples_per_s=event.samples_per_s,
        at=at,
    )
    broadcast.send(
        broadcast.job_group(job.pk),
        {
            "type": "progress",
            "job_id": job.pk,
            "generation": event.generation,
            "step": event.step,
            "total_steps": event.total_steps or job.total_steps,
            "epoch": event.epoch,
            "loss": event.loss,
            "samples_per_s": event.samples_per_s,
            "global_batch": event.global_batch,
            "learning_rate": event.lr,
            "at": event.at,
        },
    )
    broadcast.send(
        broadcast.CLUSTER_GROUP,
        {"type": "job_progress", "job_id": job.pk, "steps_done": event.step, "total_steps": job.total_steps},
    )


def step_times_key(job_id: int, generation: int, rank: int) -> str:
    """Redis key of a rank's latest compute times per step (portal.scheduling.snapshot reads it)."""
    return key("job", job_id, "step-times", generation, rank)


def _on_step_times(node: Node, job: Job, event: WorkerEvent) -> None:
    """A rank's latest compute times per step: kept in Redis (live data, not history) for the
    scheduler's straggler check."""
    client().set(
        step_times_key(job.pk, event.generation, event.rank),
        json.dumps(event.step_times or []),
        ex=STEP_TIMES_TTL_S,
    )


def _on_log(node: Node, job: Job, event: WorkerEvent) -> None:
    line = (event.message or "")[:LOG_LINE_LIMIT]
    row = JobLog.objects.create(
        job=job, generation=event.generation, rank=event.rank, at=_at(event.at), line=line
    )
    broadcast.send(
        broadcast.job_group(job.pk),
        {
            "type": "log",
            "id": row.pk,
            "job_id": job.pk,
            "rank": event.rank,
            "generation": event.generation,
            "line": line,
            "at": event.at,
        },
    )


def _on_exited(node: Node, job: Job, event: WorkerEvent) -> None:
    now = timezone.now()
    row = Worker.objects.filter(job=job, generation=event.generation, rank=event.rank).first()
    was_running = row is not None and row.state == Worker.State.RUNNING
    Worker.objects.update_or_create(
        job=job,
        generation=event.generation,
        rank=event.rank,
        defaults={
            "node": node,
            "device_index": event.device_index or 0,
            "state": Worker.State.EXITED,
            "exit_code": event.exit_code,
            "reason": event.reason or "",
            "exited_at": _at(event.at),
        },
    )
    if job.state in ACTIVE_STATES and event.reason == "completed":
        _finish(job, now)
    elif job.state in ACTIVE_STATES and was_running and event.reason == "failed":
        _worker_failed(job, event, node)
    elif job.state in (JobState.RUNNING, JobState.RESIZING) and was_running:
        # A worker that left or stopped although its device is still the job's: plan again,
        # so that a generation puts a worker there (a leaver that a newer plan took back).
        if job.allocations.filter(device__node=node, device__index=event.device_index).exists():
            Job.objects.filter(pk=job.pk).update(restart_requested=True)
            request_schedule(f"job {job.pk}: worker on {node.name}/{event.device_index} {event.reason}")
    publish_generation(job.pk)


def _finish(job: Job, now: datetime) -> None:
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.state not in ACTIVE_STATES:
            return
        locked.claim(
            JobState.SUCCEEDED, finished_at=now, steps_done=locked.total_steps, message="trained every step"
        )
        locked.allocations.all().delete()
        request_schedule(f"job {job.pk} finished")
    stop_job_workers(job.pk, locked.generation + 1, "finished")
    broadcast.job_changed(locked)
    broadcast.allocation_changed()


def _worker_failed(job: Job, event: WorkerEvent, node: Node) -> None:
    """A worker of the job died: plan a generation without its device (its peers hold the
    state of the last completed step and wait for it). Every replan a failure causes counts
    once towards MAX_RESTARTS."""
    what = f"worker rank {event.rank} of generation {event.generation} failed (exit code {event.exit_code})"
    device = Device.objects.filter(node=node, index=event.device_index).values_list("pk", flat=True).first()
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.state not in ACTIVE_STATES:
            return
        first = not locked.restart_requested
        locked.failed_devices = sorted({*locked.failed_devices, *([device] if device is not None else [])})
        locked.restart_requested = True
        locked.restarts += 1 if first else 0
        locked.message = f"{what}; replanning without it"
        locked.save(update_fields=["failed_devices", "restart_requested", "restarts", "message"])
        give_up = locked.restarts > settings.BUNGEE["MAX_RESTARTS"]
        failed = False
        if give_up:
            failed = locked.claim(
                JobState.FAILED,
                finished_at=timezone.now(),
                restart_requested=False,
                message=f"{what}; gave up after {locked.restarts - 1} restarts",
            )
            if failed:
                locked.allocations.all().delete()
        request_schedule(f"job {job.pk} lost a worker")
    if failed:
        stop_job_workers(job.pk, locked.generation + 1, "finished")
        broadcast.allocation_changed()
    broadcast.job_changed(locked)


_EVENT_HANDLERS = {
    "started": _on_started,
    "joined": _on_joined,
    "resized": _on_resized,
    "progress": _on_progress,
    "log": _on_log,
    "step_times": _on_step_times,
    "exited": _on_exited,
}
