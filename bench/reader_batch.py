"""What a batch read by a task's reader processes costs the worker's own process, four ways side
by side, interleaved in rounds:

- items: every item pickled on its own in the readers, unpickled in the worker and collated
  there by torch's default_collate (what the readers did before they stacked);
- pipe: each reader stacks its run of items as default_collate would and sends the stack through
  the pool's pipe; the worker joins the stacks (what they did before shared memory);
- shared: the same stacks, written by the readers into segments of shared memory the worker lends
  them and copied out once by the worker (elastic.tasks.readers: what a task without a
  `collate` of its own gets now);
- dataloader, the baseline: torch's own DataLoader over the same data set with as many workers,
  its batches iterated in the main process (each worker's batch comes in shared memory of its
  own; with `--pin`, pinned by its pin-memory thread, as a user's loop on a GPU has it).

    python bench/reader_batch.py                              # ResNet example, batch 128, 2 readers
    python bench/reader_batch.py --batch 256 --readers 4 --rounds 10
    python bench/reader_batch.py --readers 6 --pin     # on a GPU machine: every arm ends in pinned memory

The figure that matters on a GPU is the worker process's CPU time a batch (time.process_time: its
main thread and its threads: the pool's, that receives the readers' results, and the
DataLoader's pin-memory thread), since that is host time the step's own Python competes with; the
wall time a batch is printed too (on 2 shared cores it mostly measures the readers). Bungee's arms
read the same items with the same seeds, and the bench checks that they give the same bytes (the
DataLoader's items are drawn by its own generators). Per arm: min / median / max over the rounds
of each round's median; the last line is one JSON object."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402
from torch.utils.data import DataLoader, default_collate  # noqa: E402

from bench.conditions import ROOT, machine, show, spread  # noqa: E402
from elastic.tasks.hyperparameters import validate_hyperparameters  # noqa: E402
from elastic.tasks.loader import construct_task, load_task_class  # noqa: E402
from elastic.tasks.readers import ItemReaders, Stacked  # noqa: E402


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def _pinned(batch: Any, pin: bool) -> Any:
    """`batch` with its tensors in pinned memory if `pin` (what the read-ahead does on a GPU)."""
    return tree_map(lambda value: value.pin_memory() if isinstance(value, torch.Tensor) else value, batch) if pin else batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", type=Path, default=ROOT / "examples" / "resnet")
    parser.add_argument("--entrypoint", default="task:ResNetTask")
    parser.add_argument("--hyperparameters", default='{"width": 8}', help="the task's, JSON")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batches", type=int, default=10, help="batches per arm and round")
    parser.add_argument("--pin", action="store_true",
                        help="end in pinned memory, as for a GPU (needs CUDA): the items' batch pinned after "
                        "collating, the stacks joined there")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    readers = ItemReaders(args.readers, args.task.resolve(), args.entrypoint, json.loads(args.hyperparameters), None,
                          stack=True)  # fmt: skip
    task_class = load_task_class(args.task.resolve(), args.entrypoint)
    dataset = construct_task(task_class, validate_hyperparameters(task_class, json.loads(args.hyperparameters)),
                             None).train_data()  # fmt: skip
    loader = iter(DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.readers,
                             pin_memory=args.pin, persistent_workers=True))  # fmt: skip
    arms = {
        "items": lambda indices, seeds: _pinned(default_collate(readers.read(indices, seeds)), args.pin),
        "pipe": lambda indices, seeds: readers.start(indices, seeds, pin=args.pin, shared=False).result(),
        "shared": lambda indices, seeds: readers.start(indices, seeds, pin=args.pin).result(),
        "dataloader": lambda indices, seeds: next(loader),
    }
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        first = list(range(args.batch))
        seeds = [10_000 + index for index in first]
        for _ in range(2):  # the first tells the segments' size, and is not one of them
            shared = arms["shared"](first, seeds)
        if not isinstance(shared, Stacked) or not shared.batch or not _equal(shared.batch, arms["pipe"](first, seeds).batch):
            raise SystemExit("the task's items did not stack alike, or the segments changed them: nothing to compare")
        if not _equal(shared.batch, arms["items"](first, seeds)):
            raise SystemExit("the stacked batch differs from the items collated in this process")
        for _ in range(3):
            arms["dataloader"](first, seeds)  # its workers started, its read-ahead full
        for round_index in range(args.rounds):
            shift = round_index % len(arms)
            order = list(arms)[shift:] + list(arms)[:shift]
            for arm in order:
                cpu_times, wall_times = [], []
                for batch_index in range(args.batches):
                    at = (round_index * args.batches + batch_index) * args.batch
                    indices = list(range(at, at + args.batch))
                    batch_seeds = [10_000 + index for index in indices]
                    began, began_cpu = time.perf_counter(), time.process_time()
                    arms[arm](indices, batch_seeds)
                    wall_times.append((time.perf_counter() - began) * 1000)
                    cpu_times.append((time.process_time() - began_cpu) * 1000)
                cpu[arm].append(statistics.median(cpu_times))
                wall[arm].append(statistics.median(wall_times))
    finally:
        readers.close()
    conditions["load_average_after_1m"] = machine()["load_average_1m"]
    print(f"{args.task.name}/{args.entrypoint} {args.hyperparameters}, batch {args.batch}, {args.readers} readers, "
          f"{args.rounds} rounds of {args.batches} batches per arm{', into pinned memory' if args.pin else ''}")  # fmt: skip
    for arm in arms:
        print(f"  {arm:>10}: worker process CPU {show(cpu[arm], 'ms a batch', 2)}; wall {show(wall[arm], 'ms', 2)}")
    medians = {arm: statistics.median(values) for arm, values in cpu.items()}
    ratios = {
        "shared_vs_pipe_cpu": medians["shared"] / medians["pipe"],
        "shared_vs_items_cpu": medians["shared"] / medians["items"],
        "shared_vs_dataloader_cpu": medians["shared"] / medians["dataloader"],
    }
    print("  worker process CPU, medians: " + ", ".join(f"{name[:-4].replace('_vs_', ' / ')} {value:.3f}"
                                                       for name, value in ratios.items())  # fmt: skip
          + f"; load average after {conditions['load_average_after_1m']}")
    print(json.dumps({
        "bench": "reader_batch", "task": f"{args.task.name}/{args.entrypoint}", "batch": args.batch,
        "readers": args.readers, "rounds": args.rounds, "batches": args.batches, "pin": args.pin,
        "cpu_ms": {arm: spread(values) for arm, values in cpu.items()},
        "wall_ms": {arm: spread(values) for arm, values in wall.items()},
        **ratios, "conditions": conditions,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
