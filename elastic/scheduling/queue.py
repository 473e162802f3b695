"""What a waiting job is told: its place in the queue, who holds the devices it waits for, and
when it may start. A pure function of the snapshot and the plan, like the policies.

The estimate follows the rule every policy shares for minimums: a job runs once the jobs served
before it (guaranteed before opportunistic, then by submission) leave room for its minimum in
its pool. Each job served before it holds its minimum (a guaranteed job served before an
opportunistic one holds all it has, since it is never shrunk for one) until it finishes: a
running job when the caller says (its last reported step rate), else after its remaining steps
at its modelled step time, a waiting job after its own
estimated start plus its remaining steps at its modelled step time on its minimum. A job whose
step time is unknown (it has not run yet, so only a prior is known) is taken to hold its devices for
good: the estimate then says which job it waits on instead of a time. Jobs served later are
ignored, as a policy ignores them when it gives out minimums.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from elastic.scheduling.api import ClusterSnapshot, JobView, Plan


@dataclass(frozen=True)
class Holder:
    """A job holding devices of the pool a waiting job waits on."""

    job_id: int
    devices: int
    pinned: bool
    finishes_in_s: float | None
    """None: its speed is not known yet."""


@dataclass(frozen=True)
class QueueEntry:
    job_id: int
    position: int
    """1 for the next job to start in its pool."""
    waiting: int
    """How many jobs wait in its pool."""
    holders: tuple[Holder, ...]
    """The running jobs of its pool, the soonest to finish first."""
    starts_in_s: float | None
    """Seconds from the snapshot until it is expected to start; None when it cannot be said."""
    no_estimate: str = ""
    """Why there is no estimate, for people."""


@dataclass(frozen=True)
class _Span:
    job_id: int
    start: float
    end: float
    devices: int


def _service_order(job: JobView) -> tuple[int, float, int]:
    return (0 if job.priority == "guaranteed" else 1, job.submitted_at, job.id)


def duration_s(job: JobView, workers: int) -> float | None:
    """Seconds the job needs to finish its remaining steps on `workers` workers, from its
    throughput model (None unless the model was fitted to its own reports, and its remaining work
    and batch are known)."""
    if job.throughput is None or not job.throughput_measured or workers < 1:
        return None
    if job.remaining_work is None or job.batch_size is None:
        return None
    return job.remaining_work * job.throughput.step_time(workers, 1, job.batch_size / workers)


def explain_queue(
    snapshot: ClusterSnapshot, plan: Plan, finishes_in_s: Mapping[int, float] | None = None
) -> dict[int, QueueEntry]:
    """A QueueEntry for every job the plan leaves waiting (no devices), by job id.
    `finishes_in_s` gives the running jobs whose end the caller knows better than the model
    (from their last reported step rate): seconds from the snapshot."""
    available = [d for d in snapshot.devices if d.available]
    shared = sum(1 for d in available if not d.lent)
    ordered = sorted(snapshot.jobs, key=_service_order)
    waiting = [j for j in ordered if not plan.assignments.get(j.id)]
    finish: dict[int, float] = {}  # seconds from now; math.inf: not known
    for job in ordered:
        held = len(plan.assignments.get(job.id, ()))
        if held:
            known = (finishes_in_s or {}).get(job.id)
            finish[job.id] = known if known is not None else duration_s(job, held) or math.inf
    # What a waiting job's pool shows it, the same for every job of the pool: who waits, and
    # the running jobs (a guaranteed job waits only on guaranteed ones), soonest to end first.
    pools: dict[bool, tuple[list[JobView], tuple[Holder, ...]]] = {}
    for guaranteed in (True, False):
        running = sorted(
            (
                Holder(
                    job_id=other.id,
                    devices=len(plan.assignments[other.id]),
                    pinned=other.pinned_workers is not None,
                    finishes_in_s=finish[other.id] if math.isfinite(finish[other.id]) else None,
                )
                for other in ordered
                if plan.assignments.get(other.id) and (guaranteed <= (other.priority == "guaranteed"))
            ),
            key=lambda h: (h.finishes_in_s is None, h.finishes_in_s or 0.0, h.job_id),
        )
        pools[guaranteed] = ([w for w in waiting if (w.priority == "guaranteed") == guaranteed], tuple(running))
    entries: dict[int, QueueEntry] = {}
    for job in waiting:
        guaranteed = job.priority == "guaranteed"
        capacity = shared if guaranteed else len(available)
        ahead = ordered[: ordered.index(job)]
        spans: list[_Span] = []  # what each job served before it occupies
        for other in ahead:
            held = len(plan.assignments.get(other.id, ()))
            if other.id in entries:
                start = entries[other.id].starts_in_s
                if start is None:
                    continue  # it may never start: it is not what this job waits for
                end = start + (duration_s(other, other.min_workers) or math.inf)
                spans.append(_Span(other.id, start, end, other.min_workers))
            elif held:
                keeps = held if other.priority == "guaranteed" and not guaranteed else other.min_workers
                spans.append(_Span(other.id, 0.0, finish[other.id], keeps))
        moments = sorted({0.0, *(s.end for s in spans if math.isfinite(s.end)), *(s.start for s in spans)})
        starts_in = next(
            (at for at in moments if sum(s.devices for s in spans if s.start <= at < s.end) + job.min_workers <= capacity),
            None,
        )
        no_estimate = ""
        if starts_in is None:
            if job.min_workers > capacity:
                no_estimate = f"it needs {job.min_workers} devices and its pool has {capacity} usable now"
            else:
                unknown = ", ".join(f"#{s.job_id}" for s in spans if not math.isfinite(s.end))
                no_estimate = f"it waits on jobs whose speed is not known yet ({unknown})"
        pool_waiting, holders = pools[guaranteed]
        entries[job.id] = QueueEntry(
            job_id=job.id,
            position=pool_waiting.index(job) + 1,
            waiting=len(pool_waiting),
            holders=holders,
            starts_in_s=starts_in,
            no_estimate=no_estimate,
        )
    return entries

