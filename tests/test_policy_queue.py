"""What a waiting job is told (elastic.scheduling.queue): its place in its pool's queue, the jobs
holding the devices it waits for and whether they are pinned, and an estimated start from the
jobs' modelled step times and remaining steps, or why there is none."""

from __future__ import annotations

import pytest

from elastic.scheduling import ClusterSnapshot, DeviceView, JobView, Plan, ThroughputModel
from elastic.scheduling.queue import Holder, duration_s, explain_queue

STEADY = ThroughputModel(0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
"""0.1 s a step whatever the workers: easy arithmetic."""


def job(job_id: int, min_workers: int, submitted_at: float, steps: float | None = 100.0, **change: object) -> JobView:
    fields: dict[object, object] = {"batch_size": 32, "throughput": STEADY, "throughput_measured": True,
                                    "remaining_work": steps, **change}
    return JobView(job_id, min_workers, 4, submitted_at=submitted_at, **fields)  # type: ignore[arg-type]


def test_position_holders_and_start_in_order() -> None:
    devices = tuple(DeviceView(i, "a") for i in range(4))
    running = job(1, 4, 1.0, steps=300, pinned_workers=4)  # 30 s left
    second = job(2, 3, 2.0, steps=100)  # starts at 30 s, runs 10 s
    third = job(3, 2, 3.0)  # 2 + 3 > 4 while the second runs: starts at 40 s
    plan = Plan(assignments={1: (0, 1, 2, 3), 2: (), 3: ()})
    queue = explain_queue(ClusterSnapshot(devices, (running, second, third)), plan)
    assert set(queue) == {2, 3}
    assert (queue[2].position, queue[2].waiting, queue[3].position) == (1, 2, 2)
    assert queue[2].holders == (Holder(job_id=1, devices=4, pinned=True, finishes_in_s=pytest.approx(30.0)),)
    assert queue[2].starts_in_s == pytest.approx(30.0) and queue[3].starts_in_s == pytest.approx(40.0)


def test_each_waiting_job_counts_the_ones_served_before_it() -> None:
    devices = tuple(DeviceView(i, "a") for i in range(4))
    plan = Plan(assignments={1: (0, 1, 2), 2: (), 3: ()})
    queue = explain_queue(
        ClusterSnapshot(devices, (job(1, 3, 1.0, steps=200), job(2, 4, 2.0), job(3, 2, 3.0))), plan
    )
    assert queue[2].starts_in_s == pytest.approx(20.0), "the large job waits for the running one"
    assert queue[3].starts_in_s == pytest.approx(30.0), "then the small one waits for the large one to finish"


def test_no_estimate_says_why() -> None:
    devices = tuple(DeviceView(i, "a") for i in range(2))
    unknown = job(1, 2, 1.0, throughput_measured=False)  # a prior only: it has not reported yet
    queue = explain_queue(ClusterSnapshot(devices, (unknown, job(2, 1, 2.0), job(3, 3, 3.0))),
                          Plan(assignments={1: (0, 1), 2: (), 3: ()}))
    assert queue[2].starts_in_s is None and queue[2].no_estimate == "it waits on jobs whose speed is not known yet (#1)"
    assert queue[2].holders == (Holder(1, 2, False, None),)
    assert queue[3].no_estimate == "it needs 3 devices and its pool has 2 usable now"


def test_an_opportunistic_job_waits_for_guaranteed_ones_at_their_full_size() -> None:
    devices = (DeviceView(0, "a"), DeviceView(1, "a"), DeviceView(2, "a", owner="carol"))
    guaranteed = job(1, 1, 5.0, steps=100)  # on 3 devices, though its minimum is 1
    borrower = job(2, 1, 1.0, priority="opportunistic")
    queue = explain_queue(ClusterSnapshot(devices, (guaranteed, borrower)), Plan(assignments={1: (0, 1, 2), 2: ()}))
    assert queue[2].starts_in_s == pytest.approx(10.0) and queue[2].holders[0].devices == 3


def test_a_running_jobs_reported_end_beats_the_model() -> None:
    devices = tuple(DeviceView(i, "a") for i in range(2))
    snapshot = ClusterSnapshot(devices, (job(1, 2, 1.0, steps=100), job(2, 2, 2.0)))
    plan = Plan(assignments={1: (0, 1), 2: ()})
    assert explain_queue(snapshot, plan)[2].starts_in_s == pytest.approx(10.0)
    told = explain_queue(snapshot, plan, {1: 42.0})[2]
    assert told.starts_in_s == 42.0 and told.holders[0].finishes_in_s == 42.0


def test_duration_needs_a_model_steps_and_a_batch() -> None:
    assert duration_s(job(1, 1, 0.0, steps=50), 2) == pytest.approx(5.0)
    assert duration_s(job(1, 1, 0.0, throughput=None), 1) is None
    assert duration_s(job(1, 1, 0.0, throughput_measured=False), 1) is None
    assert duration_s(job(1, 1, 0.0, steps=None), 1) is None
