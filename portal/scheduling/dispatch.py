"""Commands to agents, on each node's Redis stream. Every command names the job's generation, so
that a repeated or late one is harmless (the agent ignores what it has already done or passed)."""

from __future__ import annotations

import logging
import os

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from elastic.wire import LaunchCommand, StopCommand, WorkerAssignment, command_stream
from portal.jobs.models import Job, Worker
from portal.jobs.states import JobState
from portal.live import broadcast
from portal.redis import client

log = logging.getLogger(__name__)

STREAM_MAXLEN = 10_000


def stream_for(node_name: str) -> str:
    return command_stream(node_name, settings.BUNGEE["REDIS_PREFIX"])


def send(node_name: str, command: LaunchCommand | StopCommand) -> None:
    client().xadd(
        stream_for(node_name), {"command": command.model_dump_json()}, maxlen=STREAM_MAXLEN, approximate=True
    )


def stop_job_workers(job_id: int, before_generation: int, reason: str) -> None:
    """Ask every node that runs a worker of the job older than `before_generation` to stop it."""
    nodes = (
        Worker.objects.filter(job_id=job_id, state=Worker.State.RUNNING, generation__lt=before_generation)
        .values_list("node__name", flat=True)
        .distinct()
    )
    for node_name in nodes:
        send(node_name, StopCommand(job_id=job_id, before_generation=before_generation, reason=reason))


def run_dir(job: Job) -> str:
    """The job's checkpoint directory. Named by id and submission time, so that a database
    that starts over (ids reused) never resumes a job from another job's checkpoint."""
    return os.path.join(settings.BUNGEE["RUN_DIR"], f"job-{job.pk}-{job.created_at:%Y%m%dT%H%M%S%f}")


def launch_if_ready(job_id: int) -> bool:
    """Launch the job's current generation once none of its older workers is still running.
    Returns whether this call sent the launch (a conditional UPDATE makes it happen once)."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None or job.state not in (JobState.QUEUED, JobState.RUNNING, JobState.RESIZING):
        return False
    if job.launched_generation >= job.generation:
        return False
    if Worker.objects.filter(job=job, state=Worker.State.RUNNING, generation__lt=job.generation).exists():
        return False
    allocations = list(job.allocations.select_related("device__node").order_by("rank"))
    if not allocations or any(a.generation != job.generation for a in allocations):
        return False
    with transaction.atomic():
        claimed = Job.objects.filter(
            pk=job.pk, generation=job.generation, launched_generation__lt=job.generation
        ).update(launched_generation=job.generation)
        if claimed != 1:
            return False
        if job.state == JobState.QUEUED:
            job.claim(JobState.RUNNING, started_at=job.started_at or timezone.now(), message="workers starting")
    master = allocations[0].device.node
    per_node: dict[str, list[WorkerAssignment]] = {}
    for allocation in allocations:
        per_node.setdefault(allocation.device.node.name, []).append(
            WorkerAssignment(rank=allocation.rank, device_index=allocation.device.index)
        )
    for node_name, workers in per_node.items():
        send(
            node_name,
            LaunchCommand(
                job_id=job.pk,
                generation=job.generation,
                world_size=len(allocations),
                master_addr=master.address,
                master_port=job.master_port or settings.BUNGEE["MASTER_PORT_BASE"],
                workers=workers,
                spec=job.spec,
                run_dir=run_dir(job),
            ),
        )
    log.info("job %s: launched generation %s on %s", job.pk, job.generation, sorted(per_node))
    broadcast.job_changed(job)
    return True
