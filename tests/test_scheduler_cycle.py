"""The scheduling cycle against the real database and Redis: plans become generations, each
published as a membership record on the job's board and launches of its joiners on the nodes'
streams; a resize leaves the running workers alone (in place); a cycle run twice (a redelivered
task) changes nothing."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from elastic.wire import AgentReport, WorkerEvent, parse_command
from portal.dispatch import board, stream_for
from portal.jobs import lifecycle
from portal.jobs.agents import ingest_report
from portal.jobs.models import Allocation, Generation, Job, JobLog, ResizeEvent, Worker
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db


def commands(redis: Any, node: str = "node-a") -> list[Any]:
    return [parse_command(fields["command"]) for _, fields in redis.xrange(stream_for(node))]


def event(job: Job, kind: str, rank: int = 0, generation: int | None = None, **fields: Any) -> WorkerEvent:
    return WorkerEvent(job_id=job.pk, generation=generation or job.generation, rank=rank, kind=kind,
                       at=time.time(), **fields)


def report(node: Any, *events: WorkerEvent) -> None:
    ingest_report(node, AgentReport(node=node.name, events=list(events)))


def form(node: Any, job: Job, ranks: int, generation: int | None = None, pid_base: int = 1000,
         **resized: Any) -> None:
    """Report what the workers of a generation say once its group formed."""
    generation = generation or job.generation
    report(node, *(event(job, "joined", rank=rank, generation=generation, pid=pid_base + rank, device_index=rank)
                   for rank in range(ranks)),
           event(job, "resized", generation=generation, **resized))


def submit(api: dict, **change: Any) -> Job:
    reply = api["alice"].post("/api/jobs", {**VALID_SPEC, **change})
    assert reply.status_code == 201, reply.content
    return Job.objects.get(pk=reply.json()["id"])


def training_on_two(api: dict, cluster: Any) -> Job:
    """A job submitted, launched on two workers of `cluster`'s node, and its group formed."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    for rank in (0, 1):
        report(cluster, event(job, "started", rank=rank, pid=3000 + rank, device_index=rank))
    form(cluster, job, 2, pid_base=3000)
    return job


