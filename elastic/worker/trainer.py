"""One data-parallel training step over a process group.

Every rank holds the whole model. At step s each rank trains on its share of the global batch
(elastic.worker.data), scales its gradient by its share of the batch, and one all-reduce (SUM)
yields on every rank the gradient of the mean loss over the global batch. The same all-reduce
carries the step's loss sum, sample count and stop flag, so the stop decision costs nothing
extra and all ranks reach it at the same step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.worker.data import SampleStream, derive_seed
from elastic.workloads.api import TrainingProblem

# The buffer of the per-step all-reduce ends with three statistics after the gradients.
_LOSS_SUM, _COUNT, _STOP_VOTES = -3, -2, -1
_STATS = 3


def all_reduce_sum(buffer: torch.Tensor) -> None:
    """Sum `buffer` in place over the ranks of the default process group."""
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)


def step_seed(seed: int, step: int, rank: int) -> int:
    """Return the seed of torch's generator for `rank` at step `step` (0-based) of a job.

    Dropout and any other randomness in a step draw from it, so a resumed run draws what an
    uninterrupted run with the same world size would have drawn, with no saved RNG state.
    """
    return derive_seed(seed, step, rank)


@dataclass(frozen=True)
class StepOutcome:
    """What all ranks agree on after a step."""

    step: int
    """Completed steps, this one included."""
    loss: float
    """Mean loss over the global batch."""
    samples: int
    """Samples in the global batch."""
    stop: bool
    """Some rank was asked to stop; every rank stops after this step."""


class SampleRecorder:
    """Appends, for each completed step, the sample indices this rank trained on to a file
    shared by all ranks and generations (one JSON object a line, one write per line)."""

    def __init__(self, path: Path, generation: int, rank: int, world_size: int) -> None:
        self._path = path
        self._fields = {"generation": generation, "rank": rank, "world_size": world_size}

    def record(self, step: int, indices: torch.Tensor) -> None:
        """Record that 0-based step `step` trained on `indices`. Raises OSError."""
        line = json.dumps({**self._fields, "step": step, "indices": indices.tolist()}) + "\n"
        descriptor = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)


class Trainer:
    """Trains `problem` one global step at a time as `rank` of `world_size`. `reduce` sums a
    tensor in place over all ranks; by default over the default process group, which must then
    be initialised, even for a world of one."""

    def __init__(
        self,
        problem: TrainingProblem,
        optimizer: torch.optim.Optimizer,
        stream: SampleStream,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        recorder: SampleRecorder | None = None,
        reduce: Callable[[torch.Tensor], None] = all_reduce_sum,
    ) -> None:
        self.problem = problem
        self.optimizer = optimizer
        self.stream = stream
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.recorder = recorder
        self.reduce = reduce
        self._parameters = [p for p in problem.model.parameters() if p.requires_grad]
        if not self._parameters:
            raise ValueError("the model has no trainable parameters")
        self._gradient_size = sum(p.numel() for p in self._parameters)
        first = self._parameters[0]
        self._dtype = first.dtype
        self._device = first.device

    def step(self, step: int, stop_requested: bool) -> StepOutcome:
        """Train 0-based step `step` and return what all ranks agree on. A collective call:
        every rank must call it with the same `step`. Raises what torch.distributed raises if a
        peer fails or times out."""
        torch.manual_seed(step_seed(self.seed, step, self.rank))
        indices = self.stream.local_batch(step, self.batch_size, self.world_size, self.rank)
        self.optimizer.zero_grad(set_to_none=True)
        buffer = torch.zeros(self._gradient_size + _STATS, dtype=self._dtype, device=self._device)
        count = len(indices)
        if count:
            device_indices = indices.to(self.problem.inputs.device)
            loss = self.problem.loss(
                self.problem.inputs[device_indices], self.problem.targets[device_indices]
            )
            loss.backward()
            self._pack_gradients(buffer, count / self.batch_size)
            buffer[_LOSS_SUM] = loss.detach() * count
        buffer[_COUNT] = count
        buffer[_STOP_VOTES] = 1.0 if stop_requested else 0.0
        self.reduce(buffer)
        self._unpack_gradients(buffer)
        self.optimizer.step()
        stats = buffer[-_STATS:].tolist()  # one device-to-host copy; the indices work on both
        if self.recorder is not None:
            self.recorder.record(step, indices)
        return StepOutcome(
            step=step + 1,
            loss=stats[_LOSS_SUM] / stats[_COUNT],
            samples=round(stats[_COUNT]),
            stop=stats[_STOP_VOTES] > 0,
        )

    def _pack_gradients(self, buffer: torch.Tensor, weight: float) -> None:
        """Write each parameter's gradient times `weight` into its slice of `buffer`; a
        parameter without a gradient (unused by this batch) keeps its zeros."""
        offset = 0
        for parameter in self._parameters:
            size = parameter.numel()
            if parameter.grad is not None:
                torch.mul(parameter.grad.reshape(-1), weight, out=buffer[offset : offset + size])
            offset += size

    def _unpack_gradients(self, buffer: torch.Tensor) -> None:
        """Make each parameter's gradient its slice of the reduced `buffer`."""
        offset = 0
        for parameter in self._parameters:
            size = parameter.numel()
            parameter.grad = buffer[offset : offset + size].view_as(parameter)
            offset += size
