"""How the real Slurm of the suite preempts Bungee's pool, with plain shell batch jobs: what an
agent job inside it will live through. An owners' job that needs a pool job's slots preempts it;
the pool job's batch shell hears SIGTERM at once (`--signal=B:TERM@N` with the controller's
preempt_send_user_signal) and has the partition's GraceTime to leave; a job that leaves in its
grace is over (COMPLETED, not requeued: the pool submits again for the demand left); one that is
still there when the grace ends is killed and, under PreemptMode=REQUEUE, queued again, and it
runs again once the owners' job is gone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm_support import SlurmCluster, slurm_cluster, wait_until

pytestmark = pytest.mark.slow

GRACE_S = 5
SIGNAL = "--signal=B:TERM@60"
WAIT_S = 90.0
"""Bound on a preemption's steps: the grace ends on the controller's time-limit pass (every 30 s
in 22.05), then KillWait (5 s), then a requeued job waits cred_expire (10 s)."""

LEAVES_ON_TERM = """#!/bin/bash
marks={marks}
trap 'date +%s.%N > $marks/$SLURM_JOB_ID.t && mv $marks/$SLURM_JOB_ID.t $marks/$SLURM_JOB_ID.term; exit 0' TERM
date +%s.%N > $marks/$SLURM_JOB_ID.start.${{SLURM_RESTART_COUNT:-0}}
sleep 600 & wait $!
"""
STAYS_ON_TERM = """#!/bin/bash
marks={marks}
trap 'date +%s.%N >> $marks/$SLURM_JOB_ID.term' TERM
date +%s.%N > $marks/$SLURM_JOB_ID.start.${{SLURM_RESTART_COUNT:-0}}
while true; do sleep 600 & wait $!; done
"""
OWNER = """#!/bin/bash
marks={marks}
date +%s.%N > $marks/owner-$SLURM_JOB_ID.t && mv $marks/owner-$SLURM_JOB_ID.t $marks/owner-$SLURM_JOB_ID.start
for _ in $(seq 3000); do [ -e $marks/release ] && exit 0; sleep 0.2; done
exit 1
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster(preempt_mode="REQUEUE", grace_s=GRACE_S) as running:
        yield running


@pytest.fixture
def marks(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Path]:
    tmp_path.chmod(0o755)
    yield tmp_path
    cluster.cancel_all()


def _stamp(path: Path) -> float:
    return float(path.read_text().split()[0])


def _pool_jobs(cluster: SlurmCluster, marks: Path, script: str, count: int) -> list[int]:
    jobs = [
        cluster.sbatch("-p", cluster.pool, f"--gres={cluster.gres}:2", "--requeue", SIGNAL,
                       f"--output={marks}/%j.out", script=script.format(marks=marks))
        for _ in range(count)
    ]
    for job_id in jobs:
        wait_until(lambda j=job_id: (marks / f"{j}.start.0").exists(), WAIT_S, f"pool job {job_id} started")
    return jobs


def test_an_owner_job_preempts_one_pool_job_whose_shell_hears_term_and_leaves(
    cluster: SlurmCluster, marks: Path
) -> None:
    first, second = _pool_jobs(cluster, marks, LEAVES_ON_TERM, 2)
    owner = cluster.sbatch("-p", cluster.owners, f"--gres={cluster.gres}:2", f"--output={marks}/owner.out",
                           script=OWNER.format(marks=marks))
    terms = wait_until(lambda: [j for j in (first, second) if (marks / f"{j}.term").exists()], WAIT_S,
                       "a pool job's shell trapped SIGTERM")
    wait_until((marks / f"owner-{owner}.start").exists, WAIT_S, "the owner's job started")
    assert isinstance(terms, list) and len(terms) == 1, "two slots are wanted: one pool job gives them"
    (left,) = terms
    stayed = second if left == first else first
    assert _stamp(marks / f"owner-{owner}.start") >= _stamp(marks / f"{left}.term")
    # It left in its grace by itself: over, not requeued; the other pool job was not touched.
    assert cluster.wait_for_state(left, ["COMPLETED"], WAIT_S) == "COMPLETED"
    assert cluster.state(stayed) == "RUNNING"
    assert not (marks / f"{stayed}.term").exists()


def test_a_pool_job_still_there_after_its_grace_is_requeued_and_runs_after_the_owner(
    cluster: SlurmCluster, marks: Path
) -> None:
    (pool,) = _pool_jobs(cluster, marks, STAYS_ON_TERM, 1)
    owner = cluster.sbatch("-p", cluster.owners, f"--gres={cluster.gres}:3", f"--output={marks}/owner.out",
                           script=OWNER.format(marks=marks))
    wait_until(lambda: (marks / f"{pool}.term").exists(), WAIT_S, "the pool job's shell trapped SIGTERM")
    assert cluster.state(owner) == "PENDING", "the owner's job waits for the grace"
    cluster.wait_for_state(owner, ["RUNNING"], WAIT_S)
    assert cluster.wait_for_state(pool, ["PENDING"], WAIT_S) == "PENDING"
    # It heard TERM twice: when preempted, and when its grace ended (then KILL, KillWait later).
    preempted, grace_over = map(float, (marks / f"{pool}.term").read_text().split())
    assert grace_over - preempted >= GRACE_S - 1  # a second for the stamps' and Slurm's rounding
    assert "Restarts=1" in cluster.run("scontrol", "show", "job", str(pool)).stdout
    assert not (marks / f"{pool}.start.1").exists()

    (marks / "release").touch()
    cluster.wait_for_state(owner, ["COMPLETED"], WAIT_S)
    wait_until(lambda: (marks / f"{pool}.start.1").exists(), WAIT_S, "the requeued pool job ran again")
    assert cluster.state(pool) == "RUNNING"
