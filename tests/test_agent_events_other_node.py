"""A node's report speaks only for its own workers: every worker event is checked against the plan
of its generation (portal.jobs.lifecycle.ranks_held), and one about a worker that plan put on
another node, or about a job that does not exist, is refused: listed under `refused` in the reply,
counted in /metrics, and nothing of it stored. The same events from the worker's own node are
taken."""

from __future__ import annotations

import time
from typing import Any

import pytest

from portal.accounts.models import ApiToken
from portal.cluster.models import ReportRefusals
from portal.jobs import lifecycle
from portal.jobs.models import Job, JobEvaluation, JobLog, JobMetric, Worker
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC, ApiClient
from tests.test_agent_node_binding import registration
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.django_db


@pytest.fixture
def setting(users: dict, api: dict, redis_client: Any) -> dict[str, Any]:
    """node-a (one device) and node-b, each registered by its own agent token, and a job planned
    by the scheduler onto node-a alone, whose rank 0 started there."""
    agent_b = ApiClient(ApiToken.issue(users["staff"], "agent b", ApiToken.Role.AGENT)[1])
    assert api["agent"].post("/api/agent/register", registration("node-a", devices=1)).status_code == 200
    job = Job.objects.get(pk=api["alice"].post("/api/jobs", VALID_SPEC).json()["id"])
    run_cycle()
    job.refresh_from_db()
    assert job.generation == 1 and list(job.allocations.values_list("device__node__name", flat=True)) == ["node-a"]
    assert agent_b.post("/api/agent/register", registration("node-b")).status_code == 200
    started = event(job, "started", pid=4242, device_index=0)
    reply = api["agent"].post("/api/agent/report", report("node-a", [started]))
    assert reply.status_code == 200 and reply.json()["refused"] == [], reply.content
    return {"a": api["agent"], "b": agent_b, "job": job, "worker": Worker.objects.get(job=job)}


@pytest.fixture
def metrics_token(users: dict[str, Any]) -> str:
    return ApiToken.issue(users["staff"], "prometheus", ApiToken.Role.METRICS)[1]


def event(job: Job, kind: str, **fields: Any) -> dict[str, Any]:
    return {"job_id": job.pk, "generation": 1, "rank": 0, "kind": kind, "at": time.time(), **fields}


def report(node: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    return {"node": node, "samples": [], "events": events, "running": []}


FORGERIES = {
    "progress": {"step": 399_999, "total_steps": 400_000, "loss": 0.01, "samples_per_s": 1.0},
    "log": {"message": "forged line"},
    "evaluation": {"step": 399_999, "metrics": {"accuracy": 1.0}},
    "step_times": {"step_times": [9.0, 9.0]},
    "started": {"pid": 999, "device_index": 0},
    "joined": {"pid": 999, "device_index": 0},
    "exited": {"exit_code": 0, "reason": "completed", "step": 50},
    "resized": {"step": 3, "members_before": [], "members_after": ["node-b/0"], "pause_s": 0.1},
    "form_failed": {"failed_generation": 1, "message": "forged"},
}


def row(worker: Worker) -> tuple[Any, ...]:
    worker.refresh_from_db()
    return (worker.node.name, worker.device_index, worker.pid, worker.state, worker.exit_code, worker.reason)


def test_another_nodes_events_are_refused_listed_and_counted(setting: dict, metrics_token: str) -> None:
    job, worker = setting["job"], setting["worker"]
    before = row(worker)
    forged = [event(job, kind, **fields) for kind, fields in FORGERIES.items()]
    reply = setting["b"].post("/api/agent/report", report("node-b", forged))
    assert reply.status_code == 200, reply.content
    refused = reply.json()["refused"]
    assert [item["item"] for item in refused] == [f"events[{i}]" for i in range(len(forged))]
    assert all("node node-b does not hold rank 0 of job" in item["message"] for item in refused), refused
    assert refused[0]["value"] == {"job_id": job.pk, "generation": 1, "rank": 0, "kind": "progress"}

    job.refresh_from_db()
    assert job.steps_done == 0 and job.restarts == 0 and job.generation == 1
    assert not JobMetric.objects.filter(job=job).exists()
    assert not JobLog.objects.filter(job=job, line__contains="forged").exists()
    assert not JobEvaluation.objects.filter(job=job).exists()
    assert row(worker) == before == ("node-a", 0, 4242, "running", None, "")
    assert Worker.objects.filter(job=job).count() == 1
    assert not lifecycle.needs_replan(lifecycle.current(job))
    counted = ReportRefusals.objects.get(node__name="node-b", reason=ReportRefusals.Reason.NOT_ITS_WORKER)
    assert counted.count == len(forged)
    families = scrape(metrics_token)
    assert value(families, "bungee_agent_report_items_refused", "bungee_agent_report_items_refused_total",
                 node="node-b", reason="not_its_worker") == len(forged)


def test_the_workers_own_node_is_heard(setting: dict) -> None:
    job, worker = setting["job"], setting["worker"]
    events = [
        event(job, "progress", step=40, total_steps=50, loss=0.5, samples_per_s=10.0),
        *(event(job, kind, **FORGERIES[kind]) for kind in ("log", "evaluation")),
        event(job, "exited", exit_code=0, reason="stopped", step=40),
    ]
    reply = setting["a"].post("/api/agent/report", report("node-a", events))
    assert reply.status_code == 200 and reply.json()["refused"] == [], reply.content
    job.refresh_from_db()
    assert job.steps_done == 40
    assert JobLog.objects.filter(job=job, line="forged line").count() == 1
    assert JobEvaluation.objects.filter(job=job).count() == 1
    assert row(worker)[3:] == ("exited", 0, "stopped")
    assert not ReportRefusals.objects.filter(node__name="node-a").exists()


def test_a_rank_or_generation_the_plan_never_gave_the_node_is_refused(setting: dict) -> None:
    """node-a holds rank 0 of generation 1 only: rank 1, and generation 2 (never planned), are
    not its to speak for."""
    job = setting["job"]
    events = [
        {**event(job, "progress", **FORGERIES["progress"]), "rank": 1},
        {**event(job, "progress", **FORGERIES["progress"]), "generation": 2},
    ]
    reply = setting["a"].post("/api/agent/report", report("node-a", events))
    assert [item["item"] for item in reply.json()["refused"]] == ["events[0]", "events[1]"]
    job.refresh_from_db()
    assert job.steps_done == 0


def test_an_unknown_job_and_an_agent_only_kind_are_refused_not_a_500(setting: dict) -> None:
    job = setting["job"]
    events = [
        {**event(job, "log", message="x"), "job_id": job.pk + 1000},
        event(job, "exiting", exit_code=0),
        {"job_id": job.pk, "kind": "log"},  # not valid: no generation, rank or time
        event(job, "log", message="kept"),
    ]
    reply = setting["a"].post("/api/agent/report", report("node-a", events))
    assert reply.status_code == 200, reply.content
    refused = {item["item"]: item["message"] for item in reply.json()["refused"]}
    assert set(refused) == {"events[0]", "events[1]", "events[2]"}, refused
    assert refused["events[0]"] == f"no job {job.pk + 1000}"
    assert "'exiting'" in refused["events[1]"]
    assert JobLog.objects.filter(job=job, line="kept").count() == 1
    counts = dict(ReportRefusals.objects.filter(node__name="node-a").values_list("reason", "count"))
    assert counts == {"unknown_job": 1, "invalid": 2}
