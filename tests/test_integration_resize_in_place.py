"""In-place resizing through the whole platform (API, Celery scheduler, two real agents, real torch
workers, joiners from warm standbys as the agent runs by default): 2 -> 3 -> 1 -> 2 workers
during a run, with the survivors' pids unchanged; a survivor SIGKILLed mid-step; every worker killed at once; a user's own
code, uploaded through the API, resized in place, and the same code with a bug, which fails the job
at once. Each ends with every step trained once on exactly its batch (the workers record their
samples), and the API showing the allocation the workers really have. Joiners caught while
warming up: test_integration_warm_up."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch

from elastic.worker.data import SampleStream
from tests.code_support import RINGS, directory_files, evaluate_without_bungee, tar_gz
from tests.environment_support import TINY, tiny_wheelhouse
from tests.membership_support import SilentListener
from tests.platform import FAST_PROGRESS_ENV, Platform, running_platform
from tests.test_cli import bungee
from tests.worker_support import DIGITS_SAMPLES, Ledger

pytestmark = pytest.mark.slow

BATCH = 32
SEED = 4
SPEC = {
    "name": "in-place",
    "workload": "digits-mlp",
    "min_workers": 1,
    "max_workers": 3,
    "seed": SEED,
    "hyperparameters": {"batch_size": BATCH, "hidden": 128},
}
ENDLESS = 10_000_000
ENDED = ("succeeded", "failed", "cancelled")
RING_SAMPLES = 600


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("samples") / "samples.jsonl"


def runtime_env(record: Path) -> dict[str, str]:
    """The settings of a platform that tests the elastic runtime: the fair policy, a periodic
    checkpoint every 0.5 s, FAST_PROGRESS_ENV, and every trained sample recorded to `record`."""
    return {
        "BUNGEE_RECORD_SAMPLES": str(record),
        "BUNGEE_CHECKPOINT_EVERY_S": "0.5",
        **FAST_PROGRESS_ENV,
        # These tests are about the runtime: with the fair policy no straggler or locality move
        # adds a generation of its own (the bungee policy's moves have their own tests).
        "BUNGEE_POLICY": "fair",
    }


@contextmanager
def inplace_platform(tmp_path_factory: pytest.TempPathFactory, record: Path, extra_env: dict[str, str]) -> Iterator[Platform]:
    """Two agents (node-a with 2 devices, node-b with 1) on the runtime_env settings."""
    env = {**runtime_env(record), **extra_env}
    with running_platform(tmp_path_factory.mktemp("platform"), {"node-a": 2, "node-b": 1}, env) as running:
        alice = running.api("alice")
        running.wait_for(
            "three devices",
            lambda: sum(len(n["devices"]) for n in alice.get("/api/cluster").json()["nodes"]) == 3,
        )
        yield running


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, record: Path) -> Any:
    # With warm standbys, as the agent runs by default: joiners start from them (the tests of a
    # joiner caught warming up, which need cold ones, are in test_integration_warm_up). The
    # agents build jobs' environments from a wheelhouse, offline.
    wheelhouse = tiny_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))
    with inplace_platform(tmp_path_factory, record, {"BUNGEE_ENV_FIND_LINKS": str(wheelhouse), "UV_OFFLINE": "1"}) as running:
        yield running


@pytest.fixture(autouse=True)
def no_job_left(platform: Platform) -> Any:
    """Cancels whatever a test left running (a failed one), so the next starts on free devices."""
    yield
    alice = platform.api("alice")
    for job in alice.get("/api/jobs").json():
        if job.get("state") not in ENDED:
            alice.post(f"/api/jobs/{job['id']}/cancel")


def detail(platform: Platform, job_id: int) -> dict[str, Any]:
    return platform.job(job_id)


def live_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in job["workers_history"] if w["state"] == "running"]


def settled(
    platform: Platform, job_id: int, workers: int, after_generation: int = 0, timeout_s: float = 120
) -> dict[str, Any]:
    """Waits until the job runs on `workers` workers of a generation newer than `after_generation`
    that formed, with no resize pending and no leaver left; returns the job."""

    def check() -> dict[str, Any] | None:
        job = detail(platform, job_id)
        rows = live_rows(job)
        done = (
            job["state"] == "running"
            and job["workers"] == workers
            and job["generation"] > after_generation
            and job["resizes"][-1]["completed_at"] is not None
            and len(rows) == workers
            and all(row["generation"] == job["generation"] for row in rows)
        )
        return job if done else None

    try:
        return platform.wait_for(f"job {job_id} settled on {workers} workers", check, timeout_s=timeout_s)
    except AssertionError as err:
        raise AssertionError(f"{err}\n--- the job when it did not settle\n{job_story(platform, job_id)}") from None


def job_story(platform: Platform, job_id: int) -> str:
    """What the job's record and log say, for a failure's message: its state, its workers, its
    last resizes and the last lines of its log."""
    job = detail(platform, job_id)
    workers = [{k: w.get(k) for k in ("generation", "rank", "node", "device_index", "pid", "state")} for w in job["workers_history"][-8:]]
    lines = logs(platform, job_id)[-60:]
    return (f"state {job['state']}, generation {job['generation']}, workers {job['workers']}, steps {job['steps_done']}\n"
            f"workers: {workers}\nresizes: {job['resizes'][-2:]}\nlog:\n" + "\n".join(lines))


def assert_true_allocation(job: dict[str, Any]) -> None:
    """The devices the API says the job holds are those its running workers are on."""
    held = sorted((a["node"], a["device_index"], a["rank"]) for a in job["allocations"])
    running = sorted((w["node"], w["device_index"], w["rank"]) for w in live_rows(job))
    assert held == running, (held, running)


def submit(platform: Platform, workers: int, spec: dict[str, Any] = SPEC) -> int:
    alice = platform.api("alice")
    reply = alice.post("/api/jobs", json={"steps": ENDLESS, **spec})
    assert reply.status_code == 201, reply.text
    job_id: int = reply.json()["id"]
    assert alice.post(f"/api/jobs/{job_id}/resize", json={"workers": workers}).status_code == 200
    return job_id


def pin(platform: Platform, job_id: int, workers: int) -> None:
    reply = platform.api("alice").post(f"/api/jobs/{job_id}/resize", json={"workers": workers})
    assert reply.status_code == 200, reply.text


def steps_past(platform: Platform, job_id: int, step: int) -> dict[str, Any]:
    return platform.wait_for(
        f"job {job_id} past step {step}",
        lambda: (j := detail(platform, job_id))["steps_done"] > step and j,
        timeout_s=60,
    )


def cancel(platform: Platform, job_id: int) -> dict[str, Any]:
    assert platform.api("alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
    return platform.wait_for(
        "the workers to stop", lambda: not live_rows(j := detail(platform, job_id)) and j
    )


def logs(platform: Platform, job_id: int) -> list[str]:
    reply = platform.api("alice").get(f"/api/jobs/{job_id}/logs")
    assert reply.status_code == 200, f"job {job_id}'s logs: HTTP {reply.status_code}: {reply.text[:500]}"
    return [entry["line"] for entry in reply.json()]


def loss_fell(platform: Platform, job_id: int) -> bool:
    metrics = platform.api("alice").get(f"/api/jobs/{job_id}/metrics").json()["points"]
    return bool(metrics) and metrics[-1]["loss"] < metrics[0]["loss"] / 2


def pids_by_generation(job: dict[str, Any]) -> dict[int, set[int]]:
    pids: dict[int, set[int]] = {}
    for row in job["workers_history"]:
        if row["state"] != "exited" or row["reason"] != "failed":
            pids.setdefault(row["generation"], set()).add(row["pid"])
    return pids


def test_2_3_1_2_with_survivors_never_restarted(platform: Platform, record: Path) -> None:
    job_id = submit(platform, 2)
    job = settled(platform, job_id, 2)
    sizes = []
    for workers in (3, 1, 2):
        steps_past(platform, job_id, job["steps_done"])
        before = job
        pin(platform, job_id, workers)
        job = settled(platform, job_id, workers, before["generation"])
        assert_true_allocation(job)
        sizes.append((before["workers"], workers))
        # The survivors are the same processes: their pids carry over into the new generation.
        survivors = pids_by_generation(job)[before["generation"]] & pids_by_generation(job)[job["generation"]]
        assert len(survivors) == min(before["workers"], workers), job["workers_history"]
    steps_past(platform, job_id, job["steps_done"] + 100)
    done = cancel(platform, job_id)
    assert done["allocations"] == []
    resizes = done["resizes"]
    assert (
        [(r["workers_before"], r["workers_after"]) for r in resizes[-3:]] == sizes == [(2, 3), (3, 1), (1, 2)]
    )
    for resize in resizes[-3:]:
        assert resize["pause_s"] is not None and resize["pause_s"] >= 0 and resize["phases"]
        assert len(resize["members_after"]) == resize["workers_after"]
    assert (
        resizes[-3]["bytes_moved"] > 0 and resizes[-2]["bytes_moved"] == 0 and resizes[-1]["bytes_moved"] > 0
    )
    assert not [line for line in logs(platform, job_id) if "checkpoint" in line], "nothing went through disk"
    # Every step once, up to the one all stopped after, whose count the portal shows.
    steps = Ledger.read(record, job_id).check(SampleStream(DIGITS_SAMPLES, SEED), BATCH, virtual_workers=3)
    assert steps == done["steps_done"] and f"stopping at step {steps}" in logs(platform, job_id)
    assert loss_fell(platform, job_id)
    platform.wait_for(
        "devices freed",
        lambda: all(
            d["holder"] == "free"
            for n in platform.api("alice").get("/api/cluster").json()["nodes"]
            for d in n["devices"]
        ),
    )


def test_a_survivor_killed_mid_step(platform: Platform, record: Path) -> None:
    job_id = submit(platform, 3)
    job = settled(platform, job_id, 3)
    job = steps_past(platform, job_id, job["steps_done"] + 100)
    victim = next(row for row in live_rows(job) if row["rank"] == 1)
    others = {row["pid"] for row in live_rows(job)} - {victim["pid"]}
    os.kill(victim["pid"], signal.SIGKILL)
    # The others notice at once, go on without it, and the scheduler gives the device back: in
    # two generations (without it, then with a new worker), or in one when the device is free
    # again by the time it plans (seen in CI: a warm standby took it in the next generation).
    job = settled(platform, job_id, 3, job["generation"])
    assert job["restarts"] == 1 and others <= {row["pid"] for row in live_rows(job)}
    assert_true_allocation(job)
    assert any(line.startswith("lost a peer") for line in logs(platform, job_id))
    steps_past(platform, job_id, job["steps_done"])
    stopped = cancel(platform, job_id)
    steps = Ledger.read(record, job_id).check(
        SampleStream(DIGITS_SAMPLES, SEED), BATCH, partial=1, virtual_workers=3
    )
    assert steps >= stopped["steps_done"]
    assert loss_fell(platform, job_id)


def test_a_port_where_another_program_listens_costs_nothing(platform: Platform, record: Path) -> None:
    """CI once drew RabbitMQ's port for a generation: rank 0 could not bind it, and the other
    members, finding it accepting, hung in torch's store client until the next generation had
    expired too. Now rank 0 makes its store at a port the kernel picks and tells the members
    that one: the generation forms as if nothing happened, with its survivors, and no worker
    ever connects to the other program."""
    job_id = submit(platform, 2)
    job = settled(platform, job_id, 2)
    survivors = {row["pid"] for row in live_rows(job)}
    squatted_generation = job["generation"] + 1
    # The port the portal gives that generation (portal.jobs.lifecycle._free_port, no other
    # job active); the log below shows that rank 0 really met the squatter there.
    port = int(platform.env["BUNGEE_MASTER_PORT_BASE"]) + (job_id * 7 + squatted_generation) % 5000
    squatter = SilentListener(port)
    try:
        pin(platform, job_id, 3)
        job = settled(platform, job_id, 3, squatted_generation - 1)
    finally:
        squatter.close()
    assert squatter.accepted == [], "a worker connected to the other program"
    assert job["generation"] == squatted_generation, job_story(platform, job_id)
    assert survivors <= {row["pid"] for row in live_rows(job)}, "a survivor was restarted"
    lines = logs(platform, job_id)
    said = f"generation {squatted_generation}: port {port} is taken by another program; the store listens at"
    assert any(said in line for line in lines), "\n".join(lines[-30:])
    assert_true_allocation(job)
    steps_past(platform, job_id, job["steps_done"] + 100)
    stopped = cancel(platform, job_id)
    steps = Ledger.read(record, job_id).check(
        SampleStream(DIGITS_SAMPLES, SEED), BATCH, partial=1, virtual_workers=3
    )
    assert steps >= stopped["steps_done"]


def test_every_worker_killed_resumes_from_the_checkpoint(platform: Platform, record: Path) -> None:
    job_id = submit(platform, 2)
    job = settled(platform, job_id, 2)
    job = steps_past(platform, job_id, job["steps_done"] + 300)
    killed = job["generation"]
    for row in live_rows(job):
        os.kill(row["pid"], signal.SIGKILL)
    resumed_line = platform.wait_for(
        "the resume",
        lambda: [
            line for line in logs(platform, job_id) if line.startswith("resumed from the periodic checkpoint")
        ],
    )[0]
    resumed = int(re.search(r" at step (\d+) of ", resumed_line).group(1))  # type: ignore[union-attr]
    job = settled(platform, job_id, 2, job["generation"])
    assert_true_allocation(job)
    steps_past(platform, job_id, job["steps_done"] + 200)
    cancel(platform, job_id)
    ledger = Ledger.read_all(record, job_id)
    again = Ledger({step: records[-1] for step, records in ledger.items()})
    again.check(SampleStream(DIGITS_SAMPLES, SEED), BATCH, partial=1, virtual_workers=3)
    # Steps the killed generation trained past its checkpoint ran again, and only those: how many
    # depends on when the last periodic save landed (after every step, on a slow machine).
    for step, records in ledger.items():
        before_kill = [record for record in records if record.generation <= killed]
        again = step >= resumed and bool(before_kill)
        assert len(records) == (2 if again else 1), (step, resumed, records)
    assert resumed <= max(step for step, records in ledger.items() if records[0].generation <= killed) + 1
    assert loss_fell(platform, job_id)
    # Reported steps past the checkpoint come back as a rollback, not as a line going back.
    curve = platform.api("alice").get(f"/api/jobs/{job_id}/metrics").json()
    for rollback in curve["rollbacks"]:
        assert rollback["to_step"] < rollback["at_step_from"], rollback
    for segment in {p["segment"] for p in curve["points"]}:
        steps = [p["step"] for p in curve["points"] if p["segment"] == segment]
        assert steps == sorted(set(steps)), f"steps went back inside segment {segment}"


def test_uploaded_code_resizes_in_place_and_a_bug_in_it_fails_the_job(
    platform: Platform, record: Path, tmp_path: Path
) -> None:
    alice = platform.api("alice")
    archive = tar_gz(directory_files(RINGS), top="rings/")
    reply = alice.post("/api/code", files={"file": ("rings.tar.gz", archive, "application/gzip")})
    assert reply.status_code == 201, reply.text
    spec = {
        "name": "rings",
        "code": reply.json()["digest"],
        "entrypoint": "task:RingsTask",
        "min_workers": 1,
        "max_workers": 3,
        "seed": SEED,
        "hyperparameters": {"batch_size": 24, "hidden": 16},
    }
    job_id = submit(platform, 2, spec)
    two = settled(platform, job_id, 2)
    first = {row["pid"] for row in live_rows(two)}
    pin(platform, job_id, 3)
    grown = settled(platform, job_id, 3, two["generation"])
    assert first <= {row["pid"] for row in live_rows(grown)}, "the survivors were not restarted"
    # A worker SIGKILLed mid-training: the others go on without it, and the pin brings a new
    # worker back.
    victim = next(row for row in live_rows(grown) if row["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    healed = settled(platform, job_id, 3, grown["generation"] + 1)
    pin(platform, job_id, 1)
    shrunk = settled(platform, job_id, 1, healed["generation"])
    steps_past(platform, job_id, shrunk["steps_done"] + 20)
    stopped = cancel(platform, job_id)
    trained = Ledger.read(record, job_id).check(
        SampleStream(RING_SAMPLES, SEED), 24, partial=1, virtual_workers=3
    )
    assert trained >= stopped["steps_done"] and stopped["restarts"] == 1
    # The model out: rank 0's agent hands it over; it downloads through the API and, loaded
    # without Bungee into the task's own class, gives the manifest's evaluation exactly.
    kept = platform.wait_for("the artifacts", lambda: detail(platform, job_id)["artifacts"])
    assert kept["ended"] == "stopped" and kept["step"] == stopped["steps_done"]
    for name in ("model.pt", "manifest.json"):
        reply = alice.get(f"/api/jobs/{job_id}/artifacts/{name}")
        assert reply.status_code == 200, reply.text
        (tmp_path / name).write_bytes(reply.content)
    metrics = json.loads((tmp_path / "manifest.json").read_text())["final"]["metrics"]
    assert evaluate_without_bungee(tmp_path / "model.pt", tmp_path / "manifest.json") == metrics
    assert platform.api("bob").get(f"/api/jobs/{job_id}/artifacts/model.pt").status_code == 403

    # The same task on a fixed 2 workers for as many steps gives the same model, bit for bit
    # (with the same 3 virtual workers: by default a job has max_workers of them).
    fixed = {**spec, "name": "rings-fixed", "min_workers": 2, "max_workers": 2, "virtual_workers": 3,
             "steps": kept["step"]}
    reply = alice.post("/api/jobs", json=fixed)
    assert reply.status_code == 201, reply.text
    fixed_id = reply.json()["id"]
    platform.wait_for("the fixed run's model", lambda: detail(platform, fixed_id)["artifacts"], timeout_s=180)
    assert detail(platform, fixed_id)["workers_history"] and all(
        row["generation"] == 1 for row in detail(platform, fixed_id)["workers_history"]
    ), "the fixed run was never resized"
    reply = alice.get(f"/api/jobs/{fixed_id}/artifacts/model.pt")
    (tmp_path / "fixed.pt").write_bytes(reply.content)
    resized_model = torch.load(tmp_path / "model.pt", weights_only=True)
    fixed_model = torch.load(tmp_path / "fixed.pt", weights_only=True)
    assert resized_model.keys() == fixed_model.keys()
    assert [name for name in fixed_model if not torch.equal(resized_model[name], fixed_model[name])] == []

    # A job that starts from that model (init_from, its owner's only): at a negligible rate, one
    # step leaves its weights where the first job's ended, far from any fresh initialisation.
    refused = platform.api("bob").post("/api/jobs", json={**SPEC, "steps": 5, "init_from": job_id})
    assert refused.status_code == 400 and refused.json()["error"]["fields"][0]["field"] == "init_from", refused.text
    tuned = {**spec, "name": "rings-tuned", "steps": 1, "init_from": job_id, "hyperparameters": {
        **spec["hyperparameters"], "lr": 1e-9}}
    reply = alice.post("/api/jobs", json=tuned)
    assert reply.status_code == 201, reply.text
    tuned_id = reply.json()["id"]
    platform.wait_for("the tuned job's model", lambda: detail(platform, tuned_id)["artifacts"])
    reply = alice.get(f"/api/jobs/{tuned_id}/artifacts/model.pt")
    assert reply.status_code == 200, reply.text
    (tmp_path / "tuned.pt").write_bytes(reply.content)
    before = torch.load(tmp_path / "model.pt", weights_only=True)
    after = torch.load(tmp_path / "tuned.pt", weights_only=True)
    assert torch.allclose(after["0.weight"], before["0.weight"], atol=1e-6), "it did not start from the model"

    # The same code with a bug at the fifth call of loss (each worker counts its own calls, so
    # every worker that reaches it fails; a peer may first wait in that step's all-reduce): the
    # job fails at once with the traceback, and nothing restarts it.
    broken = {**spec, "name": "rings-bug", "steps": 1000, "hyperparameters": {**spec["hyperparameters"], "fail_at_call": 5}}
    job_id = submit(platform, 2, broken)
    failed = platform.wait_for("the job to fail", lambda: (j := detail(platform, job_id))["state"] == "failed" and j)
    assert "the job's code failed on worker rank" in failed["message"] and failed["restarts"] == 0
    assert "raised ValueError: the task's own bug, at call 5." in failed["message"], "the error, not only where it is"
    found = [entry for entry in logs(platform, job_id) if entry.startswith("the job's code failed")]
    assert found, logs(platform, job_id)
    for line in found:
        assert "raised ValueError: the task's own bug, at call 5" in line and 'File "task.py", line' in line
    ended = platform.wait_for("its workers to stop", lambda: not live_rows(j := detail(platform, job_id)) and j)
    assert ended["generation"] == failed["generation"], "no generation after the failure"
    assert {row["reason"] for row in ended["workers_history"]} <= {"user_error", "stopped"}
    # What it trained before the bug is kept: the state of its last completed step.
    kept = platform.wait_for("the failed job's artifacts", lambda: detail(platform, job_id)["artifacts"])
    assert kept["ended"] == "failed" and kept["step"] >= 1, kept


TINY_STEPS = 12
TINY_TASK = f"""import {TINY}
from task import RingsTask

