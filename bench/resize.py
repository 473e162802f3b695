"""How long an in-place resize pauses a job, against torchrun's restart with a checkpoint reload.

    python bench/resize.py            # 5 rounds on the 25.6M model, 1 on the 100M (about 10 minutes)
    python bench/resize.py --quick    # 1 round on the 25.6M model, one torchrun run each setting
    python bench/resize.py --device cuda   # NCCL with a GPU per worker (4 for every scenario);
                                          # fewer GPUs: every worker on GPU 0, over gloo
    python bench/resize.py --quick --task DIR --entrypoint task:MyTask --hyperparameters '{"batch_size": 32}'
                                      # a user's task (elastic.tasks) in place of the MLP

For each model (a deep MLP on the digits, SGD with momentum: 25.6M parameters is ResNet-50's
size, 205 MB of parameters and momentum; and a 100M one) a job trains on real worker processes
(elastic.worker.local.LocalJob: membership records in Redis, the same protocol as the platform)
while it is resized, round after round: scale out 2 -> 3, scale in 3 -> 2, migrate one worker,
two joiners at once (2 -> 4), and back to 2. The pause of a resize is what rank 0 reports: from
the end of the last step before the switch to the end of the first step after it, less a normal
step of the new membership. The effective bandwidth is the state's bytes over the transfer
phase, against the raw gloo (or NCCL) broadcast bandwidth of the machine. Crash recovery is the
time from a SIGKILL of a worker to the end of the first step after the survivors went on.

The baseline, on the 25.6M model, is torchrun's elastic restart the way its users resize today
(bench/torchrun_train.py: DDP, a checkpoint saved on SIGTERM and reloaded by every new worker):
`--nnodes=1:3` with the c10d rendezvous, grown one agent at a time: 1 -> 2 (the rendezvous
waits for its last call) and 2 -> 3 (it fills the range and closes at once: the headline, same
resize as ours), once with the rendezvous defaults and once with `last_call_timeout=1`;
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch#135712) lets it recover at all.

Land time (bench/land.py) is what a user waits for: from the API call that asks for a resize to
the end of the first step of the new generation, on the whole platform (scheduler, agent, real
workers), for scale-out 1 -> 2 and 2 -> 3 and a migration, with warm standby workers some of which
are prepared for the job (agent.standby), with standbys none of which is, and without (every
joiner starts Python and imports torch): 5 rounds each, 2 in --quick.

The last line is one JSON object: {"bench": "resize", "model_params", "pause_median_s",
"torchrun_pause_median_s", "speedup_vs_torchrun", "two_joiners_vs_one", "bandwidth_fraction",
"crash_recovery_s", "land_median_s", "land_median_s_unprepared", "land_median_s_cold", ...} for the
25.6M model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import (  # noqa: E402
    LARGE,
    PYTHON_PATH,
    REDIS_URL,
    RESNET50_SIZED,
    ROOT,
    BenchModel,
    TaskModel,
    machine,
    shared_gpu_env,
    show,
    spread,
)
from bench.land import land_report  # noqa: E402
from elastic.wire import WorkerEvent  # noqa: E402
from elastic.worker.local import LocalJob, free_port  # noqa: E402

OUT, IN, MIGRATE, TWO, IN4 = (
    "scale out 2->3",
    "scale in 3->2",
    "migrate 1 of 2",
    "two joiners 2->4",
    "scale in 4->2",
)
SCENARIOS = (OUT, IN, MIGRATE, TWO, IN4)

_BROADCAST = """
import sys, time, torch, torch.distributed as dist
from datetime import timedelta
rank, port, size, device, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
torch.set_num_threads(1)
if device == "cuda":
    torch.cuda.set_device(rank if backend == "nccl" else 0)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group(backend, store=store, rank=rank, world_size=2)
