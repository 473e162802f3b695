"""Bungee on a real Slurm (tests/slurm_support.py: munged, slurmctld and two slurmd of one slot
each, a low-priority pool partition that an owners partition preempts, GraceTime 20 s), with the
whole platform (API, Celery scheduler and the Slurm pool on its beat, real agents inside Slurm
jobs, real torch workers). The pool registers its agents with one pool token.

- A job (min 1, max 4) makes the pool submit two agent jobs; it trains on both. An owner's sbatch
  takes one agent's slot: Slurm preempts that agent job, its agent drains, and the job shrinks in
  place onto the other agent (the same process there; timeline reason "node preempted by
  Slurm"). The owner's job runs; when it ends the pool submits again and the job grows back.
  Cancelled, the job leaves the agents idle, and the pool cancels them.
- An agent job at its time limit (`--time`, `--signal=B:TERM@N`) drains before it ends: timeline
  reason "Slurm time limit".

Every step is trained once on exactly its batch (the workers record their samples). Figures
(the owner's sbatch to the job training without the node) are printed, not asserted."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from elastic.worker.data import SampleStream
from portal.slurm.config import pool_config
from portal.slurm.pool import agent_script, sbatch_options
from tests.platform import ROOT, Platform
from tests.slurm_support import SlurmCluster, pool_platform, slurm_cluster
from tests.test_integration_resize_in_place import ENDLESS, SEED, SPEC, live_rows, settled, steps_past
from tests.worker_support import DIGITS_SAMPLES, Ledger

pytestmark = pytest.mark.slow

BATCH = SPEC["hyperparameters"]["batch_size"]  # type: ignore[index]
AGENT_ARGS = "--standbys off --sim-pace 4 --drain-deadline 10 --stop-grace 5"
"""Within the pool partition's GraceTime (20 s): the drain, then the workers' save."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster(nodes=2, slots=1) as running:
        yield running


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("samples") / "samples.jsonl"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, cluster: SlurmCluster, record: Path) -> Iterator[Platform]:
    env = {
        "BUNGEE_RECORD_SAMPLES": str(record),
        "BUNGEE_CHECKPOINT_EVERY_S": "0.5",
        "BUNGEE_PROGRESS_EVERY_S": "0.2",
        "BUNGEE_POLICY": "fair",
        "BUNGEE_SLURM_GRACE_S": "20",
        "BUNGEE_SLURM_MAX_AGENTS": "2",
        # The time-limit test's own agent job, submitted by the test, not by the pool: a pool of
        # its own, bounded by the operator's setting.
        "BUNGEE_POOL_LIMITS": "limited:1:1",
    }
    with pool_platform(tmp_path_factory.mktemp("platform"), cluster, AGENT_ARGS, env) as running:
        yield running


def agent_jobs(cluster: SlurmCluster) -> dict[int, str]:
    return {job.id: job.state for job in cluster.jobs().values()
            if job.name == "bungee-agent" and job.state in ("PENDING", "RUNNING", "COMPLETING")}


@pytest.fixture(autouse=True)
def jobs_cancelled_after(platform: Platform) -> Iterator[None]:
    """Each test's jobs end with it, passed or failed: a failed test's endless job would keep the
    pool's agents busy and fail the next tests, which wait for an idle pool, for its sake."""
    yield
    with platform.api("alice") as alice:
        for job in alice.get("/api/jobs").json():
            if job["state"] not in ("succeeded", "failed", "cancelled"):
                alice.post(f"/api/jobs/{job['id']}/cancel")


def drain_log(platform: Platform) -> str:
    """What the pool's agents logged of their drains and of squeue: what a failed test shows."""
    agents = Path(platform.env["BUNGEE_SLURM_OUTPUT"]).parent
    return "\n".join(line for out in sorted(agents.glob("*.out")) for line in out.read_text(errors="replace").splitlines()
                     if "agent.drain" in line)


def nodes(platform: Platform) -> dict[str, str]:
    return {n["name"]: n["state"] for n in platform.api("alice").get("/api/nodes").json()}


def every_step_once(record: Path, job_id: int) -> int:
    return Ledger.read(record, job_id).check(SampleStream(DIGITS_SAMPLES, SEED), BATCH, virtual_workers=4)


