"""Faults of the control plane, as tested behaviour (marked `faults`, run by make test).

- Beat is not the only one to notice a lost node: any node's report does, so with beat dead a
  node whose agent and workers are gone is still marked lost, its job's worker with it, and the
  job planned again on what is left (in the database, and on a real platform).
- Redis away: the API answers 503 in the error shape at once. A real Redis SIGKILLed under a
  training job and started again empty: the workers train on untouched, and resizes land
  again (the board and the agents' command streams come back in the new Redis).
- The Celery worker killed: a pin asked meanwhile is kept and applied once it is back.
- With beat dead, the scheduler still runs when it must: a job that lost a worker grows back
  once its shrink settles, and onto a node that comes back."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from django.utils import timezone

from elastic.wire import DeviceInfo, NodeRegistration
from portal.cluster import ingest
from portal.cluster.ingest import register_node
from portal.cluster.models import Node
from portal.error_pages import RETRY_AFTER_S
from portal.jobs.models import Job, Worker
from portal.scheduling import tasks  # noqa: F401 - registers the task that eager Celery runs here
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC
from tests.platform import FAST_PROGRESS_ENV, POSTGRES_URL, redis_server, running_platform
from tests.test_integration_resize_in_place import detail, live_rows, pin, settled, steps_past, submit
from tests.test_scheduler_cycle import event, report

pytestmark = [pytest.mark.django_db, pytest.mark.faults]


def test_with_beat_dead_another_nodes_report_finds_the_lost_node(
    api: dict, cluster: Any, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    node_b, _ = register_node(NodeRegistration(
        name="node-b", address="127.0.0.2", backend="simulated",
        devices=[DeviceInfo(index=0, uuid="sim-b0", name="CPU slot", kind="cpu-slot", memory_total_bytes=2**30)],
    ))
    Node.objects.filter(name="node-a").update(state=Node.State.LOST)  # only node-b's device is free
    job = Job.objects.get(pk=api["alice"].post("/api/jobs", {**VALID_SPEC, "max_workers": 1}).json()["id"])
    run_cycle()
    job.refresh_from_db()
    report(node_b, event(job, "started", pid=7001, device_index=0), event(job, "joined", pid=7001, device_index=0))
    Node.objects.filter(name="node-a").update(state=Node.State.ONLINE)
    assert Worker.objects.get(job=job).node == node_b

    # node-b's agent and worker die with beat down: no tick. Time passes; node-a reports.
    silent_since = timezone.now() - timedelta(seconds=settings.BUNGEE.node_timeout_s + 1)
    Node.objects.filter(pk=node_b.pk).update(last_seen_at=silent_since)
    ingest._overdue_checked_at = time.monotonic() - 60
    with django_capture_on_commit_callbacks(execute=True) as queued:
        report(cluster)
    assert queued, "node-a's report asked for a scheduling cycle"
    node_b.refresh_from_db()
    job.refresh_from_db()
    assert node_b.state == Node.State.LOST
    assert Worker.objects.get(job=job, node=node_b).state == Worker.State.EXITED
    assert job.allocations.filter(device__node=cluster).exists(), "planned again on node-a"


def test_with_redis_away_the_api_answers_503_in_the_error_shape(api: dict, cluster: Any, settings: Any) -> None:
    """The portal's Redis client retries a bounded number of times (redis-py's Retry) and then
    fails; the API answers 503 with Retry-After, never a hang or a 500. Its next request
    connects again."""
    from portal import redis as portal_redis

    reachable = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    portal_redis.client.cache_clear()
    try:
        reply = api["alice"].get("/api/cluster")
        assert reply.status_code == 503, reply.content[:300]
        assert reply.json()["error"]["code"] == "unavailable" and reply["Retry-After"] == "5"
    finally:
        settings.REDIS_URL = reachable
        portal_redis.client.cache_clear()
    assert api["alice"].get("/api/cluster").status_code == 200, "back once Redis answers"


@pytest.mark.slow
def test_with_the_database_away_the_portal_answers_503_and_comes_back(tmp_path: Path) -> None:
    """A real portal on PostgreSQL through its pool. The database refuses the portal (new
    connections refused, its open ones ended): the API answers 503 in the error shape with
    Retry-After, and a page is the site's 503 page, within the pool's timeout and never a 500.
    Once the database takes connections again, the API and the pages answer 200 within seconds
    (the pool gives up a failed connection attempt after 5 s, and hands out no connection the
    server ended), and nothing stored was lost."""
    env = {"BUNGEE_DB_POOL_TIMEOUT_S": "2"}
    with (
        running_platform(tmp_path, {}, env) as platform,
        platform.api("alice") as alice,
        httpx.Client(base_url=platform.base_url, timeout=30) as browser,
    ):
        browser.get("/login/")
        logged_in = browser.post(
            "/login/", data={"username": "alice", "password": "alice-pass", "csrfmiddlewaretoken": browser.cookies["csrftoken"]},
            headers={"Referer": platform.base_url + "/login/"},
        )
        assert logged_in.status_code == 302, logged_in.text[:300]
        submitted = alice.post("/api/jobs", json=VALID_SPEC)
        assert submitted.status_code == 201, submitted.text
        database = platform.env["DATABASE_URL"].rsplit("/", 1)[1]
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS false')
            try:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,)
                )
                for path in ("/api/jobs", f"/api/jobs/{submitted.json()['id']}", "/api/cluster"):
                    reply = alice.get(path)
                    assert reply.status_code == 503, (path, reply.status_code, reply.text[:300])
                    error = reply.json()["error"]
                    assert error["code"] == "unavailable" and "database" in error["message"], error
                    assert database not in reply.text and "5432" not in reply.text, "where the database is stays in the log"
                    assert reply.headers["Retry-After"] == "5"
                page = browser.get("/jobs/")
                assert page.status_code == 503, (page.status_code, page.text[:300])
                assert "Unavailable" in page.text and "database" in page.text and page.headers["Retry-After"] == "5"
            finally:
                admin.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS true')
        # A connection attempt that failed is given up on within 5 s (settings: reconnect_timeout);
        # a request then connects at once.
        listed = platform.wait_for(
            "the API on the database again", lambda: (r := alice.get("/api/jobs")).status_code == 200 and r.json(), 20, 0.5
        )
        assert [job["id"] for job in listed] == [submitted.json()["id"]]
        assert browser.get("/jobs/").status_code == 200


@pytest.mark.slow
def test_beat_celery_and_an_agent_killed_nothing_is_lost(tmp_path: Path) -> None:
    """A real platform. Beat is SIGKILLed: a worker killed on node-a costs the job that device
    until its shrink settles, then it grows back, without a tick. node-b's agent is killed, and
    node-b's worker with it: node-a's reports still find node-b lost and the job goes on node-a;
    node-b's agent back, the job grows onto it again. Then the Celery worker is killed: a pin
    asked meanwhile is kept, and applied once the worker is back."""
    env = {**FAST_PROGRESS_ENV, "BUNGEE_NODE_TIMEOUT_S": "5", "BUNGEE_POLICY": "fair"}
    with running_platform(tmp_path, {"node-a": 2, "node-b": 1}, env) as platform:
        platform.wait_for("3 devices", lambda: sum(
            len(node["devices"]) for node in platform.api("alice").get("/api/cluster").json()["nodes"]
        ) == 3)
        job_id = submit(platform, 3)
        job = settled(platform, job_id, 3)
        on_b = [row["pid"] for row in live_rows(job) if row["node"] == "node-b"]
        assert on_b
        platform.kill("beat")
        # Beat is the safety net, not the engine: a worker killed on node-a is planned out at
        # once, and once that shrink settles the job grows back onto the freed device.
        [crashed] = [row["pid"] for row in live_rows(job) if row["node"] == "node-a"][-1:]
        os.kill(crashed, signal.SIGKILL)
        # Two generations at least: one without the crashed worker's device, then one with it.
        # (The 2-worker one may last too short a time for a poll to see it settled.)
        job = settled(platform, job_id, 3, job["generation"] + 1, timeout_s=90)
        assert crashed not in {row["pid"] for row in live_rows(job)}
        assert [(r["workers_before"], r["workers_after"]) for r in job["resizes"][-2:]] == [(3, 2), (2, 3)]
        assert job["resizes"][-2]["reason"] == "a worker exited"

        platform.kill_agent("node-b")
        for pid in on_b:
            os.kill(pid, signal.SIGKILL)
        shrunk = settled(platform, job_id, 2, job["generation"], timeout_s=90)
        nodes = {node["name"]: node for node in platform.api("alice").get("/api/cluster").json()["nodes"]}
        assert nodes["node-b"]["state"] == "lost"
        assert all(row["node"] == "node-a" for row in live_rows(shrunk))
        # A node's arrival runs the scheduler too: node-b's agent back, the job grows onto it.
        platform.start_agent("node-b", 1)
        job = settled(platform, job_id, 3, shrunk["generation"], timeout_s=90)
        assert any(row["node"] == "node-b" for row in live_rows(job))

        platform.kill("worker")
        pin(platform, job_id, 1)
        asked = detail(platform, job_id)
        assert asked["pinned_workers"] == 1 and asked["workers"] == 3, "nothing ran the scheduler yet"
        platform.start("worker")
        settled(platform, job_id, 1, job["generation"], timeout_s=90)


def test_a_replayed_report_changes_nothing(api: dict, cluster: Any) -> None:
    """Agents deliver at least once: an agent that took its workers back re-reads their output
    from the offset it last recorded, so progress the portal has may come again. A step the job
    already has for that generation is ignored: steps never go back and no point is doubled; a
    newer generation (a restart from the checkpoint) still may go back."""
    from portal.jobs.models import JobMetric
    from tests.test_scheduler_cycle import form

    job = Job.objects.get(pk=api["alice"].post("/api/jobs", {**VALID_SPEC, "max_workers": 1}).json()["id"])
    run_cycle()
    job.refresh_from_db()
    report(cluster, event(job, "started", pid=1000, device_index=0))
    form(cluster, job, 1)
    for step in (26, 54, 81):
        report(cluster, event(job, "progress", step=step, loss=1.0, samples_per_s=10.0))
    report(cluster, *(event(job, "progress", step=step, loss=1.0, samples_per_s=10.0) for step in (26, 54, 81)))
    job.refresh_from_db()
    assert job.steps_done == 81
    assert list(JobMetric.objects.filter(job=job).values_list("step", flat=True).order_by("at", "pk")) == [26, 54, 81]
    # The worker dies; the job restarts from its checkpoint in a newer generation, whose
    # progress may go back.
    report(cluster, event(job, "exited", exit_code=-9, reason="failed", device_index=0))
    run_cycle()
    job.refresh_from_db()
    assert job.generation == 2
    report(cluster, event(job, "started", pid=1001, device_index=0),
           event(job, "progress", step=30, loss=1.0, samples_per_s=10.0))
    job.refresh_from_db()
    assert job.steps_done == 30, "a newer generation is not a replay"


def test_a_scheduler_killed_mid_cycle_holds_the_next_ones_back_briefly(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, redis_client: Any
) -> None:
    """The lock a cycle holds lives LOCK_TIMEOUT_S (10 s), renewed every round: a Celery worker
    killed mid-cycle leaves it behind for at most that long, not a minute."""
    from portal.redis import client, key
    from portal.scheduling import tasks as scheduling_tasks

    seen: list[int] = []
    monkeypatch.setattr(scheduling_tasks, "run_cycle", lambda: seen.append(client().pttl(key("scheduler", "lock"))))
    scheduling_tasks.schedule("test")
    assert len(seen) == 1 and 0 < seen[0] <= 10_000, seen


def test_a_request_that_finds_the_lock_of_a_dead_cycle_runs_once_the_lock_expires(
    api: dict, cluster: Any, monkeypatch: pytest.MonkeyPatch, redis_client: Any
) -> None:
    """A Celery worker killed mid-cycle leaves the lock behind and runs no further round: a
    request that finds that lock (the pin's, with the beat down too) is asked again for when the
    lock expires, once however many requests find it, and that retry runs the cycle."""
    from portal.redis import key
    from portal.scheduling import tasks as scheduling_tasks

    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    dead = redis_client.lock(key("scheduler", "lock"), timeout=1)
    assert dead.acquire(blocking=False)  # never released: its holder died
    asked: list[float] = []
    monkeypatch.setattr(scheduling_tasks.schedule, "apply_async", lambda args, countdown: asked.append(countdown))
    assert scheduling_tasks.schedule("the pin") == {"changed": [], "launched": []}
    assert scheduling_tasks.schedule("another event") == {"changed": [], "launched": []}
    assert len(asked) == 1 and 0.5 <= asked[0] <= 1.5, asked
    deadline = time.monotonic() + 5
    while redis_client.exists(key("scheduler", "lock")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not redis_client.exists(key("scheduler", "lock")), "the dead cycle's lock outlived its timeout"
    assert scheduling_tasks.schedule("the retry")["changed"] == [job_id]


@pytest.mark.slow
def test_redis_killed_and_started_again_empty(tmp_path: Path) -> None:
    """A real platform on a Redis of the test's own. Redis is SIGKILLed under a training job and
    started again, empty, on the same port: while it is away the API answers at once (503 where
    it needs Redis, never a hang); once it is back the job trains on, the board is whole again,
    and a resize asked afterwards lands (Celery consumes again)."""
    with redis_server("127.0.0.1", tmp_path / "redis") as server:
        env = {**FAST_PROGRESS_ENV, "REDIS_URL": server.url, "BUNGEE_POLICY": "fair"}
        with running_platform(tmp_path / "platform", {"node-a": 2}, env) as platform:
            alice = platform.api("alice")
            platform.wait_for("2 devices", lambda: _devices(alice) == 2)
            job_id = submit(platform, 2)
            job = settled(platform, job_id, 2)
            job = steps_past(platform, job_id, job["steps_done"] + 20)

            server.kill()
            killed_at = time.monotonic()
            for path in ("/api/cluster", f"/api/jobs/{job_id}"):
                # A request that needs Redis ends on the portal's own bound (portal.redis: its
                # timeouts and retries), well inside the client's 30 s: a 503 that says so.
                reply = alice.get(path)
                assert reply.status_code in (200, 503), (path, reply.status_code, reply.text[:300])
                if reply.status_code == 503:
                    assert reply.headers["Retry-After"] == str(RETRY_AFTER_S), (path, dict(reply.headers))
                    assert reply.json()["error"]["code"] == "unavailable", (path, reply.text[:300])
                    assert "Redis is not answering" in reply.json()["error"]["message"], (path, reply.text[:300])
            time.sleep(2)
            server.start()

            platform.wait_for("the cluster's devices", lambda: _devices(alice) == 2, timeout_s=60)
            again = steps_past(platform, job_id, detail(platform, job_id)["steps_done"] + 20)
            print(f"Redis away {time.monotonic() - killed_at:.1f} s in all until the job trained on")
            assert {row["pid"] for row in live_rows(again)} == {row["pid"] for row in live_rows(job)}
            assert again["restarts"] == 0 and again["generation"] == job["generation"], "no worker noticed"
            # A shrink needs the board; a grow also the agent's command stream, in the new Redis.
            pin(platform, job_id, 1)
            shrunk = settled(platform, job_id, 1, again["generation"], timeout_s=90)
            pin(platform, job_id, 2)
            settled(platform, job_id, 2, shrunk["generation"], timeout_s=90)


def _devices(api: Any) -> int:
    reply = api.get("/api/cluster")
    return sum(len(n["devices"]) for n in reply.json()["nodes"]) if reply.status_code == 200 else 0
