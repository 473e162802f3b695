"""Counts read as English wherever people read them: "1 worker", "2 workers", in the scheduler's
reasons, its pin problems and the portal's refusals (once: "pinned to 1 workers")."""

from __future__ import annotations

from elastic.scheduling import ClusterSnapshot, DeviceView, JobView, Plan, Reason
from elastic.scheduling.fair import fair_share
from elastic.wording import counted
from portal.scheduling.decisions import explain


def test_a_count_takes_the_plural_unless_it_is_one() -> None:
    assert [counted(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    assert counted(1, "invalid field") == "1 invalid field"
    assert counted(3, "process", "processes") == "3 processes"


def test_the_schedulers_reasons_say_one_worker_and_one_device() -> None:
    devices = tuple(DeviceView(id=i, node="n") for i in range(2))
    pinned = JobView(id=1, min_workers=1, max_workers=2, pinned_workers=1)
    least = JobView(id=2, min_workers=1, max_workers=1)
    snapshot = ClusterSnapshot(devices=devices, jobs=(pinned, least))
    plan = Plan(assignments={1: (0,), 2: (1,)}, reasons={1: (Reason.PINNED,), 2: (Reason.MINIMUM,)})
    assert explain(pinned, plan, snapshot, held=(0, 1)) == "pinned to 1 worker by a manual resize"
    assert explain(least, plan, snapshot, held=(0, 1)) == "its minimum of 1 worker"
    lone = ClusterSnapshot(devices=devices[:1], jobs=(JobView(id=3, min_workers=2, max_workers=2),))
    waiting = explain(lone.jobs[0], Plan(assignments={3: ()}, reasons={3: (Reason.WAITING,)}), lone, held=())
    assert "needs at least 2 workers and the cluster has 1 device;" in waiting


def test_an_unmet_pin_says_how_many_devices_are_free_in_the_singular() -> None:
    devices = (DeviceView(id=0, node="n"), DeviceView(id=1, node="n"))
    hog = JobView(id=1, min_workers=1, max_workers=1, submitted_at=0)
    pinned = JobView(id=2, min_workers=1, max_workers=3, pinned_workers=3, submitted_at=1)
    plan = fair_share(ClusterSnapshot(devices=devices, jobs=(hog, pinned)))
    assert plan.pin_problems[2] == "pinned to 3 workers but given 1: a pin may not keep another job below its minimum (#1 needs 1)"
    alone = fair_share(ClusterSnapshot(devices=devices[:1], jobs=(pinned,)))
    assert alone.pin_problems[2] == "pinned to 3 workers but given 1: 1 device free for it (min 1, max 3)"