def test_an_owner_preempts_an_agent_the_job_shrinks_in_place_and_grows_back(
    platform: Platform, cluster: SlurmCluster, record: Path
) -> None:
    alice = platform.api("alice")
    reply = alice.post("/api/jobs", json={**SPEC, "name": "on-slurm", "max_workers": 4, "steps": ENDLESS})
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    job = settled(platform, job_id, 2, timeout_s=240)
    assert all(name.startswith("slurm-") for name in nodes(platform)), nodes(platform)
    assert len(agent_jobs(cluster)) == 2, "two agents for a demand of four devices, the pool's most"
    job = steps_past(platform, job_id, job["steps_done"] + 10)

    # The owner takes one slot: Slurm preempts one agent job; its agent drains.
    submitted = time.time()
    owner = cluster.sbatch(f"--partition={cluster.owners}", f"--gres={cluster.gres}:1", wrap="sleep 25")
    shrunk = settled(platform, job_id, 1, job["generation"], timeout_s=120)
    landed = datetime.fromisoformat(shrunk["resizes"][-1]["completed_at"]).timestamp() - submitted
    survivor = live_rows(shrunk)[0]
    assert survivor["pid"] in {row["pid"] for row in live_rows(job)}, "the survivor trains on, not restarted"
    assert shrunk["resizes"][-1]["reason"] == "node preempted by Slurm", drain_log(platform)
    cluster.wait_for_state(owner, ["RUNNING", "COMPLETED"], timeout_s=60)
    preempted = [name for name, state in nodes(platform).items() if state == "drained"]
    assert len(preempted) == 1, nodes(platform)
    print(f"\nowner's sbatch -> the job trained without the preempted node: {landed:.2f} s")

    # The owner's job ends; the pool submits again; the job grows back onto the new agent.
    cluster.wait_for_state(owner, ["COMPLETED"], timeout_s=90)
    grown = settled(platform, job_id, 2, shrunk["generation"], timeout_s=240)
    assert survivor["pid"] in {row["pid"] for row in live_rows(grown)}
    steps_past(platform, job_id, grown["steps_done"] + 10)

    assert alice.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    platform.wait_for("the workers to stop", lambda: not live_rows(platform.job(job_id)), timeout_s=60)
    every_step_once(record, job_id)
    # Idle now: the pool cancels its agents, which leave; their nodes say why.
    platform.wait_for("the pool to cancel its idle agents", lambda: not agent_jobs(cluster), timeout_s=120)
    causes = {n["name"]: n["drain_cause"] for n in alice.get("/api/nodes").json() if n["state"] == "drained"}
    assert list(causes.values()).count("idle, given back to Slurm") == 2, causes


def test_an_agent_at_its_time_limit_drains_before_it_ends(
    platform: Platform, cluster: SlurmCluster, record: Path, tmp_path: Path
) -> None:
    """An agent job with a two-minute limit, signalled 40 s before it (Slurm may send --signal up
    to 60 s early, and checks on a 30 s cycle): the job trained on it moves off it with the
    reason "Slurm time limit", and the agent leaves before Slurm ends its job."""
    alice = platform.api("alice")
    platform.wait_for("no agent job left", lambda: not agent_jobs(cluster), timeout_s=120)
    # What the pool submits with a two-minute limit and a 40 s lead (its settings as the
    # platform's, but those two and a name of its own, so that the running pool leaves it be).
    # The pool registers only the agent jobs it submitted: this one, the test's, is of a pool of
    # its own ("limited"), which BUNGEE_POOL_LIMITS lets register one node of one device.
    token_file = tmp_path / "limited.token"
    token_file.write_text(
        platform.group.run("manage.py", "create_token", "alice", "--role", "pool", "--pool", "limited").strip() + "\n"
    )
    token_file.chmod(0o600)
    config = pool_config(settings.BUNGEE_SLURM.model_copy(update={
        "enabled": True, "pool": "limited", "partition": cluster.pool,
        "gres": f"{cluster.gres}:1", "time_limit": "2", "grace_s": 40, "job_name": "bungee-limited",
        "portal_url": platform.base_url, "token_file": str(token_file),
        "python": sys.executable, "workdir": str(ROOT), "output": str(tmp_path / "limited-%j.out"),
        "export": "ALL", "agent_args": AGENT_ARGS,
    }))
    limited = cluster.sbatch(*sbatch_options(config), script=agent_script(config))
    platform.wait_for("the limited agent's node", lambda: any(
        name.endswith(f"-job{limited}") and state == "online" for name, state in nodes(platform).items()), timeout_s=60)
    reply = alice.post("/api/jobs", json={**SPEC, "name": "limited", "max_workers": 1, "steps": ENDLESS})
    job_id = reply.json()["id"]
    platform.wait_for("the job on the limited agent", lambda: any(
        row["node"].endswith(f"-job{limited}") for row in live_rows(platform.job(job_id))), timeout_s=60)
    def time_limit_resize() -> bool:
        return any(r["reason"] == "Slurm time limit" for r in platform.job(job_id)["resizes"])

    started = time.monotonic()
    platform.wait_for("the job off the limited agent", time_limit_resize, timeout_s=150)
    print(f"\nthe limited agent drained {time.monotonic() - started:.0f} s after the job landed on it")
    platform.wait_for("the limited agent gone", lambda: not any(
        row["node"].endswith(f"-job{limited}") for row in live_rows(platform.job(job_id))), timeout_s=60)
    assert cluster.wait_for_state(limited, ["COMPLETED"], timeout_s=60) == "COMPLETED", "it left before its limit"
    assert alice.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    platform.wait_for("the workers to stop", lambda: not live_rows(platform.job(job_id)), timeout_s=60)