def test_cycle_allocates_launches_and_is_idempotent(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    first = run_cycle()
    assert first.changed_jobs == [job.pk] and first.launched_jobs == [job.pk]
    job.refresh_from_db()
    assert job.state == "running" and job.generation == 1 and job.allocations.count() == 2
    launch = commands(redis_client)[-1]
    assert launch.kind == "launch" and launch.generation == 1 and launch.world_size == 2
    assert [w.rank for w in launch.workers] == [0, 1] and launch.members == [0, 1]
    record = board(job.pk).latest()
    assert record is not None and launch.coordination_key == board(job.pk).key
    assert (record.generation, record.keys(), record.has_state) == (1, ["node-a/0", "node-a/1"], False)
    assert all(member.joiner for member in record.members)
    sent = len(commands(redis_client))
    again = run_cycle()
    assert again.changed_jobs == [] and again.launched_jobs == []
    assert len(commands(redis_client)) == sent, "a repeated cycle sent commands again"
    job.refresh_from_db()
    assert job.generation == 1


def test_a_hybrid_job_gets_the_planned_batch_within_its_bounds(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job = submit(
        api,
        consistency="hybrid",
        hyperparameters={"batch_size": 64},
        min_batch_size=24,
        max_batch_size=96,
    )
    run_cycle()
    job.refresh_from_db()
    record = board(job.pk).latest()
    assert record is not None and job.batch_size is not None, job.schedule_note
    assert 24 <= job.batch_size <= 96
    assert record.global_batch == job.batch_size, "the workers are told the batch the plan chose"
    strict = submit(api, name="strict-neighbour")
    run_cycle()
    strict_record = board(strict.pk).latest()
    assert strict_record is None or strict_record.global_batch is None


def test_resize_happens_in_place(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    for rank in (0, 1):
        report(cluster, event(job, "started", rank=rank, pid=1000 + rank, device_index=rank))
    form(cluster, job, 2)
    report(cluster, event(job, "progress", step=5, loss=2.0, samples_per_s=100.0))
    job.refresh_from_db()
    assert (job.state, job.active_generation, job.steps_done) == ("running", 1, 5)
    sent = len(commands(redis_client))

    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 1})
    run_cycle()
    job.refresh_from_db()
    assert job.state == "resizing" and job.generation == 2 and job.allocations.count() == 1
    # Nothing is stopped: one launch tells the node which of its devices stay, and starts nobody.
    [launch] = commands(redis_client)[sent:]
    assert (launch.kind, launch.generation, launch.workers, launch.members) == ("launch", 2, [], [0])
    record = board(job.pk).latest()
    assert record is not None and record.generation == 2 and record.has_state
    assert record.keys() == ["node-a/0"] and not record.members[0].joiner and record.donor is None
    # The survivors train on under generation 1 meanwhile; their progress counts.
    report(cluster, event(job, "progress", generation=1, step=9, loss=1.95, samples_per_s=100.0))
    job.refresh_from_db()
    assert job.steps_done == 9

    # The switch: the survivor joins generation 2 with its pid, the leaver leaves.
    report(cluster, event(job, "joined", rank=0, generation=2, pid=1000, device_index=0),
           event(job, "exited", rank=1, generation=1, exit_code=76, reason="left", device_index=1),
           event(job, "resized", generation=2, step=10, pause_s=0.08, bytes_moved=0,
                 members_before=["node-a/0", "node-a/1"], members_after=["node-a/0"],
                 phases={"rendezvous": 0.02, "first_step": 0.05}))
    job.refresh_from_db()
    assert job.state == "running" and job.active_generation == 2
    resize = ResizeEvent.objects.get(job=job, generation=2)
    assert (resize.workers_before, resize.workers_after, resize.pause_s, resize.step) == (2, 1, 0.08, 10)
    # A manual resize lands from the API call: asked by Alice at her pin, not at the plan.
    assert (resize.reason, resize.requested_by, resize.requested_at) == ("manual resize", "alice", job.pin_requested_at)
    timeline = api["alice"].get(f"/api/jobs/{job.pk}").json()["resizes"]
    assert timeline[1]["requested_by"] == "alice" and timeline[0]["requested_by"] == ""
    assert timeline[1]["land_s"] == pytest.approx((resize.completed_at - resize.requested_at).total_seconds())
    assert resize.members_after == ["node-a/0"] and resize.phases["rendezvous"] == 0.02
    rows = {(w.generation, w.rank): (w.pid, w.state, w.reason) for w in job.workers.all()}
    assert rows == {(1, 0): (1000, "switched", ""), (1, 1): (1001, "exited", "left"), (2, 0): (1000, "running", "")}
    assert run_cycle().changed_jobs == [], "the job already has what it was pinned to"

    # Growing again starts one joiner; the survivor keeps rank 0.
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 2})
    run_cycle()
    launch = commands(redis_client)[-1]
    assert [(w.rank, w.device_index) for w in launch.workers] == [(1, 1)] and launch.members == [0, 1]
    record = board(job.pk).latest()
    assert record is not None and [(m.key, m.joiner) for m in record.members] == [
        ("node-a/0", False), ("node-a/1", True)]


