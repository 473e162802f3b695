"""The agent dies, the job goes on (the whole platform: API, Celery scheduler, a real agent, real
torch workers). The agent of a node running a two-worker job is SIGKILLed mid-training: its
workers train on, the node shows "agent unreachable" rather than lost while their heartbeats are
fresh, and an agent started again under the same name takes the same worker processes back. No
step is lost: the job was never restarted from its checkpoint, its step count never went back,
and it still runs on its two workers in the same generation. And a job that finishes has its
last worker recorded as completed, not stopped by the "finished" stop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.platform import Platform, running_platform

pytestmark = pytest.mark.slow

SPEC = {
    "name": "agent-restart",
    "workload": "digits-mlp",
    "min_workers": 1,
    "max_workers": 2,
    "seed": 3,
    "hyperparameters": {"batch_size": 32, "hidden": 64},
}
ENDLESS = 10_000_000


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    env = {
        "BUNGEE_PROGRESS_EVERY_S": "0.2",
        "BUNGEE_PG_TIMEOUT_S": "20",
        "BUNGEE_CHECKPOINT_EVERY_S": "1",
        "BUNGEE_POLICY": "fair",
        # A silent agent is noticed within seconds; its workers' heartbeats last 10 s.
        "BUNGEE_NODE_TIMEOUT_S": "6",
    }
    with running_platform(tmp_path_factory.mktemp("platform"), {"node-a": 2}, env) as running:
        alice = running.api("alice")
        running.wait_for(
            "two devices",
            lambda: sum(len(n["devices"]) for n in alice.get("/api/cluster").json()["nodes"]) == 2,
        )
        yield running


def detail(platform: Platform, job_id: int) -> dict[str, Any]:
    return platform.job(job_id)


def live_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted((w for w in job["workers_history"] if w["state"] == "running"), key=lambda w: w["rank"])


def node_state(platform: Platform) -> str:
    [node] = platform.api("alice").get("/api/cluster").json()["nodes"]
    return str(node["state"])


def logs(platform: Platform, job_id: int) -> list[str]:
    return [entry["line"] for entry in platform.api("alice").get(f"/api/jobs/{job_id}/logs").json()]


def submit(platform: Platform, steps: int) -> int:
    alice = platform.api("alice")
    reply = alice.post("/api/jobs", json={**SPEC, "steps": steps})
    assert reply.status_code == 201, reply.text
    job_id: int = reply.json()["id"]
    assert alice.post(f"/api/jobs/{job_id}/resize", json={"workers": 2}).status_code == 200
    return job_id


def test_a_killed_agent_leaves_the_job_training_and_its_successor_takes_the_workers_back(
    platform: Platform,
) -> None:
    job_id = submit(platform, ENDLESS)
    steps: list[int] = []

    def observe() -> dict[str, Any]:
        job = detail(platform, job_id)
        steps.append(job["steps_done"])
        return job

    before = platform.wait_for(
        "the job training on two workers",
        lambda: (
            (job := observe())["state"] == "running"
            and len(live_rows(job)) == 2
            and job["resizes"][-1]["completed_at"] is not None
            and job["steps_done"] > 20
            and job
        ),
        timeout_s=120,
    )
    rows = live_rows(before)
    workers = [psutil.Process(row["pid"]) for row in rows]
    try:
        platform.kill_agent("node-a")

        unreachable = platform.wait_for(
            "the node to show its agent unreachable",
            lambda: (state := node_state(platform)) != "online" and (state, observe()),
            timeout_s=60,
        )
        assert unreachable[0] == "unreachable", "a node whose workers beat is not lost"
        job = unreachable[1]
        assert job["state"] == "running" and live_rows(job) == rows, "nothing was replanned"
        assert all(worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE for worker in workers)

        frozen_at = max(steps)
        platform.start_agent("node-a", 2)
        after = platform.wait_for(
            "the job reporting progress again through the new agent",
            lambda: (
                node_state(platform) == "online" and (job := observe())["steps_done"] > frozen_at + 20 and job
            ),
            timeout_s=120,
        )
        assert [(w["rank"], w["pid"], w["generation"]) for w in live_rows(after)] == [
            (w["rank"], w["pid"], w["generation"]) for w in rows
        ], "the same worker processes, in the same generation"
        assert (after["state"], after["generation"], after["workers"]) == ("running", before["generation"], 2)
        assert len(after["resizes"]) == len(before["resizes"]), "no generation was added"
        assert steps == sorted(steps), f"steps_done went back: {steps}"
        assert not [line for line in logs(platform, job_id) if "resumed from the periodic checkpoint" in line]

        # The new agent commands them: a cancel stops the very same processes.
        assert platform.api("alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
        stopped = platform.wait_for(
            "the workers to stop", lambda: not live_rows(j := detail(platform, job_id)) and j
        )
        ends = {
            (w["pid"], w["reason"])
            for w in stopped["workers_history"]
            if w["generation"] == after["generation"]
        }
        assert ends == {(row["pid"], "stopped") for row in rows}
    finally:
        for worker in workers:
            try:
                worker.kill()
            except psutil.NoSuchProcess:
                pass


def test_the_last_worker_of_a_finished_job_is_recorded_completed(platform: Platform) -> None:
    job_id = submit(platform, 300)
    done = platform.wait_for(
        "the job to finish and its workers to exit",
        lambda: (j := detail(platform, job_id))["state"] == "succeeded" and not live_rows(j) and j,
        timeout_s=180,
    )
    last = [w for w in done["workers_history"] if w["generation"] == done["generation"]]
    assert len(last) == 2
    assert {(w["exit_code"], w["reason"]) for w in last} == {(0, "completed")}, last
