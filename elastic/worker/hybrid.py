"""Hybrid mode: the global batch follows the number of workers, the learning rate follows the
batch, and it moves to each new value gradually.

- Batch: `batch_per_worker` times the workers, clamped to [min_batch_size, max_batch_size].
- Rate: the workload's `lr` was tuned for its `batch_size`; a batch B trains at
  lr * B / batch_size (linear scaling, Goyal et al. 2017) or lr * sqrt(B / batch_size) (square
  root scaling), as chosen at submission.
- Warm-up and momentum compensation: the rate never jumps. At the start it rises linearly over
  `warmup_steps` from min(lr, target) to the target (a job that starts above the tuned batch
  warms up from the tuned rate). After every change of the batch it moves linearly, over the
  same number of steps, from the rate in effect to the new target. This is the remedy of Dynamic
  Mini-batch SGD (Lin et al., arXiv 1904.12043): the momentum buffer still carries gradients
  accumulated under the old batch and rate, and changing the rate at once ("linearly,
  immediately") lets that stale momentum act at the new rate; the paper smooths the change over
  time. We could read only the paper's abstract here, which states the problem and the remedy
  (adjust the rate smoothly over time) but not its schedule; a linear ramp over a fixed number
  of steps, in both directions, is our choice.

A task's own learning-rate scheduler keeps its rates; a step trains at the scheduler's rate
times hybrid mode's factor (the ramp's rate over the tuned `lr`), and the scheduler steps from
its own rates, so that chainable schedulers (StepLR, ExponentialLR) never see the scaled ones.

Data: the batches of consecutive steps are consecutive runs of the sample stream whatever their
size, so within an epoch no sample is skipped or seen twice; the stream position is carried in
the state (small_state), since it no longer follows from the step alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Unpack

import torch

from elastic.tasks.runtime import BoundTask
from elastic.worker.data import SampleStream
from elastic.worker.settings import BUCKET_BYTES
from elastic.worker.trainer import StepOutcome, SwitchVote, Trainer, TrainerOptions


@dataclass(frozen=True)
class HybridSchedule:
    """The rules a hybrid job was submitted with."""

    base_lr: float
    base_batch: int
    batch_per_worker: int
    min_batch: int
    max_batch: int
    lr_scaling: Literal["linear", "sqrt"]
    warmup_steps: int

    def global_batch(self, world_size: int, chosen: int | None = None) -> int:
        """The global batch with `world_size` workers: `chosen` (the scheduler's) if given, else
        batch_per_worker per worker; within [min_batch, max_batch] either way."""
        wanted = chosen if chosen is not None else self.batch_per_worker * world_size
        return max(self.min_batch, min(self.max_batch, wanted))

    def target_lr(self, batch: int) -> float:
        """The learning rate the scaling rule gives a global batch of `batch`."""
        ratio = batch / self.base_batch
        return self.base_lr * (ratio if self.lr_scaling == "linear" else math.sqrt(ratio))


@dataclass(frozen=True)
class LrRamp:
    """The rate goes linearly from `from_lr` to `to_lr` over `steps` steps from `start_step`:
    step start_step + i trains at from + (to - from) * (i + 1) / steps, then at `to_lr`."""

    start_step: int
    steps: int
    from_lr: float
    to_lr: float

    def lr_at(self, step: int) -> float:
        done = step - self.start_step + 1
        if self.steps <= 0 or done >= self.steps:
            return self.to_lr
        if done <= 0:
            return self.from_lr
        return self.from_lr + (self.to_lr - self.from_lr) * done / self.steps


class HybridTrainer(Trainer):
    """Plain data-parallel steps (mean over the global batch) whose batch and rate follow the
    job's HybridSchedule."""

    def __init__(
        self,
        problem: BoundTask,
        optimizer: torch.optim.Optimizer,
        stream: SampleStream,
        schedule: HybridSchedule,
        seed: int,
        rank: int,
        world_size: int,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        **options: Unpack[TrainerOptions],
    ) -> None:
        batch = schedule.global_batch(world_size)
        super().__init__(
            problem, optimizer, stream, batch, seed, rank, world_size, bucket_bytes=bucket_bytes, **options
        )
        self.schedule = schedule
        self.position = 0
        """Stream position of the next step's first sample."""
        self.ramp: LrRamp | None = None

    def rebind_members(
        self, rank: int, world_size: int, shares: list[int] | None, step: int, global_batch: int | None = None
    ) -> None:
        """Takes on `world_size` workers from step `step`: a new global batch (`global_batch`,
        the scheduler's choice, if given), and a ramp to its rate if the batch changed (or the
        job starts)."""
        self.rebind(rank, world_size)
        batch = self.schedule.global_batch(world_size, global_batch)
        target = self.schedule.target_lr(batch)
        if self.ramp is None:
            self.ramp = LrRamp(step, self.schedule.warmup_steps, min(self.schedule.base_lr, target), target)
        elif batch != self.batch_size:
            self.ramp = LrRamp(step, self.schedule.warmup_steps, self.ramp.lr_at(step - 1), target)
        self.batch_size = batch

    def batch_start(self, step: int) -> int:
        return self.position

    def next_batch_start(self, step: int) -> int:
        return self.position + self.batch_size

    def step(self, step: int, stop_requested: bool, switch_to: SwitchVote = 0) -> StepOutcome:
        if self.ramp is None:
            raise RuntimeError("rebind_members must be called before the first step")
        lr = self.ramp.lr_at(step)
        if self.scheduler is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        else:  # the task's schedule, times hybrid mode's scaling and ramp
            factor = lr / self.schedule.base_lr
            for group, scheduled in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = scheduled * factor
        outcome = super().step(step, stop_requested, switch_to)
        self.position += outcome.samples
        return outcome

    def advance_schedule(self) -> None:
        """The scheduler steps from its own rates, not from the scaled ones the step used."""
        self._step_lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheduler is not None:
            for group, scheduled in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = scheduled
            self.scheduler.step()

    def small_state(self) -> dict[str, Any]:
        ramp = self.ramp
        return {
            **super().small_state(),
            "position": self.position,
            "batch_size": self.batch_size,
            "ramp": None if ramp is None else [ramp.start_step, ramp.steps, ramp.from_lr, ramp.to_lr],
        }

    def load_small_state(self, state: dict[str, Any]) -> None:
        super().load_small_state(state)
        self.position = int(state["position"])
        self.batch_size = int(state["batch_size"])
        ramp = state.get("ramp")
        self.ramp = (
            None if ramp is None else LrRamp(int(ramp[0]), int(ramp[1]), float(ramp[2]), float(ramp[3]))
        )