def test_a_superseded_resize_that_trained_records_when_it_landed(api: dict, cluster: Any, redis_client: Any) -> None:
    """Rank 0 reports a resize a few steps after it landed; a newer plan may come first. The
    superseded resize landed all the same, at its generation's first step."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    for rank in (0, 1):
        report(cluster, event(job, "started", rank=rank, pid=1000 + rank, device_index=rank))
    report(cluster, *(event(job, "joined", rank=rank, pid=1000 + rank, device_index=rank) for rank in (0, 1)))
    first_step = event(job, "progress", step=1, loss=2.0, samples_per_s=100.0)
    report(cluster, first_step, event(job, "progress", step=2, loss=1.9, samples_per_s=100.0))
    assert ResizeEvent.objects.get(job=job, generation=1).completed_at is None, "not reported yet"

    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 1})
    run_cycle()
    superseded = ResizeEvent.objects.get(job=job, generation=1)
    assert superseded.completed_at is not None
    assert superseded.completed_at.timestamp() == pytest.approx(first_step.at, abs=0.01)
    assert ResizeEvent.objects.get(job=job, generation=2).completed_at is None, "the new one has not landed"


def test_members_that_report_joining_out_of_rank_order_are_not_reordered(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    """A grow's joiner may report that it joined before the survivor does (their reports come
    separately). A cycle that read the survivor's rows while they were being rewritten saw the
    joiner as the only holder, put it first, and planned a generation of the same devices in the
    other order: a resize that moved nothing, which took the grow's place at the end of the
    job's timeline (a multi-host test failed on it)."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 2)
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 1})
    run_cycle()
    report(cluster, event(job, "joined", rank=0, generation=2, pid=1000, device_index=0),
           event(job, "exited", rank=1, generation=1, exit_code=76, reason="left", device_index=1),
           event(job, "resized", generation=2, step=10, pause_s=0.05, bytes_moved=0))
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 2})
    assert run_cycle().changed_jobs == [job.pk]
    job.refresh_from_db()
    assert job.generation == 3 and list(job.allocations.order_by("rank").values_list("device__index", flat=True)) == [0, 1]
    report(cluster, event(job, "joined", rank=1, generation=3, pid=2001, device_index=1))
    # What a cycle could read while the survivor's own "joined" was half written (its generation 2
    # row switched, its generation 3 row not there yet; lifecycle.worker_joined now writes both
    # in one transaction): the joiner the only holder.
    Worker.objects.filter(job=job, generation=2, rank=0).update(state=Worker.State.SWITCHED)
    assert run_cycle().changed_jobs == [], "the same two devices: nothing to plan"
    job.refresh_from_db()
    assert job.generation == 3


def test_a_resize_waits_for_the_one_in_flight(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    run_cycle()
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 1})
    assert run_cycle().changed_jobs == [], "generation 1 has not formed yet"
    job.refresh_from_db()
    form(cluster, job, 2)
    assert run_cycle().changed_jobs == [job.pk]


def test_a_dead_worker_is_planned_out(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    for rank in (0, 1):
        report(cluster, event(job, "started", rank=rank, pid=1000 + rank, device_index=rank))
    form(cluster, job, 2)
    report(cluster, event(job, "exited", rank=1, exit_code=-9, reason="failed", device_index=1))
    job.refresh_from_db()
    lost = lifecycle.current(job)
    assert lost is not None and lost.phase == "lost" and job.restarts == 1 and len(lost.excluded_devices) == 1
    run_cycle()
    job.refresh_from_db()
    assert (job.state, job.generation, job.allocations.count()) == ("resizing", 2, 1)
    assert lifecycle.current(job).reason == "a worker exited"
    record = board(job.pk).latest()
    assert record is not None and record.keys() == ["node-a/0"] and record.has_state
    # Once the survivor runs generation 2, the scheduler grows the job again: a new joiner.
    form(cluster, job, 1, generation=2)
    run_cycle()
    job.refresh_from_db()
    assert job.generation == 3 and job.allocations.count() == 2
    assert [w.device_index for w in commands(redis_client)[-1].workers] == [1]


def test_joiners_that_never_get_ready_are_stopped_and_planned_out(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job = submit(api, max_workers=3)
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 2})
    run_cycle()
    job.refresh_from_db()
    for rank in (0, 1):
        report(cluster, event(job, "started", rank=rank, pid=1000 + rank, device_index=rank))
    form(cluster, job, 2)
    assert api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 3}).status_code == 200
    run_cycle()
    job.refresh_from_db()
    report(cluster, event(job, "started", rank=2, pid=1002, device_index=2))
    assert lifecycle.expire_overdue() == [], "not stuck yet"
    Generation.objects.filter(job=job, number=job.generation).update(deadline_at=timezone.now())
    assert lifecycle.expire_overdue() == [job.pk]
    stop = commands(redis_client)[-1]
    assert (stop.kind, stop.devices) == ("stop", [2]), "only the joiner that hangs"
    expired = lifecycle.current(job)
    assert expired is not None and expired.phase == "expired" and len(expired.excluded_devices) == 1
    assert "not ready within" in JobLog.objects.filter(job=job).last().line, "the job's log says why"
    run_cycle()
    job.refresh_from_db()
    assert job.allocations.count() == 2 and board(job.pk).latest().keys() == ["node-a/0", "node-a/1"]
    assert lifecycle.current(job).reason == "a joiner never got ready"


