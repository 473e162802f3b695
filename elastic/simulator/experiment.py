"""Many simulation runs at once: workloads x policies, spread over processes, summarised.

`run_experiment` is what bench/simulate.py calls; it is also small enough for tests to drive on
a tiny workload.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elastic.scheduling.registry import get_policy
from elastic.simulator.engine import Simulation, SimulationConfig
from elastic.simulator.metrics import Summary, summarise
from elastic.simulator.traces import DEFAULT_TRACES, load_applications
from elastic.simulator.workload import read_workload

LOAD_FOLDERS = {"1.0": "workloads", "2.0": "workloads-2.0", "realistic": "workloads-realistic"}


@dataclass(frozen=True)
class RunSpec:
    workload: Path
    policy: str
    config: SimulationConfig
    traces: Path = DEFAULT_TRACES
    first_hours: float | None = None
    """Only the jobs submitted in the first this many hours (--quick)."""


def standard_workloads(traces: Path, load: str) -> list[Path]:
    """The eight workload files of one load ("1.0", "2.0" or "realistic"). Raises ValueError for
    another load and FileNotFoundError when the folder has none."""
    if load not in LOAD_FOLDERS:
        raise ValueError(f"unknown load {load!r}; known: {', '.join(LOAD_FOLDERS)}")
    paths = sorted(
        (traces / LOAD_FOLDERS[load]).glob("workload-*.csv"), key=lambda p: int(p.stem.split("-")[1])
    )
    if not paths:
        raise FileNotFoundError(f"no workload-*.csv under {str(traces / LOAD_FOLDERS[load])!r}")
    return paths


def run_one(spec: RunSpec) -> Summary:
    """One policy on one workload."""
    apps = load_applications(spec.traces)
    jobs = read_workload(spec.workload)
    if spec.first_hours is not None:
        jobs = [j for j in jobs if j.submitted_at < spec.first_hours * 3600]
    policy = get_policy(spec.policy, resize_cost_s=spec.config.resize_cost_s)
    return summarise(Simulation(jobs, apps, policy, spec.config).run())


def run_experiment(
    workloads: Sequence[Path],
    policies: Sequence[str],
    config: SimulationConfig,
    traces: Path = DEFAULT_TRACES,
    processes: int | None = None,
    first_hours: float | None = None,
) -> dict[str, list[Summary]]:
    """Summaries per policy, one per workload in order. Runs in `processes` worker processes
    (default: one per core; 1 runs in this process)."""
    specs = [RunSpec(w, p, config, traces, first_hours) for p in policies for w in workloads]
    processes = processes or os.cpu_count() or 1
    if processes == 1:
        results = [run_one(s) for s in specs]
    else:
        heaviest_first = sorted(range(len(specs)), key=lambda i: specs[i].policy == "fifo")
        with ProcessPoolExecutor(processes) as pool:
            done = dict(
                zip(heaviest_first, pool.map(run_one, [specs[i] for i in heaviest_first]), strict=True)
            )
        results = [done[i] for i in range(len(specs))]
    by_policy: dict[str, list[Summary]] = {p: [] for p in policies}
    for spec, summary in zip(specs, results, strict=True):
        by_policy[spec.policy].append(summary)
    return by_policy


def mean_summary(summaries: Sequence[Summary]) -> Summary:
    """The field-by-field mean over workloads (how the Pollux paper reports its figures)."""

    def mean(name: str) -> float:
        return float(np.mean([s.as_dict()[name] for s in summaries]))

    return Summary(
        jobs=sum(s.jobs for s in summaries),
        unfinished=sum(s.unfinished for s in summaries),
        avg_jct_s=mean("avg_jct_s"),
        p50_jct_s=mean("p50_jct_s"),
        p99_jct_s=mean("p99_jct_s"),
        makespan_s=mean("makespan_s"),
        avg_queueing_s=mean("avg_queueing_s"),
        allocated_utilization=mean("allocated_utilization"),
        useful_utilization=mean("useful_utilization"),
        resizes_per_job=mean("resizes_per_job"),
        decision_p50_ms=mean("decision_p50_ms"),
        decision_p95_ms=mean("decision_p95_ms"),
    )
