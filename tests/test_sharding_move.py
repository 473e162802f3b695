"""The resharding engine between real processes over gloo: a model's parameters and its Adam
state, cut as fully_shard cuts them over two workers, go to three (a joiner), then back to two
(a survivor leaves, handing its shards over, and the two others swap ranks). Every tensor put
back together from the final shards equals the original, bit for bit; the planner's bytes are
the bytes that crossed."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch

from elastic.worker.reshard import (
    Member,
    Membership,
    TensorLayout,
    execute,
    new_shards,
    plan_reshard,
    shard_rows,
)


def _training_state() -> list[torch.Tensor]:
    """A model's parameters and its Adam moments after two steps, the same in every process."""
    torch.manual_seed(3)
    embedding = torch.nn.Embedding(37, 16)
    model = torch.nn.Sequential(
        embedding,
        torch.nn.Linear(16, 29),
        torch.nn.ReLU(),
        torch.nn.Linear(29, 16),
        torch.nn.Linear(16, 37, bias=False),
    )
    model[4].weight = embedding.weight  # tied: one tensor, sharded once
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randint(0, 37, (8,))).logsumexp(-1).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += [optimizer.state[p]["exp_avg"].clone(), optimizer.state[p]["exp_avg_sq"].clone()]
    return tensors


def _local(whole: list[torch.Tensor], world: int, rank: int) -> list[torch.Tensor]:
    return [t[slice(*shard_rows(t.shape[0], world, rank))].clone() for t in whole]


# Group ranks 0 and 1 hold the state over two; rank 2 joins (2->3); then rank 1 leaves and
# ranks 0 and 2 become new ranks 1 and 0 (3->2).
GROW = Membership(2, 3, (Member(0, 0, 0), Member(1, 1, 1), Member(2, None, 2)))
SHRINK = Membership(3, 2, (Member(0, 0, 1), Member(1, 1, None), Member(2, 2, 0)))


def _reshard(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked from pytest: its OpenMP threads are not here
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        whole = _training_state()
        layouts = [TensorLayout.of(t) for t in whole]
        held = _local(whole, 2, rank) if rank < 2 else []
        grown = new_shards(plan_reshard(layouts, GROW), rank)
        execute(plan_reshard(layouts, GROW), rank, held, grown)
        assert all(torch.equal(a, b) for a, b in zip(grown, _local(whole, 3, rank), strict=True)), rank
        shrunk = new_shards(plan_reshard(layouts, SHRINK), rank)
        execute(plan_reshard(layouts, SHRINK), rank, grown, shrunk)
        torch.save(shrunk, f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_parameters_and_adam_state_go_2_to_3_to_2_bit_for_bit(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _reshard, args=(3, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=3, start_method="fork"
    )
    whole = _training_state()
    layouts = [TensorLayout.of(t) for t in whole]
    assert len(layouts) == 3 * 5, "the tied weight is one tensor"
    assert torch.load(tmp_path / "1.pt") == [], "the leaver holds nothing"
    by_new_rank = [torch.load(tmp_path / "2.pt"), torch.load(tmp_path / "0.pt")]
    for index, original in enumerate(whole):
        gathered = torch.cat([shards[index] for shards in by_new_rank])
        assert torch.equal(gathered, original), index
    # What the planner counts is what the layouts force: 2->3 keeps what the survivors hold;
    # the swapped 3->2 leaves no survivor any of its old rows, so everything moves.
    grow, shrink = plan_reshard(layouts, GROW), plan_reshard(layouts, SHRINK)
    total = sum(t.numel() * t.element_size() for t in whole)
    assert grow.bytes_moved + grow.bytes_kept == total and 0 < grow.bytes_moved < total
    assert shrink.bytes_moved == total and shrink.bytes_kept == 0
