"""What a step does with a task's learning-rate scheduler and with a loss that is not finite,
in each consistency mode, driven in this process (one rank; strict mode over a real gloo group
of one).

- A NaN loss fails the step by default (NonFiniteLossError, the user's error), with nothing of it
  applied; with `nan_loss: skip` the step is skipped: parameters, optimiser, scheduler and the
  running statistics of batch norm stay as they were, and training goes on.
- The scheduler steps once per applied step, its state is part of the mode's small state (what
  travels to joiners and into the checkpoint), and a trainer that takes it on goes on exactly as
  the one it came from. In hybrid mode a step trains at the scheduler's rate times the ramp's
  factor, and the scheduler never sees the scaled rates.
- The task's named training metrics are averaged over the global batch, as the loss is."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.tasks.api import TaskDefinitionError, UserCodeError
from elastic.tasks.runtime import BoundTask, bind_task
from elastic.worker.data import SampleStream, share_bounds
from elastic.worker.hybrid import HybridSchedule, HybridTrainer
from elastic.worker.strict import StrictTrainer
from elastic.worker.trainer import NonFiniteLossError, Trainer

RINGS = Path(__file__).parent / "tasks" / "rings"
BATCH = 24
SEED = 3



def _task(**hyperparameters: Any) -> BoundTask:
    return bind_task(RINGS, "task:RingsTask", {"batch_size": BATCH, "hidden": 8, **hyperparameters}, seed=SEED)


def _trainer(mode: str, task: BoundTask, skip: bool = False) -> Trainer:
    optimizer = task.make_optimizer()
    scheduler = task.make_scheduler(optimizer)
    stream = SampleStream(task.num_samples, SEED)
    if mode == "strict":
        return StrictTrainer(
            task, optimizer, stream, BATCH, SEED, 0, 1, virtual_workers=3, scheduler=scheduler, skip_nonfinite=skip
        )
    if mode == "hybrid":
        schedule = HybridSchedule(
            base_lr=task.lr, base_batch=BATCH, batch_per_worker=BATCH, min_batch=BATCH, max_batch=BATCH,
            lr_scaling="linear", warmup_steps=4,
        )
        trainer = HybridTrainer(task, optimizer, stream, schedule, SEED, 0, 1, scheduler=scheduler, skip_nonfinite=skip)
        trainer.rebind_members(0, 1, None, 0)
        return trainer
    return Trainer(
        task, optimizer, stream, BATCH, SEED, 0, 1, reduce=lambda buffer: None, scheduler=scheduler,
        skip_nonfinite=skip,
    )


def _snapshot(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    return (
        copy.deepcopy(trainer.problem.model.state_dict()),
        copy.deepcopy(trainer.optimizer.state_dict()),
        copy.deepcopy(trainer.small_state()),
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


MODES = ["plain", "hybrid", "strict"]
SECOND_STEP_CALL = {"plain": 2, "hybrid": 2, "strict": 5}
"""The task's `loss` call in the second step (strict mode: three virtual workers a step)."""


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_loss_fails_the_step_and_applies_nothing(mode: str, group_of_one: None) -> None:
    trainer = _trainer(mode, _task(nan_at_call=SECOND_STEP_CALL[mode], lr_decay_every=1))
    for step in range(1):
        trainer.step(step, stop_requested=False)
    before = _snapshot(trainer)
    with pytest.raises(NonFiniteLossError, match="not finite .* at step 2") as caught:
        for step in range(1, 3):
            trainer.step(step, stop_requested=False)
    assert isinstance(caught.value, UserCodeError), "the job fails for it, it is never restarted for it"
    assert "nan_loss" in str(caught.value)
    assert _same(_snapshot(trainer), before), "a failed step leaves the state of the step before"


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_loss_is_skipped_when_the_job_says_so(mode: str, group_of_one: None) -> None:
    trainer = _trainer(mode, _task(nan_at_call=SECOND_STEP_CALL[mode], lr_decay_every=1), skip=True)
    trainer.step(0, stop_requested=False)
    before = _snapshot(trainer)
    outcome = trainer.step(1, stop_requested=False)
    assert outcome.skipped and math.isnan(outcome.loss) and outcome.step == 2
    model, optimizer, small = _snapshot(trainer)
    assert _same(model, before[0]), "parameters and batch norm's running statistics are as before"
    # hybrid mode's stream position moves on: a skipped step's samples count as drawn.
    assert small.pop("position", BATCH * 2) == BATCH * 2
    before[2].pop("position", None)
    assert _same(optimizer, before[1]) and _same(small, before[2]), "optimiser and scheduler did not move"
    later = [trainer.step(step, stop_requested=False) for step in range(2, 6)]
    assert not any(o.skipped for o in later) and all(math.isfinite(o.loss) for o in later)
    assert all(torch.isfinite(v).all() for v in trainer.problem.model.state_dict().values() if v.is_floating_point())