def test_the_warm_up_deadline_doubles_while_generations_expire_for_it(
    api: dict, cluster: Any, redis_client: Any, settings: Any
) -> None:
    """A machine too loaded to start a worker within the warm-up deadline expired every try of a
    job alike (a test's job went through 8 generations at load 12). Each generation in a row that
    expired waiting for a joiner doubles the next one's deadline, up to 8 times, and the log says
    what each was given. The joiners stopped at an expiry exit while the next try holds their
    devices again (the job cannot run without them); those exits end nothing."""
    base = settings.BUNGEE.warmup_timeout_s
    job = submit(api, min_workers=2)

    def published() -> Generation:
        generation = lifecycle.current(job)
        assert generation is not None and generation.phase == "published", generation and generation.phase
        return generation

    given = []
    for attempt in range(5):
        run_cycle()
        job.refresh_from_db()
        generation = published()
        given.append(round((generation.deadline_at - generation.published_at).total_seconds() / base, 1))
        if attempt > 0:  # the joiners stopped at the last expiry exit now
            report(cluster, *(event(job, "exited", rank=rank, generation=job.generation - 1, exit_code=75,
                                    reason="stopped", device_index=rank) for rank in (0, 1)))
            assert published() == generation, "the exits of the last try's joiners end nothing"
        report(cluster, *(event(job, "started", rank=rank, pid=1000 * job.generation + rank, device_index=rank)
                          for rank in (0, 1)))
        Generation.objects.filter(pk=generation.pk).update(deadline_at=timezone.now())
        assert lifecycle.expire_overdue() == [job.pk]
    assert given == [1, 2, 4, 8, 8]
    assert f"not ready within {base * 8:.0f} s" in JobLog.objects.filter(job=job).last().line

    # A generation that forms breaks the run: the next one's joiners get the plain deadline.
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 2)
    job.refresh_from_db()
    job.generation += 1  # the job's next generation, as planning it would number it
    assert lifecycle.warmup_timeout_s(job) == base


def test_the_warm_up_deadline_doubles_across_the_generations_a_job_trains_in_between_tries(
    api: dict, cluster: Any, settings: Any
) -> None:
    """A job that can train without the joiner's device trains on between two tries to grow, in a
    generation planned without it: that short generation, with no joiner, is the pause between
    tries, and the deadline doubles across it (a test's job at load 10 tried 5 times in 2 minutes,
    each time with the plain 25 s, and never grew). A generation whose joiners got ready, one that
    trained long, or one that ended in other trouble breaks the run."""
    base = settings.BUNGEE.warmup_timeout_s
    job = submit(api)
    now = timezone.now()

    def history(*generations: tuple[str, float, tuple[int, ...]]) -> float:
        """The next generation's deadline over `base` after `generations` (end reason, seconds it
        lasted, its workers' pids), oldest first."""
        Generation.objects.filter(job=job).delete()
        Worker.objects.filter(job=job).delete()
        for number, (end_reason, lasted_s, pids) in enumerate(generations, start=1):
            Generation.objects.create(job=job, number=number, phase="ended", reason="test", end_reason=end_reason,
                                      planned_at=now - timedelta(seconds=lasted_s), ended_at=now)
            for rank, pid in enumerate(pids):
                Worker.objects.create(job=job, generation=number, rank=rank, node=cluster, node_name=cluster.name,
                                      device_index=rank, pid=pid, state="exited")
        job.generation = len(generations) + 1
        return lifecycle.warmup_timeout_s(job) / base

    trained = ("", 600.0, (1, 2))
    # A try that expired (its joiner, pid 9, never ready), then training on without it (1 and 2).
    tries = [(lifecycle.NEVER_READY, 30.0, (1, 2, 9)), ("", 3.0, (1, 2))]
    assert history(trained, *tries) == 2
    assert history(trained, *tries, *tries, *tries) == 8
    assert history(trained, *tries * 6) == lifecycle.WARMUP_BACKOFF_MAX
    # A fresh start after a generation whose joiner got ready, one that trained long, or one lost.
    assert history(*tries, ("", 3.0, (1, 2, 3)), *tries) == 2
    assert history(*tries, ("", base * lifecycle.WARMUP_BACKOFF_MAX + 1, (1, 2)), *tries) == 2
    assert history(*tries, ("a worker exited", 3.0, (1, 2)), *tries) == 2
    assert history(trained) == 1