data = torch.ones(size // 4, device="cuda" if device == "cuda" else "cpu")
for repetition in range(6):
    dist.barrier()
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    dist.broadcast(data, 0)
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 1 and repetition:
        print(size / (time.perf_counter() - began) / 1e9, flush=True)
dist.destroy_process_group()
"""


def raw_backend(device: str) -> str:
    """The backend our workers use on `device` with 4 workers, which the raw figure measures."""
    return "gloo" if device == "cpu" or shared_gpu_env(device, 4) else "nccl"


def broadcast_bandwidth(size: int, device: str) -> list[float]:
    """The machine's raw broadcast bandwidth, GB/s, one sender to one receiver, `size` bytes."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _BROADCAST, str(rank), str(port), str(size), device, raw_backend(device)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    return [float(line) for line in outputs[1].split()]


# --- the elastic runtime ---------------------------------------------------------------------


@dataclass
class Resize:
    scenario: str
    generation: int
    event: WorkerEvent | None = None

    @property
    def transfer_s(self) -> float | None:
        return (self.event.phases or {}).get("transfer") if self.event else None


@dataclass
class OursResult:
    model: BenchModel | TaskModel
    resizes: list[Resize] = field(default_factory=list)
    crash_recovery_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)

    def transfers(self, scenario: str) -> list[float]:
        """The transfer phase of each resize of `scenario` (rank 0's), in seconds."""
        return [r.transfer_s for r in self.resizes if r.scenario == scenario and r.transfer_s is not None]

    def pauses(self, scenario: str | None = None) -> list[float]:
        return [
            r.event.pause_s
            for r in self.resizes
            if r.event and r.event.pause_s is not None and scenario in (None, r.scenario)
        ]

    def bandwidths(self, scenario: str) -> list[float]:
        """GB/s: the state's bytes over the transfer phase (every joiner receives all of it, at
        the same time), comparable with a one-to-one broadcast."""
        rates = []
        for r in self.resizes:
            if r.scenario != scenario or r.event is None or not r.event.bytes_moved or not r.transfer_s:
                continue
            joiners = len(set(r.event.members_after or []) - set(r.event.members_before or []))
            rates.append(r.event.bytes_moved / joiners / r.transfer_s / 1e9)
        return rates


def run_ours(
    model: BenchModel | TaskModel, rounds: int, crashes: int, device: str, work: Path, route: str = "auto"
) -> OursResult:
    env = {
        **os.environ,
        "BUNGEE_STATE_ROUTE": route,
        "OMP_NUM_THREADS": "1",
        "BUNGEE_PROGRESS_EVERY_S": "0.001",
        "BUNGEE_CHECKPOINT_EVERY_S": "86400",
        "BUNGEE_PG_TIMEOUT_S": "60",
        "BUNGEE_RENDEZVOUS_TIMEOUT_S": "30",
        "PYTHONPATH": PYTHON_PATH,
        **shared_gpu_env(device, 4),
    }
    result = OursResult(model)
    with LocalJob(
        model.spec(10**7), work / f"run-{model.label}-{route}", REDIS_URL, env=env, device=device, task=model.task
    ) as job:

        def formed(generation: int, timeout_s: float = 300) -> None:
            members = len(job.records[generation - 1].members)
            job.wait_until(
                lambda: (
                    len(
                        {
                            o.pid
                            for o in job.outputs
                            for e in o.events
                            if e.kind == "joined" and e.generation == generation
                        }
                    )
                    == members
                ),
                timeout_s,
            )

        def resize(scenario: str, slots: list[int]) -> None:
            record = job.resize(slots)
            formed(record.generation)
            result.resizes.append(Resize(scenario, record.generation))
            print(f"  {model.label}: {scenario} -> generation {record.generation}", flush=True)

        job.start([0, 1])
        formed(1)
        pair, spares = [0, 1], [2, 3]
        for _ in range(rounds):
            (a, b), (c, d) = pair, spares
            resize(OUT, [a, b, c])
            resize(IN, [a, b])
            resize(MIGRATE, [a, c])
            resize(TWO, [a, c, b, d])
            resize(IN4, [a, c])
            pair, spares = [a, c], [b, d]
        for _ in range(crashes):
            (a, b), (c, _) = pair, spares
            resize(OUT, [a, b, c])
            job.wait_for(lambda _, e, g=job.generation: e.kind == "resized" and e.generation == g, 300)
            killed_at = time.time()
            job.send_signal(b, signal.SIGKILL)
            healed = job.generation + 1
            job.wait_until(lambda g=healed: job.generation >= g, 60)
            _, first = job.wait_for(lambda _, e, g=healed: e.kind == "progress" and e.generation >= g, 120)
            result.crash_recovery_s.append(first.at - killed_at)
            print(f"  {model.label}: crash recovery {first.at - killed_at:.3f} s", flush=True)
            pair, spares = [a, c], [b, spares[1]]
        for resize_ in result.resizes:
            _, resize_.event = job.wait_for(
                lambda _, e, g=resize_.generation: e.kind == "resized" and e.generation == g, 300
            )
        leader = [e for o in job.outputs for e in o.of_kind("progress") if e.generation == 1]
        ends = [e.at for e in leader]
        result.step_s = [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)][2:]
    return result


