"""The scheduling cycle against the real database and Redis: plans become generations and
commands on the nodes' streams; a cycle run twice (a redelivered task) changes nothing."""

from __future__ import annotations

import time
from typing import Any

import pytest

from elastic.wire import AgentReport, WorkerEvent, parse_command
from portal.cluster.ingest import ingest_report
from portal.jobs.models import Job, ResizeEvent
from portal.scheduling.cycle import run_cycle
from portal.scheduling.dispatch import stream_for
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db


def commands(redis: Any, node: str = "node-a") -> list[Any]:
    return [parse_command(fields["command"]) for _, fields in redis.xrange(stream_for(node))]


def event(job: Job, kind: str, rank: int = 0, generation: int | None = None, **fields: Any) -> WorkerEvent:
    return WorkerEvent(job_id=job.pk, generation=generation or job.generation, rank=rank, kind=kind,
                       at=time.time(), **fields)


def report(node: Any, *events: WorkerEvent) -> None:
    ingest_report(node, AgentReport(node=node.name, events=list(events)))


def submit(api: dict, **change: Any) -> Job:
    reply = api["alice"].post("/api/jobs", {**VALID_SPEC, **change})
    assert reply.status_code == 201, reply.content
    return Job.objects.get(pk=reply.json()["id"])


def test_cycle_allocates_launches_and_is_idempotent(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    first = run_cycle()
    assert first.changed_jobs == [job.pk] and first.launched_jobs == [job.pk]
    job.refresh_from_db()
    assert job.state == "running" and job.generation == 1 and job.allocations.count() == 2
    launch = commands(redis_client)[-1]
    assert launch.kind == "launch" and launch.generation == 1 and launch.world_size == 2
    assert [w.rank for w in launch.workers] == [0, 1]
    sent = len(commands(redis_client))
    again = run_cycle()
    assert again.changed_jobs == [] and again.launched_jobs == []
    assert len(commands(redis_client)) == sent, "a repeated cycle sent commands again"
    job.refresh_from_db()
    assert job.generation == 1


def test_resize_stops_old_generation_then_launches_new(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    for rank in (0, 1):
        report(cluster, event(job, "started", rank=rank, pid=1000 + rank, device_index=rank))
    report(cluster, event(job, "progress", step=5, loss=2.0, samples_per_s=100.0))
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 1})
    run_cycle()
    job.refresh_from_db()
    assert job.state == "resizing" and job.generation == 2 and job.allocations.count() == 1
    stop = commands(redis_client)[-1]
    assert stop.kind == "stop" and stop.before_generation == 2
    # Not launched while the old workers still run.
    assert run_cycle().launched_jobs == []
    report(cluster, event(job, "exited", rank=1, generation=1, exit_code=75, reason="stopped"))
    assert commands(redis_client)[-1].kind == "stop"
    report(cluster, event(job, "exited", rank=0, generation=1, exit_code=75, reason="stopped"))
    launch = commands(redis_client)[-1]
    assert launch.kind == "launch" and launch.generation == 2 and launch.world_size == 1
    report(cluster, event(job, "progress", generation=2, step=6, loss=1.9, samples_per_s=90.0))
    job.refresh_from_db()
    assert job.state == "running"
    resize = ResizeEvent.objects.get(job=job, generation=2)
    assert (resize.workers_before, resize.workers_after) == (2, 1)
    assert resize.pause_s is not None and resize.pause_s >= 0


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


def test_completion_and_failure(api: dict, cluster: Any, redis_client: Any, settings: Any) -> None:
    done = submit(api, max_workers=1)
    flaky = submit(api, max_workers=1, name="flaky")
    run_cycle()
    done.refresh_from_db()
    flaky.refresh_from_db()
    report(cluster, event(done, "exited", exit_code=0, reason="completed", step=50))
    done.refresh_from_db()
    assert done.state == "succeeded" and done.allocations.count() == 0 and done.steps_done == 50
    settings.BUNGEE = {**settings.BUNGEE, "MAX_RESTARTS": 1}
    report(cluster, event(flaky, "exited", exit_code=1, reason="failed"))
    run_cycle()
    flaky.refresh_from_db()
    assert flaky.state == "resizing" and flaky.generation == 2 and flaky.restarts == 1
    assert commands(redis_client)[-1].generation == 2, "relaunched from its checkpoint"
    report(cluster, event(flaky, "exited", exit_code=1, reason="failed"))
    flaky.refresh_from_db()
    assert flaky.state == "failed" and "gave up" in flaky.message


def test_lost_node_frees_its_devices(api: dict, cluster: Any, redis_client: Any) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from portal.cluster.models import Node
    from portal.scheduling.cycle import mark_lost_nodes

    job = submit(api)
    run_cycle()
    Node.objects.filter(pk=cluster.pk).update(last_seen_at=timezone.now() - timedelta(minutes=5))
    assert mark_lost_nodes() == ["node-a"]
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
