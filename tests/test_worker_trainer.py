"""The data-parallel step, driven in one process with ranks as threads: whatever the world size,
uneven shares and empty ones included, every rank ends each step with the parameters a single
worker gets from the whole global batch, and one rank's stop reaches all of them at that step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from elastic.tasks.runtime import bind_task
from elastic.worker.data import SampleStream
from elastic.worker.trainer import StepOutcome, Trainer, all_reduce_sum
from elastic.workloads import CATALOGUE

SEED = 5
STEPS = 6


class ThreadedSum:
    """An in-place all-reduce (SUM) among `world_size` threads, summing in rank order."""

    def __init__(self, world_size: int) -> None:
        self._barrier = threading.Barrier(world_size, timeout=30)
        self._buffers: dict[int, torch.Tensor] = {}

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(buffer: torch.Tensor) -> None:
            self._buffers[rank] = buffer.clone()
            self._barrier.wait()
            total = torch.stack([self._buffers[r] for r in sorted(self._buffers)]).sum(dim=0)
            self._barrier.wait()
            buffer.copy_(total)

        return reduce


def _trainer(batch_size: int, rank: int, world_size: int, reduce: Callable[[torch.Tensor], None]) -> Trainer:
    info = CATALOGUE["digits-mlp"]
    problem = bind_task(info.path, info.entrypoint, {"batch_size": batch_size, "dropout": 0.0}, SEED)
    return Trainer(
        problem,
        problem.make_optimizer(),
        SampleStream(problem.num_samples, SEED),
        batch_size=batch_size,
        seed=SEED,
        rank=rank,
        world_size=world_size,
        reduce=reduce,
    )


def _run(trainer: Trainer, stop_at: int | None) -> list[StepOutcome]:
    return [trainer.step(step, stop_requested=step == stop_at) for step in range(STEPS)]


@pytest.mark.parametrize(("world_size", "batch_size"), [(3, 2), (2, 5), (4, 7)])
def test_ranks_agree_with_a_single_worker(world_size: int, batch_size: int) -> None:
    torch.set_num_threads(1)
    single = _trainer(batch_size, rank=0, world_size=1, reduce=lambda buffer: None)
    expected = _run(single, stop_at=None)

    threaded = ThreadedSum(world_size)
    trainers = [_trainer(batch_size, rank, world_size, threaded.for_rank(rank)) for rank in range(world_size)]
    with ThreadPoolExecutor(world_size) as pool:
        # Only the last rank is asked to stop, at step 2; every rank must hear of it.
        runs = list(pool.map(_run, trainers, [None] * (world_size - 1) + [2]))

    for outcomes, trainer in zip(runs, trainers, strict=True):
        assert [o.step for o in outcomes] == [o.step for o in expected]
        assert [o.samples for o in outcomes] == [batch_size] * STEPS
        assert [o.stop for o in outcomes] == [step == 2 for step in range(STEPS)]
        assert [o.loss for o in outcomes] == pytest.approx([o.loss for o in expected], rel=1e-5)
        mine = trainer.problem.model.state_dict()
        for name, tensor in single.problem.model.state_dict().items():
            assert torch.allclose(mine[name], tensor, rtol=1e-5, atol=1e-6), name


def _with_unused_parameter(trainer: Trainer) -> Trainer:
    """`trainer`'s model with a parameter no batch uses, and an optimiser that moves it anyway
    when its gradient is zero (weight decay, momentum)."""
    model = trainer.problem.model
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    return Trainer(
        trainer.problem, trainer.optimizer, trainer.stream, trainer.batch_size, SEED, 0, 1, reduce=trainer.reduce
    )


def test_a_worker_alone_keeps_backwards_gradients_and_trains_as_through_the_buffer(group_of_one: None) -> None:
    """A rank alone with the default all-reduce (which sums nothing) lets backward make the
    gradients, as a user's loop does, and holds no all-reduce buffer; it trains bit for bit as a
    rank that sends them through the buffer, a parameter the batch does not use included (a
    zero gradient there, not none: weight decay and momentum move it as at any world size)."""
    torch.set_num_threads(1)
    solo = _with_unused_parameter(_trainer(8, rank=0, world_size=1, reduce=all_reduce_sum))
    buffered = _with_unused_parameter(_trainer(8, rank=0, world_size=1, reduce=lambda buffer: None))
    for step in range(STEPS):
        a, b = solo.step(step, stop_requested=False), buffered.step(step, stop_requested=False)
        assert a == b and solo.metrics == buffered.metrics, step
        assert solo._buffer is None and buffered._buffer is not None
        ours, theirs = solo._parameters[-1].grad, buffered._parameters[-1].grad
        assert ours is not None and theirs is not None and ours.data_ptr() != theirs.data_ptr()
    mine, other = solo.problem.model.state_dict(), buffered.problem.model.state_dict()
    assert all(torch.equal(mine[name], other[name]) for name in other)
    assert not torch.equal(mine["unused"], torch.ones(3)), "weight decay moved the unused parameter"
    assert solo.host_reads == STEPS, "one read a step"
