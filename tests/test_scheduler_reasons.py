"""What the scheduler says about each job, against the real database: why it has what it has
(pinned, minimum, fair share, borrowed device, waiting), an unmet pin reported and lifted, hybrid
batch sizes kept, guaranteed jobs never below their minimum for an opportunistic one, and each
job's throughput, attained service and remaining work learned from its workers' reports."""

from __future__ import annotations

import time
from typing import Any

import pytest

from elastic.wire import AgentReport, DeviceSample
from portal.cluster.models import Device
from portal.jobs.agents import ingest_report
from portal.jobs.models import Job
from portal.scheduling.cycle import run_cycle
from portal.scheduling.snapshot import build_snapshot
from tests.conftest import VALID_SPEC
from tests.test_scheduler_cycle import event, report

pytestmark = pytest.mark.django_db


def submit(api: dict, user: str = "alice", **change: Any) -> int:
    reply = api[user].post("/api/jobs", {**VALID_SPEC, **change})
    assert reply.status_code == 201, reply.content
    return int(reply.json()["id"])


def settle(cluster: Any) -> None:
    """Plans, then reports every new generation as formed (each worker on its device, the
    leavers gone), until nothing changes."""
    for _ in range(6):
        result = run_cycle()
        for job in Job.objects.filter(pk__in=result.changed_jobs):
            joined = [
                event(
                    job,
                    "joined",
                    rank=a.rank,
                    pid=1000 * job.pk + a.device.index,
                    device_index=a.device.index,
                )
                for a in job.allocations.select_related("device")
            ]
            kept = set(job.allocations.values_list("device__index", flat=True))
            left = [
                event(
                    job,
                    "exited",
                    rank=w.rank,
                    generation=w.generation,
                    device_index=w.device_index,
                    exit_code=76,
                    reason="left",
                )
                for w in job.workers.filter(state="running").exclude(device_index__in=kept)
            ]
            report(cluster, *joined, *left, event(job, "resized"))
        if not result.changed_jobs:
            return
    raise AssertionError("the plan never settled")


def owner(cluster: Any, present: set[int]) -> None:
    """The agent's report: the devices in `present` have a process it did not start."""
    samples = [
        DeviceSample(
            index=i,
            taken_at=time.time(),
            utilization_pct=0,
            memory_used_bytes=0,
            memory_total_bytes=2**30,
            owner_present=i in present,
        )
        for i in range(4)
    ]
    ingest_report(cluster, AgentReport(node=cluster.name, samples=samples))


def shown(api: dict, job_id: int, user: str = "alice") -> dict[str, Any]:
    reply = api[user].get(f"/api/jobs/{job_id}")
    assert reply.status_code == 200, reply.content
    return dict(reply.json())


def test_reasons_are_stored_and_shown(api: dict, cluster: Any, redis_client: Any) -> None:
    small = submit(api, name="small", min_workers=1, max_workers=1)
    wide = submit(api, name="wide", min_workers=1, max_workers=3)
    settle(cluster)
    assert shown(api, small)["schedule_reasons"] == ["minimum"]
    detail = shown(api, wide)
    assert detail["schedule_reasons"] == ["fair share"] and detail["workers"] == 3
    assert detail["schedule_note"] == "its fair share: 3 workers"
    # Everyone sees the reasons on the list, as on the board.
    listed = {j["id"]: j for j in api["bob"].get("/api/jobs").json()}
    assert listed[wide]["schedule_note"] == "its fair share: 3 workers"
    late = submit(api, user="bob", name="late", min_workers=2, max_workers=2)
    settle(cluster)
    waiting = shown(api, late, "bob")
    assert waiting["schedule_reasons"] == ["waiting"] or waiting["workers"] == 2
    if waiting["workers"] == 0:
        assert "needs at least 2" in waiting["schedule_note"]


