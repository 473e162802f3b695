"""What the scheduler tells people about a plan: each job's reasons (stored on the job, shown on
the board and the job page, pushed live), and the decision as a whole (the staff page)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from django.conf import settings

from elastic.scheduling import ClusterSnapshot, JobView, Plan, Reason
from elastic.scheduling.queue import QueueEntry, explain_queue
from elastic.wording import counted
from portal.jobs.models import Job
from portal.scheduling.models import SchedulerDecision
from portal.scheduling.snapshot import CycleView


def reasons_of(job: JobView, plan: Plan, snapshot: ClusterSnapshot) -> tuple[Reason, ...]:
    """The plan's reasons for `job`; for a policy that gives none (the backbone's `fair`), the
    plain ones that its assignment shows."""
    given = plan.reasons.get(job.id)
    if given is not None:
        return given
    devices = plan.assignments.get(job.id, ())
    if job.pinned_workers is not None:
        first = Reason.PIN_UNMET if job.id in plan.pin_problems else Reason.PINNED
    elif not devices:
        first = Reason.WAITING
    else:
        first = Reason.MINIMUM if len(devices) == job.min_workers else Reason.FAIR_SHARE
    lent = {d.id for d in snapshot.devices if d.lent}
    return (first, Reason.BORROWED) if lent.intersection(devices) else (first,)


def explain(job: JobView, plan: Plan, snapshot: ClusterSnapshot, held: Collection[int]) -> str:
    """One sentence (or a few, joined by "; ") on why `job` has what the plan gives it. `held`:
    the devices that jobs hold once the plan is written (their allocations), which the job list
    and the board show beside the sentence: a device is free only if no job holds it. (Counted
    from the plan instead, a shrink still waiting for its resize in flight left "3 free" beside
    a listing of 3 of 4 devices held.)"""
    devices = plan.assignments.get(job.id, ())
    lent = {d.id for d in snapshot.devices if d.lent}
    parts: list[str] = []
    for reason in reasons_of(job, plan, snapshot):
        if reason in (Reason.PINNED, Reason.PIN_UNMET) and job.pinned_workers is not None:  # only a pinned job has them
            pinned = f"pinned to {counted(job.pinned_workers, 'worker')}"
            parts.append(f"{pinned} by a manual resize" if reason == Reason.PINNED else f"{pinned}, which cannot be met now")
        elif reason == Reason.MINIMUM:
            parts.append(f"its minimum of {counted(job.min_workers, 'worker')}")
        elif reason == Reason.FAIR_SHARE:
            parts.append(f"its fair share: {counted(len(devices), 'worker')}")
        elif reason == Reason.THROUGHPUT:
            parts.append(f"{counted(len(devices), 'worker')}, where it adds the most throughput")
        elif reason == Reason.GANG:
            parts.append(f"the {counted(job.gang_size, 'worker')} it asked for")
        elif reason == Reason.BORROWED:
            borrowed = sum(1 for d in devices if d in lent)
            parts.append(f"{counted(borrowed, 'borrowed device')} that their owner may take back at any time")
        elif reason == Reason.WAITING:
            free = sum(1 for d in snapshot.devices if d.available and d.id not in held)
            pool = "devices" if job.priority == "guaranteed" else "shared or lent devices"
            if job.min_workers > len(snapshot.devices):
                parts.append(
                    f"cannot start on the cluster as it is: needs at least {counted(job.min_workers, 'worker')} and the "
                    f"cluster has {counted(len(snapshot.devices), 'device')}; it starts once nodes join (or lower min_workers)"
                )
            else:
                parts.append(f"waiting for {pool}: needs at least {job.min_workers}, {free} free")
        elif reason == Reason.NOT_WORTH:
            parts.append(plan.notes.get(job.id, "more workers not worth their cost"))
        elif reason == Reason.STRAGGLER_REPLACED:
            parts.append("a slow worker is moving to a free device")
        elif reason == Reason.STRAGGLER_UNLOADED:
            parts.append("a slow worker carries fewer virtual workers")
        else:
            parts.append(str(reason))
    return "; ".join(parts)[:300]


ESTIMATE_SLACK_S = 30.0
"""An estimate that moves by less than this (or a tenth of the time until it) is not rewritten
nor pushed: the queue does not flicker at every cycle."""


def queue_view(entry: QueueEntry, jobs: dict[int, Job], now: float) -> dict[str, Any]:
    """A waiting job's QueueEntry as stored on the job and shown: Unix times, holders named."""

    def at(seconds: float | None) -> float | None:
        return None if seconds is None else round(now + seconds, 1)

    return {
        "position": entry.position,
        "waiting": entry.waiting,
        "holders": [
            {"id": h.job_id, "name": jobs[h.job_id].name, "owner": jobs[h.job_id].owner.get_username(),
             "devices": h.devices, "pinned": h.pinned, "finish_estimate_at": at(h.finishes_in_s)}
            for h in entry.holders[:5]
        ],
        "start_estimate_at": at(entry.starts_in_s),
        "no_estimate": entry.no_estimate,
    }


