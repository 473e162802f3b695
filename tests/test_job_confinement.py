"""Jobs confined on a node whose agent runs as root (elastic.worker.confine, agent.isolation): a
stranger's task with packages of its own, uploaded as a user would, tries from inside its running
job to reach the agent's memory, environment and token, its state directory, the data directory,
another job's code and the machine's /tmp, and gets none of them, while it trains; another
(tests/tasks/redis_probe), with the Redis URL its worker is given, tries to write a stop and a
drain to its node's command stream, read and write another job's keys, touch Celery's queue, list
keys and make a user: Redis refuses every try (NOPERM), the other job trains on, and once the
stranger ends its Redis user is gone; a strict job with packages of its own, grown from a standby
started and prepared in its environment (confined as the job from its start) and shrunk again
inside its confinement, ends with the fixed-size run's model, bit for bit. Whole platform:
API, Celery, a real agent with warm standbys, real torch workers."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from tests.code_support import RINGS, directory_files, tar_gz
from tests.environment_support import TINY, tiny_wheelhouse
from tests.platform import FAST_PROGRESS_ENV, REDIS_URL, Platform, running_platform

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="confining jobs needs an agent running as root"),
]

HOSTILE = Path(__file__).parent / "tasks" / "hostile"
UID_BASE = 300_000
MARKER = Path("/tmp/bungee-outside-marker")
ENDED = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    wheelhouse = tiny_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))
    wheelhouse.chmod(0o755)  # builds run as a uid of their own: an operator's wheelhouse is anyone's to read
    env = {**FAST_PROGRESS_ENV, "BUNGEE_AGENT_ISOLATION": "uid", "BUNGEE_AGENT_JOB_UID_BASE": str(UID_BASE),
           "BUNGEE_POLICY": "fair", "BUNGEE_ENV_FIND_LINKS": str(wheelhouse), "UV_OFFLINE": "1"}
    with running_platform(tmp_path_factory.mktemp("confined"), {"node-a": 2}, env) as running:
        running.wait_for("two devices", lambda: sum(
            len(n["devices"]) for n in running.api("alice").get("/api/cluster").json()["nodes"]) == 2)
        yield running


@pytest.fixture(autouse=True)
def no_job_left(platform: Platform) -> Iterator[None]:
    yield
    alice = platform.api("alice")
    for job in alice.get("/api/jobs").json():
        if job.get("state") not in ENDED:
            alice.post(f"/api/jobs/{job['id']}/cancel")


def upload(platform: Platform, files: dict[str, bytes]) -> str:
    reply = platform.api("alice").post("/api/code", files={"file": ("task.tar.gz", tar_gz(files), "application/gzip")})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["digest"])


def submit(platform: Platform, spec: dict[str, Any], workers: int | None = None) -> int:
    alice = platform.api("alice")
    reply = alice.post("/api/jobs", json=spec)
    assert reply.status_code == 201, reply.text
    job_id = int(reply.json()["id"])
    if workers is not None:
        assert alice.post(f"/api/jobs/{job_id}/resize", json={"workers": workers}).status_code == 200
    return job_id


def logs(platform: Platform, job_id: int) -> list[str]:
    reply = platform.api("alice").get(f"/api/jobs/{job_id}/logs")
    assert reply.status_code == 200, reply.text
    return [entry["line"] for entry in reply.json()]


def live(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in job["workers_history"] if w["state"] == "running"]


def settled(platform: Platform, job_id: int, workers: int, after_generation: int = 0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        job = platform.job(job_id)
        rows = live(job)
        done = (job["state"] == "running" and job["workers"] == workers and job["generation"] > after_generation
                and job["resizes"][-1]["completed_at"] is not None and len(rows) == workers
                and all(row["generation"] == job["generation"] for row in rows))
        return job if done else None

    try:
        return platform.wait_for(f"job {job_id} on {workers} workers", check, timeout_s=120)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{platform.job(job_id)}\n" + "\n".join(logs(platform, job_id)[-40:])) from None


def uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


RINGS_SPEC = {"entrypoint": "task:RingsTask", "min_workers": 1, "max_workers": 2, "seed": 3,
              "hyperparameters": {"batch_size": 24, "hidden": 16}}


def probe_of(platform: Platform, job_id: int) -> dict[str, Any]:
    lines = logs(platform, job_id)
    assert platform.job(job_id)["state"] == "succeeded", "\n".join(lines[-40:])
    [line] = [line for line in lines if line.startswith("PROBE ")]
    return dict(json.loads(line.removeprefix("PROBE ")))


def test_a_jobs_code_reaches_no_secret_of_the_platform_and_no_other_job(platform: Platform) -> None:
    MARKER.write_text("the machine's /tmp")
    try:
        neighbour = submit(platform, {**RINGS_SPEC, "name": "neighbour", "code": upload(platform, directory_files(RINGS)),
                                      "steps": 10_000_000}, workers=1)
        [worker] = live(settled(platform, neighbour, 1))
        assert uid_of(worker["pid"]) == UID_BASE + neighbour, "the job's worker runs as the job's own uid"
        # With packages of its own: its workers start from its environment's interpreter, whose
        # packages may run code as it starts (a .pth file): confined before that interpreter runs,
        # its environment built as the builder's uid.
        files = {**directory_files(RINGS), **directory_files(HOSTILE), "requirements.txt": f"{TINY}==2.0\n".encode(),
                 "tiny_hostile.py": b"import bungeetiny\nfrom hostile import HostileRings\n\n\n"
                                    b"class TinyHostile(HostileRings):\n    pass\n"}
        hostile = submit(platform, {**RINGS_SPEC, "name": "hostile", "code": upload(platform, files),
                                    "entrypoint": "tiny_hostile:TinyHostile", "max_workers": 1, "steps": 30})
        platform.wait_for("the hostile job's end", lambda: platform.job(hostile)["state"] in ENDED, timeout_s=180)
    finally:
        MARKER.unlink(missing_ok=True)
    probe = probe_of(platform, hostile)
    assert (probe["uid"], probe["gid"], probe["groups"]) == (UID_BASE + hostile, UID_BASE + hostile, []), probe
    assert probe["agents_seen"] >= 1, probe
    for key, result in probe.items():
        if key.startswith("agent ") or key == "token file":
            assert result.startswith("refused"), (key, result)
    assert "token file" in probe, probe
    assert probe["environs holding the token variable"] == [], probe
    state = probe["state dir"]
    # Only the way in to its own directory and its environment (the rest of the directory covered).
    assert state.startswith("refused") or state in ("listed ['jobs']", "listed ['environments', 'jobs']"), state
    assert probe["workers' records"].startswith("refused"), probe
    assert probe["other jobs' code read"] == [], probe
    assert probe["own code"].startswith("listed"), probe
    assert probe["outside /tmp marker"].startswith("refused"), probe
    assert probe["own /tmp"] == "got 1 bytes", probe
    assert [line for line in logs(platform, hostile) if line.startswith("built the environment")]
    print(json.dumps(probe, indent=1))


def test_a_strict_job_resized_inside_its_confinement_ends_with_the_fixed_runs_model(
    platform: Platform, tmp_path: Path
) -> None:
    # With packages of its own: its standbys start in its environment, confined as the job from
    # their start (the environment's .pth files never run as root).
    code = upload(platform, {**directory_files(RINGS), "requirements.txt": f"{TINY}==1.0\n".encode()})
    spec = {**RINGS_SPEC, "name": "confined-resized", "code": code, "steps": 10_000_000}
    job_id = submit(platform, spec, workers=1)
    one = settled(platform, job_id, 1)
    # The grow from a standby prepared for the job (its model built, confined as the job already).
    agent_log = platform.group.log_dir / "agent-node-a.log"
    platform.wait_for("a standby prepared for the job", lambda: prepared_for(agent_log, job_id), timeout_s=120)
    in_environment = {int(m.group(1)) for line in agent_log.read_text().splitlines()
                      if (m := re.search(rf": pid (\d+) in job {job_id}'s own environment", line))}
    assert set(prepared_for(agent_log, job_id)) <= in_environment
    assert all(uid_of(pid) == UID_BASE + job_id for pid in prepared_for(agent_log, job_id))
    assert alice_resize(platform, job_id, 2)
    two = settled(platform, job_id, 2, one["generation"])
    [taken] = [line for line in agent_log.read_text().splitlines() if "prepared -> taken" in line
               and f"(by job {job_id})" in line]
    assert any(f"(pid {pid})" in taken for pid in prepared_for(agent_log, job_id)), taken
    assert not [w for w in two["workers_history"] if w["state"] == "exited" and w["reason"] == "failed"], two
    assert {w["pid"] for w in live(one)} <= {w["pid"] for w in live(two)}, "the survivor was not restarted"
    assert all(uid_of(w["pid"]) == UID_BASE + job_id for w in live(two))
    assert alice_resize(platform, job_id, 1)
    shrunk = settled(platform, job_id, 1, two["generation"])
    platform.wait_for("steps after the shrink",
                      lambda: platform.job(job_id)["steps_done"] > shrunk["steps_done"] + 10, timeout_s=60)
    assert platform.api("alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
    kept = platform.wait_for("the artifacts", lambda: platform.job(job_id)["artifacts"], timeout_s=120)
    fixed_id = submit(platform, {**spec, "name": "confined-fixed", "min_workers": 2, "max_workers": 2,
                                 "virtual_workers": 2, "steps": kept["step"]})
    platform.wait_for("the fixed run's model", lambda: platform.job(fixed_id)["artifacts"], timeout_s=180)
    models = []
    for job in (job_id, fixed_id):
        reply = platform.api("alice").get(f"/api/jobs/{job}/artifacts/model.pt")
        assert reply.status_code == 200, reply.text
        (tmp_path / f"{job}.pt").write_bytes(reply.content)
        models.append(torch.load(tmp_path / f"{job}.pt", weights_only=True))
    resized, fixed = models
    assert resized.keys() == fixed.keys()
    assert [name for name in fixed if not torch.equal(resized[name], fixed[name])] == []


def prepared_for(agent_log: Path, job_id: int) -> list[int]:
    """The pids of the standbys the agent's log says it prepared for job `job_id` (earlier jobs'
    on the same platform are not its)."""
    lines = agent_log.read_text().splitlines()
    preparing = {int(m.group(1)) for line in lines
                 if (m := re.search(r"\(pid (\d+)\): warm -> preparing .*\(for job (\d+)\)", line))
                 and int(m.group(2)) == job_id}
    return sorted(pid for pid in preparing if any(f"(pid {pid}): preparing -> prepared" in line for line in lines))


def alice_resize(platform: Platform, job_id: int, workers: int) -> bool:
    return platform.api("alice").post(f"/api/jobs/{job_id}/resize", json={"workers": workers}).status_code == 200


# --- Redis: a job's worker is given a Redis user of its own job (portal.redis_users) ------------

PROBE = Path(__file__).parent / "tasks" / "redis_probe"
ENDLESS = 10_000_000


def submit_one(platform: Platform, spec: dict[str, Any]) -> int:
    reply = platform.api("alice").post("/api/jobs", json={"min_workers": 1, "max_workers": 1, **spec})
    assert reply.status_code == 201, reply.text
    return int(reply.json()["id"])


def training(platform: Platform, job_id: int, past: int = 0) -> dict[str, Any]:
    return platform.wait_for(
        f"job {job_id} training past step {past}",
        lambda: (job := platform.job(job_id))["state"] == "running" and job["steps_done"] > past and job,
        timeout_s=120,
    )


def probe_line(platform: Platform, job_id: int) -> dict[str, str]:
    def found() -> dict[str, str] | None:
        reply = platform.api("alice").get(f"/api/jobs/{job_id}/logs")
        lines = [entry["line"] for entry in reply.json()] if reply.status_code == 200 else []
        probed = [line.split("redis probe: ", 1)[1] for line in lines if "redis probe: " in line]
        return json.loads(probed[0]) if probed else None

    return platform.wait_for(f"job {job_id}'s probe", found, timeout_s=120)


def test_a_jobs_code_reaches_no_other_job_no_node_stream_and_no_celery_queue(platform: Platform) -> None:
    prefix, queue = platform.env["BUNGEE_REDIS_PREFIX"], platform.env["BUNGEE_CELERY_QUEUE"]
    victim = submit_one(platform, {"name": "victim", "workload": "digits-mlp", "steps": ENDLESS})
    before = training(platform, victim)
    alice = platform.api("alice")
    reply = alice.post("/api/code", files={"file": ("probe.tar.gz", tar_gz(directory_files(PROBE), top="probe/"),
                                                    "application/gzip")})
    assert reply.status_code == 201, reply.text
    stranger = submit_one(platform, {
        "name": "stranger", "code": reply.json()["digest"], "entrypoint": "task:RedisProbeTask", "steps": ENDLESS,
        "hyperparameters": {"batch_size": 8, "victim_key": f"{prefix}:job:{victim}:latest", "celery_queue": queue},
    })
    answers = probe_line(platform, stranger)
    assert len(answers) == 10, answers
    allowed = {what: answer for what, answer in answers.items() if "NoPermissionError" not in answer
               and "no permissions" not in answer}
    assert allowed == {}, f"the job's code could {allowed}"
    training(platform, stranger)
    after = training(platform, victim, before["steps_done"] + 10)
    assert after["generation"] == before["generation"] and after["restarts"] == 0, "the victim was disturbed"
    [node] = alice.get("/api/cluster").json()["nodes"]
    assert node["state"] == "online", node

    user = f"{prefix}:job:{stranger}"
    admin = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    assert admin.acl_getuser(user) is not None
    assert alice.post(f"/api/jobs/{stranger}/cancel").status_code == 200
    platform.wait_for("the stranger's Redis user removed", lambda: admin.acl_getuser(user) is None)
    assert alice.post(f"/api/jobs/{victim}/cancel").status_code == 200