def test_an_unmet_pin_is_reported_and_can_be_lifted(api: dict, cluster: Any, redis_client: Any) -> None:
    first = submit(api, name="first", max_workers=4)
    second = submit(api, name="second", max_workers=4)
    for job_id in (first, second):
        assert api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": 3}).status_code == 200
    settle(cluster)
    met, unmet = shown(api, first), shown(api, second)
    assert (met["workers"], met["schedule_reasons"], met["pin_problem"]) == (3, ["pinned"], "")
    assert unmet["workers"] == 1 and unmet["schedule_reasons"] == ["pin unmet"]
    assert unmet["pin_problem"] == "pinned to 3 workers but given 1: 1 device free for it (min 1, max 4)"
    # Bob may not lift Alice's pin; Alice may, and the job is the scheduler's again.
    refused = api["bob"].post(f"/api/jobs/{second}/unpin")
    assert refused.status_code == 403 and "belongs to alice" in refused.json()["error"]["message"]
    assert Job.objects.get(pk=second).pinned_workers == 3
    lifted = api["alice"].post(f"/api/jobs/{second}/unpin")
    assert lifted.status_code == 200 and lifted.json()["pinned_workers"] is None
    assert lifted.json()["schedule_reasons"] == [] and lifted.json()["pin_problem"] == "", "no word of the pin"
    assert lifted.json()["schedule_note"].startswith("pin lifted")
    settle(cluster)
    after = shown(api, second)
    assert after["pin_problem"] == "" and after["schedule_reasons"] != ["pin unmet"]


def test_a_pin_gives_way_to_another_users_guaranteed_job(api: dict, cluster: Any, redis_client: Any) -> None:
    """The probe's case on the real database: Alice pins her job to the whole cluster; Bob's
    guaranteed job starts at its minimum in the next cycle, and Alice's page says why her pin
    fell short."""
    hog = submit(api, name="hog", max_workers=4)
    assert api["alice"].post(f"/api/jobs/{hog}/resize", {"workers": 4}).status_code == 200
    settle(cluster)
    assert shown(api, hog)["workers"] == 4
    bobs = submit(api, user="bob", name="bobs", min_workers=1, max_workers=2)
    settle(cluster)
    hogged, started = shown(api, hog), shown(api, bobs, "bob")
    assert (hogged["workers"], started["workers"]) == (3, 1)
    assert hogged["schedule_reasons"] == ["pin unmet"]
    assert hogged["pin_problem"] == (
        f"pinned to 4 workers but given 3: a pin may not keep another job below its minimum (#{bobs} needs 1)"
    )


def test_unpin_of_a_finished_or_missing_job(api: dict, cluster: Any) -> None:
    job_id = submit(api)
    assert api["alice"].post(f"/api/jobs/{job_id}/cancel").status_code == 200
    ended = api["alice"].post(f"/api/jobs/{job_id}/unpin")
    assert ended.status_code == 409 and "cancelled" in ended.json()["error"]["message"]
    missing = api["alice"].post("/api/jobs/999999/unpin")
    assert missing.status_code == 404 and "999999" in missing.json()["error"]["message"]


