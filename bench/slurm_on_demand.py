"""The Slurm pool acting when demand appears, on the suite's real Slurm (tests/slurm_support.py)
with the whole platform (portal, Celery worker and beat, the pool, real agents in Slurm jobs):

    python bench/slurm_on_demand.py sbatch [--rounds 5] [--every 15]
    python bench/slurm_on_demand.py grow-back [--rounds 5] [--owner-s 10] [--agent-args "..."] [--beat-only]

`sbatch`: from a job's submission to the pool's sbatch of its agent job, with the pool acting on
demand against the beat alone (BUNGEE_SLURM_ON_DEMAND=false), side by side: two platforms on one
Slurm, their rounds taken in turn, the beat every `--every` seconds in both (15 s, the default).
The agent jobs are submitted held (`--hold`): no agent starts, the figure is the pool's alone.
Each round starts after a random pause of up to a beat, so that the rounds meet the beat at
random phases.
Times: the bench's clock before the POST against the pool's record of the sbatch (its
SUBMITTED event, written when sbatch returned).

`grow-back`: a job of min 1 / max 2 workers trains on two pool agents (two Slurm nodes of one
slot); an owner's job (`owners` partition, one slot, `--owner-s` long) preempts one agent, the
job shrinks in place; the owner's job ends, and the time is taken from its end (the last line of
its script stamps it) to the job back at 2 workers (the generation of world size 2 reported by
rank 0: its resize's completed_at). Each round is broken down from the platform's records: the
pool's sbatch of the replacement agent, Slurm starting it (squeue's StartTime, whole seconds),
its node registering, the scheduler planning the grow (the resize's requested_at), the joining
worker joined (started, built, and the state received: its row's joined_at), the switch (and its
phases as rank 0 reported them). `--agent-args` are the
pool agents' flags (by default an agent's defaults, standbys on, named explicitly; the integration
test's agents run `--standbys off`: cold workers), so that the bench runs again as the agent
changes.

Printed: min / median / max per interval with the conditions (machine, load average, Slurm,
rounds); the last line is one JSON object. Needs root and slurm-wlm + munge, like the tests.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import machine, show, spread  # noqa: E402
from tests.slurm_support import (  # noqa: E402
    SCHEDULER_PARAMETERS,
    SlurmCluster,
    missing_requirements,
    pool_platform,
    slurm_cluster,
    wait_until,
)

WAIT_S = 240.0
ARMS = {"on demand": "true", "beat only": "false"}
GROW_ENV = {
    "BUNGEE_CHECKPOINT_EVERY_S": "0.5",
    "BUNGEE_PROGRESS_EVERY_S": "0.2",
    "BUNGEE_POLICY": "fair",
    "BUNGEE_SLURM_GRACE_S": "20",
    "BUNGEE_SLURM_MAX_AGENTS": "2",
    "BUNGEE_SLURM_IDLE_S": "600",
}
OWNER = """#!/bin/bash
sleep {seconds}
date +%s.%N > {marks}/owner-$SLURM_JOB_ID.t && mv {marks}/owner-$SLURM_JOB_ID.t {marks}/owner-$SLURM_JOB_ID.end
"""
SUBMITTED_QUERY = """
import json
from portal.slurm.models import SlurmPoolEvent
print(json.dumps([[e.slurm_job_id, e.at.timestamp()] for e in SlurmPoolEvent.objects.filter(kind="submitted")]))
"""
GROWN_QUERY = """
import json
from portal.cluster.models import Node
from portal.jobs.models import ResizeEvent, Worker
from portal.slurm.models import SlurmPoolEvent
job, generation, before = {job}, {generation}, {before}
resize = ResizeEvent.objects.get(job_id=job, generation=generation)
joiner = Worker.objects.filter(job_id=job, generation=generation).exclude(pid__in=before).select_related("node").first()
print(json.dumps({{
    "requested_at": resize.requested_at.timestamp(),
    "completed_at": resize.completed_at.timestamp(),
    "phases": resize.phases,
    "node": joiner.node.name,
    "registered_at": joiner.node.registered_at.timestamp(),
    "worker_joined_at": joiner.joined_at.timestamp() if joiner.joined_at else None,
    "submitted": [[e.slurm_job_id, e.at.timestamp()] for e in SlurmPoolEvent.objects.filter(kind="submitted")],
}}))
"""
SPEC = {
    "name": "grow-back", "workload": "digits-mlp", "min_workers": 1, "max_workers": 2, "seed": 4,
    "steps": 10_000_000, "hyperparameters": {"batch_size": 32, "hidden": 128},
}


def query(running: Any, code: str) -> Any:
    return json.loads(running.group.run("manage.py", "shell", "-c", code).strip().splitlines()[-1])


def agent_jobs(cluster: SlurmCluster, name: str) -> list[int]:
    alive = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED")
    return [job.id for job in cluster.jobs().values() if job.name == name and job.state in alive]


# --- from a submission to the sbatch -------------------------------------------------------------


def sbatch_round(running: Any, cluster: SlurmCluster, name: str) -> float:
    """Submits a job of one worker; returns the seconds to the pool's sbatch of its agent job, and
    leaves the platform with no job and no agent job."""
    alice = running.api("alice")
    known = {job_id for job_id, _ in query(running, SUBMITTED_QUERY)}
    submitted = time.time()
    reply = alice.post("/api/jobs", json={**SPEC, "name": "wants-one", "max_workers": 1})
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    wait_until(lambda: agent_jobs(cluster, name), WAIT_S, f"{name}: the pool's sbatch", every_s=0.1)
    sbatched = [at for job_id_, at in query(running, SUBMITTED_QUERY) if job_id_ not in known]
    assert alice.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    cluster.scancel(*agent_jobs(cluster, name))
    wait_until(lambda: not agent_jobs(cluster, name), WAIT_S, f"{name}: no agent job left")
    return min(sbatched) - submitted


def measure_sbatch(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with slurm_cluster(nodes=1, slots=4) as cluster, ExitStack() as stack:
        platforms = {}
        for arm, on_demand in ARMS.items():
            name = "bungee-" + arm.replace(" ", "-")
            env = {"BUNGEE_SLURM_EVERY_S": str(args.every), "BUNGEE_SLURM_ON_DEMAND": on_demand,
                   "BUNGEE_SLURM_JOB_NAME": name, "BUNGEE_SLURM_SBATCH_ARGS": "--hold",
                   "BUNGEE_SLURM_IDLE_S": "600"}
            platforms[arm] = (name, stack.enter_context(pool_platform(work / name, cluster, "", env)))
        version = cluster.run("sinfo", "--version").stdout.strip()
        pauses = random.Random(args.seed)
        for round_ in range(args.rounds):
            for arm, (name, running) in platforms.items():
                # Rounds at a steady pace would meet the beat at the same phase every time.
                time.sleep(pauses.uniform(0, args.every))
                times[arm].append(sbatch_round(running, cluster, name))
                print(f"round {round_ + 1} {arm}: {times[arm][-1]:.3f} s", flush=True)
    conditions = {**machine(), "slurm": version, "beat_s": args.every, "rounds": args.rounds}
    print(f"conditions: {conditions}")
    for arm in ARMS:
        print(f"submission -> pool's sbatch, {arm:9}: {show(times[arm])}")
    return {**conditions, **{f"submit_to_sbatch_{arm.replace(' ', '_')}_s": spread(times[arm]) for arm in ARMS}}


# --- the grow-back after a preemption ------------------------------------------------------------

STAGES = (
    ("pool_sbatch", "the pool's sbatch of the replacement"),
    ("slurm_start", "Slurm starts it (whole seconds)"),
    ("registered", "its agent registered"),
    ("planned", "the grow planned"),
    ("worker_joined", "the joiner joined"),
    ("back_at_2", "back at 2 workers"),
)


def live(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in job["workers_history"] if w["state"] == "running"]


def settled(running: Any, job_id: int, workers: int, after_generation: int) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        job = running.api("alice").get(f"/api/jobs/{job_id}").json()
        rows = live(job)
        done = (job["state"] == "running" and job["workers"] == workers and job["generation"] > after_generation
                and job["resizes"] and job["resizes"][-1]["completed_at"] is not None and len(rows) == workers
                and all(row["generation"] == job["generation"] for row in rows))
        return job if done else None

    return running.wait_for(f"job {job_id} settled at {workers}", check, timeout_s=WAIT_S)


def grow_round(running: Any, cluster: SlurmCluster, marks: Path, job: dict[str, Any], owner_s: float
               ) -> tuple[dict[str, float], dict[str, Any]]:
    """One preemption and grow-back from a job settled at 2; returns each stage's time from the
    owner's job ending, and the job settled at 2 again."""
    owner = cluster.sbatch(f"--partition={cluster.owners}", f"--gres={cluster.gres}:1", "--output=/dev/null",
                           script=OWNER.format(seconds=owner_s, marks=marks))
    shrunk = settled(running, job["id"], 1, job["generation"])
    before = [row["pid"] for row in live(shrunk)]
    end_mark = marks / f"owner-{owner}.end"
    wait_until(end_mark.exists, WAIT_S, "the owner's job ended")
    ended = float(end_mark.read_text())
    grown = settled(running, job["id"], 2, shrunk["generation"])
    record = query(running, GROWN_QUERY.format(job=job["id"], generation=grown["generation"], before=before))
    replacement = int(record["node"].rsplit("-job", 1)[1])
    slurm_job = next(j for j in cluster_jobs(cluster) if j["job_id"] == replacement)
    at = {
        "pool_sbatch": next(t for job_id, t in record["submitted"] if job_id == replacement),
        "slurm_start": slurm_job["start_time"],
        "registered": record["registered_at"],
        "planned": record["requested_at"],
        "worker_joined": record["worker_joined_at"],
        "back_at_2": record["completed_at"],
    }
    stages = {stage: at[stage] - ended for stage, _ in STAGES if at[stage] is not None}
    stages["switch_phases"] = record["phases"]
    return stages, grown


