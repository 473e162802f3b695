"""The Slurm pool acting when demand appears, on a real Slurm (tests/slurm_support.py: two nodes of
two slots, room for four agent jobs of one slot) with the whole platform (API, Celery, real
agents inside Slurm jobs), the pool's beat set to an hour: only the pass that a submission asks
for can explain an agent job.

- A job submitted with no agent in the cluster has its agent job sbatch'ed within seconds.
- A burst of submissions gives exactly one agent job per device wanted: the passes the burst
  asks for run one at a time and none submits again for demand already on its way.

The time from a submission to its sbatch is printed, not asserted (bench/slurm_on_demand.py
measures it against the beat alone)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.platform import Platform
from tests.slurm_support import SlurmCluster, pool_platform, slurm_cluster
from tests.test_integration_resize_in_place import ENDLESS, SPEC, detail
from tests.test_integration_slurm import AGENT_ARGS

pytestmark = pytest.mark.slow

BEAT_S = 3600
SBATCH_DEADLINE_S = 30.0
"""Far above what a pass takes (well under a second here), far below the beat."""
BURST = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster(nodes=2, slots=2) as running:
        yield running


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, cluster: SlurmCluster) -> Iterator[Platform]:
    env = {"BUNGEE_SLURM_EVERY_S": str(BEAT_S), "BUNGEE_SLURM_MAX_AGENTS": "4", "BUNGEE_SLURM_IDLE_S": "600"}
    with pool_platform(tmp_path_factory.mktemp("platform"), cluster, AGENT_ARGS, env) as running:
        yield running


def agent_jobs_ever(cluster: SlurmCluster) -> dict[int, str]:
    """Every agent job the controller knows of, ended ones included (for MinJobAge, 300 s)."""
    return {job.id: job.state for job in cluster.jobs().values() if job.name == "bungee-agent"}


def online_pool_nodes(platform: Platform) -> list[str]:
    nodes = platform.api("alice").get("/api/nodes").json()
    return [n["name"] for n in nodes if n["name"].startswith("slurm-") and n["state"] == "online"]


def submit(platform: Platform, name: str) -> int:
    reply = platform.api("alice").post(
        "/api/jobs", json={**SPEC, "name": name, "min_workers": 1, "max_workers": 1, "steps": ENDLESS})
    assert reply.status_code == 201, reply.text
    return int(reply.json()["id"])


def test_a_submission_gets_its_agent_job_without_the_beat(platform: Platform, cluster: SlurmCluster) -> None:
    assert agent_jobs_ever(cluster) == {}, "no demand, no agent job"
    submitted = time.monotonic()
    job_id = submit(platform, "first")
    platform.wait_for("an agent job sbatch'ed for the submission", lambda: agent_jobs_ever(cluster),
                      timeout_s=SBATCH_DEADLINE_S, every_s=0.05)
    print(f"\nsubmission -> agent job in squeue: {time.monotonic() - submitted:.2f} s (beat: {BEAT_S} s)")
    assert len(agent_jobs_ever(cluster)) == 1
    platform.wait_for("the job running on the pool's agent",
                      lambda: detail(platform, job_id)["state"] == "running", timeout_s=180)


def test_a_burst_of_submissions_gets_one_agent_job_per_device_wanted(
    platform: Platform, cluster: SlurmCluster
) -> None:
    before = agent_jobs_ever(cluster)
    assert len(before) == 1 and len(online_pool_nodes(platform)) == 1, "the first test's agent"
    jobs = [submit(platform, f"burst-{n}") for n in range(BURST)]
    platform.wait_for(f"{1 + BURST} pool nodes online", lambda: len(online_pool_nodes(platform)) == 1 + BURST,
                      timeout_s=180)
    ever = agent_jobs_ever(cluster)
    assert len(ever) == 1 + BURST, f"one agent job per device wanted, no duplicate: {ever}"
    for job_id in jobs:
        assert platform.api("alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