def test_guaranteed_jobs_keep_their_minimum_when_an_owner_returns(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    Device.objects.filter(node=cluster, index=3).update(owner="carol")
    guaranteed = submit(api, name="guaranteed", min_workers=2, max_workers=2)
    borrower = submit(
        api, user="bob", name="borrower", min_workers=1, max_workers=2, priority="opportunistic"
    )
    settle(cluster)
    held = {
        job_id: set(Job.objects.get(pk=job_id).allocations.values_list("device__index", flat=True))
        for job_id in (guaranteed, borrower)
    }
    assert held == {guaranteed: {0, 1}, borrower: {2, 3}}
    assert shown(api, borrower, "bob")["schedule_reasons"] == ["fair share", "borrowed device"]
    # A process nobody started appears on a device of the guaranteed job: it takes the
    # borrower's shared device rather than fall below its minimum.
    owner(cluster, {0})
    settle(cluster)
    assert set(Job.objects.get(pk=guaranteed).allocations.values_list("device__index", flat=True)) == {1, 2}
    assert set(Job.objects.get(pk=borrower).allocations.values_list("device__index", flat=True)) == {3}
    assert shown(api, borrower, "bob")["schedule_reasons"] == ["minimum", "borrowed device"]
    # Carol comes back to her device: the borrower waits; she leaves: it is lent again.
    owner(cluster, {0, 3})
    settle(cluster)
    waiting = shown(api, borrower, "bob")
    assert waiting["workers"] == 0 and waiting["schedule_reasons"] == ["waiting"]
    assert shown(api, guaranteed)["workers"] == 2
    owner(cluster, {0})
    settle(cluster)
    lent = shown(api, borrower, "bob")
    assert lent["workers"] == 1 and "borrowed device" in lent["schedule_reasons"]
    resizes = [r["reason"] for r in shown(api, guaranteed)["resizes"]]
    assert "owner reclaimed a device" in resizes


def test_hybrid_jobs_keep_the_batch_size_the_plan_gives(api: dict, cluster: Any, redis_client: Any) -> None:
    job_id = submit(api, consistency="hybrid", hyperparameters={"batch_size": 48})
    settle(cluster)
    assert shown(api, job_id)["batch_size"] == 48
    strict = submit(api, name="strict")
    settle(cluster)
    assert shown(api, strict)["batch_size"] is None


def test_throughput_service_and_remaining_work_come_from_the_reports(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job_id = submit(api, max_workers=2, steps=500, hyperparameters={"batch_size": 32})
    settle(cluster)
    job = Job.objects.get(pk=job_id)
    [view] = build_snapshot().snapshot.jobs
    prior = view.throughput
    assert prior is not None and view.attained_service_s == 0 and view.remaining_work == 500
    # Rank 0 reported 640 samples/s on 2 workers, once a second over the last five (the reports
    # say when): 0.05 s per step of 32 samples, and 2 devices x 4 s from the first to the last.
    start = time.time() - 5
    for second in range(5):
        progress = event(job, "progress", step=100 + 20 * second, loss=1.0, samples_per_s=640.0)
        report(cluster, progress.model_copy(update={"at": start + second}))
    [view] = build_snapshot().snapshot.jobs
    assert view.remaining_work == 500 - 180
    assert view.attained_service_s == pytest.approx(2 * 4.0), view.attained_service_s
    assert view.throughput is not None and view.throughput != prior
    assert view.throughput.step_time(2, 1, 16) == pytest.approx(0.05, rel=0.2)


def test_a_job_too_big_for_the_cluster_says_so(api: dict, cluster: Any) -> None:
    """Held, not refused (nodes join; a node may be away): its reason says what it needs, what
    the cluster has, and what would start it."""
    job_id = submit(api, min_workers=8, max_workers=8)
    run_cycle()
    job = api["alice"].get(f"/api/jobs/{job_id}").json()
    assert job["state"] == "queued"
    assert job["schedule_note"] == (
        "cannot start on the cluster as it is: needs at least 8 workers and the cluster has 4 devices; "
        "it starts once nodes join (or lower min_workers)"
    ), job["schedule_note"]


def test_a_finished_job_keeps_no_scheduler_reason(api: dict, cluster: Any) -> None:
    # Four devices, both jobs want them all: the second waits, with a reason. Cancelled, it has
    # none left to show ("waiting for devices" on a cancelled job read as if it would still run).
    first = submit(api, name="first", min_workers=4, max_workers=4)
    second = submit(api, name="second", min_workers=4, max_workers=4)
    assert api["alice"].post(f"/api/jobs/{first}/resize", {"workers": 4}).status_code == 200
    settle(cluster)
    waiting = shown(api, second)
    assert waiting["workers"] == 0 and waiting["schedule_note"] and waiting["schedule_reasons"]
    for job_id in (first, second):
        assert api["alice"].post(f"/api/jobs/{job_id}/cancel").status_code == 200
        ended = shown(api, job_id)
        assert (ended["schedule_note"], ended["schedule_reasons"], ended["pin_problem"]) == ("", [], "")


def test_a_waiting_job_knows_its_place_who_holds_its_devices_and_when_it_starts(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    hog = submit(api, name="hog", min_workers=4, max_workers=4, steps=1000, hyperparameters={"batch_size": 32})
    assert api["alice"].post(f"/api/jobs/{hog}/resize", {"workers": 4}).status_code == 200
    settle(cluster)
    following = submit(api, user="bob", name="next", min_workers=2, max_workers=2)
    last = submit(api, user="bob", name="after", min_workers=4, max_workers=4)
    settle(cluster)
    queue = shown(api, following, "bob")["queue"]
    assert (queue["position"], queue["waiting"], shown(api, last, "bob")["queue"]["position"]) == (1, 2, 2)
    assert queue["holders"] == [
        {"id": hog, "name": "hog", "owner": "alice", "devices": 4, "pinned": True, "finish_estimate_at": None}
    ]
    assert queue["start_estimate_at"] is None
    assert queue["no_estimate"] == f"it waits on jobs whose speed is not known yet (#{hog})"
    # The hog reports 10 steps/s over 40 s (portal.jobs.eta), up to step 500: 500 steps left, 50 s.
    job = Job.objects.get(pk=hog)
    now = time.time()
    for ago, step in ((40, 100), (20, 300), (0, 500)):
        progress = event(job, "progress", step=step, loss=1.0, samples_per_s=320.0, global_batch=32)
        report(cluster, progress.model_copy(update={"at": now - ago}))
    running = shown(api, hog)
    reported_at = Job.objects.get(pk=hog).last_progress_at.timestamp()
    assert running["progress"] == 0.5 and running["finish_estimate_at"] == pytest.approx(reported_at + 50, abs=0.2)
    run_cycle()
    queue = shown(api, following, "bob")["queue"]
    assert queue["start_estimate_at"] == pytest.approx(reported_at + 50, abs=0.2), "when the hog should end"
    assert queue["holders"][0]["finish_estimate_at"] == pytest.approx(queue["start_estimate_at"])
    assert shown(api, last, "bob")["queue"]["no_estimate"] == (
        f"it waits on jobs whose speed is not known yet (#{following})"
    )
    assert api["alice"].post(f"/api/jobs/{hog}/cancel").status_code == 200
    assert shown(api, hog)["queue"] == {} and shown(api, hog)["finish_estimate_at"] is None


def test_a_waiting_jobs_free_devices_are_those_the_listing_shows_free(api: dict, cluster: Any) -> None:
    # A shrink that must wait for the resize in flight: the plan gives the hog 1 device, but it
    # holds 3 until that resize lands. The waiting job said "3 free" beside a listing of 3 of the
    # 4 devices held.
    hog = submit(api, name="hog", min_workers=1, max_workers=4)
    assert api["alice"].post(f"/api/jobs/{hog}/resize", {"workers": 4}).status_code == 200
    settle(cluster)
    waiting = submit(api, user="bob", name="big", min_workers=4, max_workers=4)
    assert api["alice"].post(f"/api/jobs/{hog}/resize", {"workers": 3}).status_code == 200
    run_cycle()  # the generation of 3 is planned, not formed
    assert api["alice"].post(f"/api/jobs/{hog}/resize", {"workers": 1}).status_code == 200
    run_cycle()
    listing = {row["id"]: row for row in api["bob"].get("/api/jobs").json()}
    held = sum(row["workers"] for row in listing.values())
    assert (listing[hog]["workers"], held) == (3, 3)
    assert listing[waiting]["schedule_note"].endswith(f"needs at least 4, {4 - held} free"), listing[waiting]
