"""The simulator's rules: a workload replayed on a modelled cluster, one scheduling round at a
time, with the policy code the portal runs.

- The cluster is `nodes` nodes of `devices_per_node` devices, all in the shared pool.
- Every `round_s` seconds (60, as in the Pollux evaluation) the policy sees a snapshot of every
  submitted, unfinished job and returns a plan. A job submitted between two rounds waits for the
  next one; a job that finishes inside a round gives its devices back at the next.
- A job whose set of devices changes pauses: `start_cost_s` when it starts (or restarts after a
  preemption), `resize_cost_s` when it resizes while running. Pausing jobs hold their devices. A
  change of batch size alone (hybrid mode) costs nothing: it happens at a step boundary.
- A running job advances its progress (base-batch steps) at gain / step time, with the gain of
  its batch from the trace's gradient statistics at its current progress (midpoint rule over the
  round) and the measured step time of its placement and per-worker batch (`traces`),
  accumulating micro-batches when the per-worker batch exceeds the largest one measured.
- Jobs are hybrid by default: any batch between the application's smallest and largest measured
  batch, starting at the workload's. Policies that keep batch sizes fixed (FIFO, Tiresias,
  Optimus) keep the workload's batch.
- Every job tells the policy how much work it has left (as a job with an epoch budget can), by
  default exactly (Optimus+oracle needs it exact); `remaining_error` multiplies each job's
  figure by a fixed log-normal error, and `remaining_known=False` withholds it.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from elastic.scheduling.api import ClusterSnapshot, DeviceView, JobView, Policy
from elastic.scheduling.throughput import ThroughputLearner, ThroughputModel
from elastic.simulator.traces import Application
from elastic.simulator.workload import TraceJob


@dataclass(frozen=True)
class SimulationConfig:
    nodes: int = 16
    devices_per_node: int = 4
    round_s: float = 60.0
    resize_cost_s: float = 30.0
    start_cost_s: float | None = None
    """None: the same as `resize_cost_s`."""
    consistency: str = "hybrid"
    remaining_known: bool = True
    remaining_error: float = 0.0
    """Sigma of the log-normal error on each job's remaining-work figure (0: exact)."""
    learn_throughput: bool = False
    """Policies see each job's curve as learned online from its own step times (5% noise),
    starting from the generic prior, instead of the model fitted to the whole trace."""
    max_time_s: float = 30 * 86400.0
    """A run that has not finished by then stops with the unfinished jobs reported."""

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def start_cost(self) -> float:
        return self.resize_cost_s if self.start_cost_s is None else self.start_cost_s


@dataclass
class JobRecord:
    spec: TraceJob
    app: Application
    id: int
    batch_size: int
    progress: float = 0.0
    devices: tuple[int, ...] = ()
    pause_left_s: float = 0.0
    attained_service_s: float = 0.0
    first_start_s: float | None = None
    finish_s: float | None = None
    resizes: int = 0
    allocated_device_s: float = 0.0
    useful_device_s: float = 0.0


@dataclass
class SimulationResult:
    jobs: list[JobRecord]
    decision_times_s: list[float]
    devices: int
    unfinished: int = 0
    rounds: int = 0


