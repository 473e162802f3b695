"""How often strict mode's predicted scales are rejected: fallbacks per step.

    python bench/strict_fallbacks.py                      # three tasks, 1..8 and 16 virtual workers, 60 steps
    python bench/strict_fallbacks.py --steps 15 --virtual-workers 3,4

A strict step tries the scales predicted from the last step that took the MAX all-reduce
(elastic.worker.strict); if any rank's vote says its terms do not fit them, the step falls back:
the MAX all-reduce and a second SUM of the whole gradient. This bench trains each task with a
StrictTrainer over a process group of one (gloo) for `--steps` steps after the first (which
takes the MAX all-reduce) and counts, per number of virtual workers: the steps that tried a
prediction, the rejected ones (fallbacks), the steps that took the MAX all-reduce without trying
one (no margin to predict in), the fallbacks per step over the second half of the steps (after
a switch to int64, if the job made one: elastic.worker.strict), and the fixed point the job
ended in. The votes are those a
multi-worker run agrees on (a vote is on the max over every virtual worker, whatever their
placement), so the counts hold for any world size.

The tasks: the noisy test task (tests/tasks/noisy, NoisyMetrics: 2 -> 8 -> 2 with batch norm
and three metrics), the digits MLP (examples/digits, 4.8k parameters) and the ResNet-style task
at width 8 (examples/resnet, 175k parameters, as bench/step.py --quick). CPU only, one thread.
The last line is one JSON object: the rows and the conditions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.conditions import ROOT, machine  # noqa: E402
from elastic.tasks.runtime import bind_task  # noqa: E402
from elastic.worker.data import SampleStream  # noqa: E402
from elastic.worker.strict import StrictTrainer  # noqa: E402

SEED = 6
TASKS: dict[str, tuple[Path, str, dict[str, Any], int]] = {
    "noisy": (ROOT / "tests" / "tasks" / "noisy", "task:NoisyMetrics", {}, 32),
    "digits-mlp": (ROOT / "examples" / "digits", "task:DigitsMLP", {"batch_size": 64}, 64),
    "resnet-w8": (ROOT / "examples" / "resnet", "task:ResNetTask", {"width": 8, "batch_size": 32}, 32),
}
"""name: (directory, entrypoint, hyperparameters, global batch)."""


def measure(name: str, virtual_workers: int, steps: int) -> dict[str, Any]:
    """Trains `steps` + 1 steps of task `name` with `virtual_workers` and counts the outcomes of
    the last `steps`."""
    directory, entrypoint, hyperparameters, batch = TASKS[name]
    task = bind_task(directory, entrypoint, hyperparameters, seed=SEED)
    trainer = StrictTrainer(
        task, task.make_optimizer(), SampleStream(task.num_samples, SEED), batch, SEED, 0, 1,
        virtual_workers=virtual_workers,
    )  # fmt: skip
    trainer.step(0, stop_requested=False)  # takes the MAX all-reduce: nothing predicted yet
    predicted = max_only = 0
    fallbacks_before = trainer.scale_fallbacks
    half = steps // 2 + 1
    second_half_from = fallbacks_before
    for step in range(1, steps + 1):
        if step == half:
            second_half_from = trainer.scale_fallbacks
        if trainer.predicted_scales is None:
            max_only += 1
        else:
            predicted += 1
        trainer.step(step, stop_requested=False)
    fallbacks = trainer.scale_fallbacks - fallbacks_before
    late = trainer.scale_fallbacks - second_half_from
    return {
        "task": name,
        "virtual_workers": virtual_workers,
        "batch": batch,
        "steps": steps,
        "predicted": predicted,
        "fallbacks": fallbacks,
        "max_only": max_only,
        "fallbacks_per_step": round(fallbacks / steps, 3),
        "second_half_fallbacks": late,
        "second_half_per_step": round(late / (steps - half + 1), 3),
        "fixed_point": str(trainer.fixed_dtype).removeprefix("torch."),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--virtual-workers", default="1,2,3,4,5,6,7,8,16")
    parser.add_argument("--tasks", default=",".join(TASKS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    conditions = {**machine(), "steps": args.steps, "threads": 1, "world_size": 1, "seed": SEED}
    print("conditions:", json.dumps(conditions))
    print(f"{'task':<11} {'vws':>3} {'batch':>5} {'predicted':>9} {'fallbacks':>9} {'max only':>8} "
          f"{'per step':>8} {'2nd half':>8}  fixed point at the end")  # fmt: skip
    rows = []
    for name in args.tasks.split(","):
        for virtual_workers in (int(v) for v in args.virtual_workers.split(",")):
            row = measure(name, virtual_workers, args.steps)
            rows.append(row)
            print(f"{name:<11} {virtual_workers:>3} {row['batch']:>5} {row['predicted']:>9} {row['fallbacks']:>9} "
                  f"{row['max_only']:>8} {row['fallbacks_per_step']:>8.3f} {row['second_half_per_step']:>8.3f}  "
                  f"{row['fixed_point']}", flush=True)  # fmt: skip
    dist.destroy_process_group()
    print(json.dumps({"rows": rows, "conditions": conditions}))


if __name__ == "__main__":
    main()