def test_a_skipped_step_gives_back_a_buffer_the_model_assigns_anew(group_of_one: None) -> None:
    """The buffers a step saves are listed once and kept while the modules hold them: a model
    that assigns a buffer a new tensor in its forward (rather than changing it in place) has the
    new one restored when the step is skipped, not the one listed before."""
    trainer = _trainer("hybrid", _task(nan_at_call=3), skip=True)
    model = trainer.problem.model
    model.register_buffer("calls", torch.zeros(()))
    model.register_forward_pre_hook(lambda module, args: setattr(module, "calls", module.calls + 1))
    for step in range(2):
        trainer.step(step, stop_requested=False)
    assert model.calls.item() == 2
    assert trainer.step(2, stop_requested=False).skipped
    assert model.calls.item() == 2, "the skipped step's forward is undone in the tensor the model holds now"
    trainer.step(3, stop_requested=False)
    assert model.calls.item() == 3


@pytest.mark.parametrize("mode", MODES)
def test_the_scheduler_steps_per_applied_step_and_travels_in_the_small_state(mode: str, group_of_one: None) -> None:
    trainer = _trainer(mode, _task(lr_decay_every=3))
    for step in range(7):
        trainer.step(step, stop_requested=False)
    assert trainer.scheduler is not None and trainer.scheduler.last_epoch == 7
    assert trainer.scheduler.get_last_lr() == [pytest.approx(0.1 * 0.5**2)]

    joiner = _trainer(mode, _task(lr_decay_every=3))
    joiner.problem.model.load_state_dict(trainer.problem.model.state_dict())
    joiner.optimizer.load_state_dict(copy.deepcopy(trainer.optimizer.state_dict()))
    joiner.load_small_state(copy.deepcopy(trainer.small_state()))
    for mine, theirs in zip(joiner.bulk_state(), trainer.bulk_state(), strict=True):
        mine.copy_(theirs)  # strict mode's per-virtual-worker contexts, as a transfer moves them
    joiner.state_arrived()
    for step in range(7, 12):
        a = trainer.step(step, stop_requested=False)
        b = joiner.step(step, stop_requested=False)
        assert a.loss == b.loss and trainer.lr == joiner.lr, step
    for name, value in trainer.problem.model.state_dict().items():
        assert torch.equal(value, joiner.problem.model.state_dict()[name]), name


