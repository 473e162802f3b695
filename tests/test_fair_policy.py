"""The backbone policy: min/max respected, pins honoured or reported, fair shares, placements
kept across cycles, and properties that hold for any cluster (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.scheduling import ClusterSnapshot, DeviceView, JobView, fair_share


def devices(n: int, nodes: int = 1) -> tuple[DeviceView, ...]:
    return tuple(DeviceView(id=i, node=f"n{i % nodes}") for i in range(n))


def test_jobs_share_the_rest_fairly() -> None:
    snapshot = ClusterSnapshot(
        devices(4),
        (JobView(1, 1, 4, submitted_at=1), JobView(2, 1, 4, submitted_at=2)),
    )
    plan = fair_share(snapshot)
    assert [len(plan.assignments[j]) for j in (1, 2)] == [2, 2]


def test_a_job_that_cannot_get_its_minimum_waits() -> None:
    snapshot = ClusterSnapshot(devices(3), (JobView(1, 2, 2, submitted_at=1), JobView(2, 2, 2, submitted_at=2)))
    plan = fair_share(snapshot)
    assert len(plan.assignments[1]) == 2 and plan.assignments[2] == ()


def test_guaranteed_before_opportunistic() -> None:
    snapshot = ClusterSnapshot(
        devices(2),
        (JobView(1, 2, 2, "opportunistic", submitted_at=1), JobView(2, 2, 2, "guaranteed", submitted_at=2)),
    )
    plan = fair_share(snapshot)
    assert plan.assignments == {2: (0, 1), 1: ()}


def test_pin_is_honoured_and_unmet_pin_reported() -> None:
    snapshot = ClusterSnapshot(devices(4), (JobView(1, 1, 4, current=(0, 1, 2, 3), pinned_workers=1),))
    assert fair_share(snapshot).assignments[1] == (0,)
    crowded = ClusterSnapshot(
        devices(4),
        (JobView(1, 3, 3, submitted_at=1), JobView(2, 1, 4, submitted_at=2, pinned_workers=3)),
    )
    plan = fair_share(crowded)
    assert len(plan.assignments[2]) == 1
    assert plan.pin_problems[2] == (
        "pinned to 3 workers but given 1: a pin may not keep another job below its minimum (#1 needs 3)"
    )


def test_a_pin_never_keeps_a_later_job_below_its_minimum() -> None:
    """Alice pinned her job to the whole cluster; Bob's guaranteed job, submitted later, still
    gets its minimum: the pin is cut back and says why."""
    pinned = JobView(1, 1, 4, submitted_at=1, current=(0, 1, 2, 3), pinned_workers=4)
    later = JobView(2, 1, 2, submitted_at=2)
    plan = fair_share(ClusterSnapshot(devices(4), (pinned, later)))
    assert (len(plan.assignments[1]), len(plan.assignments[2])) == (3, 1)
    assert plan.pin_problems[1] == (
        "pinned to 4 workers but given 3: a pin may not keep another job below its minimum (#2 needs 1)"
    )
    alone = fair_share(ClusterSnapshot(devices(4), (pinned, JobView(3, 1, 2, submitted_at=2, priority="opportunistic"))))
    assert len(alone.assignments[1]) == 4 and not alone.assignments[3], "an opportunistic job does not cut a pin"


def test_placement_is_kept_and_owner_device_left() -> None:
    snapshot = ClusterSnapshot(
        (DeviceView(0, "a"), DeviceView(1, "a", usable=False), DeviceView(2, "b"), DeviceView(3, "a")),
        (JobView(1, 2, 2, current=(0, 1)),),
    )
    plan = fair_share(snapshot)
    assert plan.assignments[1][0] == 0 and 1 not in plan.assignments[1]
    assert plan.assignments[1] == (0, 3), "grows on the node it is already on"


def test_same_snapshot_same_plan_no_churn() -> None:
    first = fair_share(ClusterSnapshot(devices(6, 2), (JobView(1, 1, 3), JobView(2, 1, 3))))
    again = fair_share(
        ClusterSnapshot(devices(6, 2), (JobView(1, 1, 3, current=first.assignments[1]),
                                        JobView(2, 1, 3, current=first.assignments[2])))
    )
    assert again.assignments == first.assignments


job_strategy = st.builds(
    lambda i, lo, extra, prio, pin, cur: (i, lo, lo + extra, prio, pin, cur),
    st.integers(), st.integers(1, 4), st.integers(0, 4), st.sampled_from(["guaranteed", "opportunistic"]),
    st.none() | st.integers(1, 8), st.lists(st.integers(0, 15), max_size=4, unique=True),
)


@settings(max_examples=200, deadline=None)
@given(
    n_devices=st.integers(0, 16),
    unusable=st.sets(st.integers(0, 15)),
    raw_jobs=st.lists(job_strategy, max_size=8),
)
def test_plan_invariants(n_devices: int, unusable: set[int], raw_jobs: list) -> None:
    devs = tuple(DeviceView(i, f"n{i % 3}", usable=i not in unusable) for i in range(n_devices))
    jobs = []
    for job_id, (_, lo, hi, prio, pin, current) in enumerate(raw_jobs):
        pinned = None if pin is None else min(max(pin, lo), hi)
        jobs.append(JobView(job_id, lo, hi, prio, float(job_id), tuple(c for c in current if c < n_devices), pinned))
    plan = fair_share(ClusterSnapshot(devs, tuple(jobs)))
    usable = {d.id for d in devs if d.usable}
    given_out = [d for assigned in plan.assignments.values() for d in assigned]
    assert len(given_out) == len(set(given_out)), "a device given twice"
    assert set(given_out) <= usable, "an unusable device given"
    for job in jobs:
        count = len(plan.assignments[job.id])
        assert count == 0 or job.min_workers <= count <= job.max_workers
    if len(given_out) < len(usable):
        for job in jobs:
            count = len(plan.assignments[job.id])
            if job.pinned_workers is None and count:
                assert count == job.max_workers, "a device left idle while a running job could grow"
