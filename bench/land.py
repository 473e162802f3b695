"""Land time: from asking for a resize to the first step of the new generation, on the whole
platform (tests.platform: PostgreSQL, Redis, daphne, the Celery scheduler, one agent with four
simulated devices, real torch workers), with warm standby workers and without.

    python bench/land.py              # 5 rounds each way on the 25.6M model
    python bench/land.py --quick      # 2 rounds each way

`bench/resize.py` runs it too and puts `land_median_s` (standbys) and `land_median_s_cold` in its
JSON line. A job (the 25.6M digits MLP, strict, 1 to 4 workers, pinned through the API) goes,
each round: scale out 1 -> 2 and 2 -> 3 (`POST /api/jobs/N/resize`), a migration (the owner of
one of its devices comes back, played through the agent's command stream as `python -m
agent.simulate owner` does; the pin keeps it at 3, so a worker moves to the free device), the
owner leaves, and back to 1. The clock starts just before the request is sent and stops at the
end of the first step of the new generation (the resize's `completed_at`, rank 0's report; same
machine, same clock). Before each scale-out and migration the bench waits until the free devices'
standbys are warm (with standbys) or the device is free (without): the steady state of a
cluster, where a device has been free for more than a few seconds.

Beside each land time it prints when that first step began (the end less the step, from the
resize's own phases: the new generation is training from then) and the joiner's own start-up line
(the worker's "built in" log: its task code, model, optimiser and warm-up pass). It also reports
what a waiting standby costs: its resident memory and its CPU use over 5 s of
waiting. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.main import DEFAULT_PREPARED  # noqa: E402
from bench.conditions import RESNET50_SIZED, BenchModel, machine, show, spread  # noqa: E402
from elastic.worker.standby import PREPARED_LINE, READY_LINE  # noqa: E402

SCALE_OUT_1_2, SCALE_OUT_2_3, MIGRATION = "scale out 1->2", "scale out 2->3", "migration"
LAND_SCENARIOS = (SCALE_OUT_1_2, SCALE_OUT_2_3, MIGRATION)
DEVICES = 4
ENDLESS = 10_000_000
SETTLE_S = 300.0
BUILT = re.compile(r"built in [0-9.]+ s, ([0-9.]+) s after the worker began")
"""The worker's start-up line (elastic.worker.runner): how long after its process began to be
the worker it was built."""


def job_spec(model: BenchModel) -> dict[str, Any]:
    return {
        "name": f"land-{model.label}",
        "workload": "digits-mlp",
        "min_workers": 1,
        "max_workers": DEVICES,
        "steps": ENDLESS,
        "seed": 0,
        "hyperparameters": {
            "batch_size": model.batch_size, "hidden": model.hidden, "layers": model.layers, "dropout": 0.0, "lr": 0.01,
        },
    }


def waiting_standbys(state_dir: Path) -> list[tuple[psutil.Process, bool]]:
    """The standbys that wait, as their own output files name them (a standby that became a
    worker has its command line still, but its own output file is gone), each with whether it
    was prepared for a job."""
    found = []
    for output in (state_dir / "standby").glob("device*.out"):
        said = output.read_text(errors="replace")
        for line in said.splitlines():
            if READY_LINE in line:
                try:
                    found.append((psutil.Process(json.loads(line)["pid"]), PREPARED_LINE in said))
                except (ValueError, KeyError, psutil.NoSuchProcess):
                    pass
    return found


def standby_cost(state_dir: Path, seconds: float = 5.0) -> dict[str, Any]:
    """Resident memory and CPU of the waiting standbys over `seconds`, unprepared and prepared
    apart (a prepared one holds the job's model, optimiser and trainer buffers)."""
    processes = waiting_standbys(state_dir)
    before = {p.pid: p.cpu_times() for p, _ in processes}
    time.sleep(seconds)
    kinds: dict[str, dict[str, list[float]]] = {}
    for process, prepared in processes:
        try:
            after = process.cpu_times()
            memory = process.memory_full_info()
        except psutil.NoSuchProcess:
            continue
        kind = kinds.setdefault("prepared" if prepared else "unprepared", {"rss": [], "uss": [], "pss": [], "cpu": []})
        kind["rss"].append(memory.rss / 2**20)
        kind["uss"].append(memory.uss / 2**20)  # its own pages: what killing it frees
        kind["pss"].append(memory.pss / 2**20)  # shared pages (torch's libraries) split among their users
        start = before[process.pid]
        kind["cpu"].append(100 * ((after.user + after.system) - (start.user + start.system)) / seconds)
    return {
        name: {
            "standbys": len(values["rss"]),
            "rss_mib": spread(values["rss"]),
            "uss_mib": spread(values["uss"]),
            "pss_mib": spread(values["pss"]),
            "cpu_pct": spread(values["cpu"]),
        }
        for name, values in sorted(kinds.items())
    } | {"seconds": seconds}


@dataclass
class LandTimes:
    """What one arm measured, per scenario."""

    standbys: bool
    land_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in LAND_SCENARIOS})
    """Request to the end of the new generation's first step."""
    start_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in LAND_SCENARIOS})
    """Request to the start of that step."""
    phases_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Phase (launch, build, switch, first_step) -> seconds, one per resize."""


class LandRun:
    """One platform, one job, standbys on or off."""

    def __init__(self, platform: Any, model: BenchModel, standbys: bool) -> None:
        self.platform = platform
        self.alice = platform.api("alice")
        self.model = model
        self.standbys = standbys
        self.times = LandTimes(standbys)
        """scenario -> phase (launch, build, switch, first_step) -> seconds, one per resize."""
        self.seen_log = 0
        self.state_dir = Path(platform.env["BUNGEE_DATA_DIR"]) / "agent" / "node-a"

    def job(self) -> dict[str, Any]:
        reply = self.alice.get(f"/api/jobs/{self.job_id}")
        reply.raise_for_status()
        return reply.json()

    def start(self) -> None:
        self.platform.wait_for(
            f"{DEVICES} devices",
            lambda: sum(len(n["devices"]) for n in self.alice.get("/api/cluster").json()["nodes"]) == DEVICES,
        )
        reply = self.alice.post("/api/jobs", json=job_spec(self.model))
        reply.raise_for_status()
        self.job_id = reply.json()["id"]
        self.pin(1)
        self.settled(1)

    def pin(self, workers: int) -> None:
        reply = self.alice.post(f"/api/jobs/{self.job_id}/resize", json={"workers": workers})
        reply.raise_for_status()

    def settled(self, workers: int, after_generation: int = 0) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            job = self.job()
            live = [w for w in job["workers_history"] if w["state"] == "running"]
            done = (
                job["state"] == "running"
                and job["workers"] == workers
                and job["generation"] > after_generation
                and job["resizes"]
                and job["resizes"][-1]["completed_at"] is not None
                and len(live) == workers
                and all(w["generation"] == job["generation"] for w in live)
            )
            return job if done else None

        # Half a second between polls: the land time comes from the portal's own timestamps, not
        # from when this loop notices, and a faster poll is CPU the training shares.
        return self.platform.wait_for(f"job {self.job_id} on {workers} workers", check, SETTLE_S, 0.5)

    def warm(self, free: int) -> None:
        """Waits until `free` devices have a warm standby, and up to DEFAULT_PREPARED of them are
        prepared for the job (with standbys on)."""
        if not self.standbys:
            return
        prepared = min(free, DEFAULT_PREPARED)

        def ready() -> bool:
            said = [f.read_text(errors="replace") for f in (self.state_dir / "standby").glob("device*.out")]
            return sum(READY_LINE in s for s in said) >= free and sum(PREPARED_LINE in s for s in said) >= prepared

        self.platform.wait_for(f"{free} warm standbys, {prepared} prepared", ready, SETTLE_S, 0.1)

    def measured(self, scenario: str, act: Any, workers: int) -> None:
        before = self.job()["generation"]
        asked = time.time()
        act()
        job = self.settled(workers, before)
        resize = job["resizes"][-1]
        landed = datetime.fromisoformat(resize["completed_at"]).timestamp()
        # The new generation's first step began this long before it ended (the resize's own
        # phases: last step end to first step end, less rendezvous, exchange, transfer, leave).
        first_step = resize["phases"].get("first_step", 0.0)
        self.times.land_s[scenario].append(landed - asked)
        self.times.start_s[scenario].append(landed - first_step - asked)
        built = self.joiner_built(resize["generation"])
        where = ""
        if built:
            # The last joiner to be built decides when the switch can happen.
            began, ready = max(built, key=lambda b: b[2])[1:]
            where = (
                f"\n    where it went: request to the joiner's process {began - asked:.3f} s, its build "
                f"{ready - began:.3f} s, built to the first step's start {landed - first_step - ready:.3f} s, "
                f"the first step {first_step:.3f} s; the switch's phases: "
                + ", ".join(f"{name} {seconds:.3f}" for name, seconds in resize["phases"].items())
            )
            for name, seconds in (
                ("launch", began - asked), ("build", ready - began), ("switch", landed - first_step - ready),
                ("first_step", first_step),
            ):
                self.times.phases_s.setdefault(scenario, {}).setdefault(name, []).append(seconds)
        print(
            f"  {'standbys' if self.standbys else 'cold'}: {scenario}: landed in {landed - asked:.3f} s "
            f"(its first step began at {landed - first_step - asked:.3f} s; pause {resize['pause_s']:.3f} s)"
            + "".join(f"\n    joiner: {line}" for line, _, _ in built) + where,
            flush=True,
        )

    def joiner_built(self, generation: int) -> list[tuple[str, float, float]]:
        """What the joiners of `generation` said of their start-up (the worker's "built in"
        line), with when its process began to be the worker and when it was built (epoch s)."""
        reply = self.alice.get(f"/api/jobs/{self.job_id}/logs", params={"after": self.seen_log})
        reply.raise_for_status()
        lines = reply.json()
        if lines:
            self.seen_log = lines[-1]["id"]
        found = []
        for g in lines:
            match = BUILT.search(g["line"]) if g["generation"] == generation else None
            if match:
                ready = datetime.fromisoformat(g["at"]).timestamp()
                found.append((f"rank {g['rank']}: {g['line']}", ready - float(match.group(1)), ready))
        return found

    def owner(self, device_index: int, present: bool) -> None:
        from agent.simulate import main as simulate

        simulate([
            "owner", "--redis-url", self.platform.env["REDIS_URL"], "--node", "node-a", "--device",
            str(device_index), "--present" if present else "--absent", "--prefix", self.platform.env["BUNGEE_REDIS_PREFIX"],
        ])

    def round(self) -> None:
        self.warm(DEVICES - 1)
        self.measured(SCALE_OUT_1_2, lambda: self.pin(2), 2)
        self.warm(DEVICES - 2)
        self.measured(SCALE_OUT_2_3, lambda: self.pin(3), 3)
        self.warm(DEVICES - 3)
        used = [a["device_index"] for a in self.job()["allocations"]]
        taken = max(used)
        self.measured(MIGRATION, lambda: self.owner(taken, True), 3)
        self.owner(taken, False)
        generation = self.job()["generation"]
        self.pin(1)
        self.settled(1, generation)


def run_land(model: BenchModel, standbys: bool, rounds: int, work: Path) -> tuple[LandTimes, dict[str, Any]]:
    """The run (land times per scenario), and what the standbys cost at idle (empty without them)."""
    from tests.platform import running_platform

    env = {
        "BUNGEE_STANDBYS": "on" if standbys else "off",
        "BUNGEE_PROGRESS_EVERY_S": "0.2",
        "BUNGEE_CHECKPOINT_EVERY_S": "86400",
        "BUNGEE_PG_TIMEOUT_S": "60",
    }
    with running_platform(work / ("standbys" if standbys else "cold"), {"node-a": DEVICES}, env) as platform:
        run = LandRun(platform, model, standbys)
        run.start()
        cost: dict[str, Any] = {}
        if standbys:
            run.warm(DEVICES - 1)
            cost = standby_cost(run.state_dir)
            print(f"  a waiting standby: {cost}", flush=True)
        for _ in range(rounds):
            run.round()
        return run.times, cost


def land_report(model: BenchModel, rounds: int, work: Path, with_cold: bool = True) -> dict[str, Any]:
    """Both arms (or only the standbys' without `with_cold`), one after the other on fresh
    platforms; returns the JSON fields and prints a table."""
    warm_run, cost = run_land(model, True, rounds, work)
    cold_run = run_land(model, False, rounds, work)[0] if with_cold else LandTimes(standbys=False)
    warm, cold = warm_run.land_s, cold_run.land_s
    print(f"\nLand time, request to the end of the first step of the new generation ({model.label} model, "
          "platform, one agent, 4 simulated devices); min / median / max")
    for scenario in LAND_SCENARIOS:
        print(f"  {scenario:16} standbys {show(warm[scenario])}; cold {show(cold[scenario])}")
    print("Request to the start of that first step (the new generation is training):")
    for scenario in LAND_SCENARIOS:
        print(f"  {scenario:16} standbys {show(warm_run.start_s[scenario])}; cold {show(cold_run.start_s[scenario])}")
    print("Where it went (request to the joiner's process, its build, built to the first step's start, the first step):")
    for run in (warm_run, cold_run):
        for scenario, phases in run.phases_s.items():
            print(f"  {'standbys' if run.standbys else 'cold':8} {scenario:16} "
                  + "; ".join(f"{name} {show(values)}" for name, values in phases.items()))
    every_warm = [v for s in LAND_SCENARIOS for v in warm[s]]
    every_cold = [v for s in LAND_SCENARIOS for v in cold[s]]
    scale_out = [v for s in (SCALE_OUT_1_2, SCALE_OUT_2_3) for v in warm[s]]
    scale_out_start = [v for s in (SCALE_OUT_1_2, SCALE_OUT_2_3) for v in warm_run.start_s[s]]
    return {
        "land_median_s": spread(every_warm)["median"],
        "land_median_s_cold": spread(every_cold)["median"],
        "land_scale_out_median_s": spread(scale_out)["median"],
        "land_to_first_step_start_scale_out_median_s": spread(scale_out_start)["median"],
        "land_by_scenario_s": {s: {"standbys": spread(warm[s]), "cold": spread(cold[s])} for s in LAND_SCENARIOS},
        "land_to_first_step_start_by_scenario_s": {
            s: {"standbys": spread(warm_run.start_s[s]), "cold": spread(cold_run.start_s[s])} for s in LAND_SCENARIOS
        },
        "land_phases_s": {
            "standbys": {s: {k: spread(v) for k, v in p.items()} for s, p in warm_run.phases_s.items()},
            "cold": {s: {k: spread(v) for k, v in p.items()} for s, p in cold_run.phases_s.items()},
        },
        "standby_idle_cost": cost,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds each way")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--skip-cold", action="store_true", help="only the arm with standbys (no baseline: for profiling)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    rounds = args.rounds or (2 if args.quick else 5)
    summary = {
        "bench": "land",
        "model": RESNET50_SIZED.label,
        **land_report(RESNET50_SIZED, rounds, Path(tempfile.mkdtemp(prefix="bungee-bench-land-")), not args.skip_cold),
        "conditions": conditions,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
