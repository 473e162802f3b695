"""Strict mode's exact sum on a sharded model, between real processes over gloo: a task with an
output layer tied to its embedding and dropout, 4 virtual workers, Adam, trained three steps
sharded over 4 workers, over 2, over 1, and over 2 then (resized in place) 4: every parameter
and every tensor of Adam's state comes out the same bits. With batch norm too, 6 virtual
workers over 2 -> 1 -> 3 -> 2 workers (leavers handing over, joiners taking the contexts and the
last largest terms that predict the scales) equal
a fixed run over 2, buffers included. Placements the passes cannot match are refused by name."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.tasks.runtime import BoundTask, bind_task
from elastic.worker.reshard import Member, Membership
from tests.test_sharding_full_state import _same

TASK = Path(__file__).parent / "tasks" / "tied"
SEED, VIRTUAL, BATCH, STEPS = 3, 4, 8, 3
GROW = Membership(2, 4, (Member(0, 0, 0), Member(1, 1, 1), Member(2, None, 2), Member(3, None, 3)))


def _problem() -> BoundTask:
    return bind_task(TASK, "task:Tied", {"batch_size": BATCH}, SEED)


def _hosted(rank: int, size: int) -> range:
    return range(rank * VIRTUAL // size, (rank + 1) * VIRTUAL // size)


def _strict(rank: int, world: int, init: str, margin: int, out: str) -> None:
    import torch.distributed as dist

    from elastic.worker.data import SampleStream
    from elastic.worker.sharded import ShardedModel, full_state, mesh_of, outline_of, units_for
    from elastic.worker.strict_sharded import ExactShardedStep

    torch.set_num_threads(1)  # forked from pytest: its OpenMP threads are not here
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        cpu = torch.device("cpu")
        groups: dict[int, Any] = {4: None, 2: dist.new_group([0, 1]), 1: dist.new_group([0])}
        results: dict[str, Any] = {}

        def start(size: int) -> tuple[Any, ShardedModel, torch.nn.Module, torch.optim.Optimizer]:
            problem = _problem()
            sharded = ShardedModel(problem.model, units_for(problem.task), cpu)
            optimizer = problem.make_optimizer()
            return (
                problem,
                sharded,
                sharded.first(problem.model, mesh_of(groups[size], cpu), optimizer),
                optimizer,
            )

        def stepper(
            problem: Any, module: torch.nn.Module, optimizer: Any, size: int, carried: Any = None
        ) -> ExactShardedStep:
            stream = SampleStream(problem.num_samples, SEED)
            hosted = _hosted(rank, size)
            return ExactShardedStep(
                problem,
                module,
                optimizer,
                stream,
                BATCH,
                SEED,
                VIRTUAL,
                hosted,
                groups[size],
                carried,
                margin,
            )

        for size in (4, 2, 1):
            if rank < size:
                problem, _, module, optimizer = start(size)
                steps = stepper(problem, module, optimizer, size)
                losses = [steps.step(step) for step in range(STEPS)]
                state = full_state(module, optimizer)
                results[f"fixed {size}"] = (state, losses)
                results[f"rejected {size}"] = steps.rejected_steps
            dist.barrier()

        # Two workers, then four: two joiners take their shards from the two in memory.
        problem, sharded, module, optimizer = start(2) if rank < 2 else (None, None, None, None)
        carried = None
        if rank < 2:
            steps = stepper(problem, module, optimizer, 2)
            for step in range(STEPS - 1):
                steps.step(step)
            carried = steps.carried()
        else:
            problem = _problem()
            sharded = ShardedModel(problem.model, units_for(problem.task), cpu)
            module, optimizer = problem.model, problem.make_optimizer()
        box = [outline_of(module, optimizer) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None and sharded is not None
        grown = sharded.reshard(module, optimizer, box[0], GROW, rank, mesh_of(None, cpu))
        assert grown.model is not None
        after = stepper(problem, grown.model, optimizer, 4, carried)
        after.share_carried(0)  # the joiners take the last largest terms (and contexts) of a holder
        after.step(STEPS - 1)
        results["resized 2 -> 4"] = (full_state(grown.model, optimizer), None)
        if rank == 0:
            torch.save(results, f"{out}/0.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("margin", [8, 0], ids=["predicted", "mostly-rejected"])
def test_strict_sharded_steps_are_the_same_bits_on_any_placement_and_through_a_resize(
    tmp_path: Path, margin: int
) -> None:
    """With strict mode's margin the predictions mostly hold; with none, steps whose largest
    term grew are done again: the same bits on every placement either way."""
    import torch.multiprocessing as mp

    args = (4, f"file://{tmp_path / 'store'}", margin, str(tmp_path))
    mp.start_processes(_strict, args=args, nprocs=4, start_method="fork")
    results = torch.load(tmp_path / "0.pt", weights_only=False)
    reference, losses = results["fixed 4"]
    assert len(reference[1]["state"]) == 5, "five parameters (the tied weight once), each with Adam's state"
    for name in ("fixed 2", "fixed 1", "resized 2 -> 4"):
        assert _same(results[name][0], reference), name
    assert results["fixed 2"][1] == pytest.approx(losses, rel=1e-6)
    plain = _problem().model
    assert plain.load_state_dict(reference[0]) is not None
    rejected = [results[f"rejected {size}"] for size in (4, 2, 1)]
    assert rejected[0] == rejected[1] == rejected[2], "the same steps rejected on every placement"
    assert (rejected[0] > 0) == (margin == 0), rejected


def _refused(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from elastic.worker.data import SampleStream
    from elastic.worker.sharded import ShardedModel, mesh_of, units_for
    from elastic.worker.strict_sharded import ExactShardedStep

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        cpu = torch.device("cpu")
        problem = _problem()
        optimizer = problem.make_optimizer()
        module = ShardedModel(problem.model, units_for(problem.task), cpu).first(
            problem.model, mesh_of(None, cpu), optimizer
        )
        stream = SampleStream(problem.num_samples, SEED)
        uneven = range(0, 2) if rank == 0 else range(2, 3)  # 3 of 4 hosted: 2 and 1
        with pytest.raises(
            ValueError, match="every worker must host the same number of the 3 virtual workers"
        ):
            ExactShardedStep(problem, module, optimizer, stream, BATCH, SEED, 3, uneven)
        Path(out, f"refused-{rank}").touch()
    finally:
        dist.destroy_process_group()


def test_placements_the_passes_cannot_match_are_refused(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _refused, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, start_method="fork"
    )
    assert (tmp_path / "refused-0").exists() and (tmp_path / "refused-1").exists()


NORM_VIRTUAL, NORM_BATCH = 6, 12
TO_ONE = Membership(2, 1, (Member(0, 0, 0), Member(1, 1, None)))
ONE_TO_THREE = Membership(1, 3, (Member(0, 0, 0), Member(1, None, 1), Member(2, None, 2)))
THREE_TO_TWO = Membership(3, 2, (Member(0, 0, 0), Member(1, 1, None), Member(2, 2, 1)))


def _norm_problem() -> BoundTask:
    return bind_task(TASK, "task:TiedNorm", {"batch_size": NORM_BATCH}, SEED)


def _resized(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from elastic.worker.data import SampleStream
    from elastic.worker.sharded import ShardedModel, full_state, mesh_of, outline_of, units_for
    from elastic.worker.strict_sharded import ExactShardedStep

    torch.set_num_threads(1)  # forked from pytest: its OpenMP threads are not here
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        cpu = torch.device("cpu")
        first_two, alone, last_two = dist.new_group([0, 1]), dist.new_group([0]), dist.new_group([0, 2])

        def built() -> tuple[Any, ShardedModel, torch.optim.Optimizer]:
            problem = _norm_problem()
            return (
                problem,
                ShardedModel(problem.model, units_for(problem.task), cpu),
                problem.make_optimizer(),
            )

        def stepper(
            problem: Any,
            module: Any,
            optimizer: Any,
            new_rank: int,
            size: int,
            group: Any,
            carried: Any = None,
        ) -> ExactShardedStep:
            hosted = range(new_rank * NORM_VIRTUAL // size, (new_rank + 1) * NORM_VIRTUAL // size)
            stream = SampleStream(problem.num_samples, SEED)
            return ExactShardedStep(
                problem, module, optimizer, stream, NORM_BATCH, SEED, NORM_VIRTUAL, hosted, group, carried
            )

        report: dict[str, Any] = {}
        if rank < 2:  # the fixed run: two workers, four steps
            problem, sharded, optimizer = built()
            module = sharded.first(problem.model, mesh_of(first_two, cpu), optimizer)
            fixed = stepper(problem, module, optimizer, rank, 2, first_two)
            for step in range(4):
                fixed.step(step)
            report["fixed"] = full_state(module, optimizer)
        dist.barrier()

        problem, sharded, optimizer = built()
        module: torch.nn.Module = problem.model
        steps: ExactShardedStep | None = None
        if rank < 2:  # step 0 over two
            module = sharded.first(problem.model, mesh_of(first_two, cpu), optimizer)
            steps = stepper(problem, module, optimizer, rank, 2, first_two)
            steps.step(0)
        schedule = ((TO_ONE, alone, 1), (ONE_TO_THREE, None, 2), (THREE_TO_TWO, last_two, 3))
        for membership, group, step in schedule:
            box = [outline_of(module, optimizer) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            assert box[0] is not None
            member = next((m for m in membership.members if m.rank == rank), None)
            if member is None:  # takes no part in this resize
                continue
            if member.old_rank is None and steps is not None:  # left before; comes back as a new worker
                problem, sharded, optimizer = built()
                module, steps = problem.model, None
            mesh = mesh_of(group, cpu) if member.new_rank is not None else None
            moved = sharded.reshard(module, optimizer, box[0], membership, rank, mesh)
            if moved.model is None:  # a leaver: it handed its shards over
                steps = None
                continue
            assert member.new_rank is not None
            kept = steps.carried() if steps is not None else None
            module = moved.model
            steps = stepper(problem, module, optimizer, member.new_rank, membership.new_world, group, kept)
            if any(m.old_rank is None for m in membership.members):
                steps.share_carried(0)
            steps.step(step)
        if rank != 1:
            report["resized"] = full_state(module, optimizer)
        if rank == 0:
            torch.save(report, f"{out}/0.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_strict_sharded_2_1_3_2_with_batch_norm_equals_a_fixed_run(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _resized, args=(3, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=3, start_method="fork"
    )
    report = torch.load(tmp_path / "0.pt", weights_only=False)
    fixed_model, _ = report["fixed"]
    assert {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"} <= set(fixed_model)
    assert int(fixed_model["norm.num_batches_tracked"]) == 4, "virtual worker 0's context, four steps in"
    assert _same(report["resized"], report["fixed"])
