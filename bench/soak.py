"""Soak: random resizes, worker kills, joiner kills and agent restarts against running jobs on a
real platform, for minutes, counting the events after which a job did not train again in time.

    python bench/soak.py                         # 20 minutes of events, seed 0
    python bench/soak.py --minutes 3 --seed 7    # a short run
    python bench/soak.py --load                  # with a busy loop on every core, as CI runs

The platform is the integration tests' (tests.platform.running_platform: a fresh PostgreSQL
database, Redis, the portal, a Celery worker and beat) with two agents, node-a and node-b, of two
simulated devices each. Two strict digits-mlp jobs (hidden 64, 1 to 3 workers, steps without
end) are pinned to a worker count through the API. Then, until the minutes are over, one event
at a time, picked by a seeded RNG among those possible at that moment:

- resize: `POST /api/jobs/N/resize` to another count within the job's bounds and the free devices;
- worker_kill: SIGKILL one running worker of the job's newest, formed generation;
- joiner_kill: grow the job by one and SIGKILL the new worker as soon as it has started, while
  it warms up (the line says "late" if it had joined already);
- agent_restart: SIGKILL an agent (its workers are not signalled) and start it again at once
  with the same name and token.
- with --control-plane also: portal_restart (SIGKILL the portal, start it again: settled once it
  answers and every job's progress moved on), beat_restart (the same for Celery beat), and
  scheduler_restart (SIGKILL the Celery worker, pin a job to another count while it is down,
  start it again: settled when the pin has landed).

After each event the bench waits for every job the event touched to be training again: running
on its pinned count (or fewer, where the scheduler says the pin cannot be met), every live
worker in the job's newest generation, whose resize has completed, that generation newer than
the one at the event (for an agent restart: the agent registered again instead), and
`steps_done` past its value at the event. The time from the event to then is the settle time.
A job not training again within `--deadline-s` is a hang: the bench prints the job, its log and
the tail of every platform process's log, waits as long again for it to settle, and otherwise
cancels it and submits a new one. A job that fails (or ends) is reported and submitted again.

The jobs run on the fair policy by default (pinned jobs only move when the bench moves them;
`--policy bungee` adds its own moves), with BUNGEE_MAX_RESTARTS raised so that the kills do not
fail the jobs on purpose. The last line is one JSON object: {"bench": "soak", "events",
"hangs", "failed", "settle_p95_s", "settle_median_s", "settle_max_s", "by_kind", ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import machine  # noqa: E402
from tests.platform import FAST_PROGRESS_ENV, Platform, running_platform  # noqa: E402

KINDS = ("resize", "worker_kill", "joiner_kill", "agent_restart", "portal_restart", "beat_restart", "scheduler_restart")
AGENTS = {"node-a": 2, "node-b": 2}
DEVICES = sum(AGENTS.values())
INITIAL_WORKERS = (2, 1)
"""The jobs' first pins: one device is left free, so that a grow is possible from the start."""
ENDLESS = 10_000_000
SPEC: dict[str, Any] = {
    "workload": "digits-mlp",
    "min_workers": 1,
    "max_workers": 3,
    "steps": ENDLESS,
    "hyperparameters": {"batch_size": 32, "hidden": 64},
}
PLATFORM_LOGS = ("portal", "worker", "beat", *(f"agent-{name}" for name in AGENTS))
FINAL_STATES = ("succeeded", "failed", "cancelled")

T = TypeVar("T")


class PlatformDiedError(RuntimeError):
    """A process of the platform (portal, Celery, an agent) exited by itself."""


class SoakAbortedError(RuntimeError):
    """The bench cannot go on: a job could not be brought back to training at all."""


@dataclass
class SoakJob:
    id: int
    target: int
    """The worker count the job is pinned to."""


@dataclass
class Watch:
    """A job an event touched, and what it looked like just before the event."""

    job: SoakJob
    steps_before: int
    generation_before: int | None
    """None where the event need not make a new generation (an agent restart checks the
    agent's registration instead)."""


@dataclass
class Outcome:
    at_s: float
    kind: str
    what: str
    job_ids: list[int]
    status: str = "pending"
    """"ok", "HANG" (not training again within the deadline) or "FAILED" (the job ended)."""
    settle_s: float | None = None
    fallback: bool = False


