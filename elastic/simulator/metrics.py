"""What a simulation run measured, summarised the way docs/design/scheduler.md and the JSON line report it.

- JCT: finish minus submission, per job (unfinished jobs are left out and counted).
- makespan: last finish minus first submission.
- queueing delay: first start minus submission.
- allocated utilisation: device-seconds held by jobs (pauses included) over devices x makespan.
- useful utilisation: device-seconds spent training, each weighted by the statistical
  efficiency of the batch used then (1 at the base batch), over devices x makespan.
- resizes per job: changes of a job's devices after its first start (a preemption and the
  restart after it are two).
- decision time: wall time of one policy call, median and 95th percentile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from elastic.simulator.engine import SimulationResult


@dataclass(frozen=True)
class Summary:
    jobs: int
    unfinished: int
    avg_jct_s: float
    p50_jct_s: float
    p99_jct_s: float
    makespan_s: float
    avg_queueing_s: float
    allocated_utilization: float
    useful_utilization: float
    resizes_per_job: float
    decision_p50_ms: float
    decision_p95_ms: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def summarise(result: SimulationResult) -> Summary:
    done = [j for j in result.jobs if j.finish_s is not None]
    jct = np.array([j.finish_s - j.spec.submitted_at for j in done if j.finish_s is not None])
    queueing = np.array(
        [j.first_start_s - j.spec.submitted_at for j in result.jobs if j.first_start_s is not None]
    )
    first_submit = min((j.spec.submitted_at for j in result.jobs), default=0.0)
    last_finish = max((j.finish_s for j in done if j.finish_s is not None), default=first_submit)
    makespan = max(last_finish - first_submit, 1e-9)
    capacity = result.devices * makespan
    decisions = np.array(result.decision_times_s or [0.0]) * 1000.0
    return Summary(
        jobs=len(result.jobs),
        unfinished=result.unfinished,
        avg_jct_s=float(jct.mean()) if jct.size else float("nan"),
        p50_jct_s=float(np.percentile(jct, 50)) if jct.size else float("nan"),
        p99_jct_s=float(np.percentile(jct, 99)) if jct.size else float("nan"),
        makespan_s=float(makespan),
        avg_queueing_s=float(queueing.mean()) if queueing.size else float("nan"),
        allocated_utilization=float(sum(j.allocated_device_s for j in result.jobs) / capacity),
        useful_utilization=float(sum(j.useful_device_s for j in result.jobs) / capacity),
        resizes_per_job=float(sum(j.resizes for j in result.jobs) / max(len(result.jobs), 1)),
        decision_p50_ms=float(np.percentile(decisions, 50)),
        decision_p95_ms=float(np.percentile(decisions, 95)),
    )