def cluster_jobs(cluster: SlurmCluster) -> list[dict[str, Any]]:
    """Every job squeue --json lists (22.05: all, ended ones within MinJobAge), with its start."""
    listed = json.loads(cluster.run("squeue", "--json").stdout)["jobs"]
    found = []
    for job in listed:
        start = job.get("start_time")
        if isinstance(start, dict):
            start = start.get("number")
        found.append({"job_id": int(job["job_id"]), "start_time": float(start or 0)})
    return found


def measure_grow_back(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = {**GROW_ENV, "BUNGEE_SLURM_ON_DEMAND": "false" if args.beat_only else "true",
           "BUNGEE_SLURM_EVERY_S": str(args.every)}
    rounds: list[dict[str, Any]] = []
    with slurm_cluster(nodes=2, slots=1) as cluster:
        marks = cluster.directory / "marks"
        marks.mkdir()
        version = cluster.run("sinfo", "--version").stdout.strip()
        with pool_platform(work / "platform", cluster, args.agent_args, env) as running:
            reply = running.api("alice").post("/api/jobs", json=SPEC)
            assert reply.status_code == 201, reply.text
            job = settled(running, reply.json()["id"], 2, 0)
            for round_ in range(args.rounds):
                stages, job = grow_round(running, cluster, marks, job, args.owner_s)
                rounds.append(stages)
                print(f"round {round_ + 1}: " + ", ".join(
                    f"{stage} {stages[stage]:+.2f}" for stage, _ in STAGES if stage in stages), flush=True)
    conditions = {**machine(), "slurm": version, "scheduler_parameters": SCHEDULER_PARAMETERS,
                  "on_demand": not args.beat_only, "beat_s": args.every, "owner_s": args.owner_s,
                  "agent_args": args.agent_args, "rounds": args.rounds}
    print(f"conditions: {conditions}")
    print("from the owner's job ending to (s, min / median / max; negative: before it ended):")
    figures: dict[str, Any] = {}
    for stage, what in STAGES:
        values = [r[stage] for r in rounds if stage in r]
        print(f"  {what:40} {show(values)}")
        figures[f"end_to_{stage}_s"] = spread(values)
    phases = sorted({phase for r in rounds for phase in r["switch_phases"]})
    for phase in phases:
        values = [float(r["switch_phases"][phase]) for r in rounds if phase in r["switch_phases"]]
        print(f"  switch phase {phase:27} {show(values)}")
    figures["switch_phases_median_s"] = {
        phase: statistics.median(float(r["switch_phases"][phase]) for r in rounds if phase in r["switch_phases"])
        for phase in phases
    }
    return {**conditions, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("part", choices=["sbatch", "grow-back"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=float, default=15.0, help="the pool's beat (BUNGEE_SLURM_EVERY_S)")
    parser.add_argument("--owner-s", type=float, default=10.0, help="grow-back: how long the owner's job runs")
    parser.add_argument("--agent-args", default="--standbys on --sim-pace 4 --drain-deadline 10 --stop-grace 5",
                        help="grow-back: the pool agents' flags")
    parser.add_argument("--beat-only", action="store_true", help="grow-back: the pool on its beat alone")
    parser.add_argument("--seed", type=int, default=0, help="sbatch: the random pauses between rounds")
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        parser.exit(2, f"slurm_on_demand: {missing}\n")
    with tempfile.TemporaryDirectory(prefix="bench-slurm-on-demand-") as tmp:
        work = Path(tmp)
        figures = measure_sbatch(args, work) if args.part == "sbatch" else measure_grow_back(args, work)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