def test_hybrid_trains_at_the_schedulers_rate_times_its_ramp(group_of_one: None) -> None:
    trainer = _trainer("hybrid", _task(lr_decay_every=2))
    assert isinstance(trainer, HybridTrainer) and trainer.ramp is not None and trainer.scheduler is not None
    for step in range(8):
        trainer.step(step, stop_requested=False)
        scheduled = 0.1 * 0.5 ** (step // 2)
        assert trainer.lr == pytest.approx(scheduled * trainer.ramp.lr_at(step) / 0.1), step
        assert trainer.scheduler.get_last_lr() == [pytest.approx(0.1 * 0.5 ** ((step + 1) // 2))], step


def test_a_state_with_a_scheduler_is_refused_by_a_job_without_one(group_of_one: None) -> None:
    with_one = _trainer("plain", _task(lr_decay_every=3))
    without = _trainer("plain", _task())
    with pytest.raises(ValueError, match="the task defines none"):
        without.load_small_state(with_one.small_state())
    with pytest.raises(ValueError, match="the task defines one"):
        with_one.load_small_state(without.small_state())


def test_a_scheduler_that_steps_on_a_metric_is_refused() -> None:
    task = _task()
    optimizer = task.make_optimizer()
    task.task.scheduler = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(TaskDefinitionError, match="ReduceLROnPlateau"):
        task.make_scheduler(optimizer)
    task.task.scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=1), 1)
    with pytest.raises(TaskDefinitionError, match="over the optimiser it was given"):
        task.make_scheduler(optimizer)


class ThreadGroup:
    """A SUM all-reduce between trainers stepping in threads of this process."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=30)
        self.buffers: list[torch.Tensor | None] = [None] * size

    def reducer(self, rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(buffer: torch.Tensor) -> None:
            self.buffers[rank] = buffer.clone()
            self.barrier.wait()
            total = torch.stack([b for b in self.buffers if b is not None]).sum(0)
            self.barrier.wait()
            buffer.copy_(total)

        return reduce


def test_training_metrics_are_the_global_batchs_like_the_loss() -> None:
    group = ThreadGroup(2)
    tasks = [_task(dropout=0.0) for _ in range(2)]
    trainers = [
        Trainer(task, task.make_optimizer(), SampleStream(task.num_samples, SEED), 30, SEED, rank, 2,
                reduce=group.reducer(rank))
        for rank, task in enumerate(tasks)
    ]
    differed = False
    for step in range(4):
        outcomes: list[Any] = [None, None]

        def run(rank: int, step: int, outcomes: list[Any]) -> None:
            outcomes[rank] = trainers[rank].step(step, stop_requested=False)

        threads = [threading.Thread(target=run, args=(rank, step, outcomes)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        own = [task.metrics["accuracy"] for task in tasks]  # each rank's share: 15 samples
        differed |= own[0] != own[1]
        for trainer in trainers:
            assert trainer.metrics == {"accuracy": pytest.approx((own[0] + own[1]) / 2, abs=1e-6)}, step
        assert outcomes[0].loss == outcomes[1].loss
    assert differed, "the ranks' own metrics never differed: nothing was averaged"


def test_strict_metrics_are_the_global_batchs_whatever_the_virtual_workers(group_of_one: None) -> None:
    task = _task(dropout=0.0)
    trainer = _trainer("strict", task)
    assert isinstance(trainer, StrictTrainer)
    for step in range(3):
        before = copy.deepcopy(task.model)  # train mode: batch norm uses each vw's own batch
        first = trainer.batch_start(step)
        expected = 0.0
        for vw in range(3):
            start, stop = share_bounds(BATCH, 3, vw)
            features, rings = task.batch(trainer.stream.positions(first + start, first + stop))
            accuracy = float((before(features).argmax(1) == rings).float().mean())
            expected += accuracy * (stop - start) / BATCH
        trainer.step(step, stop_requested=False)
        assert trainer.metrics == {"accuracy": pytest.approx(expected, abs=1e-6)}, step


@pytest.mark.parametrize("mode", MODES)
def test_the_switch_vote_is_asked_after_the_steps_compute(mode: str, group_of_one: None) -> None:
    """A joiner that got ready while the step computed is switched to after this step: the vote
    is read once the task's loss has run, not before the step began."""
    trainer = _trainer(mode, _task())
    losses_before_vote: list[int] = []
    calls = {"loss": 0}
    loss = trainer.problem.loss

    def counting_loss(batch: Any) -> Any:
        calls["loss"] += 1
        return loss(batch)

    trainer.problem.loss = counting_loss  # type: ignore[method-assign]

    def ask() -> int:
        losses_before_vote.append(calls["loss"])
        return 9

    outcome = trainer.step(0, stop_requested=False, switch_to=ask)
    assert outcome.switch_to == 9
    assert losses_before_vote == [3 if mode == "strict" else 1]  # every loss of the step (3 virtual workers in strict), then the vote
    assert trainer.step(1, stop_requested=False, switch_to=0).switch_to == 0


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "a-transposed-buffer"])
def test_strict_contexts_give_back_every_buffer_bit_for_bit(contiguous: bool, group_of_one: None) -> None:
    """A virtual worker's context (the model's buffers as bytes) packed and loaded again: in one
    multi-tensor copy of the buffers' bytes, or, where a buffer is not contiguous (it has no flat
    view), buffer by buffer."""
    task = _task()
    grid = torch.arange(12.0).reshape(3, 4)
    task.model.register_buffer("grid", grid if contiguous else grid.t())
    trainer = _trainer("strict", task)
    assert (trainer._buffer_bytes is not None) == contiguous
    buffers = [buffer for _, buffer in task.model.named_buffers()]
    assert {buffer.dtype for buffer in buffers} == {torch.float32, torch.int64}, "batch norm's statistics and count"
    trainer.step(0, stop_requested=False)
    kept = [buffer.clone() for buffer in buffers]
    row = trainer._pack()
    for buffer in buffers:
        buffer.add_(7)
    trainer._unpack(row)
    assert all(torch.equal(buffer, was) for buffer, was in zip(buffers, kept, strict=True))
    assert all(a is b for a, b in zip(buffers, [b for _, b in task.model.named_buffers()], strict=True)), "in place"