assert {TINY}.VERSION == "2.0", {TINY}.VERSION


class TinyRingsTask(RingsTask):
    pass
""".encode()


def test_code_with_its_own_requirements_trains_in_its_environment_on_both_nodes(
    platform: Platform, tmp_path: Path
) -> None:
    """A task that imports a package of its own (from the agents' wheelhouse, offline): each
    node builds the environment once, the workers of both nodes train in it, a second job with
    the same requirements finds it in the cache and, in strict mode, ends bitwise where the
    first did; a requirement no wheelhouse has fails the next job at once, in uv's words."""
    alice = platform.api("alice")
    files = {**directory_files(RINGS), "requirements.txt": f"{TINY}==2.0\n".encode(), "tiny_task.py": TINY_TASK}
    reply = alice.post("/api/code", files={"file": ("tiny.tar.gz", tar_gz(files), "application/gzip")})
    assert reply.status_code == 201, reply.text
    spec = {"name": "tiny", "code": reply.json()["digest"], "entrypoint": "tiny_task:TinyRingsTask", "min_workers": 1,
            "max_workers": 3, "seed": SEED, "hyperparameters": {"batch_size": 24, "hidden": 16}}
    three = {**spec, "min_workers": 3, "max_workers": 3, "steps": TINY_STEPS}
    reply = alice.post("/api/jobs", json=three)
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    # Rank 0 hands its model over before it exits, and the job succeeds on that exit's report:
    # the artifacts may be listed while the job still runs.
    done = platform.wait_for("the job on 3 workers to end, its model kept",
                             lambda: (j := detail(platform, job_id))["state"] in ENDED and j["artifacts"] and j, timeout_s=180)
    assert done["state"] == "succeeded" and {row["node"] for row in done["workers_history"]} == {"node-a", "node-b"}
    built = [line for line in logs(platform, job_id) if line.startswith("built the environment")]
    assert len(built) == 2, logs(platform, job_id)  # once per node; the task's import proves the workers use it
    (tmp_path / "three.pt").write_bytes(alice.get(f"/api/jobs/{job_id}/artifacts/model.pt").content)
    # What it was trained with is on record: the job's detail (from the node that built the
    # environment), its manifest (rank 0's), `bungee status`, and the lock `bungee download` writes.
    own = done["own_packages"]
    assert own is not None and own["node"] in {"node-a", "node-b"} and re.fullmatch(r"[0-9a-f]{64}", own["digest"])
    assert (own["source"], own["requirements"], own["packages"]) == ("requirements.txt", [f"{TINY}==2.0"],
                                                                      {TINY: "2.0"})
    trained_with = alice.get(f"/api/jobs/{job_id}/artifacts").json()["manifest"]["environment"]
    assert (trained_with["torch"], trained_with["torch_cuda"]) == (torch.__version__, torch.version.cuda)
    assert trained_with["own_packages"]["packages"] == {TINY: "2.0"}
    assert trained_with["own_packages"]["digest"] == own["digest"], "one interpreter and packages: one digest"
    home = tmp_path / "cli"
    assert bungee(home, "login", platform.base_url, "--token", platform.tokens["alice"]).returncode == 0
    status = bungee(home, "status", str(job_id))
    assert status.returncode == 0 and f"{TINY}==2.0 (from requirements.txt; environment {own['digest'][:12]}" \
        in status.stdout, status.stdout
    downloaded = bungee(home, "download", str(job_id), "-d", str(tmp_path / "download"))
    assert downloaded.returncode == 0, downloaded.stderr
    lock = (tmp_path / "download" / "requirements.lock").read_text().splitlines()
    assert [line for line in lock if not line.startswith("#")] == [f"{TINY}==2.0"]
    assert any(f"torch {torch.__version__}" in line for line in lock), lock

    fixed = {**spec, "name": "tiny-fixed", "min_workers": 1, "max_workers": 1, "virtual_workers": 3,
             "steps": TINY_STEPS}
    reply = alice.post("/api/jobs", json=fixed)
    assert reply.status_code == 201, reply.text
    fixed_id = reply.json()["id"]
    platform.wait_for("the fixed run's model", lambda: detail(platform, fixed_id)["artifacts"], timeout_s=180)
    lines = logs(platform, fixed_id)
    assert any("is in this node's cache" in line for line in lines), lines
    assert not any(line.startswith("built the environment") for line in lines), "no second build"
    (tmp_path / "fixed.pt").write_bytes(alice.get(f"/api/jobs/{fixed_id}/artifacts/model.pt").content)
    resized_model = torch.load(tmp_path / "three.pt", weights_only=True)
    fixed_model = torch.load(tmp_path / "fixed.pt", weights_only=True)
    assert [name for name in fixed_model if not torch.equal(resized_model[name], fixed_model[name])] == []

    files["requirements.txt"] = f"{TINY}==3.0\n".encode()
    reply = alice.post("/api/code", files={"file": ("tiny.tar.gz", tar_gz(files), "application/gzip")})
    assert reply.status_code == 201, reply.text
    job_id = submit(platform, 1, {**spec, "name": "tiny-unresolvable", "code": reply.json()["digest"]})
    failed = platform.wait_for("the job to fail", lambda: (j := detail(platform, job_id))["state"] == "failed" and j)
    assert "No solution found when resolving dependencies" in failed["message"] and failed["restarts"] == 0, failed
    assert any(f"{TINY}==3.0" in line for line in logs(platform, job_id)), logs(platform, job_id)

    # A module that neither the node nor the job's environment has: the message says what to add.
    files.update({"requirements.txt": f"{TINY}==2.0\n".encode(), "missing_task.py": TINY_TASK.replace(
        b"from task import", b"import bungee_nowhere\nfrom task import")})
    reply = alice.post("/api/code", files={"file": ("tiny.tar.gz", tar_gz(files), "application/gzip")})
    assert reply.status_code == 201, reply.text
    job_id = submit(platform, 1, {**spec, "name": "tiny-missing", "code": reply.json()["digest"],
                                  "entrypoint": "missing_task:TinyRingsTask"})
    failed = platform.wait_for("the job to fail", lambda: (j := detail(platform, job_id))["state"] == "failed" and j)
    assert "No module named 'bungee_nowhere'. 'bungee_nowhere' is installed neither on the node nor in the job's " \
           "packages: add the package that provides 'bungee_nowhere' to the requirements.txt beside the code" \
        in failed["message"], failed["message"]


def test_no_password_or_token_in_any_log(platform: Platform) -> None:
    """After every test of this module (it runs last): the platform's logs, the agents' worker
    outputs and records hold no user's password, no user token and no agent token. The token
    files the agents read are the one place an agent token is written."""
    redis_password = urlsplit(platform.env["REDIS_URL"]).password
    assert redis_password, "the platform's Redis asks for no password"
    secrets = [*platform.tokens.values(), "alice-pass", "bob-pass", platform.env["SECRET_KEY"], redis_password]
    root = platform.group.log_dir.parent
    searched = 0
    for path in root.rglob("*"):
        if not path.is_file() or path.suffix in (".token", ".pt") or path.stat().st_size > 64 * 1024**2:
            continue
        text = path.read_bytes()
        searched += 1
        for secret in secrets:
            assert secret.encode() not in text, f"a secret ({secret[:6]}…) is in {path.relative_to(root)}"
    assert searched >= 5, f"only {searched} files searched under {root}"
