"""A node's agent speaks only for the workers the portal placed on it, as they first reported:
an event about a placed rank from another device, or from another pid than the one the worker's
first report bound, is refused (listed, counted as not_its_worker, nothing stored); so is a
worker an agent says it re-adopted at (re)registration that its generation's plan never put
there (it keeps no worker of the portal's alive); and a job's artifacts are taken only from the
node that ran its rank 0, the one that writes them."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from portal.accounts.models import ApiToken
from portal.cluster.models import ReportRefusals
from portal.jobs.models import Job, Worker
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC, ApiClient
from tests.test_agent_node_binding import registration

pytestmark = pytest.mark.django_db


def event(job: Job, kind: str, **fields: Any) -> dict[str, Any]:
    return {"job_id": job.pk, "generation": 1, "rank": 0, "kind": kind, "at": time.time(), **fields}


def report(node: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    return {"node": node, "samples": [], "events": events, "running": []}


def refusals(node: str) -> int:
    row = ReportRefusals.objects.filter(node__name=node, reason=ReportRefusals.Reason.NOT_ITS_WORKER).first()
    return row.count if row is not None else 0


@pytest.fixture
def placed(users: dict, api: dict, redis_client: Any) -> dict[str, Any]:
    """node-a and node-b, one device each, and a job of two workers planned over both, whose
    ranks started: pid 4242 on node-a's device 0, 4343 on node-b's."""
    secret_b = ApiToken.issue(users["staff"], "agent b", ApiToken.Role.AGENT)[1]
    clients = {"node-a": api["agent"], "node-b": ApiClient(secret_b)}
    for name, client in clients.items():
        assert client.post("/api/agent/register", registration(name, devices=1)).status_code == 200
    job = Job.objects.get(pk=api["alice"].post("/api/jobs", VALID_SPEC).json()["id"])
    run_cycle()
    job.refresh_from_db()
    assert job.generation == 1
    rank_of = {name: rank for rank, name in enumerate(
        job.allocations.order_by("rank").values_list("device__node__name", flat=True))}
    assert set(rank_of) == {"node-a", "node-b"}, rank_of
    pids = {"node-a": 4242, "node-b": 4343}
    for name, client in clients.items():
        started = event(job, "started", rank=rank_of[name], pid=pids[name], device_index=0)
        reply = client.post("/api/agent/report", report(name, [started]))
        assert reply.status_code == 200 and reply.json()["refused"] == [], reply.content
    return {"job": job, "clients": clients, "rank_of": rank_of, "pids": pids, "secret_b": secret_b}


def test_an_event_from_another_pid_or_device_of_a_placed_rank_is_refused(placed: dict) -> None:
    job, rank = placed["job"], placed["rank_of"]["node-a"]
    forged = [
        event(job, "joined", rank=rank, pid=999, device_index=0),
        event(job, "exited", rank=rank, pid=999, device_index=0, exit_code=0, reason="completed", step=50),
        event(job, "started", rank=rank, pid=4242, device_index=3),
    ]
    reply = placed["clients"]["node-a"].post("/api/agent/report", report("node-a", forged))
    assert reply.status_code == 200, reply.content
    messages = [item["message"] for item in reply.json()["refused"]]
    assert len(messages) == 3, messages
    assert all("is pid 4242 (its first report), not 999" in message for message in messages[:2]), messages
    assert "is on device 0 of node node-a, not 3" in messages[2]
    worker = Worker.objects.get(job=job, rank=rank)
    assert (worker.pid, worker.state, worker.device_index) == (4242, Worker.State.RUNNING, 0)
    assert refusals("node-a") == 3

    joined = event(job, "joined", rank=rank, pid=4242, device_index=0)
    reply = placed["clients"]["node-a"].post("/api/agent/report", report("node-a", [joined]))
    assert reply.json()["refused"] == [], "its own pid and device are heard"


def test_a_worker_re_adopted_at_registration_that_was_never_placed_there_is_refused(placed: dict) -> None:
    job, rank, pid = placed["job"], placed["rank_of"]["node-a"], placed["pids"]["node-a"]
    said = registration("node-a", devices=1)
    said["running"] = [
        # The real worker's job, device and pid, in a generation never planned: not its word.
        {"job_id": job.pk, "generation": 7, "rank": rank, "pid": pid, "device_index": 0},
        # node-b's rank, claimed by node-a.
        {"job_id": job.pk, "generation": 1, "rank": placed["rank_of"]["node-b"], "pid": 4343, "device_index": 0},
    ]
    reply = placed["clients"]["node-a"].post("/api/agent/register", said)
    assert reply.status_code == 200, reply.content
    assert refusals("node-a") == 2
    mine = Worker.objects.get(job=job, generation=1, rank=rank)
    assert mine.state != Worker.State.RUNNING, "a worker kept alive only by a claim it was not given is gone"
    theirs = Worker.objects.get(job=job, generation=1, rank=placed["rank_of"]["node-b"])
    assert theirs.state == Worker.State.RUNNING and theirs.node.name == "node-b"


def test_a_placed_worker_re_adopted_at_registration_is_kept(placed: dict) -> None:
    job, rank, pid = placed["job"], placed["rank_of"]["node-a"], placed["pids"]["node-a"]
    said = registration("node-a", devices=1)
    said["running"] = [{"job_id": job.pk, "generation": 1, "rank": rank, "pid": pid, "device_index": 0}]
    assert placed["clients"]["node-a"].post("/api/agent/register", said).status_code == 200
    assert Worker.objects.get(job=job, generation=1, rank=rank).state == Worker.State.RUNNING
    assert refusals("node-a") == 0


def test_artifacts_come_only_from_the_node_of_rank_0(placed: dict, tokens: dict, settings: Any, tmp_path: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})
    job = placed["job"]
    other = next(name for name, rank in placed["rank_of"].items() if rank != 0)
    secret = tokens["agent"] if other == "node-a" else placed["secret_b"]
    reply = Client().post(
        f"/api/agent/jobs/{job.pk}/artifacts",
        {name: SimpleUploadedFile(name, b"junk") for name in ("model.pt", "checkpoint.pt", "manifest.json")},
        HTTP_AUTHORIZATION=f"Bearer {secret}",
    )
    assert reply.status_code == 403, reply.content
    assert f"rank 0 of job {job.pk} never ran on node '{other}'" in reply.json()["error"]["message"]
