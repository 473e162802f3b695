"""One scheduling cycle: read the cluster from the database, ask the policy for a plan, write
what changed as new generations, then send the commands. Running it twice on the same state
changes nothing the second time."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction

from elastic.scheduling import ClusterSnapshot, DeviceView, JobView, Plan, fair_share
from portal.cluster.models import Device, Node
from portal.jobs.models import Allocation, Job, ResizeEvent, Worker
from portal.jobs.states import ACTIVE_STATES, JobState
from portal.live import broadcast
from portal.scheduling.dispatch import launch_if_ready, stop_job_workers

log = logging.getLogger(__name__)

MASTER_PORT_SPAN = 5000


@dataclass
class CycleResult:
    changed_jobs: list[int] = field(default_factory=list)
    launched_jobs: list[int] = field(default_factory=list)


def build_snapshot() -> tuple[ClusterSnapshot, dict[int, Job]]:
    devices = tuple(
        DeviceView(
            id=d.pk,
            node=d.node.name,
            usable=d.present and not d.owner_present and d.node.state == Node.State.ONLINE,
        )
        for d in Device.objects.select_related("node")
    )
    jobs = {j.pk: j for j in Job.objects.filter(state__in=ACTIVE_STATES)}
    current: dict[int, list[int]] = {job_id: [] for job_id in jobs}
    for allocation in Allocation.objects.filter(job_id__in=jobs).order_by("rank"):
        current[allocation.job_id].append(allocation.device_id)
    views = tuple(
        JobView(
            id=job.pk,
            min_workers=job.min_workers,
            max_workers=job.max_workers,
            priority=job.priority,  # type: ignore[arg-type]
            submitted_at=job.created_at.timestamp(),
            current=tuple(current[job.pk]),
            pinned_workers=job.pinned_workers,
        )
        for job in jobs.values()
    )
    return ClusterSnapshot(devices=devices, jobs=views), jobs


def _free_port(job: Job, generation: int) -> int:
    base = settings.BUNGEE["MASTER_PORT_BASE"]
    taken = set(
        Job.objects.filter(state__in=ACTIVE_STATES).exclude(pk=job.pk).values_list("master_port", flat=True)
    )
    offset = (job.pk * 7 + generation) % MASTER_PORT_SPAN
    for step in range(MASTER_PORT_SPAN):
        port = base + (offset + step) % MASTER_PORT_SPAN
        if port not in taken:
            return port
    raise RuntimeError(f"no free rendezvous port in [{base}, {base + MASTER_PORT_SPAN})")


def _device_labels(device_ids: tuple[int, ...], names: dict[int, str]) -> list[str]:
    return [names[d] for d in device_ids]


def apply_plan(plan: Plan, jobs: dict[int, Job], snapshot: ClusterSnapshot) -> list[int]:
    """Write the plan: a new generation for every job whose devices change. Returns their ids."""
    current = {view.id: view.current for view in snapshot.jobs}
    changing = [
        job_id
        for job_id, target in plan.assignments.items()
        if target != current[job_id] or jobs[job_id].restart_requested
    ]
    for job_id in jobs:
        problem = plan.pin_problems.get(job_id, "")
        if jobs[job_id].pin_problem != problem:
            Job.objects.filter(pk=job_id).update(pin_problem=problem)
    if not changing:
        return []
    names = {d.pk: str(d) for d in Device.objects.select_related("node").filter(
        pk__in={d for job_id in changing for d in (*current[job_id], *plan.assignments[job_id])}
    )}
    changed: list[int] = []
    with transaction.atomic():
        locked = {
            j.pk: j
            for j in Job.objects.select_for_update().filter(pk__in=changing, state__in=ACTIVE_STATES)
        }
        # Only jobs nobody touched since the snapshot; the next cycle handles the others.
        fresh = [
            job_id for job_id in changing
            if job_id in locked and locked[job_id].generation == jobs[job_id].generation
        ]
        Allocation.objects.filter(job_id__in=fresh).delete()
        for job_id in fresh:
            job = locked[job_id]
            target = plan.assignments[job_id]
            generation = job.generation + 1
            Allocation.objects.bulk_create(
                Allocation(job=job, device_id=device_id, rank=rank, generation=generation)
                for rank, device_id in enumerate(target)
            )
            has_workers = Worker.objects.filter(job=job, state=Worker.State.RUNNING).exists()
            reason = "restart after a failure" if job.restart_requested else (
                "manual resize" if job.pinned_workers is not None else "scheduler"
            )
            ResizeEvent.objects.create(
                job=job,
                generation=generation,
                reason=reason,
                workers_before=len(current[job_id]),
                workers_after=len(target),
                devices_before=_device_labels(current[job_id], names),
                devices_after=_device_labels(target, names),
            )
            fields: dict[str, object] = {
                "generation": generation,
                "restart_requested": False,
                "master_port": _free_port(job, generation) if target else None,
            }
            if not target:
                fields["message"] = "waiting for devices"
                if job.state != JobState.QUEUED:
                    job.claim(JobState.QUEUED, **fields)
                else:
                    Job.objects.filter(pk=job_id).update(**fields)
            elif job.state == JobState.RUNNING or (job.state == JobState.QUEUED and has_workers):
                fields["message"] = f"resizing to {len(target)} workers ({reason})"
                if job.state == JobState.RUNNING:
                    job.claim(JobState.RESIZING, **fields)
                else:
                    Job.objects.filter(pk=job_id).update(**fields)
            else:
                fields["message"] = f"starting {len(target)} workers"
                Job.objects.filter(pk=job_id).update(**fields)
            changed.append(job_id)
    # After the commit: an agent that acts at once must find the new generation stored.
    for job_id in changed:
        stop_job_workers(job_id, jobs[job_id].generation + 1, "resize")
    return changed


def run_cycle() -> CycleResult:
    """One full cycle; returns which jobs got a new generation and which were launched."""
    snapshot, jobs = build_snapshot()
    plan = fair_share(snapshot)
    result = CycleResult(changed_jobs=apply_plan(plan, jobs, snapshot))
    for job_id in Job.objects.filter(state__in=ACTIVE_STATES).values_list("pk", flat=True):
        if launch_if_ready(job_id):
            result.launched_jobs.append(job_id)
    if result.changed_jobs:
        log.info("scheduler: new generations for jobs %s", result.changed_jobs)
        for job in Job.objects.filter(pk__in=result.changed_jobs):
            broadcast.job_changed(job)
        broadcast.allocation_changed()
    return result


def mark_lost_nodes() -> list[str]:
    """Nodes silent for longer than NODE_TIMEOUT_S become lost, and their workers exited.
    Returns the names of the nodes this call marked."""
    from datetime import timedelta

    from django.utils import timezone

    deadline = timezone.now() - timedelta(seconds=settings.BUNGEE["NODE_TIMEOUT_S"])
    lost = list(Node.objects.filter(state=Node.State.ONLINE, last_seen_at__lt=deadline))
    for node in lost:
        if Node.objects.filter(pk=node.pk, state=Node.State.ONLINE).update(state=Node.State.LOST) == 1:
            Worker.objects.filter(node=node, state=Worker.State.RUNNING).update(
                state=Worker.State.EXITED, reason="node lost", exited_at=timezone.now()
            )
            log.warning("node %s lost: no report for %ss", node.name, settings.BUNGEE["NODE_TIMEOUT_S"])
    return [n.name for n in lost]
