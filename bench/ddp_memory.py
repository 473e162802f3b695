"""Why the elastic runtime's plain step can be faster than torch DDP's on a CPU: gradient memory.

    python bench/ddp_memory.py            # the 25.6M model, 10 interleaved rounds of 5 steps
    python bench/ddp_memory.py --quick    # 4 rounds

One process (a gloo group of one, so no wire and no other rank to wait for), the 25.6M-parameter
MLP of bench/overhead.py, three ways of taking a step, interleaved in rounds:

- "ddp": DistributedDataParallel(model) and zero_grad(set_to_none=True), PyTorch's defaults;
- "ddp_bucket_view": DDP(gradient_as_bucket_view=True) and zero_grad(set_to_none=False);
- "elastic": the elastic runtime's plain-averaging trainer (one flat buffer for the worker's
  life, the gradients views of it, one all-reduce over it).

Per step it reports wall time, the CPU time of this thread (user and system: page faults are
system time) and the minor page faults, which the machine's load does not change: a step that
allocates its gradients afresh faults their pages in again every step. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from bench.conditions import RESNET50_SIZED, machine, show  # noqa: E402
from elastic.tasks.runtime import BoundTask, bind_task  # noqa: E402
from elastic.worker.data import SampleStream  # noqa: E402
from elastic.worker.hybrid import HybridSchedule, HybridTrainer  # noqa: E402
from elastic.workloads import CATALOGUE  # noqa: E402

SEED = 0


def _problem() -> BoundTask:
    info = CATALOGUE["digits-mlp"]
    return bind_task(info.path, info.entrypoint, RESNET50_SIZED.spec(1)["hyperparameters"], SEED)


class DdpStep:
    """A step as bench/torchrun_train.py takes it."""

    def __init__(self, bucket_view: bool) -> None:
        self.problem = _problem()
        self.optimizer = self.problem.make_optimizer()
        self.ddp = DistributedDataParallel(self.problem.model, gradient_as_bucket_view=bucket_view)
        self.set_to_none = not bucket_view
        self.stream = SampleStream(self.problem.num_samples, SEED)

    def __call__(self, step: int) -> None:
        indices = self.stream.local_batch(step, self.problem.batch_size, 1, 0)
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        self.problem.loss(self.problem.batch(indices), model=self.ddp).backward()
        self.optimizer.step()


class ElasticStep:
    """A step of the elastic runtime's plain-averaging path."""

    def __init__(self) -> None:
        problem = _problem()
        batch = problem.batch_size
        schedule = HybridSchedule(base_lr=problem.lr, base_batch=batch, batch_per_worker=batch, min_batch=batch,
                                  max_batch=batch, lr_scaling="linear", warmup_steps=0)  # fmt: skip
        self.trainer = HybridTrainer(
            problem, problem.make_optimizer(), SampleStream(problem.num_samples, SEED), schedule, SEED, 0, 1
        )
        self.trainer.rebind_members(0, 1, None, 0)

    def __call__(self, step: int) -> None:
        self.trainer.step(step, False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    arms: dict[str, Any] = {"ddp": DdpStep(False), "ddp_bucket_view": DdpStep(True), "elastic": ElasticStep()}
    rounds, steps = (4, 5) if args.quick else (10, 5)
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    faults: dict[str, list[float]] = {arm: [] for arm in arms}
    for arm in arms.values():
        for step in range(2):  # warm-up: the first allocations, DDP's bucket rebuild
            arm(step)
    for index in range(rounds):
        for name, arm in arms.items():
            for step in range(2 + index * steps, 2 + (index + 1) * steps):
                began, began_cpu = time.perf_counter(), time.thread_time()
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                arm(step)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
                cpu[name].append(time.thread_time() - began_cpu)
                wall[name].append(time.perf_counter() - began)
    dist.destroy_process_group()
    print(f"\n{RESNET50_SIZED.label} MLP ({RESNET50_SIZED.parameters / 1e6:.1f}M parameters), one process, "
          f"{rounds} interleaved rounds of {steps} steps an arm, load average {machine()['load_average_1m']} at the end")  # fmt: skip
    for name in arms:
        print(f"  {name:16s} wall {show(wall[name])}; CPU {show(cpu[name])}; "
              f"minor page faults a step {statistics.median(faults[name]):.0f}")  # fmt: skip
    elastic_cpu = statistics.median(cpu["elastic"])
    result = {
        "bench": "ddp_memory",
        "cpu_time_median_s": {name: statistics.median(values) for name, values in cpu.items()},
        "wall_median_s": {name: statistics.median(values) for name, values in wall.items()},
        "minor_faults_median": {name: statistics.median(values) for name, values in faults.items()},
        "elastic_vs_ddp_cpu_pct": (elastic_cpu / statistics.median(cpu["ddp"]) - 1) * 100,
        "elastic_vs_bucket_view_cpu_pct": (elastic_cpu / statistics.median(cpu["ddp_bucket_view"]) - 1) * 100,
        "model_params": RESNET50_SIZED.parameters,
        "conditions": conditions,
    }
    print(f"  elastic vs DDP in CPU time: {result['elastic_vs_ddp_cpu_pct']:+.1f}%; vs DDP bucket view "
          f"{result['elastic_vs_bucket_view_cpu_pct']:+.1f}%")  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
