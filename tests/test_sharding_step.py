"""The trainer's step on a sharded model, between real processes over gloo: the digits MLP
sharded with fully_shard trains two steps over two workers, two over three (a joiner, the state
moved in place), two over two again (a leaver hands its shards over), with a global batch of 7
(uneven shares). Every step's loss and the final parameters are those of one unsharded worker
on the whole batch, to float rounding (the reduction order differs); and a batch smaller than
the world is refused by name."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.tasks.runtime import bind_task
from elastic.worker.data import SampleStream
from elastic.worker.reshard import Member, Membership
from elastic.worker.trainer import Trainer
from elastic.workloads import CATALOGUE

SEED, BATCH, STEPS = 5, 7, 6
GROW = Membership(2, 3, (Member(0, 0, 0), Member(1, 1, 1), Member(2, None, 2)))
SHRINK = Membership(3, 2, (Member(0, 0, 0), Member(1, 1, None), Member(2, 2, 1)))


def _problem() -> Any:
    info = CATALOGUE["digits-mlp"]
    return bind_task(info.path, info.entrypoint, {"batch_size": BATCH, "dropout": 0.0}, SEED)


def _sharded(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from elastic.worker.sharded import ShardedModel, default_units, mesh_of, outline_of
    from elastic.worker.sharded_step import ShardedSteps

    torch.set_num_threads(1)  # forked from pytest: its OpenMP threads are not here
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        cpu = torch.device("cpu")
        first_two, last_two = dist.new_group([0, 1]), dist.new_group([0, 2])
        problem = _problem()
        full = problem.model
        sharded = ShardedModel(full, default_units, cpu)
        optimizer = problem.make_optimizer()
        trainer = ShardedSteps(
            problem, optimizer, SampleStream(problem.num_samples, SEED), BATCH, SEED, rank, 2
        )
        losses: dict[int, float] = {}
        module: torch.nn.Module = full

        def train(steps: range, group: Any) -> None:
            trainer.reduce = lambda tensor: dist.all_reduce(tensor, group=group)
            for step in steps:
                losses[step] = trainer.step(step, stop_requested=False).loss

        if rank < 2:
            module = sharded.first(full, mesh_of(first_two, cpu), optimizer)
            trainer.adopt(module)
            train(range(0, 2), first_two)
        for membership, group in ((GROW, None), (SHRINK, last_two)):
            box = [outline_of(module, optimizer) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            assert box[0] is not None
            member = membership.member(rank)
            mesh = mesh_of(group, cpu) if member.new_rank is not None else None
            moved = sharded.reshard(module, optimizer, box[0], membership, rank, mesh)
            if moved.model is None:
                break  # a leaver: it handed its shards over
            assert member.new_rank is not None
            module = moved.model
            trainer.adopt(module)
            trainer.rebind(member.new_rank, membership.new_world)
            train(
                range(2, 4) if membership is GROW else range(4, 6),
                group if group is not None else dist.group.WORLD,
            )
        whole = [p.full_tensor() for p in module.parameters()] if rank != 1 else []  # type: ignore[attr-defined]
        torch.save({"losses": losses, "parameters": whole}, f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_sharded_step_is_the_global_batch_mean_through_a_grow_and_a_shrink(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    problem = _problem()
    alone = Trainer(
        problem,
        problem.make_optimizer(),
        SampleStream(problem.num_samples, SEED),
        BATCH,
        SEED,
        0,
        1,
        reduce=lambda tensor: None,
    )
    expected = [alone.step(step, stop_requested=False).loss for step in range(STEPS)]
    mp.start_processes(
        _sharded, args=(3, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=3, start_method="fork"
    )
    reports = [torch.load(tmp_path / f"{rank}.pt") for rank in range(3)]
    assert sorted(reports[0]["losses"]) == list(range(STEPS))
    assert sorted(reports[1]["losses"]) == [0, 1, 2, 3], "the leaver trained until it left"
    assert sorted(reports[2]["losses"]) == [2, 3, 4, 5], "the joiner trained from the step it joined at"
    for report in reports:
        for step, loss in report["losses"].items():
            assert loss == pytest.approx(expected[step], rel=1e-5), step
    for rank in (0, 2):
        for got, want in zip(reports[rank]["parameters"], problem.model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def _too_small(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from elastic.worker.sharded import ShardedModel, default_units, mesh_of
    from elastic.worker.sharded_step import ShardedSteps

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        problem = _problem()
        module = ShardedModel(problem.model, default_units, torch.device("cpu")).first(
            problem.model, mesh_of(None, torch.device("cpu"))
        )
        trainer = ShardedSteps(
            problem, problem.make_optimizer(), SampleStream(problem.num_samples, SEED), 1, SEED, rank, world
        )
        trainer.adopt(module)
        with pytest.raises(ValueError, match="a global batch of 1 over 2 workers leaves some none"):
            trainer.step(0, stop_requested=False)
        Path(out, f"refused-{rank}").touch()
    finally:
        dist.destroy_process_group()


def test_a_sharded_step_needs_a_sample_for_every_worker(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _too_small, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, start_method="fork"
    )
    assert (tmp_path / "refused-0").exists() and (tmp_path / "refused-1").exists()