def test_a_generation_whose_joiners_are_ready_but_never_forms_expires(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    generation = lifecycle.current(job)
    assert generation is not None and generation.phase == "published"
    for key in ("node-a/0", "node-a/1"):
        board(job.pk).mark_ready(job.generation, key)
    assert lifecycle.expire_overdue() == [], "every joiner ready: the FORM deadline starts, nothing ends"
    generation.refresh_from_db()
    assert generation.ready_at is not None and generation.phase == "published"
    Generation.objects.filter(pk=generation.pk).update(deadline_at=timezone.now())
    assert lifecycle.expire_overdue() == [job.pk]
    generation.refresh_from_db()
    assert generation.phase == "expired" and generation.end_reason == "its group did not form"
    assert generation.excluded_devices == [], "every joiner was ready: nobody is left out"
    run_cycle()
    job.refresh_from_db()
    assert job.generation == 2 and lifecycle.current(job).phase == "published"


@pytest.mark.parametrize("disagreement", ["record-lists-more-members", "no-record-on-the-board"])
def test_a_generation_whose_joiners_cannot_be_told_is_never_taken_for_ready(
    api: dict, cluster: Any, redis_client: Any, disagreement: str
) -> None:
    """The board's record of a published generation lists its members in the rank order of the
    generation's allocations. When the two disagree in number (or the record is gone), which
    members are joiners cannot be told: the generation is not ready (an empty set of joiners
    would be), keeps its WARMUP deadline and expires at it; a mismatch is said once."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    generation = lifecycle.current(job)
    assert generation is not None and generation.phase == "published"
    warmup_deadline = generation.deadline_at
    if disagreement == "record-lists-more-members":
        Allocation.objects.filter(job=job, rank=1).delete()
    else:
        redis_client.delete(board(job.pk)._record_key(job.generation))
    board(job.pk).mark_ready(job.generation, "node-a/0")
    lines = JobLog.objects.filter(job=job).count()
    for _ in range(2):
        assert lifecycle.expire_overdue() == [], "not past its deadline yet"
    generation.refresh_from_db()
    assert (generation.ready_at, generation.deadline_at) == (None, warmup_deadline), "not ready: no FORM deadline"
    said = list(JobLog.objects.filter(job=job).values_list("line", flat=True))[lines:]
    if disagreement == "record-lists-more-members":
        assert said == ["generation 1: its membership record lists 2 members but it holds 1 device; "
                        "its joiners cannot be told ready"], "said once, with both counts"
    else:
        assert said == [], "publish writes the record just after the phase: nothing to say yet"
    Generation.objects.filter(pk=generation.pk).update(deadline_at=timezone.now())
    assert lifecycle.expire_overdue() == [job.pk]
    generation.refresh_from_db()
    assert (generation.phase, generation.end_reason) == ("expired", "its joiners could not be told")
    assert generation.excluded_devices == [], "no joiner is known late: nobody is left out"
    assert "its joiners could not be told ready within" in JobLog.objects.filter(job=job).last().line


def test_a_member_that_cannot_form_expires_its_generation_at_once(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    report(cluster, event(job, "form_failed", failed_generation=1, message="could not form generation 1: timeout"))
    assert lifecycle.current(job).phase == "expired"
    run_cycle()
    job.refresh_from_db()
    assert job.generation == 2 and lifecycle.current(job).reason == "its group did not form"


def test_a_manual_resize_planned_again_still_says_who_asked_and_when(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    """A pin's generation that did not form (CI met one on a port another program held) is
    planned again for the job's own reason; the resize that lands is still Alice's, and its land
    time counts from her request, and it goes from the workers that ran before the first try.
    Once it landed, the next resize is nobody's."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 2)
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 1})
    run_cycle()
    job.refresh_from_db()
    asked = job.pin_requested_at
    report(cluster, event(job, "form_failed", failed_generation=2, message="could not form generation 2: EADDRINUSE"))
    run_cycle()
    job.refresh_from_db()
    assert job.generation == 3
    again = ResizeEvent.objects.get(job=job, generation=3)
    assert (again.reason, again.requested_by, again.requested_at) == ("its group did not form", "alice", asked)
    # The job still runs on the 2 workers it had before generation 2: the timeline says 2 → 1.
    failed = ResizeEvent.objects.get(job=job, generation=2)
    assert (again.workers_before, again.devices_before) == (2, failed.devices_before) and len(again.devices_after) == 1
    form(cluster, job, 1, step=40, pause_s=0.1)
    report(cluster, event(job, "exited", rank=1, generation=1, exit_code=76, reason="left", device_index=1))
    job.refresh_from_db()
    assert ResizeEvent.objects.get(job=job, generation=3).completed_at is not None
    lifecycle.form_failed(cluster, job, event(job, "form_failed", failed_generation=3))
    assert lifecycle.current(job).phase == "settled", "a generation that formed does not expire"
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 2})
    run_cycle()
    job.refresh_from_db()
    later = ResizeEvent.objects.get(job=job, generation=4)
    assert later.requested_by == "alice" and later.requested_at > asked, "a new pin is a new request"
    report(cluster, event(job, "exited", rank=0, generation=3, exit_code=1, reason="failed", device_index=0))
    run_cycle()
    job.refresh_from_db()
    assert [(r.generation, r.requested_by) for r in ResizeEvent.objects.filter(job=job, generation__gt=4)] == [
        (5, "alice")
    ], "generation 4 never landed: its replan is still the pin's"