def _times(view: dict[str, Any]) -> list[float | None]:
    return [view.get("start_estimate_at"), *(h["finish_estimate_at"] for h in view.get("holders", []))]


def _same_queue(old: dict[str, Any], new: dict[str, Any], now: float) -> bool:
    """Whether `new` says what `old` says, up to estimates that moved within the slack."""
    if {**old, "holders": None, "start_estimate_at": None} != {**new, "holders": None, "start_estimate_at": None}:
        return False
    if [{**h, "finish_estimate_at": None} for h in old.get("holders", [])] != [
        {**h, "finish_estimate_at": None} for h in new.get("holders", [])
    ]:
        return False
    for before, after in zip(_times(old), _times(new), strict=True):
        if (before is None) != (after is None):
            return False
        if before is not None and after is not None:
            if abs(before - after) > max(ESTIMATE_SLACK_S, 0.1 * max(after - now, 0.0)):
                return False
    return True


def store_job_reasons(plan: Plan, cycle: CycleView) -> list[int]:
    """Writes each job's reasons, note, pin problem, queue view and (hybrid) batch size where
    they changed, with the devices jobs hold once the plan is written (`cycle.held`, explain).
    Returns the ids of the jobs that changed, to be pushed to the browsers."""
    jobs, snapshot, held = cycle.jobs, cycle.snapshot, cycle.held
    changed = []
    ends = {job.pk: at - snapshot.now for job in jobs.values() if (at := job.finish_estimate_at()) is not None}
    queue = explain_queue(snapshot, plan, ends)
    for view in snapshot.jobs:
        job = jobs[view.id]
        fields: dict[str, Any] = {
            "schedule_reasons": [str(r) for r in reasons_of(view, plan, snapshot)],
            "schedule_note": explain(view, plan, snapshot, held),
            "pin_problem": plan.pin_problems.get(view.id, ""),
            "queue": queue_view(queue[view.id], jobs, snapshot.now) if view.id in queue else {},
        }
        if job.consistency == Job.Consistency.HYBRID and view.id in plan.batch_sizes:
            fields["batch_size"] = plan.batch_sizes[view.id]
        if fields["queue"] and job.queue and _same_queue(job.queue, fields["queue"], snapshot.now):
            del fields["queue"]
        stale = {name: value for name, value in fields.items() if getattr(job, name) != value}
        if stale:
            Job.objects.filter(pk=view.id).update(**stale)
            changed.append(view.id)
    return changed


def record_decision(
    policy: str, decision_ms: float, plan: Plan, cycle: CycleView, changed_jobs: list[int]
) -> SchedulerDecision:
    """Stores the decision, its devices named by their member keys, and forgets all but the
    newest DECISIONS_KEPT. Returns it."""
    jobs, snapshot, held, label = cycle.jobs, cycle.snapshot, cycle.held, cycle.devices.key
    owners = {d.id: d.owner for d in snapshot.devices if d.owner}
    holder = {device: job_id for job_id, devices in plan.assignments.items() for device in devices}
    rows = []
    for view in sorted(snapshot.jobs, key=lambda v: v.id):
        job = jobs[view.id]
        target = plan.assignments.get(view.id, ())
        rows.append(
            {
                "id": view.id,
                "name": job.name,
                "owner": job.owner.get_username(),
                "priority": view.priority,
                "min_workers": view.min_workers,
                "max_workers": view.max_workers,
                "pinned_workers": view.pinned_workers,
                "workers_before": len(view.current),
                "target": [label(d) for d in target],
                "reasons": [str(r) for r in reasons_of(view, plan, snapshot)],
                "note": explain(view, plan, snapshot, held),
                "pin_problem": plan.pin_problems.get(view.id, ""),
                "batch_size": plan.batch_sizes.get(view.id),
            }
        )
    lent = [
        {"device": label(d), "owner": owner, "job": holder[d]}
        for d, owner in sorted(owners.items())
        if d in holder
    ]
    stragglers = [
        {
            "job": s.job_id,
            "device": label(s.slow_device),
            "slowdown": round(s.slowdown, 3),
            "replacement": label(s.replacement)
            if s.replacement is not None and s.replacement in cycle.devices.by_id
            else None,
            "virtual_workers": list(s.virtual_workers) if s.virtual_workers else None,
        }
        for s in plan.stragglers
    ]
    decision = SchedulerDecision.objects.create(
        policy=policy,
        resize_cost_s=settings.BUNGEE.resize_cost_s,
        decision_ms=decision_ms,
        devices_total=len(snapshot.devices),
        devices_available=sum(1 for d in snapshot.devices if d.available),
        jobs=rows,
        lent_devices=lent,
        stragglers=stragglers,
        changed_jobs=changed_jobs,
    )
    kept = SchedulerDecision.objects.values_list("pk", flat=True)[: settings.BUNGEE.decisions_kept]
    SchedulerDecision.objects.exclude(pk__in=list(kept)).delete()
    return decision
