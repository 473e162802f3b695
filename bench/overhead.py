"""What the elastic runtime costs a job that is not being resized: its steady-state step time
against plain DDP on the same model, data and world size.

    python bench/overhead.py            # 25.6M model, 2 workers, 10 rounds of 30-step runs
    python bench/overhead.py --quick    # 6 rounds of 20-step runs, no unpolled arm (about 9 minutes)
    python bench/overhead.py --quick --turns-only   # the arms in turns alone (about 2 minutes)
    python bench/overhead.py --device cuda

The elastic arm is the real worker (elastic.worker.local.LocalJob, membership board in Redis,
rank 0's watcher thread, the step's all-reduce carrying the stop and switch votes). The DDP arm
is bench/torchrun_train.py under `torchrun --standalone` without its stop vote, written as a
DDP user writes it: `DistributedDataParallel(model)` and `zero_grad(set_to_none=True)`, the
defaults. A third arm is the same DDP with `gradient_as_bucket_view=True` and gradients zeroed
in place ("DDP, bucket view"). The full run adds a fourth, the elastic worker whose rank 0 does
not poll the board, which isolates what the coordination costs.

Method. Each round runs every arm once, short runs, in an order that rotates from round to
round, so that a change in the machine's load hits every arm alike and no arm always runs
first. Every process of every arm has the same thread settings (OMP_NUM_THREADS=1, which both
workers pass to torch.set_num_threads, and MKL_NUM_THREADS=1) and the same CPU affinity (the
bench pins itself, to --cpus or to the mask it was given, before it starts anything, and every
worker inherits the mask). A step's time is
the gap between consecutive step ends on rank 0, the first WARMUP_STEPS of a run left out. The
figure is the median over rounds of the per-round ratio of medians (elastic over DDP), with the
min and max of those ratios: their spread says how far the figure can be trusted. The load
average is printed with every round.

Why the elastic arm could come out faster than DDP at all (the README's -12.8%), when it does
strictly more (the watcher thread, the votes in the all-reduce). Not threads: both arms run one
torch thread per process (OMP_NUM_THREADS=1, read by both) with the same affinity, and drop the
same warm-up steps. Not gradient memory either, as we first thought (DDP's default frees the
gradients every step and copies them into and out of its buckets): bench/ddp_memory.py takes the
three kinds of step in one process, and their CPU time a step is the same within a few percent
(25.6M model: DDP 0.299 s, DDP bucket view 0.319 s, elastic 0.306 s, median of 20 each, load 9)
with no page faults a step for DDP's default (its freed gradients' memory is reused). So the
difference lies in the two-process run's wall time. A fourth arm, DDP with one bucket
(bucket_cap_mb past the model's size: its all-reduce waits for the whole backward, as ours
does), tells which part. Measured quietly (--quick, load 1.3-2.4, 6 rounds,
bench/results/overhead-quick-cpu-2core-quiet.txt), median steps: DDP 320 ms, DDP bucket view
286 ms, DDP one bucket 327 ms, elastic 303 ms. DDP's overlap of its bucket all-reduces with
backward helps it (one bucket is the slowest; our earlier guess, that the overlap takes cores
from the computation, was wrong), and its default gradients cost a copy into and out of the
buckets each step in the two-process run (bucket view is the fastest). The elastic trainer pays
no copy (its gradients live in one flat buffer, as bucket view's do) but does not overlap: it
beats DDP's defaults by 4% and trails DDP with bucket view by 7.5% (rounds -1.0 to +12.8%).
Reaching the 1% target against the best DDP needs the all-reduce overlapped with backward.
The worker now does that (elastic.worker.trainer.GradientBuckets), and a fifth arm runs it
without (BUNGEE_BUCKET_MB=0). On these 2 cores it brought nothing measurable (per round -14.6 /
+1.7 / +11.6%, bench/results/overhead-quick-overlap-cpu-2core-quiet.txt): the two workers'
backward passes already take both cores, so the all-reduce finds none idle.
Single pairs of long runs then read as -13% or +25% depending on the hour: that figure
said nothing. The method above (rotated order, per-round ratios, their spread) is what makes a
figure readable; on a loaded machine (load 7 to 10 from other work) the rounds
still disagreed by tens of points (README), and by 45 points on a quiet 2-core VM.

In turns, the figure to read (`turns_overhead_pct`, `turns_overhead_vs_bucket_view_pct`). Runs
one after the other see different minutes of a shared VM, and there the speed of the same matrix
product drifts by half from one run to the next. So each of three arms (elastic, DDP, DDP bucket
view) is started once, warmed up, and stopped (SIGSTOP to every process of the job, the
torchrun launcher's workers included); then the arms run in turns of TURN_S seconds, the order
rotating from round to round, the others stopped. A step counts if it begins and ends inside its
arm's turn, the first of each turn left out (the caches then hold another arm's data). A round's
figure is the ratio of its turns' medians; the median over rounds is printed with the min, the
max and the interquartile range, and the pooled ratio. Stopping the elastic worker stops its
watcher and heartbeat threads too: what they cost falls inside its turns, as it does in a run.

The last line is one JSON object: {"bench": "overhead", "overhead_pct": ...} (with
"turns_overhead_pct" and the rest of the turns' figures).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import (  # noqa: E402
    PYTHON_PATH,
    REDIS_URL,
    RESNET50_SIZED,
    ROOT,
    BenchModel,
    RoundRatios,
    machine,
    show,
)
from elastic.worker.local import LocalJob  # noqa: E402

WARMUP_STEPS = 5
TURN_S = 3.0
"""How long each arm runs in its turn (about 10 steps of the 25.6M model on 2 cores)."""
ENDLESS = 10_000_000
T = TypeVar("T")
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""Every worker of every arm: one intra-op thread (both workers call torch.set_num_threads
with OMP_NUM_THREADS)."""