@dataclass
class SoakSettings:
    minutes: float
    seed: int
    deadline_s: float
    pause_s: float
    load: bool
    policy: str
    max_restarts: int | None
    """BUNGEE_MAX_RESTARTS; None: the product's own restart budget."""
    control_plane: bool = False
    """Also restart the portal, beat and the Celery worker (a pin asked while it is down)."""
    kinds: tuple[str, ...] = ()
    """Only these kinds of event (empty: every kind possible)."""


def live_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in job["workers_history"] if row["state"] == "running"]


def training_again(job: dict[str, Any], watch: Watch) -> tuple[bool, bool]:
    """(whether the job is training again after the event `watch` describes, whether on fewer
    workers than its pin because the scheduler says the pin cannot be met now)."""
    rows = live_rows(job)
    formed = (
        job["state"] == "running"
        and bool(rows)
        and len(rows) == job["workers"]
        and all(row["generation"] == job["generation"] for row in rows)
        and (not job["resizes"] or job["resizes"][-1]["completed_at"] is not None)
        and (watch.generation_before is None or job["generation"] > watch.generation_before)
        and job["steps_done"] > watch.steps_before
    )
    fallback = bool(job["pin_problem"]) and job["min_workers"] <= job["workers"] < watch.job.target
    return formed and (job["workers"] == watch.job.target or fallback), fallback


