"""How fast the suite's real Slurm (tests/slurm_support.py) preempts a pool job for an owner's:
the time from the owner's `sbatch` to the pool job's batch shell hearing SIGTERM, and from that
TERM to the owner's job running, when the pool job leaves at once (an agent whose drain is done).

    python bench/slurm_preemption.py [--rounds 5] [--nodes 1]

Each round starts from an idle cluster, runs two pool jobs (`--gres=slot:2 --requeue
--signal=B:TERM@60`, a `trap` on TERM that writes the time and exits) and submits an owners' job
of `slot:2`, whose script's first line writes the time it started. Times are wall-clock stamps
written by the jobs (date +%s.%N) against the stamp taken just before `sbatch`. Printed:
min / median / max per interval, with the cluster's scheduler settings and the machine; the last
line is one JSON object. Needs root and slurm-wlm + munge, like the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import show, spread  # noqa: E402
from tests.slurm_support import SCHEDULER_PARAMETERS, SlurmCluster, slurm_cluster, wait_until  # noqa: E402

POOL = """#!/bin/bash
trap 'date +%s.%N > {marks}/$SLURM_JOB_ID.t && mv {marks}/$SLURM_JOB_ID.t {marks}/$SLURM_JOB_ID.term; exit 0' TERM
touch {marks}/$SLURM_JOB_ID.start
sleep 600 & wait $!
"""
OWNER = """#!/bin/bash
date +%s.%N > {marks}/owner-$SLURM_JOB_ID.t && mv {marks}/owner-$SLURM_JOB_ID.t {marks}/owner-$SLURM_JOB_ID.start
sleep 600
"""
WAIT_S = 120.0


def one_round(cluster: SlurmCluster, marks: Path) -> tuple[float, float, float]:
    """Returns (sbatch -> TERM, TERM -> owner running, sbatch -> owner running) in seconds."""
    pool = [
        cluster.sbatch("-p", cluster.pool, f"--gres={cluster.gres}:2", "--requeue", "--signal=B:TERM@60",
                       "--output=/dev/null", script=POOL.format(marks=marks))
        for _ in range(2)
    ]
    for job_id in pool:
        wait_until(lambda j=job_id: (marks / f"{j}.start").exists(), WAIT_S, f"pool job {job_id} started")
    submitted = time.time()
    owner = cluster.sbatch("-p", cluster.owners, f"--gres={cluster.gres}:2", "--output=/dev/null",
                           script=OWNER.format(marks=marks))
    started = marks / f"owner-{owner}.start"
    wait_until(started.exists, WAIT_S, "the owner's job started")
    owner_at = float(started.read_text())
    term_at = min(float((marks / f"{j}.term").read_text()) for j in pool if (marks / f"{j}.term").exists())
    cluster.cancel_all()
    return term_at - submitted, owner_at - term_at, owner_at - submitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=1, choices=[1, 2])
    args = parser.parse_args()
    to_term: list[float] = []
    to_owner: list[float] = []
    overall: list[float] = []
    with slurm_cluster(preempt_mode="REQUEUE", nodes=args.nodes, slots=4 // args.nodes) as cluster:
        marks = cluster.directory / "marks"
        marks.mkdir()
        version = cluster.run("sinfo", "--version").stdout.strip()
        for _ in range(args.rounds):
            a, b, c = one_round(cluster, marks)
            to_term.append(a)
            to_owner.append(b)
            overall.append(c)
    conditions = {
        "machine": platform.node(),
        "cores": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "slurm": version,
        "slurm_nodes": args.nodes,
        "scheduler_parameters": SCHEDULER_PARAMETERS,
        "rounds": args.rounds,
    }
    print(f"conditions: {conditions}")
    print(f"owner sbatch -> pool job TERM:   {show(to_term)}")
    print(f"pool job TERM -> owner running:  {show(to_owner)}")
    print(f"owner sbatch -> owner running:   {show(overall)}")
    print(json.dumps({**conditions, "sbatch_to_term_s": spread(to_term), "term_to_owner_s": spread(to_owner),
                      "sbatch_to_owner_s": spread(overall)}))


if __name__ == "__main__":
    main()