class Simulation:
    def __init__(
        self, workload: list[TraceJob], apps: dict[str, Application], policy: Policy, config: SimulationConfig
    ) -> None:
        missing = sorted({j.application for j in workload} - set(apps))
        if missing:
            raise ValueError(f"workload uses applications the traces lack: {missing}")
        self.config = config
        self.policy = policy
        self.devices = tuple(
            DeviceView(id=n * config.devices_per_node + i, node=f"node{n:02d}")
            for n in range(config.nodes)
            for i in range(config.devices_per_node)
        )
        self.node_of = {d.id: d.node for d in self.devices}
        self.records = [
            JobRecord(spec, apps[spec.application], i, spec.batch_size) for i, spec in enumerate(workload)
        ]
        errors = np.random.default_rng(0).normal(0.0, 1.0, len(self.records)) * config.remaining_error
        self.estimate_factor = np.exp(errors)
        self.learners: dict[int, ThroughputLearner] = {}
        self.reported: dict[int, set[tuple[int, int, float, int]]] = {}
        self.measurement_noise = np.random.default_rng(1)

    def _view(self, job: JobRecord) -> JobView:
        app = job.app
        most = max(1, min(self.config.devices, app.max_batch_size // max(app.min_local_batch, 1)))
        return JobView(
            id=job.id,
            min_workers=1,
            max_workers=most,
            submitted_at=job.spec.submitted_at,
            current=job.devices,
            requested_workers=min(job.spec.replicas, most),
            consistency="hybrid" if self.config.consistency == "hybrid" else "strict",
            throughput=self._learner(job).model() if self.config.learn_throughput else app.throughput,
            batch_size=job.batch_size,
            min_batch_size=app.base_batch_size,
            max_batch_size=max(app.max_batch_size, job.spec.batch_size),
            max_local_batch_size=app.max_local_batch,
            gradient_noise=app.gradient_noise(job.progress, job.batch_size),
            attained_service_s=job.attained_service_s,
            remaining_work=(
                max(app.target_progress - job.progress, 0.0) * float(self.estimate_factor[job.id])
                if self.config.remaining_known
                else None
            ),
        )

    def _shape(self, job: JobRecord) -> tuple[int, ...]:
        per_node = Counter(self.node_of[d] for d in job.devices)
        return tuple(sorted(per_node.values(), reverse=True))

    def rate(self, job: JobRecord, progress: float) -> tuple[float, float]:
        """(progress per second, statistical efficiency) of `job` at `progress` on its devices."""
        workers = len(job.devices)
        local = job.batch_size / workers
        accumulation = max(1, math.ceil(local / job.app.max_local_batch))
        step = job.app.step_time(self._shape(job), local / accumulation, accumulation)
        noise = job.app.gradient_noise(progress, job.batch_size)
        gain = float(noise.gain(job.batch_size))
        return gain / step, float(noise.efficiency(job.batch_size))

    def _learner(self, job: JobRecord) -> ThroughputLearner:
        if job.id not in self.learners:
            local = max(1, job.spec.batch_size // job.spec.replicas)
            self.learners[job.id] = ThroughputLearner(ThroughputModel.prior(1.0, local))
        return self.learners[job.id]

    def _report_step_time(self, job: JobRecord) -> None:
        """What the job's workers would report: one noisy step time per new configuration (a
        learner refits on each report; repeats of a known shape add little)."""
        workers = len(job.devices)
        nodes = len({self.node_of[d] for d in job.devices})
        local = job.batch_size / workers
        accumulation = max(1, math.ceil(local / job.app.max_local_batch))
        key = (workers, nodes, local / accumulation, accumulation)
        seen = self.reported.setdefault(job.id, set())
        if key in seen:
            return
        seen.add(key)
        step = job.app.step_time(self._shape(job), local / accumulation, accumulation)
        noisy = step * float(np.exp(self.measurement_noise.normal(0.0, 0.05)))
        self._learner(job).observe(workers, nodes, local / accumulation, noisy, accumulation)

    def _advance(self, job: JobRecord, now: float) -> None:
        round_s = self.config.round_s
        workers = len(job.devices)
        pause = min(job.pause_left_s, round_s)
        job.pause_left_s -= pause
        train = round_s - pause
        first, _ = self.rate(job, job.progress)
        midpoint = min(job.progress + first * train / 2, job.app.target_progress)
        rate, efficiency = self.rate(job, midpoint)
        left = job.app.target_progress - job.progress
        if rate * train >= left:
            train = left / rate
            job.progress = job.app.target_progress
            job.finish_s = now + pause + train
        else:
            job.progress += rate * train
        used = pause + train
        job.attained_service_s += workers * used
        job.allocated_device_s += workers * used
        job.useful_device_s += workers * train * efficiency

    def run(self) -> SimulationResult:
        round_s = self.config.round_s
        pending = sorted(self.records, key=lambda j: (j.spec.submitted_at, j.id))
        active: list[JobRecord] = []
        decisions: list[float] = []
        now = 0.0
        rounds = 0
        while (pending or active) and now <= self.config.max_time_s:
            while pending and pending[0].spec.submitted_at <= now:
                active.append(pending.pop(0))
            if not active:
                now = math.ceil(pending[0].spec.submitted_at / round_s) * round_s
                continue
            snapshot = ClusterSnapshot(self.devices, tuple(self._view(j) for j in active), now=now)
            started = time.perf_counter()
            plan = self.policy(snapshot)
            decisions.append(time.perf_counter() - started)
            rounds += 1
            for job in active:
                target = plan.assignments.get(job.id, ())
                if set(target) != set(job.devices):
                    if target:
                        if job.devices:
                            job.pause_left_s = self.config.resize_cost_s
                            job.resizes += 1
                        else:
                            job.pause_left_s = self.config.start_cost
                            if job.first_start_s is not None:
                                job.resizes += 1
                    elif job.devices:
                        job.resizes += 1
                        job.pause_left_s = 0.0
                    job.devices = tuple(target)
                if job.devices:
                    job.batch_size = plan.batch_sizes.get(job.id, job.batch_size)
                    if job.first_start_s is None:
                        job.first_start_s = now
            for job in active:
                if job.devices:
                    self._advance(job, now)
                    if self.config.learn_throughput:
                        self._report_step_time(job)
            active = [j for j in active if j.finish_s is None]
            now += round_s
        return SimulationResult(
            self.records, decisions, self.config.devices, unfinished=len(active) + len(pending), rounds=rounds
        )
