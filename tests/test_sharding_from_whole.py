"""One worker holding the whole state (a model not sharded, with its Adam state: a restored
checkpoint) cuts it over the group in memory, between real processes over gloo: the holder
stands for an old world of one, the others join, and the cut state put back together is the
whole state, bit for bit. Only the rows the holder does not keep cross the group."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import torch

from elastic.worker.reshard import Member, Membership
from tests.test_sharding_full_state import _same
from tests.test_sharding_module import _model, _train_step

FROM_ONE = Membership(1, 3, (Member(0, 0, 0), Member(1, None, 1), Member(2, None, 2)))


def _whole_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        _train_step(model, optimizer, step, 0)
    return model, optimizer


def _cut(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from elastic.worker.sharded import ShardedModel, default_units, full_state, mesh_of, outline_of

    torch.set_num_threads(1)  # forked from pytest: its OpenMP threads are not here
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        cpu = torch.device("cpu")
        if rank == 0:
            model, optimizer = _whole_state()
        else:
            model = _model()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
        sharded = ShardedModel(model, default_units, cpu)
        original = copy.deepcopy((model.state_dict(), optimizer.state_dict())) if rank == 0 else None
        box = [outline_of(model, optimizer) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        result = sharded.reshard(model, optimizer, box[0], FROM_ONE, rank, mesh_of(None, cpu))
        assert result.model is not None
        state = full_state(result.model, optimizer)
        if rank == 0:
            torch.save(
                {
                    "original": original,
                    "state": state,
                    "moved": result.plan.bytes_moved,
                    "kept": result.plan.bytes_kept,
                },
                f"{out}/0.pt",
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_one_holder_of_the_whole_state_cuts_it_over_the_group(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _cut, args=(3, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=3, start_method="fork"
    )
    report = torch.load(tmp_path / "0.pt", weights_only=False)
    # Compared with the state as the holder had it (its thread count, not this process's).
    assert _same(report["state"], report["original"])
    assert report["moved"] > 0 and report["kept"] > 0, "the holder keeps its own rows and sends the rest"
