"""A node drained through the whole platform (API, Celery scheduler, two real agents, real torch
workers): node-b's agent runs with the default `--on-term drain`. A SIGTERM to it, and a staff
`bungee node drain`, each shrink the job in place onto node-a (the survivor is the same process,
the timeline names the cause) and the agent exits 0 once its worker left; a job that would fall
below its minimum saves its step, waits saying why, and resumes when node-b's agent is back. In
each, every step is trained once on exactly its batch (the workers record their samples): no
step lost, none doubled. The time from the drain's notice to the job training without the node
is printed, not asserted (figures belong to bench/drain.py and the notes)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.worker.data import SampleStream
from tests.platform import Platform, running_platform
from tests.test_cli import BUNGEE, bungee
from tests.test_integration_resize_in_place import (
    ENDLESS,
    SEED,
    SPEC,
    live_rows,
    logs,
    runtime_env,
    settled,
    steps_past,
)
from tests.worker_support import DIGITS_SAMPLES, Ledger

pytestmark = pytest.mark.slow

BATCH = SPEC["hyperparameters"]["batch_size"]  # type: ignore[index]
DRAINING = ("node-b", 1)


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("samples") / "samples.jsonl"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, record: Path) -> Any:
    """node-a (one device, its agent stopping on SIGTERM as the platform's teardown wants) and
    node-b (one device, its agent draining on SIGTERM)."""
    with running_platform(tmp_path_factory.mktemp("platform"), {"node-a": 1}, runtime_env(record)) as running:
        start_draining_agent(running)
        running.wait_for("two devices", lambda: devices_online(running) == 2)
        yield running


def start_draining_agent(platform: Platform) -> None:
    platform.start_agent(*DRAINING, "drain", "--drain-deadline", "60")


def devices_online(platform: Platform) -> int:
    nodes = platform.api("alice").get("/api/cluster").json()["nodes"]
    return sum(len(n["devices"]) for n in nodes if n["state"] == "online")


def node_state(platform: Platform, name: str) -> str:
    return str(next(n["state"] for n in platform.api("alice").get("/api/nodes").json() if n["name"] == name))


def agent_exit(platform: Platform, name: str, timeout_s: float = 90) -> int:
    """Waits for node `name`'s agent to exit by itself (a drain ends so) and lets the group forget
    it; returns its exit code."""
    [managed] = [p for p in platform.group.processes if p.name == f"agent-{name}"]
    try:
        code = managed.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"agent {name} did not exit:\n{platform.group.tail(managed.name)}") from None
    managed.log_file.close()
    platform.group.processes.remove(managed)
    return code


def submit(platform: Platform, **spec: Any) -> int:
    reply = platform.api("alice").post(
        "/api/jobs", json={**SPEC, "max_workers": 2, "steps": ENDLESS, "name": "drained", **spec}
    )
    assert reply.status_code == 201, reply.text
    return int(reply.json()["id"])


def cancel(platform: Platform, job_id: int) -> None:
    assert platform.api("alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
    platform.wait_for("the workers to stop", lambda: not live_rows(platform.job(job_id)))


def every_step_once(record: Path, job_id: int, done: int) -> None:
    steps = Ledger.read(record, job_id).check(SampleStream(DIGITS_SAMPLES, SEED), BATCH, virtual_workers=2)
    assert steps >= done, (steps, done)


def shrinks_off_node_b(platform: Platform, job_id: int, drain: Any, cause: str) -> None:
    """Drains node-b with `drain()` under the job running on both nodes; checks that the job
    shrinks in place onto node-a, its survivor untouched, and that the agent leaves."""
    job = settled(platform, job_id, 2)
    job = steps_past(platform, job_id, job["steps_done"] + 10)
    survivor = next(row["pid"] for row in live_rows(job) if row["node"] == "node-a")
    asked = time.monotonic()
    platform.agent_may_leave("node-b")
    drain()
    shrunk = settled(platform, job_id, 1, job["generation"])
    landed = time.monotonic() - asked
    assert [row["pid"] for row in live_rows(shrunk)] == [survivor], shrunk["workers_history"]
    assert shrunk["resizes"][-1]["reason"] == cause
    assert agent_exit(platform, "node-b") == 0
    assert node_state(platform, "node-b") == "drained"
    print(f"\n{cause}: drain asked -> the job trained on node-a alone after {landed:.2f} s")
    steps_past(platform, job_id, shrunk["steps_done"] + 10)


def test_sigterm_drains_the_node_and_the_job_shrinks_in_place(platform: Platform, record: Path) -> None:
    job_id = submit(platform)

    def sigterm() -> None:
        [agent] = [p for p in platform.group.processes if p.name == "agent-node-b"]
        agent.process.send_signal(signal.SIGTERM)

    shrinks_off_node_b(platform, job_id, sigterm, "node's agent stopped")
    cancel(platform, job_id)
    every_step_once(record, job_id, platform.job(job_id)["steps_done"])


def test_staff_drain_with_the_cli(platform: Platform, record: Path, tmp_path: Path) -> None:
    start_draining_agent(platform)
    platform.wait_for("node-b back", lambda: node_state(platform, "node-b") == "online")
    platform.group.run("manage.py", "ensure_user", "root", "--password", "root-pass", "--staff")
    token = platform.group.run("manage.py", "create_token", "root").strip()
    assert BUNGEE.exists()
    assert bungee(tmp_path, "login", platform.base_url, "--token", token).returncode == 0
    job_id = submit(platform)

    def operator() -> None:
        done = bungee(tmp_path, "node", "drain", "node-b", "--deadline", "60")
        assert done.returncode == 0, done.stderr
        assert "node node-b is draining: node drained by an operator" in done.stdout

    shrinks_off_node_b(platform, job_id, operator, "node drained by an operator")
    listed = bungee(tmp_path, "node", "list")
    assert "drained" in listed.stdout and "node drained by an operator" in listed.stdout
    cancel(platform, job_id)
    every_step_once(record, job_id, platform.job(job_id)["steps_done"])


def test_a_job_below_its_minimum_saves_its_step_waits_and_resumes(platform: Platform, record: Path) -> None:
    start_draining_agent(platform)
    platform.wait_for("node-b back", lambda: node_state(platform, "node-b") == "online")
    job_id = submit(platform, min_workers=2)
    job = settled(platform, job_id, 2)
    job = steps_past(platform, job_id, job["steps_done"] + 10)
    [agent] = [p for p in platform.group.processes if p.name == "agent-node-b"]
    platform.agent_may_leave("node-b")
    agent.process.send_signal(signal.SIGTERM)
    waiting = platform.wait_for(
        "the job to wait for devices",
        lambda: (j := platform.job(job_id))["state"] == "queued" and not live_rows(j) and j,
        timeout_s=90,
    )
    assert waiting["message"] == "node node-b drained: node's agent stopped; waiting for 2 devices"
    assert agent_exit(platform, "node-b") == 0
    stopped_at = waiting["steps_done"]

    start_draining_agent(platform)
    resumed = settled(platform, job_id, 2, waiting["generation"])
    steps_past(platform, job_id, resumed["steps_done"] + 10)
    assert f"stopping at step {stopped_at}" in "\n".join(logs(platform, job_id))
    cancel(platform, job_id)
    every_step_once(record, job_id, platform.job(job_id)["steps_done"])
