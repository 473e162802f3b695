"""Straggler replacement (the AutoScaling Engine's idea): find the worker that holds its job back
and move it, or, when no device is free, make it carry less.

In synchronous data parallelism every step waits for the slowest worker, so one slow device
(thermal throttling, a noisy neighbour, a weaker card) slows the whole job. A worker is a
straggler when, in each of the last `window` steps its job reported, its step time was more than
`threshold` above the median of its peers' in that step: a single slow step (a checkpoint, a
garbage collection) does not count, a persistent one does.

What to do about it, in order of preference:

1. migrate: give its rank to a free device the job may use, on a node the job is already on if
   there is one (the state comes from the other workers' memory, as in any resize);
2. in strict mode with no free device, rebalance virtual workers: each rank gets a share of the
   job's fixed virtual workers so that the slowest rank finishes its share no later than needed
   (greedy longest-processing-time), which the job can apply without changing its result;
3. otherwise, report it and leave it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from elastic.scheduling.api import ClusterSnapshot, JobView, Plan, StragglerAction
from elastic.scheduling.placement import FreeDevices


@dataclass(frozen=True)
class StragglerConfig:
    threshold: float = 0.3
    """A step more than this fraction above the peers' median is slow."""
    window: int = 20
    """Steps in a row that must all be slow."""


@dataclass(frozen=True)
class Straggler:
    rank: int
    slowdown: float
    """Median over the window of the worker's step time over its peers' median."""


def find_stragglers(job: JobView, config: StragglerConfig) -> list[Straggler]:
    """Ranks of `job` that were slow in each of the last `config.window` steps, slowest first.
    A job with fewer than two workers reporting, or fewer steps than the window, has none."""
    times = job.worker_step_times
    if len(times) < 2 or len(times) != len(job.current):
        return []
    if min(len(t) for t in times) < config.window:
        return []
    window = np.array([t[-config.window :] for t in times], dtype=float)
    found: list[Straggler] = []
    for rank in range(len(times)):
        peers = np.delete(window, rank, axis=0)
        reference = np.median(peers, axis=0)
        if np.all(window[rank] > (1.0 + config.threshold) * reference):
            found.append(Straggler(rank, float(np.median(window[rank] / reference))))
    return sorted(found, key=lambda s: (-s.slowdown, s.rank))


def virtual_worker_shares(virtual_workers: int, step_times: list[float]) -> tuple[int, ...]:
    """Virtual workers per rank, at least one each, so that the slowest rank's total (its share
    times its time per virtual worker) is as small as greedy assignment makes it. Raises
    ValueError when there are fewer virtual workers than ranks."""
    ranks = len(step_times)
    if virtual_workers < ranks:
        raise ValueError(f"{virtual_workers} virtual workers cannot cover {ranks} ranks")
    shares = [1] * ranks
    for _ in range(virtual_workers - ranks):
        finish = [(shares[r] + 1) * step_times[r] for r in range(ranks)]
        best = min(range(ranks), key=lambda r: (finish[r], r))
        shares[best] += 1
    return tuple(shares)


def handle_stragglers(
    snapshot: ClusterSnapshot, plan: Plan, spare: dict[int, FreeDevices], config: StragglerConfig
) -> None:
    """Adds a StragglerAction to `plan` for every straggler of a job that keeps its devices, and
    applies migrations to `plan.assignments`."""
    node_of = {d.id: d.node for d in snapshot.devices}
    for job in sorted(snapshot.jobs, key=lambda j: j.id):
        assigned = list(plan.assignments.get(job.id, ()))
        stragglers = find_stragglers(job, config)
        if not stragglers or not assigned:
            continue
        free = spare[job.id]
        unloaded = False
        for straggler in stragglers:
            slow = job.current[straggler.rank]
            if slow not in assigned:
                continue
            near = Counter(node_of[d] for d in assigned if d != slow)
            replacement = free.take(1, near) if len(free) else []
            if replacement:
                new = replacement[0]
                assigned[assigned.index(slow)] = new
                for other in spare.values():
                    if new in other:
                        other.remove(new)
                plan.stragglers.append(StragglerAction(job.id, slow, straggler.slowdown, replacement=new))
            elif job.consistency == "strict" and job.virtual_workers and not unloaded:
                if tuple(assigned) != job.current or job.virtual_workers < len(assigned):
                    continue
                medians = [float(np.median(t[-config.window :])) for t in job.worker_step_times]
                shares = virtual_worker_shares(job.virtual_workers, medians)
                plan.stragglers.append(
                    StragglerAction(job.id, slow, straggler.slowdown, virtual_workers=shares)
                )
                unloaded = True
        plan.assignments[job.id] = tuple(assigned)
