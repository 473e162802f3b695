"""The backbone end to end, every part real: submit through the API, the Celery scheduler puts
the job on devices a real agent reports, two real torch workers train it, it is resized 2 -> 1
-> 2 in place (rank 0 is the same process throughout) without losing a finished step, it
finishes, and a WebSocket client saw it all live; /metrics counted the resizes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic.worker.standby import PREPARED_LINE
from tests.platform import Platform, SocketRecorder, running_platform

pytestmark = pytest.mark.slow

STEPS = 1000
"""Long enough for both resizes to land first: at the test platform's pace (10: about 20 steps a
second here) they landed at steps 81 and 181 of a quiet run."""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with running_platform(tmp_path_factory.mktemp("platform"), {"node-a": 2}) as running:
        yield running


def job_detail(platform: Platform, job_id: int) -> dict[str, Any]:
    return platform.job(job_id)


def scrape(platform: Platform, token: str) -> dict[str, Any]:
    """/metrics as Prometheus reads it, parsed by prometheus_client's own parser."""
    reply = httpx.get(platform.base_url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert reply.status_code == 200, reply.text[:300]
    return {family.name: family for family in text_string_to_metric_families(reply.text)}


def total(families: dict[str, Any], sample: str) -> float:
    """The sum of a sample over its labels, 0 where there is none."""
    return sum(s.value for f in families.values() for s in f.samples if s.name == sample)


def wait_running_on(platform: Platform, job_id: int, workers: int, after_step: int) -> dict[str, Any]:
    def landed() -> dict[str, Any] | None:
        job = job_detail(platform, job_id)
        if job["state"] == "running" and job["workers"] == workers and job["steps_done"] > after_step:
            return job
        return None

    return platform.wait_for(f"job {job_id} running on {workers} worker(s)", landed, timeout_s=90)


def test_submit_train_resize_finish(platform: Platform, tmp_path: Path) -> None:
    socket = SocketRecorder(platform.base_url.replace("http", "ws") + "/ws/live/", platform.tokens["alice"]).start()
    alice = platform.api("alice")
    platform.wait_for("the node's devices", lambda: len(
        [d for n in alice.get("/api/cluster").json()["nodes"] for d in n["devices"]]) == 2)

    spec = {"name": "backbone", "workload": "digits-mlp", "min_workers": 1, "max_workers": 2,
            "steps": STEPS, "hyperparameters": {"batch_size": 32, "hidden": 64}}
    reply = alice.post("/api/jobs", json=spec)
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    socket_ok = platform.wait_for("socket subscription", lambda: socket.messages and not socket.error)
    assert socket_ok

    job = wait_running_on(platform, job_id, 2, after_step=0)
    first_steps = job["steps_done"]
    platform.wait_for("steps to advance", lambda: job_detail(platform, job_id)["steps_done"] > first_steps)

    metrics_token = platform.group.run("manage.py", "create_token", "alice", "--role", "metrics").strip()
    scraped_before = scrape(platform, metrics_token)
    standbys = Path(platform.env["BUNGEE_DATA_DIR"]) / "agent" / "node-a" / "standby"
    for workers in (1, 2):
        before = job_detail(platform, job_id)
        if workers == 2:
            # The freed device's standby is prepared for the job, which may grow there again.
            platform.wait_for("a standby prepared for the job", lambda: any(
                PREPARED_LINE in f.read_text(errors="replace") for f in standbys.glob("device*.out")), timeout_s=90)
        resized = alice.post(f"/api/jobs/{job_id}/resize", json={"workers": workers})
        assert resized.status_code == 200, resized.text
        job = wait_running_on(platform, job_id, workers, after_step=before["steps_done"])
        assert job["generation"] > before["generation"]

    # An operator's Prometheus saw both resizes: counted, and their pauses in the histogram.
    scraped = scrape(platform, metrics_token)
    assert total(scraped, "bungee_resizes_total") >= total(scraped_before, "bungee_resizes_total") + 2
    assert total(scraped, "bungee_resize_pause_seconds_count") >= total(scraped_before, "bungee_resize_pause_seconds_count") + 2
    running = [s for s in scraped["bungee_job_workers"].samples if s.labels["job_id"] == str(job_id)]
    assert [s.value for s in running] == [2.0] and running[0].labels["user"] == "alice"

    done = platform.wait_for(
        "the job to finish", lambda: (j := job_detail(platform, job_id))["state"] == "succeeded" and j, timeout_s=240
    )
    assert done["steps_done"] == STEPS and done["allocations"] == []
    # A generation planned again at the same size is allowed only with its cause (a rendezvous
    # port taken by another socket expires a generation, and the next one forms on another).
    replans = [r["reason"] for r in done["resizes"] if r["workers_before"] == r["workers_after"]]
    assert set(replans) <= {"its group did not form"}, done["resizes"]
    sizes = [(r["workers_before"], r["workers_after"]) for r in done["resizes"] if r["workers_before"] != r["workers_after"]]
    assert sizes[:3] == [(0, 2), (2, 1), (1, 2)], sizes
    resized = [r for r in done["resizes"][1:] if r["workers_before"] != r["workers_after"]][:2]
    assert all(r["pause_s"] is not None and r["pause_s"] >= 0 for r in resized), resized

    # In place: rank 0 is one process in every generation, each switch picked up where the last
    # step ended, and nothing was restored from disk.
    leader = {w["pid"] for w in done["workers_history"] if w["rank"] == 0}
    assert len(leader) == 1, done["workers_history"]
    logs = [entry["line"] for entry in alice.get(f"/api/jobs/{job_id}/logs").json()]
    # The joiner of the grow took the build its standby had made (and trained on with it, below).
    assert [line for line in logs if "its standby had prepared it for this job" in line], logs
    switched = [line for line in logs if line.startswith("generation ") and " -> " in line]
    assert len(switched) >= 2 and not [line for line in logs if "resumed" in line], logs
    metrics = alice.get(f"/api/jobs/{job_id}/metrics").json()["points"]
    steps = [m["step"] for m in metrics]
    assert steps == sorted(steps), "steps went backwards: a finished step was lost"
    assert metrics[-1]["loss"] < metrics[0]["loss"], "the model did not learn"

    # Live: device samples and the job's resizes reached the socket.
    platform.wait_for("samples on the socket", lambda: socket.of_type("samples"))
    seen_workers = [job["workers"] for job in socket.job_states() if job["id"] == job_id]
    assert 1 in seen_workers and 2 in seen_workers, seen_workers
    assert any(job["state"] == "succeeded" for job in socket.job_states() if job["id"] == job_id)
    socket.stop()
    assert socket.error is None, socket.error

    # Leavers freed their devices: the board shows both free again.
    holders = platform.wait_for("devices freed", lambda: all(
        d["holder"] == "free" for n in alice.get("/api/cluster").json()["nodes"] for d in n["devices"]))
    assert holders


def test_second_user_is_refused_everywhere(platform: Platform) -> None:
    alice, bob = platform.api("alice"), platform.api("bob")
    job_id = alice.post("/api/jobs", json={"name": "private", "workload": "digits-mlp", "steps": 5}).json()["id"]
    assert bob.get(f"/api/jobs/{job_id}").status_code == 403
    assert bob.post(f"/api/jobs/{job_id}/resize", json={"workers": 1}).status_code == 403
    assert bob.post(f"/api/jobs/{job_id}/cancel").status_code == 403
    assert job_id in [j["id"] for j in bob.get("/api/jobs").json()]
    socket = SocketRecorder(platform.base_url.replace("http", "ws") + "/ws/live/", platform.tokens["bob"]).start()
    platform.wait_for("bob's socket", lambda: socket.messages)
    from websockets.sync.client import connect

    with connect(platform.base_url.replace("http", "ws") + "/ws/live/",
                 additional_headers={"Authorization": f"Bearer {platform.tokens['bob']}"},
                 origin="http://127.0.0.1") as ws:  # type: ignore[arg-type]
        ws.recv(timeout=5)
        import json

        ws.send(json.dumps({"action": "subscribe_job", "job_id": job_id}))
        while (answer := json.loads(ws.recv(timeout=5)))["type"] not in {"error", "subscribed"}:
            pass
        assert answer["type"] == "error" and "not yours" in answer["message"]
    socket.stop()
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus):
        with connect(platform.base_url.replace("http", "ws") + "/ws/live/", origin="http://127.0.0.1"):  # type: ignore[arg-type]
            pass