def _gaps(ends: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)][WARMUP_STEPS:]


def elastic_env(poll_s: float = 0.05, overlap: bool = True) -> dict[str, str]:
    """The elastic workers' environment: a progress event every step, no periodic checkpoint."""
    return {
        **os.environ,
        **THREADS,
        **({} if overlap else {"BUNGEE_BUCKET_MB": "0"}),
        "BUNGEE_PROGRESS_EVERY_S": "0.001",
        "BUNGEE_CHECKPOINT_EVERY_S": "86400",
        "BUNGEE_MEMBERSHIP_POLL_S": str(poll_s),
        "PYTHONPATH": PYTHON_PATH,
    }


def torchrun_command(
    model: BenchModel, steps: int, workers: int, device: str, folder: Path, bucket_view: bool, one_bucket: bool = False
) -> list[str]:
    """bench/torchrun_train.py under `torchrun --standalone`, its checkpoint and timeline in
    `folder`, without its stop vote."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
        str(ROOT / "bench" / "torchrun_train.py"), "--spec", json.dumps(model.spec(steps)),
        "--checkpoint", str(folder / "checkpoint.pt"), "--timeline", str(folder / "timeline"),
        "--device", device, "--no-stop-flag",
        *(["--bucket-view"] if bucket_view else []), *(["--one-bucket"] if one_bucket else []),
    ]  # fmt: skip


def elastic_steps(
    model: BenchModel, steps: int, workers: int, device: str, work: Path, poll_s: float = 0.05, overlap: bool = True
) -> list[float]:
    """Step times of the elastic runtime; rank 0 reads the membership board every `poll_s`;
    without `overlap`, the gradient's all-reduce waits for the whole backward (one bucket)."""
    with LocalJob(
        model.spec(steps),
        Path(tempfile.mkdtemp(dir=work)),
        REDIS_URL,
        env=elastic_env(poll_s, overlap),
        heal=False,
        device=device,
    ) as job:
        job.start(list(range(workers)))
        outputs = job.wait(timeout_s=1200)
    leader = outputs[0].of_kind("progress")
    return _gaps([event.at for event in leader])


def ddp_steps(
    model: BenchModel, steps: int, workers: int, device: str, work: Path, bucket_view: bool = False,
    one_bucket: bool = False,
) -> list[float]:
    """Step times of torch DDP under torchrun (bench/torchrun_train.py)."""
    folder = Path(tempfile.mkdtemp(dir=work))
    timeline = folder / "timeline"
    command = torchrun_command(model, steps, workers, device, folder, bucket_view, one_bucket)
    env = {**os.environ, **THREADS, "PYTHONPATH": PYTHON_PATH}
    done = subprocess.run(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1200
    )
    if done.returncode != 0:
        raise RuntimeError(f"the torchrun baseline exited {done.returncode}:\n{done.stderr[-3000:]}")
    return _gaps([float(line.split()[1]) for line in timeline.read_text().splitlines()])


