"""Properties every registered policy keeps for any cluster (hypothesis): bounds, devices,
owners, pins, the opportunistic guarantee, determinism and no thrash."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings

from elastic.scheduling import POLICY_NAMES, ClusterSnapshot, get_policy
from tests.policy_cases import counts, following, snapshots

POLICIES = {name: get_policy(name) for name in POLICY_NAMES}


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=120, deadline=None)
@given(snapshot=snapshots())
def test_bounds_devices_and_owners(name: str, snapshot: ClusterSnapshot) -> None:
    plan = POLICIES[name](snapshot)
    by_id = {d.id: d for d in snapshot.devices}
    assert set(plan.assignments) == {j.id for j in snapshot.jobs}
    given_out = [d for devices in plan.assignments.values() for d in devices]
    assert len(given_out) == len(set(given_out)), "a device given twice"
    for device_id in given_out:
        device = by_id[device_id]
        assert device.usable, "an unusable device given"
        assert not device.owner_present, "owner reclaim must win"
    for job in snapshot.jobs:
        count = len(plan.assignments[job.id])
        assert count == 0 or job.min_workers <= count <= job.max_workers
        if job.priority == "guaranteed":
            assert not any(by_id[d].lent for d in plan.assignments[job.id]), "guaranteed job on a lent device"
        if job.pinned_workers is not None and count != job.pinned_workers:
            assert job.id in plan.pin_problems, "an unmet pin not reported"
        if job.id in plan.pin_problems:
            assert count != job.pinned_workers
        if count and job.consistency == "hybrid" and job.batch_size is not None:
            assert plan.batch_sizes[job.id] >= 1


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=80, deadline=None)
@given(snapshot=snapshots())
def test_deterministic_and_no_thrash(name: str, snapshot: ClusterSnapshot) -> None:
    policy = POLICIES[name]
    plan = policy(snapshot)
    assert policy(snapshot) == plan, "same snapshot, different plan"
    again = policy(following(snapshot, plan))
    assert again.assignments == plan.assignments, "resized although nothing changed"
    assert again.batch_sizes == plan.batch_sizes


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=80, deadline=None)
@given(snapshot=snapshots())
def test_guaranteed_jobs_never_held_below_minimum_by_opportunistic_ones(
    name: str, snapshot: ClusterSnapshot
) -> None:
    policy = POLICIES[name]
    with_them = counts(policy(snapshot))
    alone = replace(snapshot, jobs=tuple(j for j in snapshot.jobs if j.priority == "guaranteed"))
    without = counts(policy(alone))
    for job_id, count in without.items():
        if count:
            assert with_them[job_id] >= min(
                count, next(j.min_workers for j in snapshot.jobs if j.id == job_id)
            )


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=60, deadline=None)
@given(snapshot=snapshots())
def test_a_feasible_pin_is_honoured(name: str, snapshot: ClusterSnapshot) -> None:
    """A pin is met as far as it leaves every other job of its pool its minimum: the pinned job
    gets its own minimum, the other guaranteed jobs' minimums that fit are set aside in
    submission order, and the pin is raised from what is left; a shortfall is reported."""
    guaranteed = [j for j in snapshot.jobs if j.priority == "guaranteed"]
    if not guaranteed:
        return
    shared = sum(1 for d in snapshot.devices if d.available and not d.lent)
    target = guaranteed[0]
    pin = min(target.max_workers, max(target.min_workers, shared))
    if pin > shared:
        return
    jobs = tuple(
        replace(j, pinned_workers=pin) if j.id == target.id else replace(j, pinned_workers=None)
        for j in snapshot.jobs
    )
    plan = POLICIES[name](replace(snapshot, jobs=tuple(sorted(jobs, key=lambda j: j.id != target.id))))
    if name == "fair" and any(
        j.priority == "guaranteed" and (j.submitted_at, j.id) < (target.submitted_at, target.id) for j in jobs
    ):
        return  # the backbone gives minimums in submission order, the pinned job's among them
    free = shared - target.min_workers
    set_aside = 0
    for other in sorted((j for j in guaranteed if j.id != target.id), key=lambda j: (j.submitted_at, j.id)):
        if other.min_workers <= free - set_aside:
            set_aside += other.min_workers
    expected = target.min_workers + min(pin - target.min_workers, free - set_aside)
    assert len(plan.assignments[target.id]) == expected
    assert (target.id in plan.pin_problems) == (expected != pin)

@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_pin_never_keeps_another_users_guaranteed_job_below_its_minimum(name: str) -> None:
    """The probe's case: a job dragged to the whole cluster and pinned there, then another
    user's guaranteed job. It starts at its minimum at once, and the pin says why it fell short."""
    from elastic.scheduling import DeviceView, JobView

    cluster = tuple(DeviceView(i, "node-a") for i in range(4))
    pinned = JobView(1, 1, 4, submitted_at=1.0, current=(0, 1, 2, 3), pinned_workers=4)
    later = JobView(2, 1, 1, submitted_at=2.0)  # min = max: the gang baselines (fifo, tiresias) start it too
    plan = POLICIES[name](ClusterSnapshot(cluster, (pinned, later), now=3.0))
    assert len(plan.assignments[2]) == 1 and len(plan.assignments[1]) == 3
    assert "a pin may not keep another job below its minimum (#2 needs 1)" in plan.pin_problems[1]