def test_the_portal_holds_no_more_database_connections_than_its_pool(platform: Platform) -> None:
    """The ASGI portal runs its sync views and consumers in many threads; with per-thread
    persistent connections one portal held 15 idle ones, and two platforms side by side met
    PostgreSQL's max_connections and answered 500. Many requests and sockets at once: every
    reply is a 200, and the portal holds at most its pool (BUNGEE_DB_POOL_SIZE, 8)."""
    paths = ["/api/jobs", "/api/cluster", "/api/cluster/history", "/api/workloads"]

    def get(index: int) -> int:
        with platform.api("alice") as client:
            return client.get(paths[index % len(paths)]).status_code

    sockets = [
        SocketRecorder(platform.base_url.replace("http", "ws") + "/ws/live/", platform.tokens["alice"]).start()
        for _ in range(6)
    ]
    try:
        with ThreadPoolExecutor(max_workers=24) as pool:
            statuses = list(pool.map(get, range(144)))
        platform.wait_for("every socket's first message", lambda: all(s.messages for s in sockets))
    finally:
        for socket in sockets:
            socket.stop()
    assert set(statuses) == {200}, statuses
    [portal] = [p for p in platform.group.processes if p.name == "portal"]
    held = [
        c for c in psutil.Process(portal.process.pid).net_connections(kind="tcp") if c.raddr and c.raddr.port == 5432
    ]
    assert 0 < len(held) <= 8, f"the portal holds {len(held)} connections to PostgreSQL"
