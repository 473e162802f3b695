"""One scheduling cycle: snapshot -> policy -> lifecycle.plan(), then lifecycle.publish() for
every job with a generation to publish. Running it twice on the same state changes nothing the
second time. The cycle reads the world once (build_snapshot's CycleView, the devices among it)
and every step takes that view; what it plans is written into the view, not read back.

A job changes one generation at a time: while its newest generation is on its way to forming
(or its leavers are still on their way out), the plan waits, unless that generation was lost or
expired (then the job is planned again from the members that are alive, leaving out the devices
whose worker died or never got ready, if the job can do without them) or a device it holds was
taken away. The workers that hold the training state keep the lowest ranks, so that rank 0,
which leads the switch, is a survivor."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic.membership.compose import holders_first
from elastic.scheduling import Plan
from portal.cluster import drain
from portal.cluster.models import Device, Node
from portal.jobs import lifecycle
from portal.jobs.models import Generation, Job, listed
from portal.live import broadcast
from portal.scheduling.decisions import record_decision, store_job_reasons
from portal.scheduling.policy import configured_policy, policy_name
from portal.scheduling.snapshot import CycleView, build_snapshot

log = logging.getLogger(__name__)

@dataclass
class CycleResult:
    changed_jobs: list[int] = field(default_factory=list)
    launched_jobs: list[int] = field(default_factory=list)
    decision_ms: float = 0.0
    """How long the policy took to plan."""


def _target(planned: tuple[int, ...], generation: Generation | None, min_workers: int,
            holders: dict[int, int]) -> tuple[int, ...]:
    """The devices the job gets: the plan, without the devices its lost or expired generation
    left out (a worker died there, or never got ready) if the job can run without them, the
    holders of the state first in their current rank order."""
    excluded = set(generation.excluded_devices) if lifecycle.needs_replan(generation) and generation else set()
    kept = tuple(d for d in planned if d not in excluded)
    target = kept if len(kept) >= min_workers else planned
    return tuple(holders_first(target, holders))


DRAINED_STATES = (Node.State.DRAINING, Node.State.DRAINED)


def _resize_reason(job: Job, generation: Generation | None, current: tuple[int, ...],
                   devices: Mapping[int, Device], plan: Plan) -> tuple[str, str]:
    """Why the job's membership changes, for its resize history, and a sentence for its message
    if it must wait: the true cause, first the generation that ended, then a device that went
    away (its owner back, its node draining (the cause of the drain) or lost)."""
    if lifecycle.needs_replan(generation) and generation is not None:
        return generation.end_reason or str(generation.phase), ""
    held = [devices[d] for d in current if d in devices]
    if any(d.owner_present for d in held):
        return "owner reclaimed a device", ""
    leaving = sorted({d.node.name: d.node for d in held if d.node.state in DRAINED_STATES}.items())
    if leaving:
        cause = drain.cause_text(leaving[0][1])
        names = ", ".join(name for name, _ in leaving)
        return cause, f"node {names} drained: {cause.removeprefix('node ')}"
    if any(d.node.state == Node.State.LOST for d in held):
        return "node lost", ""
    if any(not d.present for d in held):
        return "device gone", ""  # its agent does not report it any more
    if any(action.job_id == job.pk and action.replacement is not None for action in plan.stragglers):
        return "straggler replaced", ""
    return ("manual resize" if job.pinned_workers is not None else "scheduler"), ""


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


def apply_plan(plan: Plan, view: CycleView) -> list[int]:
    """Write the plan: a new generation for every job whose set of devices changes, or whose
    newest generation was lost or expired; each is written into `view` too. Returns their ids."""
    jobs, newest = view.jobs, view.newest
    current = {job.id: job.current for job in view.snapshot.jobs}
    targets = {
        job_id: _target(planned, newest.get(job_id), jobs[job_id].min_workers, view.holders(job_id))
        for job_id, planned in plan.assignments.items()
    }
    available = {device.id for device in view.snapshot.devices if device.available}
    replan = {job_id for job_id in plan.assignments if lifecycle.needs_replan(newest.get(job_id))}
    # A target of the same devices in another order is no change: the ranks of a running group
    # are the members' own business (holders first was settled when it formed), and a generation
    # that only reorders them would cost a resize and record one that moved nothing.
    changing = [
        job_id
        for job_id, target in targets.items()
        if (set(target) != set(current[job_id]) or job_id in replan)
        and (
            job_id in replan
            or not view.resize_in_flight(job_id)
            or not set(current[job_id]) <= available  # a device it holds is gone: no waiting
        )
    ]
    changing = _unblocked(changing, targets, current)
    if not changing:
        return []
    plans = [
        lifecycle.GenerationPlan(
            job_id, jobs[job_id].generation, targets[job_id], current[job_id],
            *_resize_reason(jobs[job_id], newest.get(job_id), current[job_id], view.devices.by_id, plan),
        )
        for job_id in changing
    ]
    written = lifecycle.plan(plans, lambda fresh: _unblocked(fresh, targets, current), view.devices)
    for job_id, generation in written.items():
        view.planned_now(job_id, generation, targets[job_id])
    return list(written)


def run_cycle() -> CycleResult:
    """One full cycle; returns which jobs got a new generation and which were launched. Lost
    nodes and overdue generations are handled first, whatever asked for the cycle, so that no
    deadline depends on the beat alone."""
    lifecycle.nodes_lost()
    lifecycle.expire_overdue()
    policy = configured_policy()
    view = build_snapshot()
    started = time.perf_counter()
    plan = policy(view.snapshot)
    decision_ms = (time.perf_counter() - started) * 1000
    result = CycleResult(changed_jobs=apply_plan(plan, view), decision_ms=decision_ms)
    # The reasons count free devices from the allocations as written (view.held, kept up to
    # date as the plan is written), which the job list shows.
    explained = store_job_reasons(plan, view)
    record_decision(policy_name(), decision_ms, plan, view, result.changed_jobs)
    for job_id in sorted(view.planned):
        if lifecycle.publish(job_id, view.to_publish(job_id)):
            result.launched_jobs.append(job_id)
    if result.changed_jobs:
        log.info("scheduler (%s, %.1f ms): new generations for jobs %s", policy_name(), decision_ms,
                 result.changed_jobs)
    # One message for every job the cycle changed: a new job moves every queued one's place.
    broadcast.jobs_changed(listed(Job.objects.filter(pk__in={*result.changed_jobs, *explained})))
    if result.changed_jobs:
        # Read, not taken from the view: a job that ended meanwhile (its owner cancelled it) has
        # freed its devices, and the boards must not be told it still holds them.
        broadcast.allocation_changed(lifecycle.allocation_rows())
    return result