def test_owner_return_shrinks_the_job(api: dict, cluster: Any, redis_client: Any) -> None:
    from elastic.wire import DeviceSample

    job = submit(api, max_workers=4)
    run_cycle()
    job.refresh_from_db()
    assert job.allocations.count() == 4
    samples = [
        DeviceSample(index=i, taken_at=time.time(), utilization_pct=50, memory_used_bytes=1,
                     memory_total_bytes=2**30, owner_present=(i == 3))
        for i in range(4)
    ]
    ingest_report(cluster, AgentReport(node="node-a", samples=samples))
    run_cycle()
    job.refresh_from_db()
    assert job.allocations.count() == 3
    assert 3 not in set(job.allocations.values_list("device__index", flat=True))
    state = api["bob"].get("/api/cluster").json()
    holders = [d["holder"] for d in state["nodes"][0]["devices"]]
    assert holders == ["job", "job", "job", "owner"]
    assert state["nodes"][0]["devices"][0]["sample"]["utilization_pct"] == 50


def test_a_job_succeeds_when_its_rank_0_is_done_writing_its_model(api: dict, cluster: Any) -> None:
    """The other ranks exit completed as soon as the last step is trained; rank 0 exports the
    artifacts first. Finishing the job then would stop rank 0 mid-export."""
    job = submit(api, min_workers=2, max_workers=2)
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 2)
    report(cluster, event(job, "exited", rank=1, exit_code=0, reason="completed", step=50))
    job.refresh_from_db()
    assert job.state == "running" and job.generation == 1 and job.allocations.count() == 2
    report(cluster, event(job, "exited", rank=0, exit_code=0, reason="completed", step=50))
    job.refresh_from_db()
    assert job.state == "succeeded" and job.allocations.count() == 0
    assert sorted(job.workers.values_list("reason", flat=True)) == ["completed", "completed"]