def rotated(arms: list[T], round_index: int) -> list[T]:
    """`arms` starting at a different one each round."""
    shift = round_index % len(arms)
    return arms[shift:] + arms[:shift]


class Arm:
    """A job kept for the turns: started once, then run while its turn lasts and stopped
    (SIGSTOP) while the other arms have theirs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.windows: list[tuple[float, float]] = []
        """(resumed, stopped) of each turn, time.time()."""

    def pids(self) -> list[int]:
        raise NotImplementedError

    def step_ends(self) -> list[float]:
        """Rank 0's step end times so far, time.time()."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def signal(self, number: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, number)
            except ProcessLookupError:
                raise RuntimeError(f"{self.name}: process {pid} is gone") from None

    def warm(self, steps: int, timeout_s: float = 300.0) -> None:
        """Waits until `steps` steps have ended (the arm running alone), then stops it."""
        deadline = time.monotonic() + timeout_s
        while len(self.step_ends()) < steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not reach {steps} steps in {timeout_s} s")
            time.sleep(0.1)
        self.signal(signal.SIGSTOP)

    def turn(self, seconds: float) -> None:
        self.signal(signal.SIGCONT)
        resumed = time.time()
        time.sleep(seconds)
        self.signal(signal.SIGSTOP)
        self.windows.append((resumed, time.time()))

    def gaps_per_turn(self) -> list[list[float]]:
        """Each turn's step times: gaps between consecutive step ends that both fall inside the
        turn, the turn's first step (begun before it, or just after the other arms' turns
        filled the caches with theirs) left out."""
        ends = self.step_ends()
        turns = []
        for resumed, stopped in self.windows:
            inside = [end for end in ends if resumed <= end <= stopped]
            turns.append([later - earlier for earlier, later in zip(inside, inside[1:], strict=False)][1:])
        return turns


class ElasticArm(Arm):
    def __init__(self, name: str, model: BenchModel, workers: int, device: str, work: Path) -> None:
        super().__init__(name)
        self.job = LocalJob(
            model.spec(ENDLESS), Path(tempfile.mkdtemp(dir=work)), REDIS_URL, env=elastic_env(), heal=False, device=device
        )
        self.job.start(list(range(workers)))

    def pids(self) -> list[int]:
        return [output.pid for output in self.job.live()]

    def step_ends(self) -> list[float]:
        return [event.at for event in self.job.worker_on(0).of_kind("progress")]

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        self.job.kill()


class DdpArm(Arm):
    def __init__(self, name: str, model: BenchModel, workers: int, device: str, work: Path, bucket_view: bool) -> None:
        super().__init__(name)
        folder = Path(tempfile.mkdtemp(dir=work))
        self.timeline = folder / "timeline"
        command = torchrun_command(model, ENDLESS, workers, device, folder, bucket_view)
        env = {**os.environ, **THREADS, "PYTHONPATH": PYTHON_PATH}
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def pids(self) -> list[int]:
        # The launcher and every process under it: torchrun starts its workers in sessions of
        # their own, so the launcher's process group does not reach them.
        return [self.process.pid, *descendants(self.process.pid)]

    def step_ends(self) -> list[float]:
        if not self.timeline.exists():
            return []
        return [float(line.split()[1]) for line in self.timeline.read_text().splitlines() if line.count(" ") == 2]

    def close(self) -> None:
        for number in (signal.SIGCONT, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, number)
                except ProcessLookupError:
                    pass
        self.process.wait(timeout=60)


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux: /proc/PID/task/TID/children)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except OSError:  # the task ended meanwhile
                continue
            found += children
            pending += children
    return found


