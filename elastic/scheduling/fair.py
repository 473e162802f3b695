"""The backbone's policy: every job between its minimum and maximum, manual pins honoured,
the rest shared fairly.

Jobs are served in order: guaranteed before opportunistic, then by submission time. First each
job gets its minimum if that many devices are left, else it waits: a job never runs below its
minimum. Then pinned jobs are raised towards their pin from what is left, so that a pin never
keeps another job below its minimum. Then the devices left over are dealt one at a time, round robin, to the
unpinned jobs still below their maximum. Placement keeps every device a job already holds when
it can (a resize costs the job a pause), and grows a job onto the nodes it is already on first.

A device whose owner is present is given to nobody. Hybrid jobs keep their batch size. Lent devices (owned, owner away) go only to
opportunistic jobs, before any shared device does; guaranteed jobs draw on the shared pool only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from elastic.scheduling.allocation import pin_shortfall
from elastic.scheduling.api import ClusterSnapshot, DeviceView, JobView, Plan


def _service_order(job: JobView) -> tuple[int, float, int]:
    return (0 if job.priority == "guaranteed" else 1, job.submitted_at, job.id)


class _Budget:
    """Devices left to give: guaranteed jobs draw on the shared pool, opportunistic ones on the
    lent pool first."""

    def __init__(self, shared: int, lent: int) -> None:
        self.shared = shared
        self.lent = lent

    def left_for(self, job: JobView) -> int:
        return self.shared if job.priority == "guaranteed" else self.shared + self.lent

    def take(self, job: JobView, count: int) -> None:
        if job.priority != "guaranteed":
            from_lent = min(count, self.lent)
            self.lent -= from_lent
            count -= from_lent
        self.shared -= count


def _worker_counts(jobs: list[JobView], budget: _Budget, plan: Plan) -> dict[int, int]:
    counts: dict[int, int] = {}
    for priority in ("guaranteed", "opportunistic"):
        group = [j for j in jobs if (j.priority == "guaranteed") == (priority == "guaranteed")]
        for job in group:  # every job's minimum first, pinned or not: a pin holds no job below it
            counts[job.id] = job.min_workers if job.min_workers <= budget.left_for(job) else 0
            budget.take(job, counts[job.id])
        for job in group:
            if job.pinned_workers is None:
                continue
            free = counts[job.id] + budget.left_for(job)
            if counts[job.id]:
                wanted = min(max(job.pinned_workers, job.min_workers), job.max_workers)
                extra = min(wanted - counts[job.id], budget.left_for(job))
                counts[job.id] += extra
                budget.take(job, extra)
            if counts[job.id] != job.pinned_workers:
                kept_for = [j for j in group if j.pinned_workers is None and counts[j.id]]
                plan.pin_problems[job.id] = pin_shortfall(job, counts[job.id], free, kept_for)
    growable = [j for j in jobs if j.pinned_workers is None and counts[j.id] > 0]
    while True:
        grew = False
        for job in growable:
            if budget.left_for(job) > 0 and counts[job.id] < job.max_workers:
                counts[job.id] += 1
                budget.take(job, 1)
                grew = True
        if not grew:
            break
    return counts


def _growth_order(
    usable: dict[int, DeviceView], own: Counter[str], spare: Counter[str]
) -> Callable[[int], tuple[bool, int, int, str, int]]:
    """The sort key of the free devices a job grows onto: lent ones first, then those on the
    nodes it is on (`own`: its devices per node), then those on the nodes with the most free
    devices (`spare`); ties by node name and device id."""

    def key(device_id: int) -> tuple[bool, int, int, str, int]:
        device = usable[device_id]
        return (not device.lent, -own[device.node], -spare[device.node], device.node, device_id)

    return key


def fair_share(snapshot: ClusterSnapshot) -> Plan:
    """Returns the target devices of every job in the snapshot (see the module docstring)."""
    plan = Plan()
    usable = {d.id: d for d in snapshot.devices if d.available}
    jobs = sorted(snapshot.jobs, key=_service_order)
    budget = _Budget(sum(1 for d in usable.values() if not d.lent), sum(1 for d in usable.values() if d.lent))
    counts = _worker_counts(jobs, budget, plan)

    def allowed(job: JobView, device: DeviceView) -> bool:
        return job.priority != "guaranteed" or not device.lent

    lent_total = sum(1 for d in usable.values() if d.lent)
    opportunistic_total = sum(counts[j.id] for j in jobs if j.priority != "guaranteed")
    shared_for_opportunistic = opportunistic_total - min(opportunistic_total, lent_total)
    free = set(usable)
    kept: dict[int, list[int]] = {}
    for job in jobs:
        keep: list[int] = []
        for d in job.current:
            if len(keep) == counts[job.id] or d not in free or not allowed(job, usable[d]):
                continue
            if job.priority != "guaranteed" and not usable[d].lent:
                if shared_for_opportunistic == 0:
                    continue
                shared_for_opportunistic -= 1
            keep.append(d)
        kept[job.id] = keep
        free.difference_update(keep)

    for job in jobs:
        devices = kept[job.id]
        missing = counts[job.id] - len(devices)
        if missing > 0:
            own_nodes = Counter(usable[d].node for d in devices)
            free_per_node = Counter(usable[d].node for d in free)
            chosen = sorted(
                (d for d in free if allowed(job, usable[d])),
                key=_growth_order(usable, own_nodes, free_per_node),
            )[:missing]
            devices = devices + chosen
            free.difference_update(chosen)
        plan.assignments[job.id] = tuple(devices)
        if devices and job.consistency == "hybrid" and job.batch_size is not None:
            plan.batch_sizes[job.id] = job.batch_size
    return plan