# --- torchrun --------------------------------------------------------------------------------


@dataclass
class Transition:
    before: int
    after: int
    pause_s: float


def timeline_transitions(path: Path) -> list[Transition]:
    """Where the world size changes in a torchrun timeline, and what each change paused."""
    rows = [
        (int(s), float(t), int(w)) for s, t, w in (line.split() for line in path.read_text().splitlines())
    ]
    transitions = []
    for index in range(1, len(rows)):
        if rows[index][2] != rows[index - 1][2]:
            after = [row[1] for row in rows[index : index + 6] if row[2] == rows[index][2]]
            if len(after) < 4:
                continue
            normal = statistics.median(
                later - earlier for earlier, later in zip(after[1:], after[2:], strict=False)
            )
            transitions.append(
                Transition(rows[index - 1][2], rows[index][2], after[0] - rows[index - 1][1] - normal)
            )
    return transitions


def run_torchrun(
    model: BenchModel | TaskModel, last_call_s: float | None, sequences: int, work: Path
) -> list[Transition]:
    """Grows a torchrun job one agent at a time, 1 -> 2 -> 3 (a restart each), `sequences`
    times; returns every world-size change with its pause. Growing to 3 fills --nnodes=1:3, so
    that the rendezvous closes at once; growing to 2 waits for the last call."""
    label = "defaults" if last_call_s is None else f"last_call_timeout={last_call_s:g}"
    extra = [] if last_call_s is None else [f"--rdzv-conf=last_call_timeout={last_call_s:g}"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONPATH": PYTHON_PATH,
    }
    transitions: list[Transition] = []
    for sequence in range(sequences):
        folder = work / f"torchrun-{label}-{sequence}"
        folder.mkdir()
        timeline = folder / "timeline"
        timeline.touch()
        port = free_port()
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:3", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench-{port}",
            "--max-restarts=100", *extra, str(ROOT / "bench" / "torchrun_train.py"),
            "--spec", json.dumps(model.spec(10**7)), "--checkpoint", str(folder / "checkpoint.pt"),
            "--timeline", str(timeline),
            *(["--code-dir", str(model.task[0])] if model.task else []),
        ]  # fmt: skip
        agents: list[subprocess.Popen[bytes]] = []
        try:
            for world in (1, 2, 3):
                log = open(folder / f"agent-{world}.log", "wb")
                agents.append(
                    subprocess.Popen(
                        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
                _wait_world(timeline, world, 5, label)
                print(f"  torchrun {label}: training at world size {world}", flush=True)
        finally:
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGTERM)
            for agent in agents:
                try:
                    agent.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(agent.pid, signal.SIGKILL)
        transitions += timeline_transitions(timeline)
    return transitions


def _wait_world(timeline: Path, world: int, steps: int, label: str, timeout_s: float = 240) -> None:
    """Waits until the last `steps` steps of the timeline ran at world size `world`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = timeline.read_text().splitlines()
        if len(lines) >= steps and all(line.split()[2] == str(world) for line in lines[-steps:]):
            return
        time.sleep(0.2)
    raise TimeoutError(f"torchrun ({label}) never trained {steps} steps at world size {world}")


# --- report ----------------------------------------------------------------------------------


def report(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    models: list[BenchModel | TaskModel]
    if args.task:
        models = [TaskModel(args.task.resolve(), args.entrypoint, json.loads(args.hyperparameters))]
    else:
        models = [RESNET50_SIZED] if args.quick else [RESNET50_SIZED, LARGE]
    first = models[0]
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-resize-"))
    bandwidth = broadcast_bandwidth(first.state_bytes, args.device)
    print(
        f"raw {raw_backend(args.device)} broadcast{' (both on GPU 0)' if shared_gpu_env(args.device, 4) else ''}, 1 -> 1, "
        f"{first.state_bytes / 1e6:.3f} MB: {show(bandwidth, 'GB/s', 2)}",
        flush=True,
    )
    ours = {}
    for model in models:
        # Five of each resize on the 25.6M model (one round in --quick), one round on the 100M one.
        rounds = args.rounds or (1 if args.quick or model is LARGE else 5)
        crashes = (1 if args.quick else 2) if model is first else 0
        ours[model.label] = run_ours(model, rounds, crashes, args.device, work)
    # The other route for several joiners: ours on one node (the workers' default, "auto") sends
    # the state from the sources to each joiner; the chain through the joiners is what auto takes
    # across nodes (elastic.worker.restore.relayed). The same model and resizes, right after ours.
    chain = run_ours(first, args.rounds or (1 if args.quick else 5), 0, args.device, work, route="relay")
    # The machine's load drifts over a run this long: the raw bandwidth is measured again after
    # our resizes, and the ratio uses every measurement.
    bandwidth += broadcast_bandwidth(first.state_bytes, args.device)
    print(f"raw broadcast again after our resizes: {show(bandwidth, 'GB/s', 2)} (all)", flush=True)
    land = {} if args.skip_land or args.task else land_report(RESNET50_SIZED, 2 if args.quick else 5, work)
    torchrun: dict[str, list[Transition]] = {}
    if not args.skip_torchrun:
        for last_call in (1.0, None):
            sequences = 1 if last_call is None or args.quick else 2
            label = "defaults" if last_call is None else "last_call_timeout=1"
            torchrun[label] = run_torchrun(first, last_call, sequences, work)

    print(
        f"\nIn-place resize, {conditions['cores']} cores, device {args.device}, load average "
        f"{conditions['load_average_1m']} at start; pause min / median / max"
    )
    for label, result in ours.items():
        print(
            f"\n{label} model ({result.model.parameters / 1e6:.1f}M parameters, "
            f"{result.model.state_bytes / 1e6:.1f} MB of model and optimiser state, batch {result.model.batch_size}); "
            f"normal step {show(result.step_s)} at 2 workers"
        )
        for scenario in SCENARIOS:
            chosen = [r for r in result.resizes if r.scenario == scenario and r.event]
            moved = [float(r.event.bytes_moved or 0) / 1e6 for r in chosen if r.event]
            phases: dict[str, list[float]] = {}
            for r in chosen:
                for name, seconds in ((r.event.phases or {}) if r.event else {}).items():
                    phases.setdefault(name, []).append(seconds)
            print(
                f"  {scenario:18} pause {show(result.pauses(scenario))}; moved {show(moved, 'MB', 1)}; "
                f"{show(result.bandwidths(scenario), 'GB/s', 2)}"
            )
            print(
                "  "
                + " " * 18
                + " phases (median): "
                + ", ".join(
                    f"{name} {statistics.median(values) * 1000:.0f} ms" for name, values in phases.items()
                )
            )
            timed = [r for r in chosen if r.event and r.event.pause_s is not None]
            if len(timed) > 1:
                # Where the tail comes from: the slowest resize of the scenario, phase by phase.
                worst = max(timed, key=lambda r: r.event.pause_s if r.event and r.event.pause_s else 0.0)
                assert worst.event is not None
                print(
                    "  " + " " * 18 + f" slowest (pause {worst.event.pause_s:.3f} s): "
                    + ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in (worst.event.phases or {}).items())
                )
        if result.crash_recovery_s:
            print(
                f"  {'crash recovery':18} {show(result.crash_recovery_s)} (SIGKILL to the end of the first step "
                "after; local coordinator, the platform adds the agent's report and a scheduler cycle)"
            )
    default = ours[first.label]
    print(
        f"\nstate to two joiners on one host, {first.label} model: min / median / max, and two over one "
        "(medians); the transfer phase is what the route changes, the pause adds the step-time noise"
    )
    for label, arm in (("ours (auto: sent to each)", default), ("relayed down a chain", chain)):
        for what, one, two_of in (
            ("transfer", arm.transfers(OUT), arm.transfers(TWO)),
            ("pause", arm.pauses(OUT), arm.pauses(TWO)),
        ):
            ratio = statistics.median(two_of) / statistics.median(one) if one and two_of else math.nan
            print(f"  {label:26} {what:8} one joiner {show(one)}; two joiners {show(two_of)}: {ratio:.2f}x")
    for label, transitions in torchrun.items():
        outs = [t.pause_s for t in transitions if (t.before, t.after) == (2, 3)]
        partial = [t.pause_s for t in transitions if (t.before, t.after) == (1, 2)]
        print(
            f"\ntorchrun --nnodes=1:3 c10d {label} ({first.label} model, gloo, DDP, checkpoint reload): scale out 2->3 "
            f"{show(outs)}; scale out 1->2 (the rendezvous waits for the last call) {show(partial)}"
        )

    main = ours[first.label]
    ours_out = spread(main.pauses(OUT))["median"]
    fast = [t.pause_s for t in torchrun.get("last_call_timeout=1", []) if (t.before, t.after) == (2, 3)]
    slow = [t.pause_s for t in torchrun.get("defaults", []) if (t.before, t.after) == (2, 3)]
    partial = {
        label: spread([t.pause_s for t in transitions if (t.before, t.after) == (1, 2)])["median"]
        for label, transitions in torchrun.items()
    }
    two = spread(main.pauses(TWO))["median"]
    out_bandwidth = spread(main.bandwidths(OUT))["median"]
    raw = spread(bandwidth)["median"]
    summary = {
        "bench": "resize",
        "model_params": main.model.parameters,
        "model": main.model.label if not args.task else f"{args.task} {args.entrypoint}",
        "pause_median_s": spread(main.pauses())["median"],
        "pause_median_by_scenario_s": {s: spread(main.pauses(s))["median"] for s in SCENARIOS},
        "torchrun_pause_median_s": spread(fast)["median"],
        "torchrun_defaults_pause_median_s": spread(slow)["median"],
        "torchrun_1_to_2_pause_median_s": partial,
        "speedup_vs_torchrun": spread(fast)["median"] / ours_out if fast and ours_out else None,
        "speedup_vs_torchrun_defaults": spread(slow)["median"] / ours_out if slow and ours_out else None,
        "two_joiners_vs_one": two / ours_out if two is not None and ours_out else None,
        "two_joiners_transfer_vs_one": _ratio(main.transfers(TWO), main.transfers(OUT)),
        "two_joiners_transfer_vs_one_relay": _ratio(chain.transfers(TWO), chain.transfers(OUT)),
        "two_joiners_vs_one_relay": _ratio(chain.pauses(TWO), chain.pauses(OUT)),
        "bandwidth_fraction": out_bandwidth / raw if out_bandwidth and raw else None,
        "raw_broadcast_gbps": raw,
        "crash_recovery_s": spread(main.crash_recovery_s)["median"],
        **land,
        "large_model": {
            label: {
                "model_params": r.model.parameters,
                "pause_median_s": spread(r.pauses())["median"],
                "pause_median_by_scenario_s": {s: spread(r.pauses(s))["median"] for s in SCENARIOS},
            }
            for label, r in ours.items()
            if r is not main
        },
        "device": args.device,
        "conditions": conditions,
        "wall_s": round(time.monotonic() - began, 1),
    }
    return summary


def _ratio(numerator: list[float], denominator: list[float]) -> float | None:
    """The ratio of the two lists' medians, None if either is empty."""
    return statistics.median(numerator) / statistics.median(denominator) if numerator and denominator else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the 25.6M model only, 1 round (about 3 minutes)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, help="rounds of every resize on each model (default 5, 1 with --quick)")
    parser.add_argument("--skip-torchrun", action="store_true", help="leave the torchrun baseline out")
    parser.add_argument(
        "--skip-land", action="store_true", help="leave out the land time on the platform (bench/land.py)"
    )
    parser.add_argument("--task", type=Path, help="a user's task directory, trained instead of the MLP")
    parser.add_argument("--entrypoint", default="task:Task", help="the task class in --task, module:ClassName")
    parser.add_argument(
        "--hyperparameters", default='{"batch_size": 64}', help="the task's hyperparameters as JSON (batch_size required)"
    )
    args = parser.parse_args(argv)
    summary = report(args)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
