"""The backbone's policy: every job between its minimum and maximum, manual pins honoured,
the rest shared fairly.

Jobs are served in order: guaranteed before opportunistic, then by submission time. First each
job gets its minimum (or its pin) if that many devices are left, else it waits: a job never runs
below its minimum. Then the devices left over are dealt one at a time, round robin, to the
unpinned jobs still below their maximum. Placement keeps every device a job already holds when
it can (a resize costs the job a pause), and grows a job onto the nodes it is already on first.
"""

from __future__ import annotations

from collections import Counter

from elastic.scheduling.api import ClusterSnapshot, JobView, Plan


def _service_order(job: JobView) -> tuple[int, float, int]:
    return (0 if job.priority == "guaranteed" else 1, job.submitted_at, job.id)


def _worker_counts(jobs: list[JobView], capacity: int, plan: Plan) -> dict[int, int]:
    counts: dict[int, int] = {}
    left = capacity
    for job in jobs:
        wanted = job.pinned_workers if job.pinned_workers is not None else job.min_workers
        if wanted <= left:
            counts[job.id] = wanted
        elif job.pinned_workers is not None and job.min_workers <= left:
            counts[job.id] = left
        else:
            counts[job.id] = 0
        left -= counts[job.id]
        if job.pinned_workers is not None and counts[job.id] != job.pinned_workers:
            plan.pin_problems[job.id] = (
                f"pinned to {job.pinned_workers} workers but only {counts[job.id]} devices "
                f"are free for it"
            )
    growable = [j for j in jobs if j.pinned_workers is None and counts[j.id] > 0]
    while left > 0:
        grew = False
        for job in growable:
            if left > 0 and counts[job.id] < job.max_workers:
                counts[job.id] += 1
                left -= 1
                grew = True
        if not grew:
            break
    return counts


def fair_share(snapshot: ClusterSnapshot) -> Plan:
    """Returns the target devices of every job in the snapshot (see the module docstring)."""
    plan = Plan()
    usable = {d.id: d for d in snapshot.devices if d.usable}
    jobs = sorted(snapshot.jobs, key=_service_order)
    counts = _worker_counts(jobs, len(usable), plan)

    free = set(usable)
    kept: dict[int, list[int]] = {}
    for job in jobs:
        keep = [d for d in job.current if d in free][: counts[job.id]]
        kept[job.id] = keep
        free.difference_update(keep)

    for job in jobs:
        devices = kept[job.id]
        missing = counts[job.id] - len(devices)
        if missing > 0:
            own_nodes = Counter(usable[d].node for d in devices)
            free_per_node = Counter(usable[d].node for d in free)
            chosen = sorted(
                free,
                key=lambda d, own=own_nodes, spare=free_per_node: (
                    -own[usable[d].node], -spare[usable[d].node], usable[d].node, d
                ),
            )[:missing]
            devices = devices + chosen
            free.difference_update(chosen)
        plan.assignments[job.id] = tuple(devices)
    return plan
