"""Sharded training on CPU: FSDP2's own loop against Bungee's sharded steps, the state bytes a
worker holds, the in-place re-cut of a resize, and strict mode's bits.

    python bench/sharding.py            # the 25.2M-parameter task, 3 runs of each
    python bench/sharding.py --quick    # a 2.2M-parameter one, 2 runs

The task is bench/tasks/tokens (tied embedding, residual MLP blocks, Adam, a global batch of 8
sequences of 64 tokens), its units the task's `shard_units`. Processes are forked from this one
(torch imported once) and meet over gloo, as torchrun's would; each figure is the median of a
run's timed steps (after two warm-up steps), then min / median / max over the runs, the kinds
interleaved run by run. What it measures:

- `fsdp_step_s`: FSDP2's own loop (fully_shard, forward, backward, Adam, zero_grad) at world
  sizes 2 and 4;
- `bungee_step_s` and `step_vs_fsdp`: Bungee's sharded step (elastic.worker.sharded_step:
  the trainer's data stream and statistics, the gradient weighted by each worker's share) on
  the same module, and its ratio to FSDP2's;
- `strict_step_s`: strict mode's exact step (elastic.worker.strict_sharded, one virtual worker
  per worker), whose measuring round runs every pass twice;
- `state_bytes_vs_ddp`: the bytes a worker holds for parameters, gradients and Adam's two
  moments after a step, against DDP's (the whole of each);
- the re-cut of 2->3, 3->2 and 4->2 (survivors keep their ranks in order; leavers hand over;
  joiners have made one fully_shard before, as a joiner's warm-up would, since a process's first
  costs about a second of torch's own set-up): `pause_s`, the slowest member's time from
  entering the re-cut to holding the new module and optimiser state, its phases, and
  `bytes_moved`, the planner's count;
- `bitwise`: strict mode with 6 virtual workers, 2 workers then 3 then 2 (one step each, the
  state re-cut in memory), against 2 workers throughout: whether every parameter and Adam
  tensor is equal (torch.equal).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
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
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from bench.conditions import machine, show, spread  # noqa: E402
from elastic.tasks.runtime import BoundTask, bind_task  # noqa: E402
from elastic.worker.data import SampleStream, share_bounds  # noqa: E402
from elastic.worker.reshard import Member, Membership  # noqa: E402
from elastic.worker.sharded import ShardedModel, full_state, mesh_of, outline_of, units_for  # noqa: E402
from elastic.worker.sharded_step import ShardedSteps  # noqa: E402
from elastic.worker.strict_sharded import ExactShardedStep  # noqa: E402

CPU = torch.device("cpu")
TASK = Path(__file__).resolve().parent / "tasks" / "tokens"
SIZES = {"25m": {}, "2m": {"vocabulary": 2048, "width": 192, "blocks": 6}}
SEED, BATCH = 0, 8


def _problem(size: str, batch: int = BATCH) -> BoundTask:
    return bind_task(TASK, "task:Tokens", {**SIZES[size], "batch_size": batch}, SEED)


def _start(size: str, group: Any, batch: int = BATCH) -> tuple[BoundTask, ShardedModel, torch.nn.Module, Any]:
    problem = _problem(size, batch)
    sharded = ShardedModel(problem.model, units_for(problem.task), CPU)
    optimizer = problem.make_optimizer()
    module = sharded.first(problem.model, mesh_of(group, CPU), optimizer)
    problem.model = module  # what the task's loss runs
    return problem, sharded, module, optimizer


def _local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimiser tensors (local shards)."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    total = 0
    for parameter in model.parameters():
        held = [parameter, parameter.grad, *optimizer.state[parameter].values()]
        for tensor in held:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                total += local(tensor).numel() * local(tensor).element_size()
    return total


def _steps(rank: int, world: int, init: str, kind: str, size: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        problem, _, module, optimizer = _start(size, None)
        stream = SampleStream(problem.num_samples, SEED)
        if kind == "bungee":
            trainer = ShardedSteps(problem, optimizer, stream, BATCH, SEED, rank, world)
            trainer.adopt(module)
        elif kind == "strict":
            strict = ExactShardedStep(
                problem, module, optimizer, stream, BATCH, SEED, world, range(rank, rank + 1)
            )
        start, stop = share_bounds(BATCH, world, rank)
        times = []
        for step in range(steps + 2):
            dist.barrier()
            began = time.perf_counter()
            if kind == "fsdp":  # FSDP2's own loop
                first = step * BATCH
                problem.loss(problem.batch(stream.positions(first + start, first + stop))).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            elif kind == "bungee":
                trainer.step(step, stop_requested=False)
            else:
                strict.step(step)
            if step >= 2:
                times.append(time.perf_counter() - began)
        if kind == "fsdp":
            held = _local_bytes(module, optimizer)
        else:
            held = 0
        if rank == 0:
            Path(out).write_text(json.dumps({"median_s": statistics.median(times), "bytes": held}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


RESIZES = {
    "2->3": Membership(2, 3, (Member(0, 0, 0), Member(1, 1, 1), Member(2, None, 2))),
    "3->2": Membership(3, 2, (Member(0, 0, 0), Member(1, 1, 1), Member(2, 2, None))),
    "4->2": Membership(4, 2, (Member(0, 0, 0), Member(1, 1, 1), Member(2, 2, None), Member(3, 3, None))),
}


def _recut(rank: int, world: int, init: str, size: str, name: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        membership = RESIZES[name]
        old_ranks = [m.rank for m in membership.members if m.old_rank is not None]
        new_ranks = [m.rank for m in membership.members if m.new_rank is not None]
        old_group = dist.new_group(old_ranks)
        new_group = dist.new_group(new_ranks) if len(new_ranks) < world else None
        member = membership.member(rank)
        if member.old_rank is not None:
            problem, sharded, model, optimizer = _start(size, old_group)
            stream = SampleStream(problem.num_samples, SEED)
            trainer = ShardedSteps(
                problem, optimizer, stream, BATCH, SEED, member.old_rank, membership.old_world
            )
            trainer.reduce = lambda tensor: dist.all_reduce(tensor, group=old_group)
            trainer.adopt(model)
            trainer.step(0, stop_requested=False)  # Adam's moments exist
        else:
            problem = _problem(size)
            sharded = ShardedModel(problem.model, units_for(problem.task), CPU)
            model, optimizer = problem.model, problem.make_optimizer()
            with torch.device("meta"):
                warm = torch.nn.Linear(2, 2)
            fully_shard(warm, mesh=mesh_of(None, CPU))
        box = [outline_of(model, optimizer) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        mesh = mesh_of(new_group, CPU) if member.new_rank is not None else None
        dist.barrier()
        began = time.perf_counter()
        result = sharded.reshard(model, optimizer, box[0], membership, rank, mesh)
        took = torch.tensor([time.perf_counter() - began, *result.phases.values()], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if rank == 0:
            total = sum(layout.rows * layout.row_bytes for layout in result.plan.layouts)
            slowest = dict(zip(result.phases, took[1:].tolist(), strict=True))
            Path(out).write_text(
                json.dumps(
                    {
                        "pause_s": took[0].item(),
                        "phases_s": slowest,
                        "bytes_moved": result.plan.bytes_moved,
                        "state_bytes": total,
                        "plan": result.plan.describe(),
                    }
                )
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


STRICT_VIRTUAL, STRICT_BATCH = 6, 12
STRICT_GROW = Membership(2, 3, (Member(0, 0, 0), Member(1, 1, 1), Member(2, None, 2)))
STRICT_SHRINK = Membership(3, 2, (Member(0, 0, 0), Member(1, 1, 1), Member(2, 2, None)))


def _bitwise(rank: int, world: int, init: str, size: str, out: str) -> None:
    """Strict, 6 virtual workers: 2 workers for three steps, against 2 -> 3 -> 2 (one step each)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        two = dist.new_group([0, 1])

        def strict(
            problem: BoundTask,
            module: Any,
            optimizer: Any,
            new_rank: int,
            size_: int,
            group: Any,
            carried: Any = None,
        ) -> ExactShardedStep:
            hosted = range(new_rank * STRICT_VIRTUAL // size_, (new_rank + 1) * STRICT_VIRTUAL // size_)
            stream = SampleStream(problem.num_samples, SEED)
            return ExactShardedStep(
                problem,
                module,
                optimizer,
                stream,
                STRICT_BATCH,
                SEED,
                STRICT_VIRTUAL,
                hosted,
                group,
                carried,
            )

        fixed = None
        if rank < 2:
            problem, _, module, optimizer = _start(size, two, STRICT_BATCH)
            steps = strict(problem, module, optimizer, rank, 2, two)
            for step in range(3):
                steps.step(step)
            fixed = full_state(module, optimizer)
        dist.barrier()
        carried = None
        if rank < 2:
            problem, sharded, module, optimizer = _start(size, two, STRICT_BATCH)
            first_steps = strict(problem, module, optimizer, rank, 2, two)
            first_steps.step(0)
            carried = first_steps.carried()
        else:
            problem = _problem(size, STRICT_BATCH)
            sharded = ShardedModel(problem.model, units_for(problem.task), CPU)
            module, optimizer = problem.model, problem.make_optimizer()
        for membership, group, step in ((STRICT_GROW, None, 1), (STRICT_SHRINK, two, 2)):
            box = [outline_of(module, optimizer) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            assert box[0] is not None
            member = membership.member(rank)
            mesh = mesh_of(group, CPU) if member.new_rank is not None else None
            moved = sharded.reshard(module, optimizer, box[0], membership, rank, mesh)
            if moved.model is None:
                break
            assert member.new_rank is not None
            module = moved.model
            steps = strict(problem, module, optimizer, member.new_rank, membership.new_world, group, carried)
            if any(m.old_rank is None for m in membership.members):
                steps.share_carried(0)  # joiners take a holder's last largest terms
            steps.step(step)
            carried = steps.carried()
        resized = full_state(module, optimizer) if rank < 2 else None
        if rank == 0:
            equal = all(
                torch.equal(a, b) for a, b in zip(fixed[0].values(), resized[0].values(), strict=True)
            )
            for index, entries in fixed[1]["state"].items():
                for name, value in entries.items():
                    equal = equal and torch.equal(value, resized[1]["state"][index][name])
            Path(out).write_text(json.dumps({"bitwise": equal}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(target: Any, world: int, *args: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = f"{scratch}/out.json"
        mp.start_processes(
            target, args=(world, f"file://{scratch}/store", *args, out), nprocs=world, start_method="fork"
        )
        result: dict[str, Any] = json.loads(Path(out).read_text())
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2.2M-parameter task, 2 runs")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after 2 warm-up steps)")
    args = parser.parse_args(argv)
    size = "2m" if args.quick else "25m"
    runs = args.runs or (2 if args.quick else 3)
    parameters = sum(p.numel() for p in _problem(size).model.parameters())
    conditions = machine()
    print(
        f"task: bench/tasks/tokens, {parameters / 1e6:.1f}M parameters, Adam, fp32, global batch {BATCH} x 64 tokens"
    )
    print(f"conditions at start: {conditions}; {runs} runs; {args.steps} timed steps per run")
    ddp_bytes = 16 * parameters  # parameters, gradients, two moments, float32
    figures: dict[str, Any] = {"parameters": parameters, "runs": runs}
    for world in (2, 4):
        measured: dict[str, list[dict[str, Any]]] = {"fsdp": [], "bungee": [], "strict": []}
        for _ in range(runs):
            for kind in measured:
                measured[kind].append(_spawn(_steps, world, kind, size, args.steps))
        steps = {kind: [m["median_s"] for m in runs_] for kind, runs_ in measured.items()}
        ratio = statistics.median(steps["bungee"]) / statistics.median(steps["fsdp"])
        held = measured["fsdp"][0]["bytes"] / ddp_bytes
        print(
            f"world {world}: FSDP2 step {show(steps['fsdp'])}; Bungee sharded {show(steps['bungee'])} "
            f"({ratio:.3f} of FSDP2's); strict exact {show(steps['strict'])}; "
            f"state per worker {measured['fsdp'][0]['bytes'] / 1e6:.1f} MB, {held:.3f} of DDP's {ddp_bytes / 1e6:.1f} MB"
        )
        figures[f"fsdp_step_s_{world}"] = spread(steps["fsdp"])
        figures[f"bungee_step_s_{world}"] = spread(steps["bungee"])
        figures[f"strict_step_s_{world}"] = spread(steps["strict"])
        figures[f"step_vs_fsdp_{world}"] = round(ratio, 4)
        figures[f"state_bytes_vs_ddp_{world}"] = round(held, 4)
    for name, membership in RESIZES.items():
        world = len(membership.members)
        recuts = [_spawn(_recut, world, size, name) for _ in range(runs)]
        pauses = [m["pause_s"] for m in recuts]
        moved, total = recuts[0]["bytes_moved"], recuts[0]["state_bytes"]
        phases = {phase: [m["phases_s"][phase] for m in recuts] for phase in recuts[0]["phases_s"]}
        print(
            f"re-cut {name}: pause {show(pauses)}; moved {moved / 1e6:.1f} MB of the state's {total / 1e6:.1f} MB; "
            "slowest member's phases: "
            + ", ".join(f"{phase} {show(values)}" for phase, values in phases.items())
        )
        print("  " + recuts[0]["plan"].replace("\n", "\n  "))
        figures[f"recut_{name}"] = {
            "pause_s": spread(pauses),
            "bytes_moved": moved,
            "state_bytes": total,
            "phases_s": {phase: spread(values) for phase, values in phases.items()},
        }
    bitwise = _spawn(_bitwise, 3, size)["bitwise"]
    print(f"strict, 6 virtual workers, 2 -> 3 -> 2 workers against 2 throughout: bitwise {bitwise}")
    figures["bitwise"] = bitwise
    figures["load_average_1m_end"] = machine()["load_average_1m"]
    figures["conditions"] = conditions
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
