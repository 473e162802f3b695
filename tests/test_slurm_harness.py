"""The real Slurm of tests/slurm_support.py: it comes up with its partitions and slots, a batch
job sees the environment an agent inside an allocation reads, and a batch job can run the
project's own interpreter from the project's root (as the pool's agent jobs do)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import slurm_support
from tests.slurm_support import PROJECT_ROOT, SlurmCluster, slurm, slurm_clean, slurm_cluster, wait_until

__all__ = ["slurm", "slurm_clean"]  # fixtures, used by name

pytestmark = pytest.mark.slow


def test_it_says_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_support.os, "geteuid", lambda: 1000)
    assert "needs root" in str(slurm_support.missing_requirements())
    monkeypatch.setattr(slurm_support.os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "missing munged, slurmctld, slurmd, sbatch" in str(slurm_support.missing_requirements())


def _output(cluster: SlurmCluster, job_id: int, path: Path) -> str:
    cluster.wait_for_state(job_id, ["COMPLETED", "FAILED", "CANCELLED"], timeout_s=60)
    assert cluster.state(job_id) == "COMPLETED", path.read_text() if path.exists() else "no output"
    return path.read_text()


def test_the_cluster_has_its_partitions_and_slots(slurm: SlurmCluster) -> None:
    partitions = slurm.run("sinfo", "--noheader", "--format=%P %a %t").stdout.split("\n")
    assert {line.split()[0].rstrip("*") for line in partitions if line} == {slurm.pool, slurm.owners}
    node = slurm.run("scontrol", "show", "node", slurm.nodes[0]).stdout
    assert f"Gres={slurm.gres}:{slurm.slots}" in node
    config = slurm.run("scontrol", "show", "config").stdout
    assert "preempt_send_user_signal" in config  # the pool job's TERM comes when preempted


def test_a_batch_job_sees_the_allocation_in_its_environment(slurm_clean: SlurmCluster) -> None:
    out = slurm_clean.directory / "env.out"
    job_id = slurm_clean.sbatch("-p", slurm_clean.pool, f"--gres={slurm_clean.gres}:2", f"--output={out}",
                                wrap="env")
    seen = dict(line.split("=", 1) for line in _output(slurm_clean, job_id, out).splitlines() if "=" in line)
    assert seen["SLURM_JOB_ID"] == str(job_id)
    assert seen["SLURMD_NODENAME"] == slurm_clean.nodes[0]
    assert seen["SLURM_JOB_PARTITION"] == slurm_clean.pool
    # A gres other than gpu is not in the job's environment (22.05): the pool passes the count.
    assert not any(slurm_clean.gres in value for key, value in seen.items() if key.startswith("SLURM_"))


def test_a_batch_job_runs_the_project_interpreter_from_the_project_root(slurm_clean: SlurmCluster) -> None:
    out = slurm_clean.directory / "python.out"
    job_id = slurm_clean.sbatch(
        "-p", slurm_clean.pool, f"--chdir={PROJECT_ROOT}", f"--output={out}",
        wrap=".venv/bin/python -c 'import os, agent, elastic; print(agent.__file__); print(os.getcwd())'",
    )
    module, cwd = _output(slurm_clean, job_id, out).split()
    assert Path(module) == PROJECT_ROOT / "agent" / "__init__.py"
    assert Path(cwd) == PROJECT_ROOT


def test_two_slurm_nodes_on_one_machine_each_run_an_allocation() -> None:
    with slurm_cluster(nodes=2, slots=2) as cluster:
        jobs = [cluster.sbatch("-p", cluster.pool, f"--gres={cluster.gres}:2", wrap="sleep 600") for _ in range(2)]
        for job_id in jobs:
            cluster.wait_for_state(job_id, ["RUNNING"], timeout_s=60)
        placed = cluster.run("squeue", "--noheader", "--format=%i %N").stdout.split("\n")
        assert sorted(line.split()[1] for line in placed if line) == cluster.nodes
        # A third does not fit: each node has two slots and both are taken.
        third = cluster.sbatch("-p", cluster.pool, f"--gres={cluster.gres}:1", wrap="true")
        wait_until(lambda: cluster.jobs()[third].reason not in ("", "None"), 30, "the third job held back")
        assert cluster.state(third) == "PENDING"
