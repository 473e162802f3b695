"""What a batch read by a task's reader processes costs the worker's own process, two ways side by
side over the same readers, interleaved in rounds:

- items: every item pickled on its own in the readers, unpickled in the worker and collated
  there by torch's default_collate (what the readers did before they stacked);
- stacked: each reader stacks its run of items as default_collate would and the worker joins
  the stacks (elastic.tasks.readers: what a task without a `collate` of its own gets now).

    python bench/reader_batch.py                              # ResNet example, batch 128, 2 readers
    python bench/reader_batch.py --batch 256 --readers 4 --rounds 10
    python bench/reader_batch.py --readers 6 --pin     # on a GPU machine: both arms end in pinned memory

The figure that matters on a GPU is the worker process's CPU time a batch (time.process_time: its
main thread and the pool's thread that receives the readers' bytes), since that is host time the
step's own Python competes with; the wall time a batch is printed too (on 2 shared cores it
mostly measures the readers). Both arms read the same items with the same seeds, and the bench
checks that they give the same bytes. Per arm: min / median / max over the rounds of each
round's median; the last line is one JSON object."""

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
from torch.utils.data import default_collate  # noqa: E402

from bench.conditions import ROOT, machine, show, spread  # noqa: E402
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
    arms = {
        "items": lambda indices, seeds: _pinned(default_collate(readers.read(indices, seeds)), args.pin),
        "stacked": lambda indices, seeds: readers.start(indices, seeds, pin=args.pin).result(),
    }
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        first = list(range(args.batch))
        seeds = [10_000 + index for index in first]
        stacked = arms["stacked"](first, seeds)
        if not isinstance(stacked, Stacked):
            raise SystemExit("the task's items did not stack alike: nothing to compare")
        if not _equal(stacked.batch, arms["items"](first, seeds)):
            raise SystemExit("the stacked batch differs from the items collated in this process")
        for round_index in range(args.rounds):
            order = list(arms) if round_index % 2 == 0 else list(arms)[::-1]
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
        print(f"  {arm:>7}: worker process CPU {show(cpu[arm], 'ms a batch', 2)}; wall {show(wall[arm], 'ms', 2)}")
    ratio = statistics.median(cpu["stacked"]) / statistics.median(cpu["items"])
    print(f"  stacked / items, worker process CPU: {ratio:.3f}; load average after {conditions['load_average_after_1m']}")
    print(json.dumps({
        "bench": "reader_batch", "task": f"{args.task.name}/{args.entrypoint}", "batch": args.batch,
        "readers": args.readers, "rounds": args.rounds, "batches": args.batches, "pin": args.pin,
        "cpu_ms": {arm: spread(values) for arm, values in cpu.items()},
        "wall_ms": {arm: spread(values) for arm, values in wall.items()},
        "stacked_vs_items_cpu": ratio, "conditions": conditions,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
