"""A stranger's job on the whole platform, with the Redis URL its worker is given: its code
(tests/tasks/redis_probe) tries to write a stop and a drain to its node's command stream, read
and write another job's keys, touch Celery's queue, list keys and make a user. Redis refuses
every try (NOPERM); the other job trains on, the node stays online, and the stranger's job trains
too. Once it ends, its Redis user is gone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.code_support import directory_files, tar_gz
from tests.platform import REDIS_URL, Platform, running_platform

pytestmark = pytest.mark.slow

PROBE = Path(__file__).parent / "tasks" / "redis_probe"
ENDLESS = 10_000_000


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("redis-users"), {"node-a": 2}) as platform:
        yield platform


def submit(platform: Platform, spec: dict[str, Any]) -> int:
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
    victim = submit(platform, {"name": "victim", "workload": "digits-mlp", "steps": ENDLESS})
    before = training(platform, victim)
    alice = platform.api("alice")
    reply = alice.post("/api/code", files={"file": ("probe.tar.gz", tar_gz(directory_files(PROBE), top="probe/"),
                                                    "application/gzip")})
    assert reply.status_code == 201, reply.text
    stranger = submit(platform, {
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
