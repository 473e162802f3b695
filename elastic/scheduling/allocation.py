"""The frame every policy but the backbone's runs in: pools, owners, pins, placement, reasons.

A policy only says how many workers each job gets out of a number of devices (a `CountRule`).
This module does the rest, the same way for all of them, so that the guarantees hold whatever
the rule:

- A device whose owner is present, or that is not usable, is given to nobody: owner reclaim
  always wins.
- The shared pool serves guaranteed jobs first. Opportunistic jobs get what guaranteed jobs
  leave of it plus the lent devices (owned devices whose owner is away), lent ones first, so
  that a guaranteed job is never held below its minimum by an opportunistic one, and a
  guaranteed job never lands on a device its owner may take back.
- Within each of those two stages, a pin never holds another job below its minimum: pinned jobs
  first get their own minimum, then the minimums of the unpinned jobs that fit are set aside
  (in service order), and only then are the pins raised towards their count from what is left.
  A pin that falls short is reported, naming the jobs whose minimums it gave way to; the rule
  shares the rest among the unpinned jobs.
- Counts become devices through `placement` (keep what a job holds, grow it near itself); then
  the straggler hook may swap devices; then each job gets its reasons.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from elastic.scheduling.api import ClusterSnapshot, DeviceView, JobView, Plan, Reason
from elastic.scheduling.placement import FreeDevices, Request, place
from elastic.wording import counted


class PlanError(RuntimeError):
    """A count rule returned something the frame cannot place (a bug in the rule)."""


@dataclass(frozen=True)
class Stage:
    """What a count rule sees: the cluster, and whether this is the opportunistic stage."""

    snapshot: ClusterSnapshot
    node_size: int
    """The most devices any node has in this stage's pool (locality: k workers need at least
    ceil(k / node_size) nodes)."""
    opportunistic: bool


@dataclass
class Decision:
    counts: dict[int, int]
    batch_sizes: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, Reason] = field(default_factory=dict)
    notes: dict[int, str] = field(default_factory=dict)
    """The rule's own words on a job's reason, with its numbers (Plan.notes)."""


CountRule = Callable[[Sequence[JobView], int, Stage], Decision]
"""(unpinned jobs, devices free for them, stage) -> how many workers each job gets. Every count
must be 0 or within the job's [min_workers, max_workers], and they must sum to at most the
devices given."""

StragglerHook = Callable[[ClusterSnapshot, Plan, dict[int, FreeDevices]], None]
"""Called with the placed plan and, per job, the devices it could still move to."""


def service_order(job: JobView) -> tuple[float, int]:
    return (job.submitted_at, job.id)


def _node_size(devices: Sequence[DeviceView]) -> int:
    per_node: dict[str, int] = {}
    for device in devices:
        per_node[device.node] = per_node.get(device.node, 0) + 1
    return max(per_node.values(), default=1)


def pin_shortfall(job: JobView, given: int, free: int, kept_for: Sequence[JobView]) -> str:
    """Why `job`'s pin got only `given` workers, for its owner: `free` devices were left for it,
    not counting those set aside for the minimums of `kept_for` (they go first when the pin falls
    short because of them)."""
    assert job.pinned_workers is not None
    head = f"pinned to {counted(job.pinned_workers, 'worker')} but given {given}"
    wanted = min(max(job.pinned_workers, job.min_workers), job.max_workers)
    if kept_for and 0 < given < wanted:
        needs = ", ".join(f"#{other.id} needs {other.min_workers}" for other in kept_for)
        return f"{head}: a pin may not keep another job below its minimum ({needs})"[:300]
    return f"{head}: {counted(free, 'device')} free for it (min {job.min_workers}, max {job.max_workers})"


def _serve_pins(jobs: Sequence[JobView], capacity: int, plan: Plan) -> tuple[dict[int, int], int]:
    pinned = sorted((j for j in jobs if j.pinned_workers is not None), key=service_order)
    counts: dict[int, int] = {}
    left = capacity
    for job in pinned:
        counts[job.id] = job.min_workers if job.min_workers <= left else 0
        left -= counts[job.id]
    kept_for: list[JobView] = []
    set_aside = 0
    for job in sorted((j for j in jobs if j.pinned_workers is None), key=service_order):
        if job.min_workers <= left - set_aside:
            set_aside += job.min_workers
            kept_for.append(job)
    for job in pinned:
        assert job.pinned_workers is not None
        wanted = min(max(job.pinned_workers, job.min_workers), job.max_workers)
        free = counts[job.id] + left - set_aside
        if counts[job.id]:
            extra = min(wanted - counts[job.id], left - set_aside)
            counts[job.id] += extra
            left -= extra
        if counts[job.id] != job.pinned_workers:
            plan.pin_problems[job.id] = pin_shortfall(job, counts[job.id], free, kept_for)
    return counts, left


def _check(decision: Decision, jobs: Sequence[JobView], capacity: int) -> None:
    total = 0
    for job in jobs:
        count = decision.counts.get(job.id, 0)
        if count and not job.min_workers <= count <= job.max_workers:
            raise PlanError(f"job {job.id}: {count} workers outside [{job.min_workers}, {job.max_workers}]")
        total += count
    if total > capacity:
        raise PlanError(f"{total} workers given out of {capacity} devices")


def _stage(
    jobs: Sequence[JobView], capacity: int, rule: CountRule, stage: Stage, plan: Plan
) -> tuple[dict[int, int], Decision]:
    counts, left = _serve_pins(jobs, capacity, plan)
    unpinned = [j for j in jobs if j.pinned_workers is None]
    decision = rule(unpinned, left, stage) if unpinned else Decision({})
    _check(decision, unpinned, left)
    for job in unpinned:
        counts[job.id] = decision.counts.get(job.id, 0)
    return counts, decision


def allocate(snapshot: ClusterSnapshot, rule: CountRule, stragglers: StragglerHook | None = None) -> Plan:
    """Runs `rule` in the frame described in the module docstring. Returns the plan; raises
    PlanError when the rule breaks its contract."""
    plan = Plan()
    available = sorted((d for d in snapshot.devices if d.available), key=lambda d: d.id)
    shared = [d for d in available if not d.lent]
    lent = [d for d in available if d.lent]
    jobs = sorted(snapshot.jobs, key=lambda j: j.id)
    guaranteed = [j for j in jobs if j.priority == "guaranteed"]
    opportunistic = [j for j in jobs if j.priority != "guaranteed"]

    g_counts, g_decision = _stage(
        guaranteed, len(shared), rule, Stage(snapshot, _node_size(shared), False), plan
    )
    o_capacity = len(shared) - sum(g_counts.values()) + len(lent)
    o_counts, o_decision = _stage(
        opportunistic, o_capacity, rule, Stage(snapshot, _node_size(available), True), plan
    )

    held_by_opportunistic = {d for j in opportunistic for d in j.current}
    free_shared = FreeDevices(shared, second=held_by_opportunistic)
    plan.assignments.update(place([Request(j, g_counts[j.id]) for j in guaranteed], free_shared))
    given = {d for devices in plan.assignments.values() for d in devices}
    shared_left = [d for d in shared if d.id not in given]
    free_any = FreeDevices([*lent, *shared_left], second={d.id for d in shared_left})
    plan.assignments.update(place([Request(j, o_counts[j.id]) for j in opportunistic], free_any))

    for decision in (g_decision, o_decision):
        plan.notes.update(decision.notes)
        for job_id, batch in decision.batch_sizes.items():
            if plan.assignments.get(job_id):
                plan.batch_sizes[job_id] = batch
    for job in jobs:
        if job.consistency == "hybrid" and plan.assignments[job.id] and job.id not in plan.batch_sizes:
            if job.batch_size is not None:
                plan.batch_sizes[job.id] = job.batch_size

    if stragglers is not None:
        given = {d for devices in plan.assignments.values() for d in devices}
        spare_shared = FreeDevices([d for d in shared if d.id not in given])
        spare_any = FreeDevices([d for d in available if d.id not in given])
        stragglers(
            snapshot, plan, {j.id: spare_shared if j.priority == "guaranteed" else spare_any for j in jobs}
        )

    lent_ids = {d.id for d in lent}
    for job in jobs:
        plan.reasons[job.id] = _reasons(job, plan, lent_ids, g_decision, o_decision)
    return plan


def _reasons(job: JobView, plan: Plan, lent_ids: set[int], *decisions: Decision) -> tuple[Reason, ...]:
    devices = plan.assignments[job.id]
    reasons: list[Reason] = []
    if job.pinned_workers is not None:
        reasons.append(Reason.PIN_UNMET if job.id in plan.pin_problems else Reason.PINNED)
    elif not devices:
        reasons.append(Reason.WAITING)
    else:
        explained = next((d.reasons[job.id] for d in decisions if job.id in d.reasons), None)
        if explained is not None:
            reasons.append(explained)
        elif len(devices) == job.min_workers:
            reasons.append(Reason.MINIMUM)
        else:
            reasons.append(Reason.FAIR_SHARE)
    if any(d in lent_ids for d in devices):
        reasons.append(Reason.BORROWED)
    for action in plan.stragglers:
        if action.job_id == job.id:
            reasons.append(
                Reason.STRAGGLER_REPLACED if action.replacement is not None else Reason.STRAGGLER_UNLOADED
            )
    return tuple(dict.fromkeys(reasons))
