"""Synthetic clusters for timing decisions at sizes the traces do not reach (512 and 2,048
devices): nodes of four devices, about one job per two devices drawn from the trace's
applications at random points of their training, half of them already running where a previous
decision put them (the steady state a scheduler sees every round)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from elastic.scheduling.api import ClusterSnapshot, DeviceView, JobView, Policy
from elastic.simulator.traces import Application

STANDARD_JOBS = {64: 32, 512: 250, 2048: 1000}


def jobs_for(devices: int) -> int:
    """Jobs in a synthetic cluster of `devices` devices: 32 at 64, 250 at 512, 1,000 at 2,048,
    about one per two devices otherwise."""
    return STANDARD_JOBS.get(devices, max(1, devices // 2))


def synthetic_snapshot(
    devices: int, apps: dict[str, Application], seed: int, warm_with: Policy | None = None
) -> ClusterSnapshot:
    """A snapshot of `devices` devices and `jobs_for(devices)` jobs. With `warm_with`, half the
    jobs hold the devices that policy gave them in a first decision."""
    rng = np.random.default_rng(seed)
    device_views = tuple(DeviceView(id=i, node=f"node{i // 4:04d}") for i in range(devices))
    names = sorted(apps)
    jobs = []
    for job_id in range(jobs_for(devices)):
        app = apps[names[int(rng.integers(len(names)))]]
        progress = float(rng.uniform(0, 0.9)) * app.target_progress
        batch = int(app.base_batch_size * 2 ** int(rng.integers(0, 4)))
        jobs.append(
            JobView(
                id=job_id,
                min_workers=int(rng.choice([1, 1, 1, 2, 4])),
                max_workers=64,
                submitted_at=float(rng.uniform(0, 3600)),
                requested_workers=int(rng.choice([1, 2, 4, 8, 16])),
                consistency="hybrid",
                throughput=app.throughput,
                batch_size=batch,
                min_batch_size=app.base_batch_size,
                max_batch_size=app.max_batch_size,
                max_local_batch_size=app.max_local_batch,
                gradient_noise=app.gradient_noise(progress, batch),
                attained_service_s=float(rng.exponential(7200)),
                remaining_work=app.target_progress - progress,
            )
        )
    snapshot = ClusterSnapshot(device_views, tuple(jobs), now=3600.0)
    if warm_with is None:
        return snapshot
    plan = warm_with(snapshot)
    running = set(rng.choice(len(jobs), size=len(jobs) // 2, replace=False).tolist())
    warmed = tuple(
        replace(
            j,
            current=plan.assignments.get(j.id, ()) if j.id in running else (),
            attained_service_s=j.attained_service_s * float(rng.uniform(0.9, 1.1)),
        )
        for j in jobs
    )
    return replace(snapshot, jobs=warmed)
