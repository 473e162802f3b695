"""What reading a step's items costs a job once they are read ahead: a task whose
`__getitem__` takes, over a step's items, as long as the step's compute, trained by the real
Trainer (world size 1) three ways, interleaved in rounds:

- floor: the same batch resident, handed to every step (compute and the trainer alone);
- read ahead: the items read by the task's 2 reader processes a step ahead (the worker's way);
- read in step: the same readers, with what was read ahead dropped before each step, so that
  every step waits for its own items (what the worker did before the read-ahead).

    python bench/readahead.py                 # 8 rounds of 12 steps each way
    python bench/readahead.py --rounds 4 --steps 8 --device cuda

An item's read is a wait (`time.sleep`, as a file read or a remote fetch is), so that the readers
do not take the cores the compute needs: on 2 shared cores a CPU-bound read would measure the
machine, not the overlap. item_s is calibrated from the floor (its fastest step, the least
disturbed by the machine's load) / batch size, unless --item-ms gives it. Each
round runs every arm once, in an order that rotates from round to round; a step's time is
taken around Trainer.step (the first steps of each arm are left out once). The figure is the
median over rounds of each round's ratio of medians to the floor, with their min and max, and
the load average at each round. The last line is one JSON object."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import machine, spread  # noqa: E402
from elastic.tasks.runtime import BoundTask, bind_task  # noqa: E402
from elastic.worker.data import SampleStream  # noqa: E402
from elastic.worker.trainer import Trainer  # noqa: E402

TASK = Path(__file__).resolve().parent / "tasks" / "slow_items"
SEED = 3
WARMUP = 3


def _trainer(entrypoint: str, hyperparameters: dict[str, Any], device: torch.device) -> Trainer:
    task: BoundTask = bind_task(TASK, f"task:{entrypoint}", hyperparameters, SEED, device)
    return Trainer(task, task.make_optimizer(), SampleStream(task.num_samples, SEED), task.batch_size, SEED, 0, 1)


class Arm:
    def __init__(self, name: str, trainer: Trainer, drop_each_step: bool = False) -> None:
        self.name, self.trainer, self.drop_each_step = name, trainer, drop_each_step
        self.step = 0

    def run(self, steps: int, device: torch.device) -> list[float]:
        times = []
        for _ in range(steps):
            if self.drop_each_step:
                self.trainer.readahead.drop()
            began = time.perf_counter()
            self.trainer.step(self.step, stop_requested=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
            self.step += 1
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (the readers take 1 each)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--item-ms", type=float, default=0.0, help="an item's read (default: calibrated)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    base = {"batch_size": args.batch}

    floor_trainer = _trainer("SlowItemsHere", base, device)
    resident = floor_trainer.problem.batch(range(args.batch))
    floor_trainer.readahead.batch = lambda *_args, **_kwargs: resident  # type: ignore[method-assign]
    floor = Arm("floor", floor_trainer)
    floor.run(WARMUP, device)
    calibration = floor.run(2 * args.steps, device)
    item_s = args.item_ms / 1e3 if args.item_ms else min(calibration) / args.batch
    slow = {**base, "item_s": item_s}
    arms = [floor, Arm("read_ahead", _trainer("SlowItems", slow, device)),
            Arm("read_in_step", _trainer("SlowItems", slow, device), drop_each_step=True)]
    for arm in arms[1:]:
        arm.run(WARMUP, device)
    print(f"item_s {item_s * 1e3:.3f} ms (a step's items read one after another: "
          f"{item_s * args.batch * 1e3:.1f} ms, the floor's step)")
    medians: dict[str, list[float]] = {arm.name: [] for arm in arms}
    loads = []
    for round_index in range(args.rounds):
        shift = round_index % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            medians[arm.name].append(statistics.median(arm.run(args.steps, device)) * 1e3)
        loads.append(machine()["load_average_1m"])
        print(f"round {round_index + 1}: " + ", ".join(f"{name} {values[-1]:.1f} ms" for name, values in medians.items())
              + f"; load {loads[-1]}")
    ratios = {
        name: [ours / theirs for ours, theirs in zip(medians[name], medians["floor"], strict=True)]
        for name in ("read_ahead", "read_in_step")
    }
    for name, values in ratios.items():
        stats = spread(values)
        print(f"{name} / floor per round: min {stats['min']:.3f}, median {stats['median']:.3f}, max {stats['max']:.3f}")
    for arm in arms:
        arm.trainer.problem.close()
    dist.destroy_process_group()
    print(json.dumps({
        "item_s": item_s,
        "batch": args.batch,
        "device": args.device,
        "step_ms": {name: spread(values) for name, values in medians.items()},
        "read_ahead_vs_floor": spread(ratios["read_ahead"]),
        "read_in_step_vs_floor": spread(ratios["read_in_step"]),
        "read_ahead_hits": arms[1].trainer.readahead.hits,
        "load_average_1m": spread(loads),
        "conditions": machine(),
    }))


if __name__ == "__main__":
    main()