def test_a_job_that_fails_after_training_has_its_checkpoint_exported(
    api: dict, cluster: Any, redis_client: Any, settings: Any
) -> None:
    """Restarts used up: the node of the newest rank 0 (it holds the periodic checkpoint) is
    asked to export it; a job that never trained is not."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"max_restarts": 0})
    trained, untrained = submit(api, max_workers=1), submit(api, max_workers=1, name="untrained")
    run_cycle()
    trained.refresh_from_db()
    untrained.refresh_from_db()
    report(cluster, event(trained, "started", pid=3000, device_index=0),
           event(trained, "progress", step=12, loss=1.5, samples_per_s=90.0),
           event(untrained, "started", pid=3001, device_index=1))
    report(cluster, event(trained, "exited", exit_code=1, reason="failed"),
           event(untrained, "exited", exit_code=1, reason="failed"))
    for job in (trained, untrained):
        job.refresh_from_db()
        assert job.state == "failed", job.message
    exports = [c for c in commands(redis_client) if c.kind == "export"]
    assert [(c.job_id, c.run_dir, c.spec["name"]) for c in exports] == [
        (trained.pk, lifecycle.run_dir(trained), trained.spec["name"])
    ]


def ended_job_page(job: Job) -> str:
    """The page of `job`, which has ended, as its owner gets it: nothing live left on it (no
    Workers box, no Resize or Cancel, as the page once showed)."""
    client = Client()
    client.force_login(job.owner)
    reply = client.get(f"/jobs/{job.pk}/")
    assert reply.status_code == 200
    page = reply.content.decode()
    for control in ('id="live-controls"', 'id="resize-to"', 'id="resize"', 'id="cancel"'):
        assert control not in page, f"the page of a {job.state} job has {control}"
    assert 'id="download-model"' in page
    return page


def test_completion_and_failure(api: dict, cluster: Any, redis_client: Any, settings: Any) -> None:
    done = submit(api, max_workers=1)
    flaky = submit(api, max_workers=1, name="flaky")
    run_cycle()
    done.refresh_from_db()
    flaky.refresh_from_db()
    report(cluster, event(done, "exited", exit_code=0, reason="completed", step=50))
    done.refresh_from_db()
    assert done.state == "succeeded" and done.allocations.count() == 0 and done.steps_done == 50
    assert done.message == "trained all 50 steps", "how it ended, in the job's own numbers"
    ended_job_page(done)
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"max_restarts": 1})
    report(
        cluster,
        event(flaky, "started", pid=2000, device_index=1),
        event(flaky, "exited", exit_code=1, reason="failed"),
    )
    run_cycle()
    flaky.refresh_from_db()
    assert flaky.state == "resizing" and flaky.generation == 2 and flaky.restarts == 1
    assert commands(redis_client)[-1].generation == 2, "relaunched (from its checkpoint: nobody holds the state)"
    record = board(flaky.pk).latest()
    assert record is not None and record.generation == 2 and not record.has_state
    report(cluster, event(flaky, "started", pid=2001, device_index=1), event(flaky, "exited", exit_code=1, reason="failed"))
    flaky.refresh_from_db()
    assert flaky.state == "failed" and "gave up" in flaky.message


def test_a_user_error_fails_the_job_at_once_and_stops_the_other_workers(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job = training_on_two(api, cluster)
    sent = len(commands(redis_client))
    report(
        cluster,
        # Its own period: the message's sentence that follows it is not ".. The traceback". The
        # worker logs its failure for people, and announces it with its exit for the portal.
        event(job, "log", rank=1, message="the job's code failed: loss(model, batch) raised ValueError: bad.\nTraceback"),
        event(job, "exited", rank=1, exit_code=77, reason="user_error", device_index=1,
              user_error={"error": "loss(model, batch) raised ValueError: bad.", "traceback": ""}),
    )
    job.refresh_from_db()
    assert job.state == "failed" and job.restarts == 0 and job.allocations.count() == 0
    assert ".." not in job.message, job.message
    assert "the job's code failed on worker rank 1" in job.message and "Not restarted" in job.message
    assert "loss(model, batch) raised ValueError: bad." in job.message, "what raised, not only where to look"
    page = ended_job_page(job)
    assert "raised ValueError: bad." in page, "the page's message says what raised"
    [stop] = commands(redis_client)[sent:]
    assert stop.kind == "stop", "the other worker is asked to stop"
    assert JobLog.objects.filter(job=job, line__contains="raised ValueError: bad").exists()
    assert run_cycle().launched_jobs == [], "no new generation for a job whose code is broken"


def test_an_environment_that_does_not_build_fails_the_job_at_once_saying_why(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    """The agent could not build the job's environment (agent.environments): its workers never
    started; uv's output is in the log and its gist in the job's message."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    gist = "No solution found when resolving dependencies: Because nosuchpkg was not found"
    report(
        cluster,
        event(job, "log", rank=0, message=f"error: {gist}"),
        event(job, "exited", rank=0, reason="user_error", device_index=0,
              message=f"the job's environment could not be built: {gist}"),
    )
    job.refresh_from_db()
    assert job.state == "failed" and job.restarts == 0
    assert gist in job.message and "could not start on" in job.message and "Not restarted" in job.message
    assert JobLog.objects.filter(job=job, line__contains="nosuchpkg").exists()


