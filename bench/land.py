"""Land time: from asking for a resize to the first step of the new generation, on the whole
platform (tests.platform: PostgreSQL, Redis, the portal, the Celery scheduler, one agent with four
simulated devices, real torch workers), in three arms: warm standby workers, some prepared for
the job (ours, the agent's default), warm standbys none of which is prepared (the agent with
--prepared-standbys 0: the baseline for the prepared build), and none at all (cold starts); on
request a fourth, `environment`: the same job as code of its own with a requirements.txt, whose
standbys start and are prepared in its own environment (compare it with `standbys`).

    python bench/land.py              # 5 rounds each arm on the 25.6M model
    python bench/land.py --quick      # 2 rounds each arm
    python bench/land.py --arms standbys   # one arm (for profiling: no baseline)
    python bench/land.py --arms standbys environment   # own packages against none

`bench/resize.py` runs it too and puts `land_median_s` (standbys), `land_median_s_unprepared`
and `land_median_s_cold` in its JSON line. A job (the 25.6M digits MLP, strict, 1 to 4 workers, pinned through the API) goes,
each round: scale out 1 -> 2 and 2 -> 3 (`POST /api/jobs/N/resize`), a migration (the owner of
one of its devices comes back, played through the agent's command stream as `python -m
agent.simulate owner` does; the pin keeps it at 3, so a worker moves to the free device), the
owner leaves, and back to 1. The clock starts just before the request is sent and stops at the
end of the first step of the new generation (the resize's `completed_at`, rank 0's report; same
machine, same clock). Before each scale-out and migration the bench waits until the free devices'
standbys are warm (and, in the first arm, up to two prepared) or the device is free (without):
the steady state of a cluster, where a device has been free for more than a few seconds.

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

from agent.settings import DEFAULT_PREPARED  # noqa: E402
from bench.conditions import RESNET50_SIZED, BenchModel, machine, show, spread  # noqa: E402
from elastic.worker.standby import PREPARED_LINE, READY_LINE  # noqa: E402
from elastic.workloads import CATALOGUE  # noqa: E402
from tests.environment_support import TINY, tiny_wheelhouse  # noqa: E402

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


def own_code(alice: Any) -> dict[str, Any]:
    """The digits task uploaded as the job's own code, with a requirements.txt (a package from
    the agents' wheelhouse): the spec's code and entrypoint."""
    from tests.code_support import directory_files, tar_gz

    info = CATALOGUE["digits-mlp"]
    files = {**directory_files(info.path), "requirements.txt": f"{TINY}==2.0\n".encode()}
    reply = alice.post("/api/code", files={"file": ("digits.tar.gz", tar_gz(files), "application/gzip")})
    reply.raise_for_status()
    return {"code": reply.json()["digest"], "entrypoint": info.entrypoint}


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


ARMS = ("standbys", "unprepared", "cold")
"""Standbys prepared for the job (ours), standbys none of which is prepared, no standbys."""
ENVIRONMENT = "environment"
"""The arm (only on request, --arms) of the same task as the job's own code with a requirements.txt:
its workers start from its environment's interpreter (agent.environments), the joiners from
standbys started and prepared in that environment, as in the first arm."""
ALL_ARMS = (*ARMS, ENVIRONMENT)


@dataclass
class LandTimes:
    """What one arm measured, per scenario."""

    arm: str
    land_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in LAND_SCENARIOS})
    """Request to the end of the new generation's first step."""
    start_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in LAND_SCENARIOS})
    """Request to the start of that step."""
    phases_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Phase (launch, build, switch, first_step) -> seconds, one per resize."""


class LandRun:
    """One platform, one job, one arm (ARMS)."""

    def __init__(self, platform: Any, model: BenchModel, arm: str) -> None:
        self.platform = platform
        self.alice = platform.api("alice")
        self.model = model
        self.arm = arm
        self.standbys = arm != "cold"
        self.prepared = DEFAULT_PREPARED if arm in ("standbys", ENVIRONMENT) else 0
        """Standbys the agent prepares for the job."""
        self.times = LandTimes(arm)
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
        spec = job_spec(self.model)
        if self.arm == ENVIRONMENT:
            spec = {key: value for key, value in spec.items() if key != "workload"} | own_code(self.alice)
        reply = self.alice.post("/api/jobs", json=spec)
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
        """Waits until `free` devices have a warm standby, and up to `self.prepared` of them are
        prepared for the job (with standbys on)."""
        if not self.standbys:
            return
        prepared = min(free, self.prepared)

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
            f"  {self.arm}: {scenario}: landed in {landed - asked:.3f} s "
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


def run_land(
    model: BenchModel, arm: str, rounds: int, work: Path, isolation: str = "auto"
) -> tuple[LandTimes, dict[str, Any]]:
    """The arm's run (land times per scenario), and what its standbys cost at idle (empty without
    them); the agent confines jobs as `isolation` says (its --isolation)."""
    from tests.platform import running_platform

    env = {
        "BUNGEE_AGENT_ISOLATION": isolation,
        "BUNGEE_STANDBYS": "off" if arm == "cold" else "on",
        "BUNGEE_PREPARED_STANDBYS": str(DEFAULT_PREPARED if arm in ("standbys", ENVIRONMENT) else 0),
        "BUNGEE_PROGRESS_EVERY_S": "0.2",
        "BUNGEE_CHECKPOINT_EVERY_S": "86400",
        "BUNGEE_PG_TIMEOUT_S": "60",
        # The test platform's pace (4: each step's compute stretched, the workers sleeping for
        # it) would stretch the steps a land time waits for: the bench runs flat out.
        "BUNGEE_SIM_PACE": "1",
    }
    if arm == ENVIRONMENT:
        env |= {"BUNGEE_ENV_FIND_LINKS": str(tiny_wheelhouse(work / "wheelhouse")), "UV_OFFLINE": "1"}
    with running_platform(work / f"{arm}-{isolation}", {"node-a": DEVICES}, env) as platform:
        run = LandRun(platform, model, arm)
        run.start()
        cost: dict[str, Any] = {}
        if run.standbys:
            run.warm(DEVICES - 1)
            cost = standby_cost(run.state_dir)
            print(f"  a waiting standby ({arm}): {cost}", flush=True)
        for _ in range(rounds):
            run.round()
        return run.times, cost


def land_report(model: BenchModel, rounds: int, work: Path, arms: tuple[str, ...] = ARMS) -> dict[str, Any]:
    """The `arms`, one after the other on fresh platforms; returns the JSON fields and prints a
    table."""
    times: dict[str, LandTimes] = {}
    costs: dict[str, dict[str, Any]] = {}
    for arm in ALL_ARMS:
        times[arm], costs[arm] = run_land(model, arm, rounds, work) if arm in arms else (LandTimes(arm), {})

    def row(field_name: str, scenario: str) -> str:
        return "; ".join(f"{arm} {show(getattr(times[arm], field_name)[scenario])}" for arm in arms)

    print(f"\nLand time, request to the end of the first step of the new generation ({model.label} model, "
          "platform, one agent, 4 simulated devices); min / median / max")
    for scenario in LAND_SCENARIOS:
        print(f"  {scenario:16} {row('land_s', scenario)}")
    print("Request to the start of that first step (the new generation is training):")
    for scenario in LAND_SCENARIOS:
        print(f"  {scenario:16} {row('start_s', scenario)}")
    print("Where it went (request to the joiner's process, its build, built to the first step's start, the first step):")
    for arm in arms:
        for scenario, phases in times[arm].phases_s.items():
            print(f"  {arm:10} {scenario:16} " + "; ".join(f"{name} {show(values)}" for name, values in phases.items()))

    def median(arm: str, field_name: str, scenarios: tuple[str, ...] = LAND_SCENARIOS) -> float | None:
        values = getattr(times[arm], field_name)
        return spread([v for s in scenarios for v in values[s]])["median"]

    scale_out = (SCALE_OUT_1_2, SCALE_OUT_2_3)
    return {
        "land_median_s": median("standbys", "land_s"),
        "land_median_s_unprepared": median("unprepared", "land_s"),
        "land_median_s_cold": median("cold", "land_s"),
        "land_scale_out_median_s": median("standbys", "land_s", scale_out),
        "land_scale_out_median_s_unprepared": median("unprepared", "land_s", scale_out),
        "land_to_first_step_start_scale_out_median_s": median("standbys", "start_s", scale_out),
        "land_median_s_environment": median(ENVIRONMENT, "land_s"),
        "land_by_scenario_s": {s: {arm: spread(times[arm].land_s[s]) for arm in ALL_ARMS} for s in LAND_SCENARIOS},
        "land_to_first_step_start_by_scenario_s": {
            s: {arm: spread(times[arm].start_s[s]) for arm in ALL_ARMS} for s in LAND_SCENARIOS
        },
        "land_phases_s": {
            arm: {s: {k: spread(v) for k, v in p.items()} for s, p in times[arm].phases_s.items()} for arm in ALL_ARMS
        },
        "standby_idle_cost": costs["standbys"] or costs["unprepared"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds each arm")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--arms", nargs="+", choices=ALL_ARMS, default=list(ARMS),
        help=f"the arms to run (default: {', '.join(ARMS)}; {ENVIRONMENT} on request)",
    )
    args = parser.parse_args(argv)
    began = time.monotonic()
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    rounds = args.rounds or (2 if args.quick else 5)
    summary = {
        "bench": "land",
        "model": RESNET50_SIZED.label,
        **land_report(RESNET50_SIZED, rounds, Path(tempfile.mkdtemp(prefix="bungee-bench-land-")), tuple(args.arms)),
        "conditions": conditions,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
