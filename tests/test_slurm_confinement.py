"""A stranger's task on a Slurm pool's agent (a real Slurm: tests/slurm_support.py; the pool
submits the agent job, which registers with the pool token): confined as on a bare agent, it
reaches neither the agent's token, memory nor state, nor the pool's token file, and trains. The
agent job runs as the user the pool submits as (root here: --isolation uid)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.code_support import RINGS, directory_files
from tests.platform import Platform
from tests.slurm_support import SlurmCluster, pool_platform, slurm_cluster
from tests.test_job_confinement import ENDED, HOSTILE, RINGS_SPEC, UID_BASE, probe_of, submit, upload

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="confining jobs needs an agent running as root"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster(nodes=1, slots=1) as running:
        yield running


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, cluster: SlurmCluster) -> Iterator[Platform]:
    env = {"BUNGEE_PROGRESS_EVERY_S": "0.2", "BUNGEE_POLICY": "fair", "BUNGEE_AGENT_ISOLATION": "uid",
           "BUNGEE_AGENT_JOB_UID_BASE": str(UID_BASE), "BUNGEE_SLURM_MAX_AGENTS": "1"}
    work = tmp_path_factory.mktemp("platform")
    with pool_platform(work, cluster, "--standbys off", env) as running:
        running.pool_token_file = work / "pool.token"  # type: ignore[attr-defined]
        yield running


def test_a_jobs_code_on_a_slurm_pool_agent_reaches_nothing_of_the_platform(platform: Platform) -> None:
    files = {**directory_files(RINGS), **directory_files(HOSTILE)}
    job_id = submit(platform, {**RINGS_SPEC, "name": "hostile-on-slurm", "code": upload(platform, files),
                               "entrypoint": "hostile:HostileRings", "max_workers": 1, "steps": 30})
    platform.wait_for("the job's end", lambda: platform.job(job_id)["state"] in ENDED, timeout_s=240)
    probe = probe_of(platform, job_id)
    node = platform.job(job_id)["workers_history"][0]["node"]
    assert node.startswith("slurm-"), node
    assert probe["uid"] == UID_BASE + job_id and probe["agents_seen"] >= 1, probe
    for key, result in probe.items():
        if key.startswith("agent ") or key == "token file":
            assert result.startswith("refused"), (key, result)
    assert probe["environs holding the token variable"] == [], probe
    assert probe["workers' records"].startswith("refused") and probe["own code"].startswith("listed"), probe
    pool_token = Path(platform.pool_token_file)  # type: ignore[attr-defined]
    assert pool_token.read_text().strip() not in "".join(platform.api("alice").get(
        f"/api/jobs/{job_id}/logs").text), "the pool's token is nowhere in the job's log"
