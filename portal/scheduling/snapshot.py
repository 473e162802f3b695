"""The cluster as the policy sees it (elastic.scheduling.ClusterSnapshot), read from the database.

Each job's throughput curve is learned from what its workers report: rank 0's progress events
give samples per second in each generation, the generation's resize record gives its world size
and nodes, so each generation is one measured step time at one configuration. Until a job has
any, its curve is the generic prior (elastic.scheduling.ThroughputModel.prior). Attained service
is accumulated as progress arrives (portal.jobs.ingest); remaining work is the steps left.

`build_snapshot` returns a `CycleView`: the snapshot and everything else one scheduling cycle
needs to know of the world (the devices, read once, by id and by member key; each job's
allocations, newest generation and running workers; who holds the training state). Planning,
publishing and the decision record all take it, and what the cycle plans is written into it,
so that nothing the cycle writes is read back."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache

from django.db.models import Avg, Count
from pydantic import ValidationError

from elastic.membership import GenerationPhase
from elastic.scheduling import ClusterSnapshot, DeviceView, JobView, ThroughputLearner, ThroughputModel
from elastic.spec import JobSpec
from portal.cluster.devices import ClusterDevices, node_of
from portal.cluster.models import Node
from portal.jobs import lifecycle
from portal.jobs.ingest import step_times_key
from portal.jobs.models import Allocation, Generation, Job, JobMetric, ResizeEvent, Worker
from portal.jobs.states import ACTIVE_STATES
from portal.redis import client

PRIOR_STEP_S = 0.1
"""The single-worker step time assumed for a job nobody has measured yet."""


def _spec_batch(job: Job) -> tuple[JobSpec, int] | None:
    """The job's spec and its workload's batch_size (defaults filled in), or None if the
    stored spec no longer validates."""
    try:
        spec = JobSpec(**job.spec)
        return spec, spec.batch_size()
    except (ValidationError, KeyError, TypeError, ValueError):
        return None


def global_batch(job: Job) -> int | None:
    """The job's global batch size: the one the scheduler chose (hybrid), else its spec's."""
    if job.batch_size:
        return int(job.batch_size)
    known = _spec_batch(job)
    return known[1] if known is not None else None


def hybrid_bounds(job: Job) -> tuple[int | None, int | None]:
    """A hybrid job's (min, max) global batch, as its worker applies them; (None, None) for a
    strict job."""
    known = _spec_batch(job)
    if job.consistency != Job.Consistency.HYBRID or known is None:
        return None, None
    spec, batch = known
    _, low, high = spec.hybrid_batch_bounds(batch)
    return low, high


def measured_throughput(jobs: dict[int, Job]) -> dict[int, ThroughputModel]:
    """Per job with a known batch size, its curve: the prior, fitted to the mean step time of
    every generation that reported progress."""
    rates = (
        JobMetric.objects.filter(job_id__in=jobs, samples_per_s__gt=0)
        .values("job_id", "generation")
        .annotate(rate=Avg("samples_per_s"), reports=Count("id"))
    )
    shapes = {
        (row.job_id, row.generation): row
        for row in ResizeEvent.objects.filter(job_id__in=jobs).only(
            "job_id", "generation", "workers_after", "devices_after"
        )
    }
    observed: dict[int, list[tuple[int, int, float, int]]] = {}
    for row in rates:
        shape = shapes.get((row["job_id"], row["generation"]))
        if shape is None or shape.workers_after < 1:
            continue
        nodes = len({node_of(str(label)) for label in shape.devices_after}) or 1
        observed.setdefault(row["job_id"], []).append(
            (shape.workers_after, nodes, float(f"{row['rate']:.3g}"), min(int(row["reports"]), 20))
        )
    models: dict[int, ThroughputModel] = {}
    for job_id, job in jobs.items():
        batch = global_batch(job)
        if batch is not None:
            models[job_id] = fitted_curve(batch, tuple(sorted(observed.get(job_id, []))))
    return models


@lru_cache(maxsize=4096)
def fitted_curve(batch: int, observed: tuple[tuple[int, int, float, int], ...]) -> ThroughputModel:
    """The prior fitted to `observed` (workers, nodes, samples/s, reports), each generation
    weighing as many reports as it had, up to 20. Cached: the Celery worker fits a job again
    only when what it measured moved (rates are compared to three significant digits)."""
    learner = ThroughputLearner(ThroughputModel.prior(PRIOR_STEP_S, batch))
    for workers, nodes, rate, reports in observed:
        for _ in range(reports):
            learner.observe(workers, nodes, batch / workers, batch / rate)
    return learner.model()


def worker_step_times(
    jobs: dict[int, Job], current: dict[int, list[int]]
) -> dict[int, tuple[tuple[float, ...], ...]]:
    """Per job whose current generation formed, each rank's latest compute times per step in
    rank order (aligned with its devices), once every rank has reported; the straggler check
    of the policy reads them."""
    settled = [j for j in jobs.values() if j.generation == j.active_generation and len(current[j.pk]) > 1]
    keys = [step_times_key(j.pk, j.generation, rank) for j in settled for rank in range(len(current[j.pk]))]
    values = iter(client().mget(keys) if keys else [])
    found: dict[int, tuple[tuple[float, ...], ...]] = {}
    for job in settled:
        ranks = [next(values) for _ in current[job.pk]]
        reported = [raw for raw in ranks if raw]
        if len(reported) == len(ranks):
            found[job.pk] = tuple(tuple(float(t) for t in json.loads(raw)) for raw in reported)
    return found


@dataclass
class CycleView:
    """The world as one scheduling cycle sees it, read once at its start (build_snapshot)."""

    snapshot: ClusterSnapshot
    jobs: dict[int, Job]
    """The active jobs, by id."""
    devices: ClusterDevices
    """Every device with its node, by id and by member key: the cycle's one read of Device."""
    allocated: dict[int, tuple[int, tuple[int, ...]]]
    """Per active job, the generation its devices were given in and the devices in rank order
    (its allocations); a job the cycle plans gets its new ones here as they are written."""
    held: set[int]
    """The devices some job holds (every allocation); kept up to date with `allocated`."""
    newest: dict[int, Generation]
    """Per active job that has been planned, its newest generation; a job the cycle plans gets
    its new one here as it is written."""
    running: dict[int, list[Worker]]
    """Per active job, its running worker rows, oldest generation first."""
    planned: set[int]
    """The jobs whose newest generation waits to be published: planned in an earlier cycle (a
    queued job waits for its old workers to exit) or in this one."""

    def holders(self, job_id: int) -> dict[int, int]:
        """The devices whose worker holds the job's training state, with its rank."""
        return {
            row.device_id: row.rank
            for row in self.running.get(job_id, [])
            if row.joined_at is not None and row.device_id is not None
        }

    def resize_in_flight(self, job_id: int) -> bool:
        """Whether the job's newest generation is on its way (lifecycle.resize_in_flight)."""
        devices = set(self.allocated.get(job_id, (0, ()))[1])
        running = [row.device_id for row in self.running.get(job_id, [])]
        return lifecycle.resize_in_flight(self.newest.get(job_id), devices, running)

    def planned_now(self, job_id: int, generation: Generation, devices: tuple[int, ...]) -> None:
        """The cycle wrote `generation` of the job, onto `devices` in rank order."""
        _, before = self.allocated.get(job_id, (0, ()))
        self.held.difference_update(before)
        self.held.update(devices)
        self.allocated[job_id] = (generation.number, devices)
        self.newest[job_id] = generation
        self.planned.add(job_id)

    def to_publish(self, job_id: int) -> lifecycle.Planned | None:
        """The job's newest generation and its devices, for lifecycle.publish (none: it waits
        for devices); None if its devices were given in another generation (publish then reads
        them, and refuses)."""
        generation = self.newest.get(job_id)
        number, devices = self.allocated.get(job_id, (-1, ()))
        if generation is None or (devices and number != generation.number):
            return None
        return lifecycle.Planned(generation, [self.devices.by_id[d] for d in devices])


