"""A model sharded with fully_shard over gloo on CPU, resized in place between real processes: two
workers train, a third joins (2->3), one of the first two leaves and hands its shards over
(3->2), and training goes on. The model has an embedding tied to its output layer, batch norm
and dropout. Through both resizes every parameter and every tensor of Adam's state, put back
together, equals what it was; the step after them equals, bit for bit, the same step of a run
that never resized. Units: the default ones and a task's own, checked."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from elastic.tasks.api import TaskDefinitionError
from elastic.worker.reshard import Member, Membership
from elastic.worker.sharded import checked_units, default_units, tied_groups

VOCABULARY, WIDTH = 23, 8


def _model() -> torch.nn.Sequential:
    torch.manual_seed(11)
    embedding = torch.nn.Embedding(VOCABULARY, WIDTH)
    output = torch.nn.Linear(WIDTH, VOCABULARY, bias=False)
    output.weight = embedding.weight
    return torch.nn.Sequential(
        embedding,
        torch.nn.Linear(WIDTH, 2 * WIDTH + 1),
        torch.nn.BatchNorm1d(2 * WIDTH + 1),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(2 * WIDTH + 1, WIDTH),
        output,
    )


def _train_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One step on this rank's share: data and dropout drawn from (step, rank)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCABULARY, (6,), generator=generator)
    torch.manual_seed(7 * step + rank)
    torch.nn.functional.cross_entropy(module(tokens), tokens.roll(1)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _whole(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and sharded optimiser tensor put back together: a collective over the
    module's mesh."""
    from torch.distributed.tensor import DTensor

    tensors = []
    for parameter in module.parameters():
        assert isinstance(parameter, DTensor)
        tensors.append(parameter.full_tensor())
        for name in sorted(optimizer.state[parameter]):
            value = optimizer.state[parameter][name]
            tensors.append(value.full_tensor() if isinstance(value, DTensor) else value.clone())
    return tensors


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# Group ranks 0 and 1 train over two; rank 2 joins (2->3); then rank 1 leaves (3->2), rank 2
# becoming new rank 1.
GROW = Membership(2, 3, (Member(0, 0, 0), Member(1, 1, 1), Member(2, None, 2)))
SHRINK = Membership(3, 2, (Member(0, 0, 0), Member(1, 1, None), Member(2, 2, 1)))


def _resize(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from elastic.worker.sharded import ShardedModel, mesh_of, outline_of

    torch.set_num_threads(1)  # forked from pytest: its OpenMP threads are not here
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        cpu = torch.device("cpu")
        first_two, survivors = dist.new_group([0, 1]), dist.new_group([0, 2])
        full = _model()
        sharded = ShardedModel(full, default_units, cpu)
        report: dict[str, object] = {}
        if rank < 2:
            # The reference: the same two workers, never resized.
            reference = sharded.first(full, mesh_of(first_two, cpu))
            reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
            for step in range(3):
                _train_step(reference, reference_optimizer, step, rank)
            report["reference"] = _whole(reference, reference_optimizer)
            report["reference_buffers"] = [b.clone() for b in reference.buffers()]
            module: torch.nn.Module = sharded.first(full, mesh_of(first_two, cpu))
            optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
            for step in range(2):
                _train_step(module, optimizer, step, rank)
            before = _whole(module, optimizer)
            report["before"] = before
        else:
            module = full  # a joiner's optimiser holds what its build made
            optimizer = torch.optim.Adam(full.parameters(), lr=0.5)
        box = [outline_of(module, optimizer) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        outline = box[0]
        assert outline is not None

        grown = sharded.reshard(module, optimizer, outline, GROW, rank, mesh_of(None, cpu))
        assert grown.model is not None
        report["grown"] = _whole(grown.model, optimizer)
        report["grown_buffers"] = [b.clone() for b in grown.model.buffers()]
        report["grow_moved"] = grown.plan.bytes_moved
        report["grow_buffers"] = grown.buffer_bytes
        assert optimizer.param_groups[0]["lr"] == 0.01

        box = [outline_of(grown.model, optimizer) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        shrunk = sharded.reshard(
            grown.model, optimizer, box[0], SHRINK, rank, mesh_of(survivors, cpu) if rank != 1 else None
        )
        report["shrink_moved"] = shrunk.plan.bytes_moved
        if rank != 1:
            assert shrunk.model is not None
            report["shrunk"] = _whole(shrunk.model, optimizer)
            new_rank = SHRINK.member(rank).new_rank
            assert new_rank is not None
            _train_step(shrunk.model, optimizer, 2, new_rank)
            report["after"] = _whole(shrunk.model, optimizer)
            report["buffers"] = [b.clone() for b in shrunk.model.buffers()]
        torch.save(report, f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_resizes_2_to_3_to_2_in_place_bit_for_bit(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _resize, args=(3, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=3, start_method="fork"
    )
    reports = [torch.load(tmp_path / f"{rank}.pt") for rank in range(3)]
    before = reports[0]["before"]
    assert _equal(before, reports[1]["before"])
    assert len(before) == 7 * 4, "seven parameters (the tied weight once), each with its step and two moments"
    for rank in range(3):
        assert _equal(reports[rank]["grown"], before), rank
    for rank in (0, 2):
        assert _equal(reports[rank]["shrunk"], before), rank
        # The step after the resizes is the never-resized run's third step: new rank 1 trains
        # as old rank 1 did.
        assert _equal(reports[rank]["after"], reports[0]["reference"]), rank
    # A survivor keeps its own batch-norm statistics; the joiner got rank 0's whole. The
    # shards moved are the planner's, the same on every rank.
    assert _equal(reports[0]["buffers"], reports[0]["reference_buffers"])
    assert _equal(reports[2]["grown_buffers"], reports[0]["grown_buffers"])
    assert not _equal(reports[1]["grown_buffers"], reports[0]["grown_buffers"]), "each worker's own"
    assert reports[2]["grow_buffers"] == sum(b.numel() * b.element_size() for b in _model().buffers())
    assert 0 < reports[0]["grow_moved"] == reports[2]["grow_moved"]
    assert 0 < reports[0]["shrink_moved"] == reports[1]["shrink_moved"]


def test_default_units_are_the_children_with_parameters_and_tied_ones_go_together() -> None:
    model = _model()
    units = default_units(model)
    assert units == [model[0], model[1], model[2], model[5], model[6]]
    assert tied_groups(units) == [[model[0], model[6]], [model[1]], [model[2]], [model[5]]]


def test_a_tasks_units_must_be_its_models_own() -> None:
    model = _model()
    assert checked_units(model, [model[1], model[5]]) == [model[1], model[5]]
    with pytest.raises(
        TaskDefinitionError, match=r"shard_units\(model\) returned a Linear at 1 that is not in the model"
    ):
        checked_units(model, [model[1], torch.nn.Linear(2, 2)])
    with pytest.raises(TaskDefinitionError, match="the model itself"):
        checked_units(model, [model])
    with pytest.raises(TaskDefinitionError, match="returned 1 twice"):
        checked_units(model, [model[1], model[1]])
    with pytest.raises(TaskDefinitionError, match="returned str at 0, not a module"):
        checked_units(model, ["1"])  # type: ignore[list-item]
