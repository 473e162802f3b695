"""Drain: from a node's drain notice to its job training without it, on the whole platform
(tests.platform: PostgreSQL, Redis, the portal, the Celery scheduler, real torch workers), with
two agents of one simulated device each: node-a (stays) and node-b (started with the default
--on-term drain, SIGTERMed each round, started again after it left).

    python bench/drain.py               # 5 rounds of each kind
    python bench/drain.py --rounds 2

Two kinds of round, alternating:
- shrink: a job (strict digits MLP, 1 to 2 workers) on both nodes; SIGTERM to node-b's agent.
  Timed: the signal to the end of the first step of the generation without node-b (the resize's
  `completed_at`), the signal to the agent's exit; checked: node-a's worker is the same process.
- below minimum: the same job with min 2; SIGTERM to node-b's agent: the job saves its step and
  waits; node-b's agent is started again at once and the job resumes. Timed: the signal to the
  job queued with its workers gone, and the agent's new start to the first step after the resume.
Steps lost or trained twice are counted from the samples every worker records (tests.worker_
support.Ledger): a step missing is lost, a step trained by two generations is redone. Both must
be 0. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
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
from tests.worker_support import Ledger  # noqa: E402

SPEC = {"name": "drain-bench", "workload": "digits-mlp", "min_workers": 1, "max_workers": 2, "seed": 4,
        "steps": 10_000_000, "hyperparameters": {"batch_size": 32, "hidden": 128}}
DEADLINE_S = 120.0


def live(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in job["workers_history"] if row["state"] == "running"]


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


class Bench:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def start_b(self) -> None:
        self.platform.start_agent("node-b", 1, "drain", "--drain-deadline", "60")

    def signal_b(self) -> float:
        [agent] = [p for p in self.platform.group.processes if p.name == "agent-node-b"]
        self.platform.agent_may_leave("node-b")
        sent = time.time()
        agent.process.send_signal(signal.SIGTERM)
        return sent

    def b_exit(self) -> float:
        [agent] = [p for p in self.platform.group.processes if p.name == "agent-node-b"]
        agent.process.wait(timeout=DEADLINE_S)
        left = time.time()
        agent.log_file.close()
        self.platform.group.processes.remove(agent)
        return left

    def online(self) -> None:
        self.platform.wait_for("node-b online", lambda: any(
            n["name"] == "node-b" and n["state"] == "online" for n in self.platform.api("alice").get("/api/nodes").json()
        ), timeout_s=DEADLINE_S)

    def settled(self, job_id: int, workers: int, after: int) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            job = self.platform.job(job_id)
            rows = live(job)
            ok = (job["state"] == "running" and job["workers"] == workers and job["generation"] > after
                  and job["resizes"][-1]["completed_at"] is not None and len(rows) == workers
                  and all(r["generation"] == job["generation"] for r in rows))
            return job if ok else None
        return self.platform.wait_for(f"job {job_id} on {workers}", check, timeout_s=DEADLINE_S)  # type: ignore[no-any-return]

    def trained_past(self, job_id: int, step: int) -> dict[str, Any]:
        return self.platform.wait_for(  # type: ignore[no-any-return]
            f"job {job_id} past {step}", lambda: (j := self.platform.job(job_id))["steps_done"] > step and j,
            timeout_s=DEADLINE_S)

    def submit(self, **spec: Any) -> int:
        reply = self.platform.api("alice").post("/api/jobs", json={**SPEC, **spec})
        reply.raise_for_status()
        return int(reply.json()["id"])

    def cancel(self, job_id: int) -> None:
        self.platform.api("alice").post(f"/api/jobs/{job_id}/cancel")
        self.platform.wait_for("stopped", lambda: not live(self.platform.job(job_id)), timeout_s=DEADLINE_S)

    def shrink(self) -> dict[str, Any]:
        job_id = self.submit()
        job = self.settled(job_id, 2, 0)
        job = self.trained_past(job_id, job["steps_done"] + 10)
        survivor = next(r["pid"] for r in live(job) if r["node"] == "node-a")
        sent = self.signal_b()
        shrunk = self.settled(job_id, 1, job["generation"])
        left = self.b_exit()
        assert [r["pid"] for r in live(shrunk)] == [survivor], "the survivor was restarted"
        self.trained_past(job_id, shrunk["steps_done"] + 5)
        self.cancel(job_id)
        self.start_b()
        self.online()
        return {"job": job_id, "trained_without_s": at(shrunk["resizes"][-1]["completed_at"]) - sent,
                "agent_left_s": left - sent, "reason": shrunk["resizes"][-1]["reason"]}

    def below_minimum(self) -> dict[str, Any]:
        job_id = self.submit(min_workers=2)
        job = self.settled(job_id, 2, 0)
        job = self.trained_past(job_id, job["steps_done"] + 10)
        sent = self.signal_b()
        waiting = self.platform.wait_for("queued", lambda: (
            (j := self.platform.job(job_id))["state"] == "queued" and not live(j) and j), timeout_s=DEADLINE_S)
        queued = time.time()
        self.b_exit()
        restarted = time.time()
        self.start_b()
        resumed = self.settled(job_id, 2, waiting["generation"])
        self.trained_past(job_id, resumed["steps_done"] + 5)
        self.cancel(job_id)
        return {"job": job_id, "queued_s": queued - sent, "message": waiting["message"],
                "resumed_s": at(resumed["resizes"][-1]["completed_at"]) - restarted}


def steps_lost_and_redone(record: Path, job_id: int) -> tuple[int, int]:
    steps = Ledger.read_all(record, job_id)
    numbers = sorted(steps)
    lost = len(set(range(numbers[0], numbers[-1] + 1)) - set(numbers)) if numbers else 0
    redone = sum(1 for records in steps.values() if len(records) > 1)
    return lost, redone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each kind (default 5)")
    args = parser.parse_args(argv)
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-drain-"))
    record = work / "samples.jsonl"
    env = {"BUNGEE_RECORD_SAMPLES": str(record), "BUNGEE_CHECKPOINT_EVERY_S": "1", "BUNGEE_PROGRESS_EVERY_S": "0.2",
           "BUNGEE_POLICY": "fair"}
    shrinks: list[dict[str, Any]] = []
    belows: list[dict[str, Any]] = []
    lost = redone = 0
    with running_platform(work, {"node-a": 1}, env) as platform:
        bench = Bench(platform)
        bench.start_b()
        bench.online()
        for round_number in range(args.rounds):
            for kind, runs in (("shrink", shrinks), ("below_minimum", belows)):
                outcome = getattr(bench, kind)()
                job_lost, job_redone = steps_lost_and_redone(record, outcome["job"])
                lost, redone = lost + job_lost, redone + job_redone
                outcome.update(steps_lost=job_lost, steps_redone=job_redone)
                runs.append(outcome)
                print(f"round {round_number + 1} {kind}: {json.dumps(outcome)}", flush=True)
    trained_without = [r["trained_without_s"] for r in shrinks]
    agent_left = [r["agent_left_s"] for r in shrinks]
    queued = [r["queued_s"] for r in belows]
    resumed = [r["resumed_s"] for r in belows]
    print(f"\nDrain, {args.rounds} rounds of each kind, 2 agents of 1 simulated device, strict digits MLP (hidden 128):")
    print(f"  SIGTERM -> job training without the node (first step of the shrunk generation): {show(trained_without)}")
    print(f"  SIGTERM -> agent exited:                                                       {show(agent_left)}")
    print(f"  below minimum: SIGTERM -> job queued, workers gone:                            {show(queued)}")
    print(f"  below minimum: agent back -> job trained again (first step after the resume):  {show(resumed)}")
    print(f"  steps lost: {lost}; steps trained twice: {redone}")
    load_end = round(__import__("os").getloadavg()[0], 2)
    print(json.dumps({
        "bench": "drain", "rounds": args.rounds, "trained_without_node_s": spread(trained_without),
        "agent_left_s": spread(agent_left), "below_min_queued_s": spread(queued),
        "below_min_resumed_s": spread(resumed), "steps_lost": lost, "steps_redone": redone,
        "conditions": conditions, "load_average_end": load_end,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
