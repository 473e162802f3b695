"""What agents tell the portal: registration, and the report they send every interval (device
samples, worker events, running workers). The database stays the source of truth; samples'
latest values go to Redis and, downsampled, to the history table."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from elastic.wire import AgentReport, DeviceSample, NodeRegistration, RegistrationReply, WorkerEvent
from portal.cluster.models import Device, Node
from portal.cluster.models import DeviceSample as DeviceSampleRow
from portal.cluster.state import latest_key
from portal.jobs.models import Job, JobLog, JobMetric, ResizeEvent, Worker
from portal.jobs.states import ACTIVE_STATES, JobState
from portal.live import broadcast
from portal.redis import client
from portal.scheduling.dispatch import launch_if_ready, stop_job_workers, stream_for
from portal.scheduling.trigger import request_schedule

log = logging.getLogger(__name__)

LATEST_SAMPLE_TTL_S = 60
LOG_LINE_LIMIT = 2000


def _at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=UTC)


def register_node(registration: NodeRegistration) -> tuple[Node, RegistrationReply]:
    """Create or refresh the node and its devices. A device the agent no longer reports is
    marked absent (its history is kept). Asks the scheduler to run."""
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
        # The agent restarted: whatever workers we thought it ran are gone.
        Worker.objects.filter(node=node, state=Worker.State.RUNNING).update(
            state=Worker.State.EXITED, reason="agent restarted", exited_at=now
        )
        # Launched generations on this node must be launched again.
        Job.objects.filter(
            state__in=ACTIVE_STATES, allocations__device__node=node
        ).update(restart_requested=True)
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


def _on_started(node: Node, job: Job, event: WorkerEvent) -> None:
    Worker.objects.update_or_create(
        job=job,
        generation=event.generation,
        rank=event.rank,
        defaults={
            "node": node,
            "device_index": event.device_index or 0,
            "pid": event.pid,
            "state": Worker.State.RUNNING,
            "started_at": _at(event.at),
        },
    )


def _on_progress(node: Node, job: Job, event: WorkerEvent) -> None:
    at = _at(event.at)
    previous_progress_at = job.last_progress_at
    updated = Job.objects.filter(pk=job.pk, generation__lte=event.generation).update(
        steps_done=event.step or 0,
        last_loss=event.loss,
        samples_per_s=event.samples_per_s,
        last_progress_at=at,
    )
    if updated != 1:
        return  # a late report from a generation that has been replaced
    JobMetric.objects.create(
        job=job,
        generation=event.generation,
        step=event.step or 0,
        epoch=event.epoch,
        loss=event.loss,
        samples_per_s=event.samples_per_s,
        at=at,
    )
    job.refresh_from_db()
    if job.state == JobState.RESIZING and event.generation == job.generation:
        if job.claim(JobState.RUNNING, message=f"running on {job.allocations.count()} workers"):
            pause = (at - previous_progress_at).total_seconds() if previous_progress_at else None
            ResizeEvent.objects.filter(job=job, generation=job.generation).update(
                completed_at=at, pause_s=pause
            )
            broadcast.job_changed(job)
    elif job.state == JobState.RUNNING and event.generation == job.generation:
        first_step = ResizeEvent.objects.filter(
            job=job, generation=job.generation, completed_at=None
        ).update(completed_at=at)
        if first_step:
            Job.objects.filter(pk=job.pk).update(message=f"running on {job.allocations.count()} workers")
            broadcast.job_changed(job)
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
            "at": event.at,
        },
    )
    broadcast.send(
        broadcast.CLUSTER_GROUP,
        {"type": "job_progress", "job_id": job.pk, "steps_done": event.step, "total_steps": job.total_steps},
    )


def _on_log(node: Node, job: Job, event: WorkerEvent) -> None:
    line = (event.message or "")[:LOG_LINE_LIMIT]
    row = JobLog.objects.create(job=job, generation=event.generation, rank=event.rank, at=_at(event.at), line=line)
    broadcast.send(
        broadcast.job_group(job.pk),
        {"type": "log", "id": row.pk, "job_id": job.pk, "rank": event.rank, "generation": event.generation,
         "line": line, "at": event.at},
    )


def _on_exited(node: Node, job: Job, event: WorkerEvent) -> None:
    now = timezone.now()
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
    elif job.state in ACTIVE_STATES and event.reason == "failed" and event.generation == job.generation:
        _worker_failed(job, event)
    launch_if_ready(job.pk)


def _finish(job: Job, now: datetime) -> None:
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.state not in ACTIVE_STATES:
            return
        locked.claim(JobState.SUCCEEDED, finished_at=now, steps_done=locked.total_steps,
                     message="trained every step")
        locked.allocations.all().delete()
        request_schedule(f"job {job.pk} finished")
    stop_job_workers(job.pk, locked.generation + 1, "finished")
    broadcast.job_changed(locked)
    broadcast.allocation_changed()


def _worker_failed(job: Job, event: WorkerEvent) -> None:
    what = f"worker rank {event.rank} of generation {event.generation} failed (exit code {event.exit_code})"
    claimed = Job.objects.filter(pk=job.pk, generation=event.generation, restart_requested=False).update(
        restart_requested=True, restarts=F("restarts") + 1
    )
    if claimed != 1:
        return  # its peers failing with it: already handled
    job.refresh_from_db()
    if job.restarts > settings.BUNGEE["MAX_RESTARTS"]:
        with transaction.atomic():
            failed = job.claim(JobState.FAILED, finished_at=timezone.now(), restart_requested=False,
                               message=f"{what}; gave up after {job.restarts - 1} restarts")
            if failed:
                job.allocations.all().delete()
            request_schedule(f"job {job.pk} failed")
        if failed:
            stop_job_workers(job.pk, job.generation + 1, "finished")
        broadcast.allocation_changed()
    else:
        Job.objects.filter(pk=job.pk).update(message=f"{what}; restarting from the last checkpoint")
        request_schedule(f"job {job.pk} restart")
    broadcast.job_changed(job)


_EVENT_HANDLERS = {
    "started": _on_started,
    "progress": _on_progress,
    "log": _on_log,
    "exited": _on_exited,
}