def test_a_plain_scancel_of_an_agent_job_drains_it_in_place(
    platform: Platform, cluster: SlurmCluster, record: Path
) -> None:
    """`scancel JOBID` (no --batch, no --signal) sends SIGTERM to every process of the agent's
    job, its workers included, and SIGKILL KillWait (5 s) later. Only the agent acts on it: it
    drains, the job shrinks in place onto the other agent (the same process there), no worker
    is reported failed, and the job's timeline says the job was cancelled (or, if squeue no longer
listed it at the TERM, a TERM it cannot place), not a preemption."""
    alice = platform.api("alice")
    platform.wait_for("no agent job left", lambda: not agent_jobs(cluster), timeout_s=120)
    reply = alice.post("/api/jobs", json={**SPEC, "name": "scancelled", "max_workers": 4, "steps": ENDLESS})
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    job = settled(platform, job_id, 2, timeout_s=240)
    job = steps_past(platform, job_id, job["steps_done"] + 10)
    rows = live_rows(job)
    cancelled = next(iter(agent_jobs(cluster)))
    leaving = [row for row in rows if row["node"].endswith(f"-job{cancelled}")]
    survivor = next(row for row in rows if row not in leaving)
    assert len(leaving) == 1, rows

    cluster.scancel(cancelled)

    def without_the_cancelled_node() -> dict[str, Any] | None:
        now = platform.job(job_id)
        live = live_rows(now)
        done = (now["generation"] > job["generation"] and now["resizes"][-1]["completed_at"] is not None
                and live and not any(row["node"] == leaving[0]["node"] for row in live))
        return now if done else None

    shrunk = platform.wait_for("the job training without the cancelled agent", without_the_cancelled_node, timeout_s=120)
    assert survivor["pid"] in {row["pid"] for row in live_rows(shrunk)}, "the survivor trains on, not restarted"
    assert shrunk["restarts"] == 0, shrunk
    assert shrunk["resizes"][-1]["reason"] in {
        "node's Slurm job cancelled", "Slurm TERM: preemption, limit or cancel"}, (shrunk["resizes"][-1], drain_log(platform))
    left = platform.wait_for("the leaver's exit", lambda: next(
        (row for row in platform.job(job_id)["workers_history"][::-1]
         if row["pid"] == leaving[0]["pid"] and row["state"] == "exited"), None), timeout_s=60)
    assert left["reason"] == "left", left
    steps_past(platform, job_id, shrunk["steps_done"] + 5)

    assert alice.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    ended = platform.wait_for("the workers to stop", lambda: not live_rows(j := platform.job(job_id)) and j, timeout_s=60)
    assert not [row for row in ended["workers_history"] if row["reason"] == "failed"], ended["workers_history"]
    every_step_once(record, job_id)
