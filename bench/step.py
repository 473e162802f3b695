"""One task trained five ways on one device, interleaved in rounds: what Bungee's step costs
against the PyTorch loop its user would write.

    python bench/step.py                                   # CPU, the ResNet-18 of examples/resnet
    python bench/step.py --device cuda --loader-workers 6  # on GPU 0 (NCCL); DataLoader with 6 workers
    python bench/step.py --device cuda --data-workers 6    # ... and Bungee's task with 6 reader processes
    python bench/step.py --task examples/digits --entrypoint task:DigitsMLP
    python bench/step.py --quick                           # a narrow ResNet and a few steps

The arms, each with its own model (same seed), optimiser and data, in one process:

- **torch**, the baseline: the loop a user writes. torch's DataLoader over the task's
  `train_data()` (shuffled, `--loader-workers` worker processes, persistent, pinned memory on
  CUDA), the batch moved with `non_blocking`, `loss`, `zero_grad`, `backward`, `step`; cuDNN's
  autotuner on (CUDA). No metric is read back.
- **floor**: the same with one batch resident on the device: compute alone.
- **deterministic**: the torch loop with torch's deterministic algorithms and cuDNN's
  deterministic kernels, autotuner off, as strict mode runs: `deterministic_vs_torch` is what
  determinism itself costs the model (EasyScale's D1), `strict_vs_deterministic` what strict
  mode's own passes and the worker add on top of it.
- **plain** and **strict**: Bungee's worker at world size 1, built by the worker's own build
  (elastic.worker.build: the task, `set_up_device` with the worker's settings, the consistency
  mode's trainer, its warm-up) and driven by the worker's own loop (elastic.worker.loop.
  TrainingLoop.train: the trainer's step with its read of the step's items (in reader processes
  when the task's `data_workers`, or `--data-workers`, says so), the step clock, rank 0's progress events), over a process
  group of one (gloo on CPU, NCCL on CUDA). Plain is a hybrid job whose batch cannot change
  (plain averaging); strict has one virtual worker (`--virtual-workers`). Events go to
  /dev/null (a worker writes them to its agent's pipe). Left out: the periodic checkpoint (every
  few minutes, in the background), the heartbeat thread and Redis: a real worker reads the
  membership board only at a switch. A block ends when the loop is told to switch generation
  (the vote every step already carries), so each block is one call of `train()`.

Every arm runs `--warmup` steps, then `--rounds` rounds in which each arm runs a block of
`--steps` + 1 steps (the order of the arms rotates every round). The first step of a block,
which finds the caches holding the other arms' data, is not timed; the device is synchronised
before and after the timed steps, and a round's figure for an arm is its block's mean time a
step. Per arm: min / median / max over the rounds, in ms a step. The arms share the process's
global settings, set before each block as that arm's own process would have them (cuDNN's
autotuner for the loops, deterministic algorithms for strict); on CUDA the process sets
CUBLAS_WORKSPACE_CONFIG=:4096:8 for every arm, since strict mode needs it before cuBLAS starts.
Threads: `--threads` (default: the worker's setting, BUNGEE_WORKER_THREADS or 1) for every arm.

`--precision bf16` runs every arm's forward and loss under bf16 autocast (Bungee's arms through
the spec's `precision`, strict's as well).

Needs torch and pydantic; neither Redis, nor Django, nor a server. The last line is one JSON
object: torch_step_ms, floor_step_ms, plain_step_ms, strict_step_ms (medians over the rounds),
plain_vs_torch, strict_vs_torch (ratios of those medians), the per-round ratios, and the
conditions.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, default_collate  # noqa: E402

from bench.conditions import ROOT, machine, show  # noqa: E402
from elastic.spec import JobSpec  # noqa: E402
from elastic.tasks.hyperparameters import hyperparameter, validate_hyperparameters  # noqa: E402
from elastic.tasks.loader import load_task_class  # noqa: E402
from elastic.tasks.runtime import BoundTask  # noqa: E402
from elastic.wire import Member, Membership, WorkerConfig  # noqa: E402
from elastic.worker.build import build, set_up_device  # noqa: E402
from elastic.worker.events import EventWriter, ProgressReporter  # noqa: E402
from elastic.worker.loop import CheckpointSaver, ResizeMeter, SwitchAgreed, TrainingLoop  # noqa: E402
from elastic.worker.position import WorkerPosition  # noqa: E402
from elastic.worker.settings import WorkerSettings  # noqa: E402
from elastic.worker.step_clock import StepClock  # noqa: E402
from elastic.worker.stop import StopRequest  # noqa: E402

ARMS = ("torch", "floor", "deterministic", "plain", "strict")
SEED = 7
RESNET = (ROOT / "examples" / "resnet", "task:ResNetTask")
QUICK_RESNET = {"width": 8, "batch_size": 32}
"""--quick on the ResNet task: 175k parameters, a step of tens of ms on one CPU core."""
BLOCK_SWITCH = 2
"""The generation a Bungee arm's loop is told to switch to at the end of its block."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def moved(batch: Any, device: torch.device) -> Any:
    """`batch` with its tensors on `device`, copied without waiting (from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: moved(value, device) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(moved(value, device) for value in batch)
    return batch


def loop_settings(device: torch.device, threads: int, deterministic: bool = False) -> None:
    """The process's settings as a user's loop has them: torch's defaults, cuDNN's autotuner on;
    or, `deterministic`, torch's deterministic algorithms and cuDNN's deterministic kernels
    without its autotuner, as strict mode runs (what determinism itself costs: EasyScale's D1)."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic


class TorchLoop:
    """The baseline (`resident` False) or the floor (True): see the module docstring."""

    def __init__(
        self, task_class: type, hyperparameters: dict[str, Any], device: torch.device, data_workers: int,
        bf16: bool, resident: bool, deterministic: bool = False,
    ) -> None:  # fmt: skip
        self.deterministic = deterministic
        self.task = task_class(validate_hyperparameters(task_class, hyperparameters))
        torch.manual_seed(SEED)
        self.model = self.task.model().to(device)
        self.model.train()
        self.optimizer = self.task.optimizer(self.model)
        self.device, self.bf16 = device, bf16
        loader = DataLoader(
            self.task.train_data(), batch_size=hyperparameters["batch_size"], shuffle=True, drop_last=True, num_workers=data_workers,
            pin_memory=device.type == "cuda", persistent_workers=data_workers > 0,
            collate_fn=getattr(self.task, "collate", None) or default_collate,
        )  # fmt: skip
        self.batches = self._forever(loader)
        self.resident = moved(next(self.batches), device) if resident else None

    @staticmethod
    def _forever(loader: DataLoader) -> Iterator[Any]:
        while True:
            yield from loader

    def step(self) -> None:
        batch = self.resident if self.resident is not None else moved(next(self.batches), self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext():
            result = self.task.loss(self.model, batch)
        loss = result[0] if isinstance(result, tuple) else result
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def block(self, steps: int, threads: int) -> tuple[float, float]:
        """Seconds a step over `steps` timed steps, after one untimed: wall-clock and this
        process's CPU time."""
        loop_settings(self.device, threads, self.deterministic)
        self.step()
        synchronize(self.device)
        began, began_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        synchronize(self.device)
        return (time.perf_counter() - began) / steps, (time.process_time() - began_cpu) / steps


class BlockClock(StepClock):
    """The worker's step clock, which also marks where a block's timed steps begin: at the start
    of its second step, the device synchronised."""

    def __init__(self, events: EventWriter, every_s: float, device: torch.device) -> None:
        super().__init__(events, every_s)
        self.device = device
        self.starts = 0
        self.timed_from = self.timed_from_cpu = 0.0

    def start(self) -> None:
        self.starts += 1
        if self.starts == 2:
            synchronize(self.device)
            self.timed_from, self.timed_from_cpu = time.perf_counter(), time.process_time()
        super().start()


class BungeeArm:
    """A worker of the job `spec` at world size 1 in this process, driven by its own loop."""

    def __init__(self, spec: dict[str, Any], task: tuple[Path, str], device: torch.device,
                 settings: WorkerSettings, run_dir: str) -> None:  # fmt: skip
        self.spec, self.device, self.settings = JobSpec(**spec), device, settings
        config = WorkerConfig(
            job_id=1, generation=1, rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
            device=str(device), spec=spec, run_dir=run_dir, node="bench", device_index=0,
            redis_url="redis://unused", coordination_key="bench", code_dir=str(task[0]), entrypoint=task[1],
        )  # fmt: skip
        self.worker_settings()
        made = build(config, settings)
        self.problem: BoundTask = made.problem
        self.model = self.problem.model
        trainer = made.trainer
        trainer.rebind_members(0, 1, None, 0)  # as the worker does when its first group forms
        events = EventWriter(config, stream=open(os.devnull, "w"))  # noqa: SIM115 - for the process's life
        self.clock = BlockClock(events, settings.progress_every_s, device)
        trainer.compute_done = self.clock.compute_done
        self.position = WorkerPosition(rank=0, membership=Membership(
            job_id=1, generation=1, master_addr="127.0.0.1", master_port=1, has_state=True,
            members=[Member(node="bench", device_index=0, address="127.0.0.1", joiner=False)],
        ))  # fmt: skip
        progress = ProgressReporter(events, total_steps=10**9, batch_size=self.problem.batch_size,
                                    samples_per_epoch=self.problem.num_samples, every_s=settings.progress_every_s)  # fmt: skip
        saver = CheckpointSaver(Path(run_dir, "checkpoint.pt"), self.spec, self.problem.model, made.optimizer,
                                trainer, events)  # fmt: skip
        self.block_end = 0
        self.loop = TrainingLoop(
            trainer, self.position, self.clock, progress, events, StopRequest(), saver, ResizeMeter(events, 10**9),
            total_steps=10**9, checkpoint_every_s=math.inf, pending=self._pending, barrier=lambda: None,
        )  # fmt: skip

    def worker_settings(self) -> None:
        """The process's settings as this worker's own process has them."""
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.benchmark = False
        set_up_device(self.spec, self.settings, self.device)

    def _pending(self) -> int:
        return BLOCK_SWITCH if self.position.step >= self.block_end - 1 else 0

    def block(self, steps: int, threads: int) -> tuple[float, float]:
        self.worker_settings()
        self.clock.starts = 0
        first = self.position.step
        self.block_end = first + steps + 1
        ended = self.loop.train()
        synchronize(self.device)
        if not isinstance(ended, SwitchAgreed):
            raise RuntimeError(f"the loop ended with {ended!r}, not at the block's end")
        timed = self.position.step - first - 1
        return (time.perf_counter() - self.clock.timed_from) / timed, (time.process_time() - self.clock.timed_from_cpu) / timed


def bungee_spec(mode: str, task: tuple[Path, str], hyperparameters: dict[str, Any], batch: int,
                precision: str, virtual_workers: int) -> dict[str, Any]:  # fmt: skip
    spec: dict[str, Any] = {
        "name": f"bench-step-{mode}", "code": "0" * 64, "entrypoint": task[1], "steps": 10**6, "seed": SEED,
        "max_workers": 1, "hyperparameters": {**hyperparameters, "batch_size": batch}, "precision": precision,
    }  # fmt: skip
    if mode == "strict":
        return {**spec, "consistency": "strict", "virtual_workers": virtual_workers}
    return {**spec, "consistency": "hybrid", "batch_per_worker": batch, "min_batch_size": batch,
            "max_batch_size": batch, "warmup_steps": 0}  # fmt: skip


def group_of_one(device: torch.device) -> None:
    """The default process group, of this process alone, as a worker's at world size 1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=timedelta(seconds=120), **({"device_id": device} if device.type == "cuda" else {}),
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", type=Path, default=RESNET[0], help="the task's directory")
    parser.add_argument("--entrypoint", default=None, help="module:Class (default task:ResNetTask for the default task)")
    parser.add_argument("--hyperparameters", default="{}", help="the task's hyperparameters, JSON")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per arm and round (20; --quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (8; --quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per arm before the rounds (5; --quick 2)")
    parser.add_argument("--data-workers", type=int, default=None,
                        help="DataLoader workers of the torch arm, and the task's data_workers in Bungee's arms "
                        "(default: the task's data_workers for both)")  # fmt: skip
    parser.add_argument("--loader-workers", type=int, default=None,
                        help="DataLoader workers of the torch arm alone (default: as --data-workers)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--virtual-workers", type=int, default=1, help="strict arm's virtual workers")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of every arm")
    parser.add_argument("--arms", default=",".join(ARMS), help="which arms, comma-separated")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps; a narrow ResNet for the default task")
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, where each arm's host time goes: cProfile over one more block, "
                        "the top functions by own time")  # fmt: skip
    args = parser.parse_args()
    task_dir = args.task.resolve()
    entrypoint = args.entrypoint or (RESNET[1] if task_dir == RESNET[0] else None)
    if entrypoint is None:
        parser.error("--entrypoint is needed for a task other than examples/resnet")
    hyperparameters = json.loads(args.hyperparameters)
    for name, full, quick in (("steps", 20, 3), ("rounds", 8, 3), ("warmup", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.quick and task_dir == RESNET[0]:
        hyperparameters = {**QUICK_RESNET, **hyperparameters}
    arms = [arm for arm in args.arms.split(",") if arm]
    if unknown := set(arms) - set(ARMS):
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: strict needs it
        torch.cuda.set_device(device)
    settings = WorkerSettings.from_env(os.environ)
    if args.threads is not None:
        settings = settings.model_copy(update={"threads": args.threads})
    threads = settings.threads

    task_class = load_task_class(task_dir, entrypoint)
    if args.data_workers is not None:
        task_class.data_workers = args.data_workers  # what the readers of Bungee's arms read with
    data_workers = getattr(task_class, "data_workers", 0)
    loader_workers = data_workers if args.loader_workers is None else args.loader_workers
    batch = int(hyperparameter(validate_hyperparameters(task_class, hyperparameters), "batch_size"))
    hyperparameters = {**hyperparameters, "batch_size": batch}

    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    group_of_one(device)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bungee-bench-step-") as run_dir:
        for arm in arms:
            loop_settings(device, threads)
            if arm in ("torch", "floor", "deterministic"):
                runs[arm] = TorchLoop(task_class, hyperparameters, device, loader_workers, args.precision == "bf16",
                                      resident=arm == "floor", deterministic=arm == "deterministic")  # fmt: skip
            else:
                spec = bungee_spec(arm, (task_dir, entrypoint), hyperparameters, batch, args.precision,
                                   args.virtual_workers)  # fmt: skip
                runs[arm] = BungeeArm(spec, (task_dir, entrypoint), device, settings, run_dir)
        for run in runs.values():
            run.block(max(1, args.warmup - 1), threads)
        times: dict[str, list[float]] = {arm: [] for arm in runs}
        cpu: dict[str, list[float]] = {arm: [] for arm in runs}
        for index in range(args.rounds):
            order = arms[index % len(arms):] + arms[: index % len(arms)]
            for arm in order:
                wall, used = runs[arm].block(args.steps, threads)
                times[arm].append(wall * 1000)
                cpu[arm].append(used * 1000)
        if args.profile:
            for arm, run in runs.items():
                profiler = cProfile.Profile()
                profiler.runcall(run.block, args.steps, threads)
                print(f"\nwhere {arm}'s host time goes ({args.steps + 1} steps, by own time):")
                pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(18)
        for run in runs.values():
            if isinstance(run, BungeeArm):
                run.problem.close()
    dist.destroy_process_group()
    parameters = sum(p.numel() for p in runs[arms[0]].model.parameters())
    describe_device = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {threads} thread(s)"
    print(f"\n{entrypoint} of {task_dir.name}, batch {batch}, hyperparameters {hyperparameters}, "
          f"{args.precision}, on {describe_device}; Bungee's data_workers {data_workers}, DataLoader workers "
          f"{loader_workers}; {args.rounds} rounds of "
          f"{args.steps} timed steps per arm")  # fmt: skip
    for arm in runs:
        print(f"  {arm:>6}: {show(times[arm], 'ms a step', 2)}; CPU time of this process {show(cpu[arm], 'ms', 2)}")
    medians = {arm: statistics.median(values) for arm, values in times.items()}

    def versus(arm: str) -> tuple[float | None, list[float]]:
        if arm not in times or "torch" not in times:
            return None, []
        per_round = [ours / theirs for ours, theirs in zip(times[arm], times["torch"], strict=True)]
        return medians[arm] / medians["torch"], per_round

    plain, plain_rounds = versus("plain")
    strict, strict_rounds = versus("strict")
    determinism, determinism_rounds = versus("deterministic")
    ours = medians["strict"] / medians["deterministic"] if "strict" in medians and "deterministic" in medians else None
    for name, ratio, rounds in (("plain", plain, plain_rounds), ("strict", strict, strict_rounds),
                                ("deterministic", determinism, determinism_rounds)):  # fmt: skip
        if ratio is not None:
            print(f"  {name}_vs_torch: {ratio:.3f} (per round {min(rounds):.3f} / {statistics.median(rounds):.3f} / "
                  f"{max(rounds):.3f})")  # fmt: skip
    if "torch" in cpu:
        print("  in CPU time of this process (what a loaded machine inflates less): " + ", ".join(
            f"{arm}_vs_torch {statistics.median(cpu[arm]) / statistics.median(cpu['torch']):.3f}"
            for arm in ("plain", "strict") if arm in cpu))  # fmt: skip
    after = os.getloadavg()
    print(f"  load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    result: dict[str, Any] = {
        "bench": "step", "task": f"{task_dir.name}/{entrypoint}", "hyperparameters": hyperparameters,
        "device": describe_device, "precision": args.precision, "data_workers": data_workers,
        "loader_workers": loader_workers,
        "steps": args.steps, "rounds": args.rounds, "model_params": parameters,
        **{f"{arm}_step_ms": medians.get(arm) for arm in ARMS},
        **{f"{arm}_cpu_ms": statistics.median(cpu[arm]) for arm in cpu},
        "plain_vs_torch": plain, "strict_vs_torch": strict, "deterministic_vs_torch": determinism,
        "strict_vs_deterministic": ours,
        **{f"{arm}_vs_torch_cpu": statistics.median(cpu[arm]) / statistics.median(cpu["torch"])
           for arm in ("plain", "strict") if arm in cpu and "torch" in cpu},
        "plain_vs_torch_per_round": plain_rounds, "strict_vs_torch_per_round": strict_rounds,
        "conditions": {**conditions, "load_average_after_1m": round(after[0], 2)},
    }  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
