"""Commands to agents, on each node's Redis stream, and the job's membership records, on its
board in Redis (elastic.worker.membership). Every command and record names the job's generation,
so that a repeated or late one is harmless (agents and workers ignore what they have passed).

A new generation is published in place: the record goes to the job's board, and each node that
runs or will run a worker of the job gets one LaunchCommand naming the joiners it must start and
the devices of it that stay. Survivors and leavers are told nothing else; they read the board."""

from __future__ import annotations

import logging
import os

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from elastic.membership.redis import RedisBoard as MembershipBoard
from elastic.wire import (
    LaunchCommand,
    Member,
    Membership,
    StopCommand,
    WorkerAssignment,
    command_stream,
    coordination_key,
)
from portal.cluster.models import Device
from portal.jobs.models import Allocation, Job, Worker
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


def stop_workers_on(job_id: int, workers: list[Worker], reason: str) -> None:
    """Ask the nodes of `workers` (rows of the job) to stop just those workers."""
    per_node: dict[str, list[int]] = {}
    for worker in workers:
        per_node.setdefault(worker.node.name, []).append(worker.device_index)
    before = max((worker.generation for worker in workers), default=0) + 1
    for node_name, devices in per_node.items():
        send(node_name, StopCommand(job_id=job_id, before_generation=before, reason=reason, devices=devices))


def board(job_id: int) -> MembershipBoard:
    """The job's membership board in the portal's Redis."""
    return MembershipBoard(client(), coordination_key(job_id, settings.BUNGEE["REDIS_PREFIX"]))


def live_workers(job_id: int) -> dict[tuple[int, int], Worker]:
    """The job's running worker processes by (node id, device index): one row each, the newest."""
    rows = Worker.objects.filter(job_id=job_id, state=Worker.State.RUNNING).select_related("node")
    return {(row.node_id, row.device_index): row for row in rows.order_by("generation")}


def run_dir(job: Job) -> str:
    """The job's checkpoint directory. Named by id and submission time, so that a database
    that starts over (ids reused) never resumes a job from another job's checkpoint."""
    return os.path.join(settings.BUNGEE["RUN_DIR"], f"job-{job.pk}-{job.created_at:%Y%m%dT%H%M%S%f}")


def membership_record(job: Job, allocations: list[Allocation], live: dict[tuple[int, int], Worker]) -> Membership:
    """The record of the job's current generation: its allocations in rank order, each member a
    joiner unless a worker that holds the state runs on its device. A worker that holds the state
    but is not a member hands it over (the donor) when no member holds it."""
    holders = sorted((row for row in live.values() if row.joined_at is not None), key=lambda row: row.rank)
    members = []
    for allocation in allocations:
        device: Device = allocation.device
        row = live.get((device.node_id, device.index))
        members.append(
            Member(
                node=device.node.name,
                device_index=device.index,
                address=device.node.address,
                joiner=row is None or row.joined_at is None,
            )
        )
    donor = None
    if holders and all(member.joiner for member in members):
        donor = Member(node=holders[0].node.name, device_index=holders[0].device_index,
                       address=holders[0].node.address, joiner=False)
    return Membership(
        job_id=job.pk,
        generation=job.generation,
        master_addr=allocations[0].device.node.address,
        master_port=job.master_port or settings.BUNGEE["MASTER_PORT_BASE"],
        members=members,
        has_state=bool(holders),
        donor=donor,
        global_batch=job.batch_size if job.consistency == Job.Consistency.HYBRID else None,
    )


def publish_generation(job_id: int) -> bool:
    """Publishes the job's current generation once: its record on the board, then a launch to
    every node involved. A queued job waits until its old workers (stopping) have exited.
    Returns whether this call published (a conditional UPDATE makes it happen once)."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None or job.state not in (JobState.QUEUED, JobState.RUNNING, JobState.RESIZING):
        return False
    if job.launched_generation >= job.generation:
        return False
    live = live_workers(job.pk)
    if job.state == JobState.QUEUED and live:
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
    record = membership_record(job, allocations, live)
    board(job.pk).publish(record)
    nodes: dict[str, tuple[list[WorkerAssignment], list[int]]] = {}
    for row in live.values():
        nodes.setdefault(row.node.name, ([], []))
    for rank, allocation in enumerate(allocations):
        device = allocation.device
        joiners, members = nodes.setdefault(device.node.name, ([], []))
        members.append(device.index)
        if (device.node_id, device.index) not in live:
            joiners.append(WorkerAssignment(rank=rank, device_index=device.index))
    for node_name, (joiners, members) in nodes.items():
        send(
            node_name,
            LaunchCommand(
                job_id=job.pk,
                generation=job.generation,
                world_size=len(allocations),
                master_addr=record.master_addr,
                master_port=record.master_port,
                workers=joiners,
                members=members,
                spec=job.spec,
                run_dir=run_dir(job),
                coordination_key=board(job.pk).key,
            ),
        )
    log.info(
        "job %s: published generation %s on %s (%s to start)",
        job.pk,
        job.generation,
        [m.key for m in record.members],
        sum(len(joiners) for joiners, _ in nodes.values()),
    )
    broadcast.job_changed(job)
    return True
