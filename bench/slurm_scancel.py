"""A plain `scancel` of one of a job's two agent jobs, on the suite's real Slurm
(tests/slurm_support.py: two Slurm nodes of one slot, proctrack/linuxproc, KillWait 5 s) with the
whole platform (portal, Celery worker and beat, the pool, real agents in Slurm jobs):

    python bench/slurm_scancel.py [--rounds 4] [--agent-args "..."] [--window 60]

Each round: a job (digits-mlp, min 1 / max 2, endless) trains on the pool's two agents; the bench
`scancel`s one agent job (SIGTERM to its whole process tree, SIGKILL KillWait later) and watches
the job's steps for `--window` seconds. Steps are stamped by the bench as they appear in the
workers' sample record (BUNGEE_RECORD_SAMPLES, polled every 10 ms). Per round:

- pause: the longest time without a step from the last step before the scancel to the end of
  the window (the survivor's pause if it trains on; the restart's if the job goes back to its
  checkpoint);
- back at rate: from the scancel to the first step from which 10 steps in a row each took at
  most 1.5 times the median step of the window's last 10 s (the rate the job keeps after);
- whether the survivor kept its process, the job's restarts, and the resize's reason.

Between rounds the job is cancelled and the pool's replacement agent comes up (agents stay:
BUNGEE_SLURM_IDLE_S is long). Run it on two versions to compare them (the figures in
docs/operator/slurm.md: before, the workers died on Slurm's TERM and the job restarted; after,
they leave it to the agent). Printed: min / median / max with the conditions (machine, load
average, Slurm, rounds); the last line is one JSON object. Needs root and slurm-wlm + munge. Jobs
run unconfined (BUNGEE_AGENT_ISOLATION=none, as in the suite): the bench reads their record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import machine, show, spread  # noqa: E402
from bench.slurm_on_demand import GROW_ENV, live  # noqa: E402
from tests.slurm_support import SlurmCluster, missing_requirements, pool_platform, slurm_cluster  # noqa: E402

WAIT_S = 240.0
STEADY_STEPS = 10
STEADY_FACTOR = 1.5
SPEC = {"name": "scancel", "workload": "digits-mlp", "min_workers": 1, "max_workers": 2, "steps": 10_000_000,
        "seed": 7, "hyperparameters": {"batch_size": 32, "hidden": 128}}


class StepWatch:
    """Stamps each line the workers append to the sample record with the bench's clock, from a
    thread that reads the file every 10 ms."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stamps: list[tuple[float, int, int, int]] = []
        """(time seen, job, step, generation), in the order seen (one line per rank)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset, partial = 0, b""
        while not self._stop.wait(0.01):
            if not self.path.exists():
                continue
            with self.path.open("rb") as record:
                record.seek(offset)
                data = record.read()
            offset += len(data)
            now = time.time()
            lines = (partial + data).split(b"\n")
            partial = lines.pop()
            for line in lines:
                entry = json.loads(line)
                self.stamps.append((now, entry["job_id"], entry["step"], entry["generation"]))

    def steps(self, job_id: int, since: float, until: float) -> list[float]:
        """When each step of the job was first seen (its first rank's line) in [since, until]; a
        step that a restart trains again, in another generation, counts again: it is training,
        if not progress."""
        first: dict[tuple[int, int], float] = {}
        for at, job, step, generation in list(self.stamps):
            if job == job_id and since <= at <= until:
                first.setdefault((step, generation), at)
        return sorted(first.values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def settled(running: Any, job_id: int, workers: int) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        job = running.api("alice").get(f"/api/jobs/{job_id}").json()
        rows = live(job)
        done = (job["state"] == "running" and job["workers"] == workers and job["resizes"]
                and job["resizes"][-1]["completed_at"] is not None and len(rows) == workers
                and all(row["generation"] == job["generation"] for row in rows))
        return job if done else None

    return running.wait_for(f"job {job_id} settled at {workers}", check, timeout_s=WAIT_S)


def agent_jobs(cluster: SlurmCluster) -> list[int]:
    return sorted(job.id for job in cluster.jobs().values()
                  if job.name == "bungee-agent" and job.state == "RUNNING")


def one_round(running: Any, cluster: SlurmCluster, watch: StepWatch, window_s: float) -> dict[str, Any]:
    alice = running.api("alice")
    reply = alice.post("/api/jobs", json=SPEC)
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    job = settled(running, job_id, 2)
    time.sleep(5)  # training at 2 for a while: the steps before the scancel
    job = alice.get(f"/api/jobs/{job_id}").json()
    victim = agent_jobs(cluster)[0]
    survivor = next(row for row in live(job) if not row["node"].endswith(f"-job{victim}"))
    cancelled_at = time.time()
    cluster.scancel(victim)
    time.sleep(window_s)
    after = alice.get(f"/api/jobs/{job_id}").json()
    stamps = watch.steps(job_id, cancelled_at - 10, cancelled_at + window_s)
    before = [t for t in stamps if t <= cancelled_at]
    during = [t for t in stamps if t > cancelled_at]
    assert before, "no step before the scancel"
    chain = [before[-1], *during]
    # To the window's end too: a job that has not trained again by then paused all of it.
    ends = [*chain, cancelled_at + window_s]
    pause = max(b - a for a, b in zip(ends, ends[1:], strict=False))
    tail = [b - a for a, b in zip(during, during[1:], strict=False) if a >= cancelled_at + window_s - 10]
    steady = statistics.median(tail) if tail else None
    back = None
    if steady is not None:
        gaps = [b - a for a, b in zip(chain, chain[1:], strict=False)]
        for i in range(len(gaps) - STEADY_STEPS + 1):
            if all(g <= STEADY_FACTOR * steady for g in gaps[i:i + STEADY_STEPS]):
                back = max(0.0, chain[i] - cancelled_at)  # 0: it never slowed
                break
    reasons = [r["reason"] for r in after["resizes"] if r["requested_at"] and r["completed_at"]]
    outcome = {
        "pause_s": round(pause, 3),
        "back_at_rate_s": round(back, 3) if back is not None else None,
        "step_before_s": round(statistics.median([b - a for a, b in zip(before, before[1:], strict=False)]), 4),
        "step_after_s": round(steady, 4) if steady is not None else None,
        "survivor_kept": survivor["pid"] in {row["pid"] for row in live(after)},
        "restarts": after["restarts"],
        "reasons": reasons[-3:],
        "failed_workers": sum(1 for row in after["workers_history"] if row["reason"] == "failed"),
    }
    assert alice.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    running.wait_for("the workers to stop", lambda: not live(alice.get(f"/api/jobs/{job_id}").json()), timeout_s=120)
    running.wait_for("two agents up again", lambda: len(agent_jobs(cluster)) == 2, timeout_s=WAIT_S)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--window", type=float, default=60.0, help="seconds the job is watched after the scancel")
    parser.add_argument("--agent-args", default="--standbys off --sim-pace 4 --drain-deadline 10 --stop-grace 5",
                        help="the pool agents' flags (the integration test's, by default)")
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        sys.exit(missing)
    # The workers write their sample record into the bench's own temporary directory, which a
    # job confined to a uid of its own cannot reach: jobs run unconfined here, as in the suite.
    os.environ.setdefault("BUNGEE_AGENT_ISOLATION", "none")
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bungee-bench-scancel-") as name:
        work = Path(name)
        record = work / "samples.jsonl"
        watch = StepWatch(record)
        with slurm_cluster(nodes=2, slots=1) as cluster:
            version = cluster.run("sinfo", "--version").stdout.strip()
            env = {**GROW_ENV, "BUNGEE_RECORD_SAMPLES": str(record)}
            with pool_platform(work / "platform", cluster, args.agent_args, env) as running:
                for round_ in range(args.rounds):
                    rounds.append(one_round(running, cluster, watch, args.window))
                    print(f"round {round_ + 1}: {rounds[-1]}", flush=True)
        watch.close()
    conditions = {**machine(), "slurm": version, "proctrack": "linuxproc", "kill_wait_s": 5,
                  "agent_args": args.agent_args, "rounds": args.rounds, "window_s": args.window}
    pauses = [r["pause_s"] for r in rounds]
    back = [r["back_at_rate_s"] for r in rounds if r["back_at_rate_s"] is not None]
    print(f"conditions: {conditions}")
    print(f"scancel of one agent: longest time without a step  {show(pauses)}")
    print(f"scancel -> back at its steady step rate           {show(back)} (of {len(rounds)} rounds)")
    print(f"survivor kept its process in {sum(r['survivor_kept'] for r in rounds)} of {len(rounds)} rounds; "
          f"restarts {[r['restarts'] for r in rounds]}; failed workers {[r['failed_workers'] for r in rounds]}")
    print(json.dumps({**conditions, "pause_s": spread(pauses), "back_at_rate_s": spread(back), "rounds_seen": rounds}))


if __name__ == "__main__":
    main()
