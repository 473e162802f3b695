"""A sharded model's state out and back in, between real processes over gloo: after two steps
over two workers, the model's and Adam's state put back together load into the plain model and
a plain Adam with no mesh (a checkpoint, the job's model.pt); cut again from that plain state
(as a resume from a checkpoint does), the sharded model and optimiser are the same bits, and
their next step is the same step as the run that never left memory."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch

from tests.test_sharding_module import _model, _train_step


def _round_trip(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from elastic.worker.sharded import ShardedModel, default_units, full_state, mesh_of

    torch.set_num_threads(1)  # forked from pytest: its OpenMP threads are not here
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        cpu = torch.device("cpu")
        mesh = mesh_of(None, cpu)
        full = _model()
        sharded = ShardedModel(full, default_units, cpu)
        optimizer = torch.optim.Adam(full.parameters(), lr=0.01)
        module = sharded.first(full, mesh, optimizer)
        for step in range(2):
            _train_step(module, optimizer, step, rank)
        model_state, optimizer_state = full_state(module, optimizer)

        plain = _model()
        plain.load_state_dict(model_state)
        resumed_optimizer = torch.optim.Adam(plain.parameters(), lr=0.5)
        resumed = sharded.first(plain, mesh, resumed_optimizer, optimizer_state)
        again = full_state(resumed, resumed_optimizer)
        _train_step(module, optimizer, 2, rank)
        _train_step(resumed, resumed_optimizer, 2, rank)
        if rank == 0:
            torch.save(
                {
                    "state": (model_state, optimizer_state),
                    "again": again,
                    "after": full_state(module, optimizer),
                },
                f"{out}/{rank}.pt",
            )
        else:
            full_state(module, optimizer)  # a collective: rank 0 gathers
        resumed_after = full_state(resumed, resumed_optimizer)
        if rank == 0:
            torch.save(resumed_after, f"{out}/resumed.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def test_sharded_state_goes_out_plain_and_comes_back_the_same(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _round_trip, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, start_method="fork"
    )
    report = torch.load(tmp_path / "0.pt", weights_only=False)
    model_state, optimizer_state = report["state"]
    # Plain torch, no mesh: the model and a plain Adam take the state as it is.
    plain = _model()
    assert plain.load_state_dict(model_state) is not None
    assert all(type(value) is torch.Tensor for value in model_state.values())
    adam = torch.optim.Adam(plain.parameters(), lr=0.01)
    adam.load_state_dict(optimizer_state)
    for parameter in plain.parameters():
        assert adam.state[parameter]["exp_avg"].shape == parameter.shape
    assert plain[0].weight is plain[6].weight, "still tied"
    # Cut again from the plain state, then the same step on both: the same bits.
    assert _same(report["again"], report["state"])
    assert _same(torch.load(tmp_path / "resumed.pt", weights_only=False), report["after"])
