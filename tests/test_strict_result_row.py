"""Where strict mode turns its exact sum back into floats: the first row of the step's terms on a
worker that hosts virtual workers (no third gradient-sized buffer), a buffer of its own on one
that hosts none. Both give the model a fixed run on one worker gives, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.tasks.runtime import bind_task
from elastic.worker.data import SampleStream
from elastic.worker.strict import StrictTrainer

RINGS = Path(__file__).parent / "tasks" / "rings"
BATCH = 24
SEED = 3
STEPS = 6


def _trainer(rank: int, world_size: int) -> StrictTrainer:
    task = bind_task(RINGS, "task:RingsTask", {"batch_size": BATCH, "hidden": 8}, seed=SEED)
    stream = SampleStream(task.num_samples, SEED)
    return StrictTrainer(task, task.make_optimizer(), stream, BATCH, SEED, rank, world_size, virtual_workers=2)


def _rank(rank: int, init: str, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        trainer = _trainer(rank, 2)
        trainer.rebind(rank, 2, [2, 0])  # rank 0 hosts both virtual workers, rank 1 none
        losses = [trainer.step(step, False).loss for step in range(STEPS)]
        first_row = trainer._terms[0] if trainer._terms is not None and len(trainer._terms) else None
        gradient = next(trainer.problem.model.parameters()).grad
        assert gradient is not None
        torch.save(
            {
                "parameters": [p.detach().clone() for p in trainer.problem.model.parameters()],
                "losses": losses,
                "own_buffer": trainer._result is not None,
                "in_first_row": first_row is not None and gradient.data_ptr() == first_row.data_ptr(),
            },
            f"{out}/{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_the_exact_sum_comes_back_in_the_terms_or_in_a_buffer_of_its_own(tmp_path: Path, group_of_one: None) -> None:
    import torch.multiprocessing as mp

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a CPU matrix product's bits depend on its threads
    try:
        alone = _trainer(0, 1)
        expected_losses = [alone.step(step, False).loss for step in range(STEPS)]
    finally:
        torch.set_num_threads(threads)
    expected = [p.detach() for p in alone.problem.model.parameters()]
    assert alone._result is None, "a worker with rows needs no buffer of its own"
    # Spawned, not forked: a fork of a process whose OpenMP threads ran hangs in its first
    # parallel region.
    mp.start_processes(_rank, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, start_method="spawn")
    hosting, empty = (torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1))
    assert hosting["in_first_row"] and not hosting["own_buffer"]
    assert empty["own_buffer"] and not empty["in_first_row"]
    for saved in (hosting, empty):
        assert saved["losses"] == expected_losses
        assert all(torch.equal(a, b) for a, b in zip(saved["parameters"], expected, strict=True))
