"""The policies' decisions on seeded clusters are pinned: a change that makes a policy faster (or
tidier) must not change what it decides. Each scenario's plan (assignments, batch sizes,
reasons, notes, pin problems, straggler actions) is compared with the one recorded in
`fixtures/policy_decisions.json`, by digest, with every job's worker count kept beside it so a
failure says which jobs moved.

The scenarios are `bench/simulate.py --decision-time`'s own clusters (4-device nodes, about one
hybrid job per two devices, half of them already placed by a first decision) at 64, 512 and
2,048 devices, on applications built here rather than fitted to the Pollux traces (which live
outside the repository), plus smaller mixed clusters: lent and reclaimed devices, unusable ones, uneven
nodes, pins, opportunistic and strict jobs, jobs without curves, stragglers.

A change that is meant to change decisions re-records the fixture and says why in its commit:

    .venv/bin/python -m tests.test_policy_decisions_pinned --record
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from elastic.scheduling import (
    POLICY_NAMES,
    ClusterSnapshot,
    DeviceView,
    GradientNoise,
    JobView,
    Plan,
    get_policy,
)
from elastic.scheduling.throughput import ThroughputModel
from elastic.simulator.synthetic import jobs_for, synthetic_snapshot
from elastic.simulator.traces import Application, ValidationCurve

FIXTURE = Path(__file__).parent / "fixtures" / "policy_decisions.json"

MODELS = (
    ThroughputModel(0.01, 0.001, 0.004, 0.001, 0.02, 0.001, 2.0),
    ThroughputModel(0.02, 0.0001, 0.05, 0.01, 0.4, 0.02, 1.0),
    ThroughputModel(0.05, 0.0004, 0.01, 0.002, 0.08, 0.004, 1.5),
    ThroughputModel(0.002, 0.00005, 0.03, 0.0005, 0.15, 0.001, 3.0),
)
"""Compute-heavy, communication-bound, in between, and tiny compute with costly sync."""
BASE_BATCHES = (32, 64, 128, 256)


def _application(name: str, model: ThroughputModel, base: int) -> Application:
    """A workload like the Pollux trace's: gradient noise that falls as training progresses, less
    so at a larger batch."""
    progress = np.array([0.0, 2e4, 1e5])
    curves = tuple(
        ValidationCurve(
            batch, progress, np.array([2.0, 0.5, 0.05]) * scale, np.array([30.0, 12.0, 4.0]) / scale
        )
        for batch, scale in ((base, 1.0), (base * 8, 1.5))
    )
    return Application(name, model, 0.0, base, base * 64, 1, base * 4, 1e5, curves)


APPLICATIONS = {
    f"app{i}": _application(f"app{i}", model, base)
    for i, (model, base) in enumerate(zip(MODELS, BASE_BATCHES, strict=True))
}
"""Stand-ins for the trace's applications, which live outside the repository."""


def _mixed(devices: int, jobs: int, seed: int) -> tuple[tuple[DeviceView, ...], list[JobView]]:
    """Everything the frame handles: owners present and away, unusable devices, nodes of 1 to
    8 devices, pins, opportunistic and strict jobs, jobs without a curve or a batch size."""
    rng = np.random.default_rng(seed)
    device_views = []
    node, left_on_node = 0, 0
    for i in range(devices):
        if left_on_node == 0:
            node, left_on_node = node + 1, int(rng.choice([1, 2, 4, 8]))
        left_on_node -= 1
        owner = "alice" if rng.random() < 0.2 else None
        device_views.append(
            DeviceView(
                id=i,
                node=f"n{node}",
                usable=bool(rng.random() > 0.05),
                owner=owner,
                owner_present=owner is not None and bool(rng.random() < 0.4),
            )
        )
    job_views = []
    for job_id in range(jobs):
        hybrid = bool(rng.random() < 0.6)
        low = int(rng.choice([1, 1, 2, 3, 4]))
        high = low + int(rng.integers(0, 12))
        base = int(rng.choice(BASE_BATCHES))
        has_noise = bool(rng.random() < 0.8)
        job_views.append(
            JobView(
                id=job_id,
                min_workers=low,
                max_workers=high,
                priority="guaranteed" if rng.random() < 0.6 else "opportunistic",
                submitted_at=float(rng.integers(0, 50)),
                pinned_workers=int(rng.integers(low, high + 1)) if rng.random() < 0.1 else None,
                requested_workers=int(rng.choice([1, 2, 4, 8])) if rng.random() < 0.7 else None,
                consistency="hybrid" if hybrid else "strict",
                throughput=MODELS[int(rng.integers(len(MODELS)))] if rng.random() < 0.85 else None,
                batch_size=base * 2 ** int(rng.integers(0, 3)) if rng.random() < 0.9 else None,
                min_batch_size=base if hybrid else None,
                max_batch_size=base * 32 if hybrid else None,
                max_local_batch_size=base * 2 if rng.random() < 0.7 else None,
                gradient_noise=(
                    GradientNoise(base, float(rng.uniform(0.01, 2.0)), float(rng.uniform(0.1, 40.0)))
                    if has_noise
                    else None
                ),
                attained_service_s=float(rng.exponential(7200)),
                virtual_workers=None
                if hybrid
                else max(1, int(high + rng.integers(-2, 3)))
                if rng.random() < 0.5
                else None,
                remaining_work=float(rng.uniform(100, 50000)) if rng.random() < 0.7 else None,
            )
        )
    return tuple(device_views), job_views