def in_turns(args: argparse.Namespace, model: BenchModel, work: Path) -> dict[str, Any]:
    """The elastic worker against DDP, each arm's job started once and kept, the arms running
    in turns of TURN_S while the others are stopped: every round sees the same minute of the
    machine, where runs one after the other see different ones."""
    rounds = 10 if args.quick else 24
    arms: list[Arm] = []
    load_before = os.getloadavg()[0]
    try:
        for make in (
            lambda: ElasticArm("elastic", model, args.workers, args.device, work),
            lambda: DdpArm("ddp", model, args.workers, args.device, work, bucket_view=False),
            lambda: DdpArm("ddp_bucket_view", model, args.workers, args.device, work, bucket_view=True),
        ):
            started: Arm = make()
            arms.append(started)
            started.warm(WARMUP_STEPS + 1)
        for index in range(rounds):
            for arm in rotated(arms, index):
                arm.turn(TURN_S)
    finally:
        for arm in arms:
            arm.close()
    load_after = os.getloadavg()[0]
    per_turn = {arm.name: arm.gaps_per_turn() for arm in arms}
    result: dict[str, Any] = {"turns": rounds, "turn_s": TURN_S, "turns_load_average": [load_before, load_after]}
    print(
        f"\n  in turns: each arm's job started once; {rounds} rounds of a {TURN_S} s turn each (order rotating), "
        f"the others stopped (SIGSTOP); load average {load_before:.2f} -> {load_after:.2f}"
    )
    for arm in arms:
        print(f"  {arm.name:18s} step: {show([gap for turn in per_turn[arm.name] for gap in turn])}")
    for baseline, key in (("ddp", "turns_overhead_pct"), ("ddp_bucket_view", "turns_overhead_vs_bucket_view_pct")):
        rounds_compared = RoundRatios.of(per_turn["elastic"], per_turn[baseline])
        print(f"  elastic vs {baseline}, {rounds_compared.describe()}")
        result[key] = rounds_compared.median
        result[key.replace("_pct", "_per_round_pct")] = rounds_compared.per_round
        result[key.replace("_pct", "_pooled_pct")] = rounds_compared.pooled
        result[key.replace("_pct", "_iqr_points")] = rounds_compared.iqr
    return result


def ratio_pct(ours: list[float], theirs: list[float]) -> float:
    return (statistics.median(ours) / statistics.median(theirs) - 1) * 100


