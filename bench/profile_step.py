"""Where a strict step's time goes, against a plain-averaging step, in one process (world size 1,
so what is measured is the strict step's own work: the fixed-point passes, the magnitudes, the
int64 sum; the all-reduces are there but cross no wire).

    python bench/profile_step.py                    # CPU, the 2.2M-parameter MLP of consistency.py
    python bench/profile_step.py --device cuda      # NCCL, on GPU 0

Both arms run the same model, batch and seed, interleaved in rounds; each prints its step time
min / median / max, then torch.profiler's top operators of a strict step and of a plain one.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.conditions import machine, show  # noqa: E402
from elastic.tasks.loader import load_task_class  # noqa: E402
from elastic.tasks.runtime import BoundTask  # noqa: E402
from elastic.worker.build import deterministic_cuda  # noqa: E402
from elastic.worker.data import SampleStream  # noqa: E402
from elastic.worker.hybrid import HybridSchedule, HybridTrainer  # noqa: E402
from elastic.worker.strict import StrictTrainer  # noqa: E402
from elastic.workloads import CATALOGUE  # noqa: E402

HYPERPARAMETERS = {"batch_size": 256, "hidden": 512, "layers": 7, "dropout": 0.0}
SEED = 5
WARMUP_STEPS = 5


def trainer(
    kind: str,
    device: torch.device,
    hyperparameters: dict[str, Any] = HYPERPARAMETERS,
    rank: int = 0,
    world_size: int = 1,
) -> StrictTrainer | HybridTrainer:
    """A strict trainer (one virtual worker a rank) or a plain-averaging one (hybrid with its
    batch held: one float all-reduce of the gradient mean, in the worker's default buckets) of
    the digits MLP, as `rank` of `world_size` of the default process group."""
    info = CATALOGUE["digits-mlp"]
    source = (info.path, info.entrypoint)
    problem = BoundTask(load_task_class(*source), hyperparameters, SEED, device, source)
    optimizer = problem.make_optimizer()
    stream = SampleStream(problem.num_samples, SEED)
    batch = problem.batch_size
    made: StrictTrainer | HybridTrainer
    if kind == "strict":
        made = StrictTrainer(problem, optimizer, stream, batch_size=batch, seed=SEED, rank=rank,
                             world_size=world_size, virtual_workers=world_size)  # fmt: skip
    else:
        schedule = HybridSchedule(base_lr=problem.lr, base_batch=batch, batch_per_worker=batch, min_batch=batch,
                                  max_batch=batch, lr_scaling="linear", warmup_steps=0)  # fmt: skip
        made = HybridTrainer(problem, optimizer, stream, schedule, seed=SEED, rank=rank, world_size=world_size)
    made.rebind_members(rank, world_size, None, 0)  # as a worker does when its first group forms
    return made


def timed_steps(
    run: StrictTrainer | HybridTrainer, first: int, count: int, device: torch.device, cpu_times: list[float] | None = None
) -> list[float]:
    """Wall-clock times of `count` steps from `first`; appends each step's CPU time of this
    thread to `cpu_times` if given (what a loaded machine's waiting for a core does not inflate)."""
    times = []
    for step in range(first, first + count):
        began, began_cpu = time.perf_counter(), time.thread_time()
        run.step(step, False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        if cpu_times is not None:
            cpu_times.append(time.thread_time() - began_cpu)
    return times


def top_operators(run: StrictTrainer | HybridTrainer, first: int, device: torch.device, rows: int) -> str:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiled:
        timed_steps(run, first, 10, device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return str(profiled.key_averages().table(sort_by=key, row_limit=rows))


def strict_profile(hyperparameters: dict[str, Any], rows: int = 8) -> str:
    """torch.profiler's top `rows` operators by self CPU time of 10 strict steps of the digits
    MLP with `hyperparameters`, one virtual worker, in this process (a gloo group of one on a
    free port, destroyed after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        device = torch.device("cpu")
        run = trainer("strict", device, hyperparameters)
        timed_steps(run, 0, 5, device)
        return top_operators(run, 5, device, rows)
    finally:
        dist.destroy_process_group()


def _interleaved_rank(
    index: int,
    kinds: list[str],
    world_size: int,
    inits: list[str],
    hyperparameters: dict[str, Any],
    rounds: int,
    block: int,
    turn: Any,
    changed: Any,
    out: str,
) -> None:
    """One rank of one arm of `interleaved`: process `index` is rank index % world_size of arm
    kinds[index // world_size]. Arm a's block of round r runs when the shared `turn` reads
    2r + a (a blocking wait on `changed`); its rank 0 passes the turn on once the whole group
    has ended the block."""
    arm, rank = divmod(index, world_size)
    kind = kinds[arm]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=inits[arm], rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        device = torch.device("cpu")
        run = trainer(kind, device, hyperparameters, rank, world_size)
        step = 0
        times: list[list[float]] = []
        for round_index in range(-1, rounds):  # round -1: the warm-up
            order = kinds if round_index % 2 == 0 else list(reversed(kinds))
            mine = 2 * (round_index + 1) + order.index(kind)
            with changed:
                if not changed.wait_for(lambda mine=mine: turn.value == mine, timeout=120):
                    raise TimeoutError(f"{kind} rank {rank} waited 120 s for turn {mine} (at {turn.value})")
            count = WARMUP_STEPS if round_index < 0 else block + 1
            took = timed_steps(run, step, count, device)
            step += count
            if round_index >= 0:
                times.append(took[1:])  # the first step after the other arm's block is left out
            dist.barrier()  # the whole group has ended its block
            if rank == 0:
                with changed:
                    turn.value += 1
                    changed.notify_all()
        if rank == 0:
            Path(out, f"{kind}.json").write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def interleaved(
    hyperparameters: dict[str, Any], world_size: int = 2, rounds: int = 60, block: int = 5
) -> list[dict[str, list[float]]]:
    """Strict against plain averaging, in turns: two process groups of `world_size` processes
    (gloo on this machine's CPU, one torch thread each), one per arm, each holding only its own
    trainer of the digits MLP with `hyperparameters`, as a worker does. After a warm-up each, the
    arms take turns: `rounds` rounds of `block` + 1 steps of each, the arm that goes first
    alternating, the other group asleep (on a shared condition) while one steps. The first step
    of each block, which finds the caches holding the other arm's data, is left out. Returns rank 0's step times, a dict of both arms' for each round. Both arms
    see the same minutes of the machine, a few steps apart, where pairs of separate runs see
    different ones: on a shared VM the speed of the same matrix product drifts by half from one
    run to the next (1.6 to 3.1 ms a call in one profile)."""
    import multiprocessing

    import torch.multiprocessing as mp

    kinds = ["strict", "plain"]
    inits = []
    for _ in kinds:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            inits.append(f"tcp://127.0.0.1:{probe.getsockname()[1]}")
    context = multiprocessing.get_context("spawn")
    turn = context.Value("i", 0, lock=False)
    changed = context.Condition()
    with tempfile.TemporaryDirectory(prefix="bungee-bench-interleaved-") as work:
        mp.start_processes(
            _interleaved_rank,
            args=(kinds, world_size, inits, hyperparameters, rounds, block, turn, changed, work),
            nprocs=len(kinds) * world_size,
            start_method="spawn",
        )
        per_arm = {kind: json.loads(Path(work, f"{kind}.json").read_text()) for kind in kinds}
    return [{kind: per_arm[kind][index] for kind in kinds} for index in range(rounds)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per arm and round")
    parser.add_argument("--rows", type=int, default=12, help="operators shown per profile")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        deterministic_cuda()  # as a strict worker does; the plain arm runs under it too
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1, timeout=timedelta(seconds=60),
        **({"device_id": device} if device.type == "cuda" else {}),
    )  # fmt: skip
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    arms = {kind: trainer(kind, device) for kind in ("strict", "plain")}
    for run in arms.values():
        timed_steps(run, 0, 5, device)  # warm-up: allocations, kernels, caches
    times: dict[str, list[float]] = {kind: [] for kind in arms}
    cpu: dict[str, list[float]] = {kind: [] for kind in arms}
    step = 5
    for _ in range(args.rounds):
        for kind, run in arms.items():
            times[kind] += timed_steps(run, step, args.steps, device, cpu[kind])
        step += args.steps
    strict, plain = statistics.median(times["strict"]), statistics.median(times["plain"])
    parameters = sum(p.numel() for p in arms["strict"].problem.model.parameters())
    print(f"\ndigits-mlp {parameters / 1e6:.2f}M parameters, batch {HYPERPARAMETERS['batch_size']}, device "
          f"{args.device}, world size 1, {args.rounds} interleaved rounds of {args.steps} steps")  # fmt: skip
    print(f"  strict step: {show(times['strict'], 's', 5)}")
    print(f"  plain step:  {show(times['plain'], 's', 5)}")
    print(f"  strict overhead (ratio of medians): {(strict / plain - 1) * 100:+.1f}%")
    strict_cpu, plain_cpu = statistics.median(cpu["strict"]), statistics.median(cpu["plain"])
    print(f"  CPU time of this thread a step: strict {show(cpu['strict'], 's', 5)}, plain {show(cpu['plain'], 's', 5)}")
    print(f"  strict overhead in CPU time (ratio of medians; what the load does not inflate): "
          f"{(strict_cpu / plain_cpu - 1) * 100:+.1f}%")  # fmt: skip
    for kind, run in arms.items():
        print(f"\ntop operators of 10 {kind} steps (by self {'CUDA' if device.type == 'cuda' else 'CPU'} time):")
        print(top_operators(run, step, device, args.rows))
    dist.destroy_process_group()
    result: dict[str, Any] = {
        "bench": "profile_step", "device": args.device, "strict_step_median_s": strict,
        "plain_step_median_s": plain, "strict_overhead_pct": (strict / plain - 1) * 100,
        "strict_overhead_cpu_time_pct": (strict_cpu / plain_cpu - 1) * 100,
        "model_params": parameters, "conditions": conditions,
    }  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
