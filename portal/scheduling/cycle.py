"""One scheduling cycle: read the cluster from the database, ask the policy for a plan, write
what changed as new generations, then publish them (dispatch.publish_generation). Running it
twice on the same state changes nothing the second time.

A job changes one generation at a time: while its joiners warm up (or its leavers are still on
their way out), the plan waits, unless a worker of the job died (then the survivors wait for a
new generation, which leaves the dead worker's device out if the job can do without it) or a
device it holds was taken away. The workers that hold the training state keep the lowest ranks,
so that rank 0, which leads the switch, is a survivor."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction

from elastic.scheduling import ClusterSnapshot, Plan
from portal.cluster.models import Device, Node
from portal.jobs.models import Allocation, Job, ResizeEvent, Worker
from portal.jobs.states import ACTIVE_STATES, JobState
from portal.live import broadcast
from portal.scheduling.decisions import record_decision, store_job_reasons
from portal.scheduling.dispatch import publish_generation, stop_job_workers, stop_workers_on
from portal.scheduling.heartbeats import beating
from portal.scheduling.policy import configured_policy, policy_name
from portal.scheduling.snapshot import build_snapshot

log = logging.getLogger(__name__)

MASTER_PORT_SPAN = 5000


@dataclass
class CycleResult:
    changed_jobs: list[int] = field(default_factory=list)
    launched_jobs: list[int] = field(default_factory=list)
    decision_ms: float = 0.0
    """How long the policy took to plan."""


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


def resize_in_flight(job: Job) -> bool:
    """Whether the job's newest generation is published but its group has not formed yet, or
    formed but a leaver is still on its way out (so that no newer plan takes it for a survivor)."""
    if job.launched_generation == job.generation > job.active_generation:
        return True
    allocated = job.allocations.values_list("device__node_id", "device__index")
    running = Worker.objects.filter(job=job, state=Worker.State.RUNNING).values_list("node_id", "device_index")
    return bool(set(running) - set(allocated))


def _holder_ranks(job_ids: list[int]) -> dict[int, dict[int, int]]:
    """Per job, the devices whose worker holds the training state, with its rank."""
    devices = {(d.node_id, d.index): d.pk for d in Device.objects.all()}
    holders: dict[int, dict[int, int]] = {job_id: {} for job_id in job_ids}
    rows = Worker.objects.filter(job_id__in=job_ids, state=Worker.State.RUNNING, joined_at__isnull=False)
    for row in rows.order_by("generation"):
        device_id = devices.get((row.node_id, row.device_index))
        if device_id is not None:
            holders[row.job_id][device_id] = row.rank
    return holders


def _target(job: Job, planned: tuple[int, ...], holders: dict[int, int]) -> tuple[int, ...]:
    """The devices the job gets: the plan, without the devices whose worker died if the job
    can run without them, the holders of the state first in their current rank order."""
    kept = tuple(d for d in planned if d not in set(job.failed_devices))
    target = kept if len(kept) >= job.min_workers else planned
    order = {device: index for index, device in enumerate(target)}
    return tuple(sorted(target, key=lambda d: (0, holders[d]) if d in holders else (1, order[d])))


def _resize_reason(job: Job, current: tuple[int, ...], available: set[int], plan: Plan) -> str:
    """Why the job's membership changes, for its resize history."""
    taken = Device.objects.filter(pk__in=set(current) - available).select_related("node")
    if any(device.owner_present for device in taken):
        return "owner reclaimed a device"
    if any(device.node.state == Node.State.LOST for device in taken):
        return "node lost"
    if taken:
        return "device gone"  # its agent does not report it any more
    if job.restart_requested:
        return "a worker exited"
    if any(action.job_id == job.pk and action.replacement is not None for action in plan.stragglers):
        return "straggler replaced"
    return "manual resize" if job.pinned_workers is not None else "scheduler"


