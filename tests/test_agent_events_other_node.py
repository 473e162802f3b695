"""A node's report speaks only for its own workers: a started, joined or exited event for a worker
that the database places on another node is ignored (with a warning) and changes none of that
node's rows; the same event from the worker's own node is taken."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from portal.accounts.models import ApiToken
from portal.cluster.models import Node
from portal.jobs import lifecycle
from portal.jobs.models import Job, Worker
from tests.conftest import VALID_SPEC, ApiClient
from tests.test_agent_node_binding import registration

pytestmark = pytest.mark.django_db


@pytest.fixture
def setting(users: dict, api: dict, redis_client: Any) -> dict[str, Any]:
    """node-a and node-b, each registered by its own agent token, and a job whose rank 0 of
    generation 1 runs on node-a."""
    agent_b = ApiClient(ApiToken.issue(users["staff"], "agent b", ApiToken.Role.AGENT)[1])
    assert api["agent"].post("/api/agent/register", registration("node-a")).status_code == 200
    assert agent_b.post("/api/agent/register", registration("node-b")).status_code == 200
    job = Job.objects.get(pk=api["alice"].post("/api/jobs", VALID_SPEC).json()["id"])
    worker = Worker.objects.create(
        job=job, generation=1, rank=0, node=Node.objects.get(name="node-a"), device_index=1, pid=4242
    )
    return {"a": api["agent"], "b": agent_b, "job": job, "worker": worker}


def report(node: str, job: Job, kind: str) -> dict[str, Any]:
    event = {
        "job_id": job.pk,
        "generation": 1,
        "rank": 0,
        "kind": kind,
        "at": time.time(),
        "pid": 999,
        "device_index": 0,
        "exit_code": 1,
        "reason": "failed",
    }
    return {"node": node, "samples": [], "events": [event], "running": []}


def row(worker: Worker) -> tuple[Any, ...]:
    worker.refresh_from_db()
    return (worker.node.name, worker.device_index, worker.pid, worker.state, worker.exit_code, worker.reason)


@pytest.mark.parametrize("kind", ["started", "joined", "exited"])
def test_an_event_for_another_nodes_worker_is_ignored(
    setting: dict, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    job, worker = setting["job"], setting["worker"]
    before = row(worker)
    with caplog.at_level(logging.WARNING, logger="portal.jobs.ingest"):
        reply = setting["b"].post("/api/agent/report", report("node-b", job, kind))
    assert reply.status_code == 200, reply.content
    assert row(worker) == before == ("node-a", 1, 4242, "running", None, "")
    assert Worker.objects.count() == 1
    job.refresh_from_db()
    assert job.restarts == 0 and not lifecycle.needs_replan(lifecycle.current(job))
    assert any("that worker is on node-a" in r.getMessage() for r in caplog.records), caplog.text


def test_the_workers_own_node_ends_it(setting: dict) -> None:
    assert (
        setting["a"].post("/api/agent/report", report("node-a", setting["job"], "exited")).status_code == 200
    )
    assert row(setting["worker"])[3:] == ("exited", 1, "failed")
