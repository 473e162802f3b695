"""Building blocks for the policy tests: small clusters, jobs with realistic curves, and a
hypothesis strategy for arbitrary snapshots (owners, pins, lent devices, hybrid jobs)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from elastic.scheduling import ClusterSnapshot, DeviceView, GradientNoise, JobView, Plan, ThroughputModel

SCALES_WELL = ThroughputModel(0.01, 0.001, 0.004, 0.001, 0.02, 0.001, 2.0)
"""A compute-heavy job: all-reduce mostly hidden, near-linear speedup."""
SCALES_BADLY = ThroughputModel(0.02, 0.0001, 0.05, 0.01, 0.4, 0.02, 1.0)
"""A communication-bound job: a second node costs more than it brings."""
NOISE = GradientNoise(base_batch_size=32, grad_sqr=1.0, grad_var=8.0)


def devices(n: int, per_node: int = 4) -> tuple[DeviceView, ...]:
    return tuple(DeviceView(id=i, node=f"n{i // per_node}") for i in range(n))


def hybrid_job(job_id: int, model: ThroughputModel = SCALES_WELL, **fields: Any) -> JobView:
    base: dict[str, Any] = dict(
        id=job_id,
        min_workers=1,
        max_workers=16,
        submitted_at=float(job_id),
        consistency="hybrid",
        throughput=model,
        batch_size=64,
        min_batch_size=32,
        max_batch_size=1024,
        max_local_batch_size=128,
        gradient_noise=NOISE,
    )
    base.update(fields)
    return JobView(**base)


def following(snapshot: ClusterSnapshot, plan: Plan) -> ClusterSnapshot:
    """The next cycle's snapshot when nothing changed but the plan being carried out."""
    jobs = tuple(
        replace(j, current=plan.assignments[j.id], batch_size=plan.batch_sizes.get(j.id, j.batch_size))
        for j in snapshot.jobs
    )
    return replace(snapshot, jobs=jobs)


def counts(plan: Plan) -> dict[int, int]:
    return {job_id: len(devices) for job_id, devices in plan.assignments.items()}


@st.composite
def snapshots(draw: st.DrawFn, max_devices: int = 20, max_jobs: int = 7) -> ClusterSnapshot:
    n = draw(st.integers(0, max_devices))
    per_node = draw(st.integers(1, 4))
    device_views = []
    for i in range(n):
        owner = draw(st.sampled_from([None, None, None, "alice"]))
        device_views.append(
            DeviceView(
                id=i,
                node=f"n{i // per_node}",
                usable=draw(st.booleans()) or draw(st.booleans()),
                owner=owner,
                owner_present=owner is not None and draw(st.booleans()),
            )
        )
    free_ids = list(range(n))
    jobs = []
    for job_id in range(draw(st.integers(0, max_jobs))):
        low = draw(st.integers(1, 3))
        high = low + draw(st.integers(0, 5))
        held = draw(st.integers(0, min(4, len(free_ids))))
        current = tuple(free_ids[:held])
        del free_ids[:held]
        pin = draw(st.none() | st.integers(low, high))
        hybrid = draw(st.booleans())
        jobs.append(
            JobView(
                id=job_id,
                min_workers=low,
                max_workers=high,
                priority=draw(st.sampled_from(["guaranteed", "opportunistic"])),
                submitted_at=float(draw(st.integers(0, 100))),
                current=current,
                pinned_workers=pin,
                requested_workers=draw(st.none() | st.integers(1, 8)),
                consistency="hybrid" if hybrid else "strict",
                throughput=draw(st.sampled_from([None, SCALES_WELL, SCALES_BADLY])),
                batch_size=draw(st.sampled_from([None, 64, 256])),
                min_batch_size=32 if hybrid else None,
                max_batch_size=1024 if hybrid else None,
                max_local_batch_size=draw(st.sampled_from([None, 64])),
                gradient_noise=draw(st.sampled_from([None, NOISE])),
                attained_service_s=float(draw(st.integers(0, 20000))),
                remaining_work=draw(st.none() | st.floats(1.0, 1e5)),
            )
        )
    return ClusterSnapshot(tuple(device_views), tuple(jobs), now=100.0)