def _slow_workers(job: JobView, rng: np.random.Generator) -> tuple[tuple[float, ...], ...]:
    """Twenty steps per worker, one worker in three jobs slow in all of them."""
    slow = int(rng.integers(len(job.current))) if rng.random() < 0.33 else -1
    return tuple(
        tuple(float(t) * (1.6 if rank == slow else 1.0) for t in rng.uniform(0.09, 0.11, 20))
        for rank in range(len(job.current))
    )


def scenario(kind: str, devices: int, jobs: int, seed: int, policy_name: str) -> ClusterSnapshot:
    """A snapshot after a first decision by the policy itself: half the jobs hold what it gave
    them (with step-time reports, for the mixed kind), attained service jittered. The bench kind
    is `bench/simulate.py --decision-time`'s own cluster, on APPLICATIONS."""
    policy = get_policy(policy_name)
    if kind == "bench":
        assert jobs == jobs_for(devices)
        return synthetic_snapshot(devices, APPLICATIONS, seed, warm_with=policy)
    device_views, job_views = _mixed(devices, jobs, seed)
    plan = policy(ClusterSnapshot(device_views, tuple(job_views), now=3600.0))
    rng = np.random.default_rng(seed + 1000)
    running = set(rng.choice(len(job_views), size=len(job_views) // 2, replace=False).tolist())
    warmed = []
    for job in job_views:
        job = replace(
            job,
            current=plan.assignments.get(job.id, ()) if job.id in running else (),
            attained_service_s=job.attained_service_s * float(rng.uniform(0.9, 1.1)),
        )
        if len(job.current) > 1:
            job = replace(job, worker_step_times=_slow_workers(job, rng))
        warmed.append(job)
    return ClusterSnapshot(device_views, tuple(warmed), now=3600.0)


SCENARIOS: list[tuple[str, str, int, int, int]] = [
    *(("bench", name, 64, 32, seed) for name in ("bungee", "saxena") for seed in range(4)),
    *(("bench", name, 512, 250, seed) for name in ("bungee", "saxena") for seed in range(2)),
    *(("bench", name, 2048, 1000, 0) for name in ("bungee", "saxena")),
    *(("mixed", name, 24, 9, seed) for name in POLICY_NAMES for seed in range(3)),
    *(("mixed", name, 96, 40, seed) for name in POLICY_NAMES for seed in range(2)),
    *(("mixed", name, 96, 12, seed) for name in POLICY_NAMES for seed in range(3)),
    *(("mixed", name, 300, 120, 7) for name in ("bungee", "saxena", "optimus")),
]


def scenario_key(kind: str, name: str, devices: int, jobs: int, seed: int) -> str:
    return f"{name} {kind} {devices} devices {jobs} jobs seed {seed}"


def plan_record(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON (keys as strings, sorted), and its digest."""
    whole = {
        "assignments": {str(k): list(v) for k, v in sorted(plan.assignments.items())},
        "batch_sizes": {str(k): v for k, v in sorted(plan.batch_sizes.items())},
        "reasons": {str(k): [str(r) for r in v] for k, v in sorted(plan.reasons.items())},
        "notes": {str(k): v for k, v in sorted(plan.notes.items())},
        "pin_problems": {str(k): v for k, v in sorted(plan.pin_problems.items())},
        "stragglers": [dataclasses.asdict(a) for a in plan.stragglers],
    }
    digest = hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()
    workers = " ".join(str(len(v)) for _, v in sorted(plan.assignments.items()))
    return {"digest": digest, "workers": workers}


def decide(kind: str, name: str, devices: int, jobs: int, seed: int) -> dict[str, Any]:
    return plan_record(get_policy(name)(scenario(kind, devices, jobs, seed, name)))


def _recorded() -> dict[str, dict[str, Any]]:
    return dict(json.loads(FIXTURE.read_text()))


@pytest.mark.parametrize(
    ("kind", "name", "devices", "jobs", "seed"), SCENARIOS, ids=[scenario_key(*s) for s in SCENARIOS]
)
def test_decision_is_the_recorded_one(kind: str, name: str, devices: int, jobs: int, seed: int) -> None:
    expected = _recorded()[scenario_key(kind, name, devices, jobs, seed)]
    got = decide(kind, name, devices, jobs, seed)
    assert got["workers"] == expected["workers"], "a job's worker count changed"
    assert got["digest"] == expected["digest"], "the plan changed (devices, batch sizes, reasons or notes)"


def test_every_scenario_is_recorded() -> None:
    assert set(_recorded()) == {scenario_key(*s) for s in SCENARIOS}


def record() -> None:
    FIXTURE.parent.mkdir(exist_ok=True)
    records = {scenario_key(*s): decide(*s) for s in SCENARIOS}
    FIXTURE.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(records)} decisions in {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python -m tests.test_policy_decisions_pinned --record")
    record()