def _unblocked(
    changing: list[int], targets: dict[int, tuple[int, ...]], current: dict[int, tuple[int, ...]]
) -> list[int]:
    """The jobs of `changing` that can take their target now: not one whose target has a device
    that a job which is not changing still holds (it waits for a resize in flight; the cycle
    after it hands the device over)."""
    holder = {device: job_id for job_id, devices in current.items() for device in devices}
    ready = list(changing)
    while True:
        moving = set(ready)
        blocked = {
            job_id
            for job_id in ready
            if any(holder.get(d, job_id) != job_id and holder[d] not in moving for d in targets[job_id])
        }
        if not blocked:
            return ready
        ready = [job_id for job_id in ready if job_id not in blocked]


def apply_plan(plan: Plan, jobs: dict[int, Job], snapshot: ClusterSnapshot) -> list[int]:
    """Write the plan: a new generation for every job whose devices change. Returns their ids."""
    current = {view.id: view.current for view in snapshot.jobs}
    holders = _holder_ranks(list(plan.assignments))
    targets = {
        job_id: _target(jobs[job_id], planned, holders[job_id]) for job_id, planned in plan.assignments.items()
    }
    available = {device.id for device in snapshot.devices if device.available}
    changing = [
        job_id
        for job_id, target in targets.items()
        if (target != current[job_id] or jobs[job_id].restart_requested)
        and (
            jobs[job_id].restart_requested
            or not resize_in_flight(jobs[job_id])
            or not set(current[job_id]) <= available  # a device it holds is gone: no waiting
        )
    ]
    changing = _unblocked(changing, targets, current)
    if not changing:
        return []
    names = {d.pk: str(d) for d in Device.objects.select_related("node").filter(
        pk__in={d for job_id in changing for d in (*current[job_id], *targets[job_id])}
    )}
    changed: list[int] = []
    with transaction.atomic():
        locked = {
            j.pk: j
            for j in Job.objects.select_for_update().filter(pk__in=changing, state__in=ACTIVE_STATES)
        }
        # Only jobs nobody touched since the snapshot; the next cycle handles the others.
        fresh = _unblocked(
            [
                job_id for job_id in changing
                if job_id in locked and locked[job_id].generation == jobs[job_id].generation
            ],
            targets,
            current,
        )
        Allocation.objects.filter(job_id__in=fresh).delete()
        for job_id in fresh:
            job = locked[job_id]
            target = targets[job_id]
            generation = job.generation + 1
            Allocation.objects.bulk_create(
                Allocation(job=job, device_id=device_id, rank=rank, generation=generation)
                for rank, device_id in enumerate(target)
            )
            has_workers = Worker.objects.filter(job=job, state=Worker.State.RUNNING).exists()
            reason = _resize_reason(job, current[job_id], available, plan)
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
                "failed_devices": [],
                "master_port": _free_port(job, generation) if target else None,
            }
            if not target:
                fields["message"] = "waiting for devices"
                if job.state != JobState.QUEUED:
                    job.claim(JobState.QUEUED, **fields)
                else:
                    Job.objects.filter(pk=job_id).update(**fields)
            elif job.state in (JobState.RUNNING, JobState.RESIZING):
                fields["message"] = f"resizing to {len(target)} workers ({reason})"
                if job.state == JobState.RUNNING:
                    job.claim(JobState.RESIZING, **fields)
                else:
                    Job.objects.filter(pk=job_id).update(**fields)
            else:
                waiting = " once its stopping workers are gone" if has_workers else ""
                fields["message"] = f"starting {len(target)} workers{waiting}"
                Job.objects.filter(pk=job_id).update(**fields)
            changed.append(job_id)
    # After the commit, so that an agent that acts at once finds the generation stored; the
    # cycle publishes the others (publish_generation).
    for job_id in changed:
        if not targets[job_id]:
            stop_job_workers(job_id, jobs[job_id].generation + 1, "resize")
    return changed


