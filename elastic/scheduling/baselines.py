"""The schedulers we measure ourselves against, written as count rules in the same frame as ours
(so owners, pins and placement are handled the same way and only the decision differs).

- `fifo`: static FIFO gang. Jobs in submission order; a job runs on exactly its requested
  workers and keeps them to the end; the first job that does not fit blocks every job behind it.
- `tiresias`: Tiresias-like two-queue least attained service, gang and preemptive. Jobs with
  less than `queue_threshold_s` device-seconds of service form the first queue; each queue is
  served in submission order; a job that does not fit is skipped (the devices go to the next one
  that fits); a running job not chosen is preempted.
- `optimus`: Optimus-like greedy marginal gain at fixed batch size. Every job first gets its
  minimum in submission order; then devices go one at a time to the job whose completion time
  drops the most with one more worker (with the simulator's oracle of remaining work), or whose
  speedup grows the most (without it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic.scheduling.allocation import Decision, Stage, allocate, service_order
from elastic.scheduling.api import ClusterSnapshot, JobView, Plan, Reason
from elastic.scheduling.speedup import speedup_table, worker_grid


def _fits_now(job: JobView, available: set[int]) -> bool:
    return bool(job.current) and all(d in available for d in job.current)


def fifo_counts(jobs: Sequence[JobView], capacity: int, stage: Stage) -> Decision:
    available = {d.id for d in stage.snapshot.devices if d.available}
    decision = Decision({j.id: 0 for j in jobs})
    left = capacity
    ordered = sorted(jobs, key=service_order)
    for job in ordered:
        if _fits_now(job, available) and job.gang_size <= left:
            decision.counts[job.id] = job.gang_size
            decision.reasons[job.id] = Reason.GANG
            left -= job.gang_size
    for job in ordered:
        if decision.counts[job.id]:
            continue
        if job.gang_size > left:
            break
        decision.counts[job.id] = job.gang_size
        decision.reasons[job.id] = Reason.GANG
        left -= job.gang_size
    return decision


@dataclass(frozen=True)
class TiresiasConfig:
    queue_threshold_s: float = 16 * 3600.0
    """Device-seconds of attained service at which a job drops to the second queue."""


class TiresiasRule:
    def __init__(self, config: TiresiasConfig) -> None:
        self.config = config

    def __call__(self, jobs: Sequence[JobView], capacity: int, stage: Stage) -> Decision:
        def order(job: JobView) -> tuple[int, float, int]:
            queue = 0 if job.attained_service_s < self.config.queue_threshold_s else 1
            return (queue, job.submitted_at, job.id)

        decision = Decision({j.id: 0 for j in jobs})
        left = capacity
        for job in sorted(jobs, key=order):
            if job.gang_size <= left:
                decision.counts[job.id] = job.gang_size
                decision.reasons[job.id] = Reason.GANG
                left -= job.gang_size
        return decision


def optimus_counts(jobs: Sequence[JobView], capacity: int, stage: Stage) -> Decision:
    grid = worker_grid(min(capacity, max(j.max_workers for j in jobs)))
    table = speedup_table(jobs, grid, stage.node_size, adapt_batch=False)
    index = {job.id: j for j, job in enumerate(jobs)}
    column = {job.id: 0 for job in jobs}
    decision = Decision({j.id: 0 for j in jobs})
    left = capacity
    for job in sorted(jobs, key=service_order):
        j = index[job.id]
        first = int(np.argmax(np.isfinite(table.rate[j]) & (grid > 0)))
        if first > 0 and np.isfinite(table.rate[j, first]) and grid[first] <= left:
            column[job.id] = first
            decision.counts[job.id] = int(grid[first])
            decision.reasons[job.id] = Reason.MINIMUM
            left -= int(grid[first])

    def gain_per_device(job: JobView) -> float:
        j, c = index[job.id], column[job.id]
        if c + 1 >= len(grid) or not np.isfinite(table.rate[j, c + 1]):
            return -np.inf
        now, more = table.rate[j, c], table.rate[j, c + 1]
        devices = int(grid[c + 1] - grid[c])
        if job.remaining_work is not None and now > 0:
            return float(job.remaining_work / now - job.remaining_work / more) / devices
        return float((more - now) / table.single_rate[j]) / devices

    heap = [(-gain_per_device(job), job.id, job) for job in jobs if decision.counts[job.id]]
    heapq.heapify(heap)
    while heap:
        negative_gain, job_id, job = heapq.heappop(heap)
        step = int(grid[column[job_id] + 1] - grid[column[job_id]]) if -negative_gain > 0 else 0
        if step == 0 or step > left:
            continue
        column[job_id] += 1
        decision.counts[job_id] = int(grid[column[job_id]])
        decision.reasons[job_id] = Reason.THROUGHPUT
        left -= step
        heapq.heappush(heap, (-gain_per_device(job), job_id, job))
    return decision


def fifo(snapshot: ClusterSnapshot) -> Plan:
    """Static FIFO gang (see the module docstring)."""
    return allocate(snapshot, fifo_counts)


def tiresias(snapshot: ClusterSnapshot, config: TiresiasConfig | None = None) -> Plan:
    """Tiresias-like two-queue least attained service (see the module docstring)."""
    return allocate(snapshot, TiresiasRule(config or TiresiasConfig()))


def optimus(snapshot: ClusterSnapshot) -> Plan:
    """Optimus-like greedy marginal gain at fixed batch size (see the module docstring)."""
    return allocate(snapshot, optimus_counts)