def test_a_job_that_fails_stops_a_joiner_that_has_not_reported_yet(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    """A job's code failed on its only running worker just as a generation launched a joiner
    whose "started" had not reached the portal: the stop went only to nodes with a running row,
    so none was sent and the joiner ran on for a failed job (a CI run waited 60 s for it). The
    nodes that hold the job's devices are asked too."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    report(cluster, event(job, "started", rank=0, pid=4000, device_index=0))
    sent = len(commands(redis_client))
    report(cluster, event(job, "exited", rank=0, exit_code=77, reason="user_error", device_index=0))
    job.refresh_from_db()
    assert job.state == "failed"
    stops = [c for c in commands(redis_client)[sent:] if c.kind == "stop"]
    assert [(c.job_id, c.before_generation) for c in stops] == [(job.pk, job.generation + 1)]


def test_named_metrics_and_evaluations_are_kept_and_served(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 2)
    report(
        cluster,
        event(job, "progress", step=10, loss=1.5, samples_per_s=90.0, metrics={"accuracy": 0.5, "top5": 0.9}),
        event(job, "evaluation", step=10, metrics={"accuracy": 0.45}),
        event(job, "progress", step=20, loss=1.2, samples_per_s=95.0, metrics={"accuracy": 0.6, "top5": 0.95}),
    )
    served = api["alice"].get(f"/api/jobs/{job.pk}/metrics").json()["points"]
    assert [(m["step"], m["metrics"]) for m in served] == [(10, {"accuracy": 0.5, "top5": 0.9}),
                                                          (20, {"accuracy": 0.6, "top5": 0.95})]
    evaluations = api["alice"].get(f"/api/jobs/{job.pk}/evaluations").json()
    assert [(e["step"], e["metrics"]) for e in evaluations] == [(10, {"accuracy": 0.45})]
    assert api["bob"].get(f"/api/jobs/{job.pk}/evaluations").status_code == 403


def test_lost_node_frees_its_devices(api: dict, cluster: Any, redis_client: Any) -> None:
    from datetime import timedelta

    from portal.cluster.models import Node

    job = submit(api)
    run_cycle()
    Node.objects.filter(pk=cluster.pk).update(last_seen_at=timezone.now() - timedelta(minutes=5))
    assert lifecycle.nodes_lost() == ["node-a"]
    run_cycle()
    job.refresh_from_db()
    assert job.state == "queued" and job.allocations.count() == 0 and job.message == "waiting for devices"
    report(Node.objects.get(pk=cluster.pk))
    run_cycle()
    job.refresh_from_db()
    assert job.allocations.count() == 2


def test_schedule_task_holds_a_lock(api: dict, cluster: Any, redis_client: Any) -> None:
    from portal.redis import key
    from portal.scheduling.tasks import schedule

    submit(api)
    lock = redis_client.lock(key("scheduler", "lock"), timeout=5)
    assert lock.acquire(blocking=False)
    try:
        assert schedule("test") == {"changed": [], "launched": []}
        assert redis_client.get(key("scheduler", "pending")) == "1", "the request waits for the holder"
    finally:
        lock.release()
    result = schedule("test")
    assert len(result["changed"]) == 1