def build_snapshot() -> CycleView:
    """Reads the world for one scheduling cycle; returns it (the snapshot the policy plans
    from among it)."""
    # A node whose agent is unreachable keeps the devices its jobs hold (their workers train
    # on) and gets no new worker: no agent would start it.
    rows = list(
        Allocation.objects.order_by("job_id", "rank").values_list("job_id", "device_id", "generation")
    )
    held = {device for _, device, _ in rows}
    known = ClusterDevices.read()
    devices = tuple(
        DeviceView(
            id=d.pk,
            node=d.node.name,
            usable=d.present
            and (
                d.node.state == Node.State.ONLINE or (d.node.state == Node.State.UNREACHABLE and d.pk in held)
            ),
            owner=d.owner or None,
            owner_present=d.owner_present,
        )
        for d in known.by_id.values()
    )
    jobs = {j.pk: j for j in Job.objects.filter(state__in=ACTIVE_STATES).select_related("owner")}
    current: dict[int, list[int]] = {job_id: [] for job_id in jobs}
    given: dict[int, set[int]] = {job_id: set() for job_id in jobs}
    for job_id, device, generation in rows:
        if job_id in jobs:
            current[job_id].append(device)
            given[job_id].add(generation)
    newest = lifecycle.newest_generations(jobs)
    running: dict[int, list[Worker]] = {job_id: [] for job_id in jobs}
    for row in Worker.objects.filter(job_id__in=list(jobs), state=Worker.State.RUNNING).order_by(
        "generation"
    ):
        running[row.job_id].append(row)
    throughput = measured_throughput(jobs)
    step_times = worker_step_times(jobs, current)
    bounds = {job_id: hybrid_bounds(job) for job_id, job in jobs.items()}  # one spec parse a job
    views = tuple(
        JobView(
            id=job.pk,
            min_workers=job.min_workers,
            max_workers=job.max_workers,
            priority=job.priority,  # type: ignore[arg-type]
            submitted_at=job.created_at.timestamp(),
            current=tuple(current[job.pk]),
            pinned_workers=job.pinned_workers,
            consistency=job.consistency,  # type: ignore[arg-type]
            throughput=throughput.get(job.pk),
            throughput_measured=bool(job.samples_per_s),
            batch_size=global_batch(job),
            min_batch_size=bounds[job.pk][0],
            max_batch_size=bounds[job.pk][1],
            attained_service_s=job.attained_service_s,
            remaining_work=float(max(job.total_steps - job.steps_done, 0)),
            worker_step_times=step_times.get(job.pk, ()),
        )
        for job in jobs.values()
    )
    return CycleView(
        snapshot=ClusterSnapshot(devices=devices, jobs=views, now=time.time()),
        jobs=jobs,
        devices=known,
        # A job whose allocations were given in more than one generation has none to publish.
        allocated={
            job_id: (given[job_id].pop() if len(given[job_id]) == 1 else -1, tuple(current[job_id]))
            for job_id in jobs
        },
        held=held,
        newest=newest,
        running=running,
        planned={job_id for job_id, g in newest.items() if g.phase == GenerationPhase.PLANNED},
    )