def nearest_rank(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def settle_stats(values: list[float]) -> dict[str, float | int | None]:
    """n, min, median, p95 (nearest rank) and max of settle times, seconds."""
    if not values:
        return {"n": 0, "min": None, "median": None, "p95": None, "max": None}
    return {
        "n": len(values),
        "min": round(min(values), 2),
        "median": round(statistics.median(values), 2),
        "p95": round(nearest_rank(values, 0.95) or 0.0, 2),
        "max": round(max(values), 2),
    }


def show_stats(stats: dict[str, float | int | None]) -> str:
    if not stats["n"]:
        return "-"
    return f"{stats['min']:.2f} / {stats['median']:.2f} / {stats['p95']:.2f} / {stats['max']:.2f} s (n={stats['n']})"


def is_worker_process(pid: int) -> bool:
    """Whether `pid` is an elastic worker (a check before a SIGKILL on a shared machine)."""
    try:
        return b"elastic.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _spin() -> None:
    while True:
        pass


class Soak:
    """Drives the events against the jobs of a running platform and keeps their outcomes."""

    def __init__(self, platform: Platform, settings: SoakSettings) -> None:
        self.platform = platform
        self.settings = settings
        self.api = platform.api("alice")
        self.rng = random.Random(settings.seed)
        self.jobs: list[SoakJob] = []
        self.outcomes: list[Outcome] = []
        self.began = time.monotonic()
        self.submitted = 0

    # --- the platform ----------------------------------------------------------------------

    def check_alive(self) -> None:
        dead = self.platform.group.dead()
        if dead:
            raise PlatformDiedError(f"{dead[0].name} exited:\n{self.platform.group.tail(dead[0].name)}")

    def poll(self, check: Callable[[], T | None], timeout_s: float, every_s: float = 0.2) -> T | None:
        """Calls `check` until it returns something other than None or False; returns that, or
        None after `timeout_s`. Raises PlatformDiedError if a platform process exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            value = check()
            if value is not None and value is not False:
                return value
            if time.monotonic() >= deadline:
                return None
            time.sleep(every_s)

    def get(self, path: str) -> Any:
        """The JSON of a GET, or None if the portal did not answer it in time or refused it."""
        try:
            reply = self.api.get(path)
        except httpx.HTTPError:
            return None
        return reply.json() if reply.status_code == 200 else None

    def detail(self, job_id: int) -> dict[str, Any] | None:
        job: dict[str, Any] | None = self.get(f"/api/jobs/{job_id}")
        return job

    def pin(self, job: SoakJob, workers: int) -> str | None:
        """Pins the job to `workers`; returns the portal's refusal, or None."""
        reply = self.api.post(f"/api/jobs/{job.id}/resize", json={"workers": workers})
        if reply.status_code != 200:
            return f"{reply.status_code} {reply.text[:300]}"
        job.target = workers
        return None

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    # --- jobs ------------------------------------------------------------------------------

    def submit(self, workers: int) -> SoakJob:
        """Submits a job pinned to `workers` and waits for it to train. Raises SoakAbortedError if it
        does not within three deadlines (its workers import torch for the first time)."""
        self.submitted += 1
        reply = self.api.post(
            "/api/jobs", json={**SPEC, "name": f"soak-{self.submitted}", "seed": self.submitted}
        )
        if reply.status_code != 201:
            raise SoakAbortedError(f"submitting a job was refused: {reply.status_code} {reply.text[:300]}")
        job = SoakJob(reply.json()["id"], workers)
        refusal = self.pin(job, workers)
        if refusal:
            raise SoakAbortedError(f"pinning job {job.id} to {workers} was refused: {refusal}")
        watch = Watch(job, 0, None)
        if not self.poll(
            lambda: (j := self.detail(job.id)) is not None and training_again(j, watch)[0],
            3 * self.settings.deadline_s,
        ):
            self.report_hang(job, "the first start")
            raise SoakAbortedError(f"job {job.id} never trained on {workers} workers")
        return job

    def cancel(self, job: SoakJob) -> None:
        """Cancels the job and waits (one deadline) for its workers to stop."""
        try:
            self.api.post(f"/api/jobs/{job.id}/cancel")
        except httpx.HTTPError as err:
            print(f"  cancelling job {job.id}: {err}", flush=True)
            return
        stopped = self.poll(
            lambda: (
                (j := self.detail(job.id)) is not None and j["state"] in FINAL_STATES and not live_rows(j)
            ),
            self.settings.deadline_s,
        )
        if not stopped:
            print(
                f"  job {job.id}: workers still reported running {self.settings.deadline_s:.0f} s after the cancel",
                flush=True,
            )

    def replace(self, job: SoakJob) -> None:
        """Cancels `job` (if it still runs) and puts a new job with its pin in its place."""
        self.cancel(job)
        new = self.submit(job.target)
        self.jobs[self.jobs.index(job)] = new
        print(f"  job {job.id} replaced by job {new.id} on {new.target} workers", flush=True)

    def free_devices(self) -> int:
        return DEVICES - sum(job.target for job in self.jobs)

    # --- waiting for the jobs to train again ------------------------------------------------

    def agent_registered(self, node: str, since: datetime) -> bool:
        cluster = self.get("/api/cluster")
        if cluster is None:
            return False
        return any(
            n["name"] == node and n["state"] == "online" and datetime.fromisoformat(n["last_seen_at"]) > since
            for n in cluster["nodes"]
        )

    def settle(
        self,
        outcome: Outcome,
        event_at: float,
        watches: list[Watch],
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        """Waits until every watched job trains again (and `ready` holds), at most the deadline
        after `event_at`; records the outcome of the event. A hung or ended job is then
        reported, and brought back or replaced."""
        pending = {watch.job.id: watch for watch in watches}
        fallback = False
        ended: list[tuple[SoakJob, dict[str, Any]]] = []
        settled_at = event_at
        deadline = event_at + self.settings.deadline_s
        while pending and time.monotonic() < deadline:
            self.check_alive()
            if ready():
                for job_id, watch in list(pending.items()):
                    job = self.detail(job_id)
                    if job is None:
                        continue
                    if job["state"] in FINAL_STATES:
                        ended.append((watch.job, job))
                        del pending[job_id]
                        continue
                    again, on_fallback = training_again(job, watch)
                    if again:
                        fallback = fallback or on_fallback
                        settled_at = time.monotonic()
                        del pending[job_id]
            if pending:
                time.sleep(0.2)
        outcome.fallback = fallback
        if pending:
            outcome.status = "HANG"
        elif ended:
            outcome.status = "FAILED"
        else:
            outcome.status, outcome.settle_s = "ok", settled_at - event_at
        self.record(outcome)
        for soak_job, job in ended:
            print(f"  job {soak_job.id} {job['state']}: {job['message']}", flush=True)
            self.report_hang(soak_job, f"{job['state']} job")
            self.replace(soak_job)
        for watch in pending.values():
            self.report_hang(watch.job, "hang")
            self.recover(watch.job)

    def recover(self, job: SoakJob) -> None:
        """After a hang: waits one more deadline for the job to train again, else replaces it."""
        baseline = self.detail(job.id)
        watch = Watch(job, baseline["steps_done"] if baseline else 0, None)
        began = time.monotonic()
        again = self.poll(
            lambda: (j := self.detail(job.id)) is not None and training_again(j, watch)[0],
            self.settings.deadline_s,
        )
        if again:
            print(f"  job {job.id} trained again {time.monotonic() - began:.1f} s later", flush=True)
        else:
            print(f"  job {job.id} still not training: cancelling it", flush=True)
            self.replace(job)

    def report_hang(self, job: SoakJob, what: str) -> None:
        """Prints the job's detail (its newest workers and resizes), its log and the tail of
        every platform process's log."""
        detail = self.detail(job.id)
        print(f"  --- {what}: job {job.id}, pinned to {job.target}", flush=True)
        if detail is None:
            print("  (the portal did not answer for the job)")
        else:
            history, resizes = detail.pop("workers_history"), detail.pop("resizes")
            detail.pop("spec", None)
            print("  job: " + json.dumps(detail, default=str))
            print(f"  resizes (last 4 of {len(resizes)}):")
            for resize in resizes[-4:]:
                print("    " + json.dumps(resize, default=str))
            print(f"  workers (last 12 of {len(history)}):")
            for row in history[-12:]:
                print("    " + json.dumps(row))
        lines = self.get(f"/api/jobs/{job.id}/logs") or []
        print("  job log (last 20):")
        for entry in lines[-20:]:
            print(f"    {entry['line']}")
        for name in PLATFORM_LOGS:
            print(f"  --- {name} log (last 30 lines)")
            print(self.platform.group.tail(name, 30))
        print("  ---", flush=True)

    # --- events ----------------------------------------------------------------------------

    def record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        if outcome.status == "ok" and outcome.settle_s is not None:
            result = f"{outcome.settle_s:6.2f} s" + (" (fallback count)" if outcome.fallback else "")
        else:
            result = f"*** {outcome.status} ***"
        jobs = ",".join(str(j) for j in outcome.job_ids)
        print(
            f"[{outcome.at_s:7.1f} s] {outcome.kind:<13} job {jobs:<5} {outcome.what:<30} {result}",
            flush=True,
        )

    def snapshot(self, job: SoakJob, new_generation: bool = True) -> tuple[dict[str, Any], Watch] | None:
        detail = self.detail(job.id)
        if detail is None:
            return None
        return detail, Watch(job, detail["steps_done"], detail["generation"] if new_generation else None)

    def resizable(self) -> list[tuple[SoakJob, list[int]]]:
        choices = []
        for job in self.jobs:
            counts = [
                k
                for k in range(SPEC["min_workers"], SPEC["max_workers"] + 1)
                if k != job.target and k - job.target <= self.free_devices()
            ]
            if counts:
                choices.append((job, counts))
        return choices

    def growable(self) -> list[SoakJob]:
        return [job for job in self.jobs if job.target < SPEC["max_workers"] and self.free_devices() > 0]

    def resize(self) -> None:
        job, counts = self.rng.choice(self.resizable())
        workers = self.rng.choice(counts)
        at_s, before = self.elapsed(), job.target
        taken = self.snapshot(job)
        if taken is None:
            return
        event_at = time.monotonic()
        refusal = self.pin(job, workers)
        if refusal:
            print(
                f"[{at_s:7.1f} s] resize        job {job.id} {before}->{workers} refused: {refusal}",
                flush=True,
            )
            return
        self.settle(Outcome(at_s, "resize", f"{before}->{workers}", [job.id]), event_at, [taken[1]])

    def worker_kill(self) -> None:
        job = self.rng.choice(self.jobs)
        taken = self.snapshot(job)
        if taken is None:
            return
        detail, watch = taken
        rows = [row for row in live_rows(detail) if row["generation"] == detail["generation"]]
        formed = detail["state"] == "running" and (
            not detail["resizes"] or detail["resizes"][-1]["completed_at"]
        )
        if not rows or not formed:
            print(f"  job {job.id}: no formed generation to kill a worker of; skipped", flush=True)
            return
        victim = self.rng.choice(rows)
        if not is_worker_process(victim["pid"]):
            print(f"  pid {victim['pid']} is not a worker any more; skipped", flush=True)
            return
        at_s, event_at = self.elapsed(), time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        what = f"rank {victim['rank']} of {len(rows)} on {victim['node']}"
        self.settle(Outcome(at_s, "worker_kill", what, [job.id]), event_at, [watch])

    def joiner_kill(self) -> None:
        job = self.rng.choice(self.growable())
        detail = self.detail(job.id)
        if detail is None:
            return
        survivors = {row["pid"] for row in live_rows(detail)}
        before, at_s, grown_at = job.target, self.elapsed(), time.monotonic()
        refusal = self.pin(job, before + 1)
        if refusal:
            print(f"[{at_s:7.1f} s] joiner_kill   job {job.id} grow refused: {refusal}", flush=True)
            return
        grow = f"grow {before}->{before + 1}"

        def joiner() -> tuple[dict[str, Any], dict[str, Any]] | None:
            now = self.detail(job.id)
            rows = [row for row in live_rows(now) if row["pid"] not in survivors] if now else []
            return (now, rows[0]) if now and rows else None

        found = self.poll(joiner, self.settings.deadline_s, every_s=0.05)
        if found is None:
            self.record(Outcome(at_s, "joiner_kill", f"{grow}: no joiner started", [job.id], "HANG"))
            self.report_hang(job, "no joiner started after a grow")
            self.recover(job)
            return
        seen, row = found
        if not is_worker_process(row["pid"]):
            print(f"  joiner pid {row['pid']} is not a worker any more; measured as a resize", flush=True)
            grown = Watch(job, detail["steps_done"], detail["generation"])
            self.settle(Outcome(at_s, "resize", f"{before}->{before + 1}", [job.id]), grown_at, [grown])
            return
        at_s, event_at = self.elapsed(), time.monotonic()
        os.kill(row["pid"], signal.SIGKILL)
        after = self.detail(job.id)
        late = after is not None and after["state"] != "resizing"
        what = f"{grow}, {row['node']}" + (" (late: had joined)" if late else "")
        watch = Watch(job, seen["steps_done"], seen["generation"])
        self.settle(Outcome(at_s, "joiner_kill", what, [job.id]), event_at, [watch])

    def agent_restart(self) -> None:
        node = self.rng.choice(sorted(AGENTS))
        watches = self._everything_trains_on()
        if watches is None:
            return
        at_s, event_at, since = self.elapsed(), time.monotonic(), datetime.now(UTC)
        self.platform.restart_agent(node, AGENTS[node])
        outcome = Outcome(at_s, "agent_restart", node, [w.job.id for w in watches])
        self.settle(outcome, event_at, watches, lambda: self.agent_registered(node, since))

    def _everything_trains_on(self) -> list[Watch] | None:
        watches = []
        for job in self.jobs:
            taken = self.snapshot(job, new_generation=False)
            if taken is None:
                return None
            watches.append(taken[1])
        return watches

    def _restart(self, process: str, ready: Callable[[], bool] = lambda: True) -> None:
        """SIGKILL the platform's `process` and start it again at once; settled once `ready`
        holds and every job has trained past its step at the event (its progress reached the
        portal). The event is recorded as "<process>_restart"."""
        watches = self._everything_trains_on()
        if watches is None:
            return
        at_s, event_at = self.elapsed(), time.monotonic()
        self.platform.kill(process)
        self.platform.start(process)
        outcome = Outcome(at_s, f"{process}_restart", process, [w.job.id for w in watches])
        self.settle(outcome, event_at, watches, ready)

    def portal_restart(self) -> None:
        """Restarts the portal; settled once it answers and every job trains on."""
        self._restart("portal", self.platform.portal_answers)

    def beat_restart(self) -> None:
        """Restarts Celery beat; every job trains on."""
        self._restart("beat")

    def scheduler_restart(self) -> None:
        """SIGKILL the Celery worker (the scheduler), pin a job to another count while it is
        down, and start it again: settled when the pin has landed (a new generation trains)."""
        choices = self.resizable()
        if not choices:
            return
        job, counts = self.rng.choice(choices)
        workers = self.rng.choice(counts)
        taken = self.snapshot(job)
        if taken is None:
            return
        at_s, event_at, before = self.elapsed(), time.monotonic(), job.target
        self.platform.kill("worker")
        refusal = self.pin(job, workers)
        self.platform.start("worker")
        if refusal:
            print(f"[{at_s:7.1f} s] scheduler_restart job {job.id} {before}->{workers} refused: {refusal}", flush=True)
            return
        self.settle(Outcome(at_s, "scheduler_restart", f"pin {before}->{workers} while down", [job.id]),
                    event_at, [taken[1]])

    def step(self) -> None:
        possible = ["worker_kill", "agent_restart"]
        if self.settings.control_plane:
            possible += ["portal_restart", "beat_restart"]
            if self.resizable():
                possible.append("scheduler_restart")
        if self.resizable():
            possible.append("resize")
        if self.growable():
            possible.append("joiner_kill")
        if self.settings.kinds:
            possible = [kind for kind in possible if kind in self.settings.kinds]
            if not possible:
                return
        kind = self.rng.choice(sorted(possible))
        getattr(self, kind)()

    def run(self) -> str | None:
        """Submits the jobs and drives events until the minutes are over; returns why it
        stopped early, or None."""
        try:
            for workers in INITIAL_WORKERS:
                self.jobs.append(self.submit(workers))
            print(
                f"[{self.elapsed():7.1f} s] jobs {[j.id for j in self.jobs]} training on "
                f"{[j.target for j in self.jobs]} workers; events begin",
                flush=True,
            )
            self.began = time.monotonic()
            while self.elapsed() < 60 * self.settings.minutes:
                self.step()
                time.sleep(self.settings.pause_s)
        except (PlatformDiedError, SoakAbortedError) as err:
            print(f"*** stopped early: {err}", flush=True)
            return str(err).splitlines()[0]
        except KeyboardInterrupt:
            print("*** interrupted", flush=True)
            return "interrupted"
        return None

    def cancel_all(self) -> None:
        for job in self.jobs:
            if self.platform.group.dead():
                return
            self.cancel(job)


def summarise(
    soak: Soak,
    settings: SoakSettings,
    conditions: dict[str, Any],
    load_end: float,
    stopped: str | None,
    wall_s: float,
) -> dict[str, Any]:
    outcomes = soak.outcomes
    settles = [o.settle_s for o in outcomes if o.status == "ok" and o.settle_s is not None]
    by_kind: dict[str, Any] = {}
    for kind in KINDS:
        chosen = [o for o in outcomes if o.kind == kind]
        by_kind[kind] = {
            "events": len(chosen),
            "hangs": sum(o.status == "HANG" for o in chosen),
            "failed": sum(o.status == "FAILED" for o in chosen),
            "settle_s": settle_stats(
                [o.settle_s for o in chosen if o.status == "ok" and o.settle_s is not None]
            ),
        }
    overall = settle_stats(settles)
    hangs = [o for o in outcomes if o.status == "HANG"]
    failed = [o for o in outcomes if o.status == "FAILED"]
    print(
        f"\nSoak: {len(outcomes)} events in {settings.minutes:g} minutes (seed {settings.seed}, "
        f"load {'on' if settings.load else 'off'}, policy {settings.policy}, deadline {settings.deadline_s:g} s); "
        f"{conditions['cores']} cores, load average {conditions['load_average_1m']} at start, "
        f"{load_end:.2f} at end; {wall_s:.0f} s in all"
    )
    print(
        f"hangs: {len(hangs)}"
        + (" *** " + "; ".join(f"{o.kind} job {o.job_ids} at {o.at_s:.0f} s" for o in hangs) if hangs else "")
    )
    print(
        f"jobs that failed: {len(failed)}"
        + (
            " *** " + "; ".join(f"{o.kind} job {o.job_ids} at {o.at_s:.0f} s" for o in failed)
            if failed
            else ""
        )
    )
    if stopped:
        print(f"stopped early: {stopped}")
    print("settle time, min / median / p95 / max:")
    print(f"  {'all':<14} {show_stats(overall)}")
    for kind, stats in by_kind.items():
        extra = (
            f", {stats['hangs']} hung, {stats['failed']} failed" if stats["hangs"] or stats["failed"] else ""
        )
        print(f"  {kind:<14} {show_stats(stats['settle_s'])}; {stats['events']} events{extra}")
    return {
        "bench": "soak",
        "events": len(outcomes),
        "hangs": len(hangs),
        "failed": len(failed),
        "settle_min_s": overall["min"],
        "settle_median_s": overall["median"],
        "settle_p95_s": overall["p95"],
        "settle_max_s": overall["max"],
        "by_kind": by_kind,
        "hung_events": [
            {"at_s": round(o.at_s, 1), "kind": o.kind, "jobs": o.job_ids, "what": o.what} for o in hangs
        ],
        "stopped_early": stopped,
        "minutes": settings.minutes,
        "seed": settings.seed,
        "load": settings.load,
        "policy": settings.policy,
        "deadline_s": settings.deadline_s,
        "max_restarts": "product" if settings.max_restarts is None else settings.max_restarts,
        "kinds": list(settings.kinds) or "all",
        "cores": conditions["cores"],
        "load_average_start": conditions["load_average_1m"],
        "load_average_end": round(load_end, 2),
        "conditions": conditions,
        "wall_s": round(wall_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long events are driven (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the event RNG (default 0)")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=150.0,
        help="an event after which a job is not training again within this is a hang (default 150: "
        "the longest deadline an event here can meet, a joiner's warm-up, 120 s, plus 30 s)",
    )
    parser.add_argument("--pause-s", type=float, default=2.0, help="pause between events (default 2)")
    parser.add_argument("--load", action="store_true", help="a busy loop on every core for the whole run")
    parser.add_argument("--policy", default="fair", help="the scheduling policy (default fair)")
    parser.add_argument(
        "--max-restarts",
        default="100000",
        help="BUNGEE_MAX_RESTARTS: kills are on purpose here (default 100000); 'product': the platform's own "
        "restart budget (BUNGEE_MAX_RESTARTS, BUNGEE_RESTART_WINDOW_S, BUNGEE_RESTART_HEALTHY_S as configured)",
    )
    parser.add_argument(
        "--kinds", default="", help=f"only these kinds of event, comma-separated, of {', '.join(KINDS)} (default: all)"
    )
    parser.add_argument(
        "--control-plane",
        action="store_true",
        help="also SIGKILL and restart the portal, Celery beat, and the Celery worker with a pin asked "
        "while it is down",
    )
    args = parser.parse_args(argv)
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        parser.error(f"--kinds: unknown kind(s) {unknown}; the kinds are {', '.join(KINDS)}")
    max_restarts = None if args.max_restarts == "product" else int(args.max_restarts)
    settings = SoakSettings(
        args.minutes, args.seed, args.deadline_s, args.pause_s, args.load, args.policy, max_restarts,
        args.control_plane, kinds,
    )
    # A SIGTERM ends the run as Ctrl-C does: through the `finally` that stops the platform.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    began = time.monotonic()
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    hogs: list[multiprocessing.Process] = []
    if settings.load:
        hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)]
        for hog in hogs:
            hog.start()
        print(f"load: {len(hogs)} busy loops", flush=True)
    env = {
        **FAST_PROGRESS_ENV,
        "BUNGEE_CHECKPOINT_EVERY_S": "1",
        "BUNGEE_POLICY": settings.policy,
        **({} if settings.max_restarts is None else {"BUNGEE_MAX_RESTARTS": str(settings.max_restarts)}),
        "BUNGEE_SIM_PACE": "1",  # flat out, not the test platform's pace of 4: the steps are what is timed
    }
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-soak-"))
    print(f"logs in {work / 'logs'}", flush=True)
    soak: Soak | None = None
    stopped: str | None = None
    try:
        with running_platform(work, AGENTS, env) as platform:
            soak = Soak(platform, settings)
            registered = soak.poll(
                lambda: (
                    (c := soak.get("/api/cluster")) is not None
                    and sum(len(n["devices"]) for n in c["nodes"]) == DEVICES
                ),
                120,
            )
            if not registered:
                stopped = f"the agents' {DEVICES} devices were not registered in 120 s"
            else:
                stopped = soak.run()
            try:
                soak.cancel_all()
            except PlatformDiedError as err:
                print(f"cancelling: {err}", flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join(5)
    load_end = os.getloadavg()[0]
    summary = (
        summarise(soak, settings, conditions, load_end, stopped, time.monotonic() - began)
        if soak
        else {"bench": "soak", "events": 0, "hangs": 0, "settle_p95_s": None, "stopped_early": "no platform"}
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