def report(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    cores = sorted(args.cpus or os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores)  # the mask every worker of every arm inherits
    conditions = machine()
    print(f"conditions: {conditions}; every worker: {THREADS}, CPU affinity {cores}", flush=True)
    rounds, steps = (6, 20) if args.quick else (10, 30)
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-overhead-"))
    model = RESNET50_SIZED
    if args.turns_only:
        print(f"\n{model.label} model ({model.parameters / 1e6:.1f}M parameters), {args.workers} workers, device {args.device}")
        return {
            "bench": "overhead", **in_turns(args, model, work), "model_params": model.parameters,
            "workers": args.workers, "device": args.device, "threads": THREADS, "cpu_affinity": cores,
            "conditions": conditions, "wall_s": round(time.monotonic() - began, 1),
        }  # fmt: skip
    runs: dict[str, Callable[[], list[float]]] = {
        "elastic": lambda: elastic_steps(model, steps, args.workers, args.device, work),
        "ddp": lambda: ddp_steps(model, steps, args.workers, args.device, work),
        "ddp_bucket_view": lambda: ddp_steps(model, steps, args.workers, args.device, work, bucket_view=True),
        # The all-reduce after the whole backward, as ours: tells whether DDP's overlap is what
        # makes it slower than the elastic arm on a machine with fewer cores than threads.
        "ddp_one_bucket": lambda: ddp_steps(model, steps, args.workers, args.device, work, one_bucket=True),
        # Ours without the overlap: what the buckets bring.
        "elastic_one_bucket": lambda: elastic_steps(model, steps, args.workers, args.device, work, overlap=False),
    }
    if not args.quick:
        runs["elastic_unpolled"] = lambda: elastic_steps(model, steps, args.workers, args.device, work, 3600)
    times: dict[str, list[float]] = {arm: [] for arm in runs}
    against_ddp: list[float] = []
    against_view: list[float] = []
    against_one: list[float] = []
    overlap_gain: list[float] = []
    loads: list[float] = []
    for index in range(rounds):
        this_round = {}
        for arm in rotated(list(runs), index):
            gaps = runs[arm]()
            times[arm] += gaps
            this_round[arm] = gaps
        loads.append(round(os.getloadavg()[0], 2))
        against_ddp.append(ratio_pct(this_round["elastic"], this_round["ddp"]))
        against_view.append(ratio_pct(this_round["elastic"], this_round["ddp_bucket_view"]))
        against_one.append(ratio_pct(this_round["elastic"], this_round["ddp_one_bucket"]))
        overlap_gain.append(ratio_pct(this_round["elastic"], this_round["elastic_one_bucket"]))
        print(
            f"  round {index + 1} (order {', '.join(rotated(list(runs), index))}; load {loads[-1]}): "
            + ", ".join(f"{arm} {statistics.median(gaps) * 1000:.1f} ms" for arm, gaps in this_round.items())
            + f"; elastic vs DDP {against_ddp[-1]:+.2f}%, vs DDP bucket view {against_view[-1]:+.2f}%, "
            f"vs DDP one bucket {against_one[-1]:+.2f}%",
            flush=True,
        )
    print(
        f"\n{model.label} model ({model.parameters / 1e6:.1f}M parameters), {args.workers} workers, device "
        f"{args.device}, {rounds} rounds of {steps}-step runs ({WARMUP_STEPS} warm-up steps left out), "
        f"load average {min(loads)} to {max(loads)}"
    )
    for arm, gaps in times.items():
        print(f"  {arm:18s} step: {show(gaps)}")
    overhead = statistics.median(against_ddp)
    over_view = statistics.median(against_view)
    print(
        f"  elastic vs DDP, per round (min / median / max): {min(against_ddp):+.2f} / {overhead:+.2f} / "
        f"{max(against_ddp):+.2f}%; the rounds agree within {max(against_ddp) - min(against_ddp):.1f} points"
    )
    print(
        f"  elastic vs DDP bucket view, per round: {min(against_view):+.2f} / {over_view:+.2f} / "
        f"{max(against_view):+.2f}%; within {max(against_view) - min(against_view):.1f} points"
    )
    over_one = statistics.median(against_one)
    print(
        f"  elastic vs DDP one bucket, per round: {min(against_one):+.2f} / {over_one:+.2f} / "
        f"{max(against_one):+.2f}%; within {max(against_one) - min(against_one):.1f} points"
    )
    print(
        f"  elastic vs elastic without the overlap, per round: {min(overlap_gain):+.2f} / "
        f"{statistics.median(overlap_gain):+.2f} / {max(overlap_gain):+.2f}%"
    )
    result: dict[str, Any] = {
        "bench": "overhead",
        "overhead_pct": overhead,
        "overhead_per_round_pct": against_ddp,
        "overhead_vs_bucket_view_pct": over_view,
        "overhead_vs_bucket_view_per_round_pct": against_view,
        "overhead_vs_one_bucket_pct": over_one,
        "overhead_vs_one_bucket_per_round_pct": against_one,
        "rounds_agree_within_points": max(against_ddp) - min(against_ddp),
        "overlap_gain_pct": statistics.median(overlap_gain),
        "overlap_gain_per_round_pct": overlap_gain,
        "ratio_of_pooled_medians_pct": ratio_pct(times["elastic"], times["ddp"]),
        "step_median_s": {arm: statistics.median(gaps) for arm, gaps in times.items()},
    }
    result.update(in_turns(args, model, work))
    if "elastic_unpolled" in times:
        coordination = ratio_pct(times["elastic"], times["elastic_unpolled"])
        print(f"  of which the coordination (rank 0 reading the board every 50 ms): {coordination:+.2f}%")
        result["coordination_overhead_pct"] = coordination
    result.update(
        model_params=model.parameters,
        workers=args.workers,
        device=args.device,
        threads=THREADS,
        cpu_affinity=cores,
        load_average_per_round=loads,
        conditions=conditions,
        wall_s=round(time.monotonic() - began, 1),
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 rounds of shorter runs, 5 arms (about 9 minutes)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--cpus", type=lambda text: {int(core) for core in text.split(",")},
        help="cores every worker of every arm is pinned to, as 0,1 (default: the bench's own mask)",
    )
    parser.add_argument("--turns-only", action="store_true", help="the arms in turns alone (about 4 minutes)")
    args = parser.parse_args(argv)
    print(json.dumps(report(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