def run_cycle() -> CycleResult:
    """One full cycle; returns which jobs got a new generation and which were launched."""
    policy = configured_policy()
    snapshot, jobs = build_snapshot()
    started = time.perf_counter()
    plan = policy(snapshot)
    decision_ms = (time.perf_counter() - started) * 1000
    explained = store_job_reasons(plan, jobs, snapshot)
    result = CycleResult(changed_jobs=apply_plan(plan, jobs, snapshot), decision_ms=decision_ms)
    record_decision(policy_name(), decision_ms, plan, jobs, snapshot, result.changed_jobs)
    for job_id in Job.objects.filter(state__in=ACTIVE_STATES).values_list("pk", flat=True):
        if publish_generation(job_id):
            result.launched_jobs.append(job_id)
    if result.changed_jobs:
        log.info("scheduler (%s, %.1f ms): new generations for jobs %s", policy_name(), decision_ms,
                 result.changed_jobs)
    for job in Job.objects.filter(pk__in={*result.changed_jobs, *explained}):
        broadcast.job_changed(job)
    if result.changed_jobs:
        broadcast.allocation_changed()
    return result


def mark_lost_nodes() -> list[str]:
    """Nodes silent for longer than NODE_TIMEOUT_S become lost, and their workers exited, unless
    a worker of theirs still beats (portal.scheduling.heartbeats): then only the agent is gone,
    the workers train on, and the node is unreachable, its workers and plan untouched, until the
    agent reports again or the heartbeats stop too. Returns the names of the nodes this call
    marked lost."""
    from datetime import timedelta

    from django.utils import timezone

    deadline = timezone.now() - timedelta(seconds=settings.BUNGEE["NODE_TIMEOUT_S"])
    silent = Node.objects.filter(
        state__in=(Node.State.ONLINE, Node.State.UNREACHABLE), last_seen_at__lt=deadline
    )
    lost = []
    for node in silent:
        running = Worker.objects.filter(node=node, state=Worker.State.RUNNING)
        if beating(node.name, list(running.values_list("job_id", "device_index", "pid"))):
            if Node.objects.filter(pk=node.pk, state=Node.State.ONLINE).update(state=Node.State.UNREACHABLE):
                log.warning("node %s: agent unreachable, its workers train on", node.name)
            continue
        if Node.objects.filter(pk=node.pk, state=node.state).update(state=Node.State.LOST) == 1:
            # Their peers elsewhere wait for a generation without them.
            Job.objects.filter(pk__in=running.values("job_id"), state__in=ACTIVE_STATES).update(
                restart_requested=True
            )
            running.update(state=Worker.State.EXITED, reason="node lost", exited_at=timezone.now())
            log.warning("node %s lost: no report for %ss", node.name, settings.BUNGEE["NODE_TIMEOUT_S"])
            lost.append(node.name)
    return lost


def expire_stuck_resizes() -> list[int]:
    """Gives up on joiners that have not become ready JOINER_TIMEOUT_S after their generation
    was written: they are stopped and the job is planned again without their devices. Returns
    the ids of the jobs concerned."""
    from datetime import timedelta

    from django.utils import timezone

    deadline = timezone.now() - timedelta(seconds=settings.BUNGEE["JOINER_TIMEOUT_S"])
    expired = []
    for job in Job.objects.filter(state__in=ACTIVE_STATES, restart_requested=False):
        if not resize_in_flight(job):
            continue
        if not ResizeEvent.objects.filter(job=job, generation=job.generation, requested_at__lt=deadline).exists():
            continue
        stuck = list(
            Worker.objects.filter(job=job, state=Worker.State.RUNNING, joined_at__isnull=True).select_related("node")
        )
        devices = list(
            Device.objects.filter(node__in=[w.node for w in stuck], index__in=[w.device_index for w in stuck])
            .values_list("pk", flat=True)
        )
        claimed = Job.objects.filter(pk=job.pk, generation=job.generation, restart_requested=False).update(
            restart_requested=True,
            failed_devices=devices,
            message=f"{len(stuck)} joiner(s) not ready after {settings.BUNGEE['JOINER_TIMEOUT_S']:.0f} s; replanning",
        )
        if claimed == 1:
            log.warning("job %s: joiners %s never became ready; replanning without them", job.pk, devices)
            stop_workers_on(job.pk, stuck, "resize")
            expired.append(job.pk)
    return expired
