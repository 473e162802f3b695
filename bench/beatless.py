"""A worker killed, the job back at full size: with the Celery beat running and with it dead,
side by side on one whole platform (tests.platform: PostgreSQL, Redis, the portal, the Celery
worker, real torch workers), one agent of 2 simulated devices.

    python bench/beatless.py               # 5 rounds of each arm
    python bench/beatless.py --rounds 3

Each round: a job (digits MLP, 1 to 2 workers, alone on the node: the scheduler gives it both) trains; one of its workers is SIGKILLed. The
job's generation is lost, it is planned again without that device (a shrink to 1), and once
that settles, grown back onto it. Timed: the kill to the end of the first step of the grown
generation (its resize's `completed_at`), and the kill to the shrunk generation's. The arms
alternate within each round: `beat` (the beat's tick, every BUNGEE_SCHEDULE_TICK_S = 5 s, is
running) and `no beat` (the beat SIGKILLed before the round, started again after it). Before
the scheduler ran when a generation settled, the `no beat` arm never grew back (the issue's
probe: 100 s at 1 worker on an idle cluster). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import machine, show, spread  # noqa: E402
from tests.platform import Platform, running_platform  # noqa: E402

SPEC = {"name": "beatless-bench", "workload": "digits-mlp", "min_workers": 1, "max_workers": 2, "seed": 4,
        "steps": 10_000_000, "hyperparameters": {"batch_size": 32, "hidden": 128}}
DEADLINE_S = 120.0
ARMS = ("beat", "no beat")


def live(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in job["workers_history"] if row["state"] == "running"]


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def settled(platform: Platform, job_id: int, workers: int, after: int) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        job = platform.job(job_id)
        rows = live(job)
        ok = (job["state"] == "running" and job["workers"] == workers and job["generation"] > after
              and job["resizes"][-1]["completed_at"] is not None and len(rows) == workers
              and all(r["generation"] == job["generation"] for r in rows))
        return job if ok else None
    return platform.wait_for(f"job {job_id} on {workers}", check, timeout_s=DEADLINE_S)  # type: ignore[no-any-return]


def one_round(platform: Platform, job_id: int) -> dict[str, Any]:
    """Kills the job's highest-ranked worker; returns the seconds to the shrink and to the grow."""
    job = settled(platform, job_id, 2, 0)
    victim = max(live(job), key=lambda row: row["rank"])["pid"]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    back = settled(platform, job_id, 2, job["generation"] + 1)
    shrink, grow = back["resizes"][-2:]
    assert (shrink["workers_after"], grow["workers_after"]) == (1, 2), back["resizes"][-2:]
    return {"shrunk_s": at(shrink["completed_at"]) - killed, "grown_back_s": at(grow["completed_at"]) - killed,
            "shrink_reason": shrink["reason"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each arm (default 5)")
    args = parser.parse_args(argv)
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-beatless-"))
    # Every kill is a failure the restart budget counts: the bench's are on purpose.
    env = {"BUNGEE_CHECKPOINT_EVERY_S": "1", "BUNGEE_PROGRESS_EVERY_S": "0.2", "BUNGEE_POLICY": "fair",
           "BUNGEE_MAX_RESTARTS": "1000"}
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with running_platform(work, {"node-a": 2}, env) as platform:
        reply = platform.api("alice").post("/api/jobs", json=SPEC)
        reply.raise_for_status()
        job_id = int(reply.json()["id"])
        # No pin: on an idle cluster of 2 devices the scheduler gives the job (1 to 2 workers) both,
        # and gives the lost one back; a pin would make the grow-back the pin's doing.
        for round_number in range(args.rounds):
            for arm in ARMS:
                if arm == "no beat":
                    platform.kill("beat")
                outcome = one_round(platform, job_id)
                if arm == "no beat":
                    platform.start("beat")
                runs[arm].append(outcome)
                print(f"round {round_number + 1} {arm}: {json.dumps(outcome)}", flush=True)
        platform.api("alice").post(f"/api/jobs/{job_id}/cancel")
    print(f"\nA worker SIGKILLed, {args.rounds} rounds of each arm, 1 agent of 2 simulated devices, digits MLP:")
    for arm in ARMS:
        print(f"  {arm:8} kill -> shrunk to 1:     {show([r['shrunk_s'] for r in runs[arm]])}")
        print(f"  {arm:8} kill -> grown back to 2: {show([r['grown_back_s'] for r in runs[arm]])}")
    print(json.dumps({
        "bench": "beatless", "rounds": args.rounds,
        **{arm.replace(" ", "_"): {"shrunk_s": spread([r["shrunk_s"] for r in runs[arm]]),
                                   "grown_back_s": spread([r["grown_back_s"] for r in runs[arm]])} for arm in ARMS},
        "conditions": conditions, "load_average_end": round(os.getloadavg()[0], 2),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
