"""One data-parallel training step over a process group.

Every rank holds the whole model. At step s each rank trains on its share of the global batch
(elastic.worker.data), scales its gradient by its share of the batch, and an all-reduce (SUM)
yields on every rank the gradient of the mean loss over the global batch. The gradient goes in
buckets sent while backward computes the rest (GradientBuckets, as DDP's); the step's last
all-reduce, a few values long, carries the step's loss sum, sample count, stop flag and the
generation to switch to (only rank 0 sets it, see elastic.membership.redis), so these decisions
cost nothing extra and all ranks reach them after the same step. A rank alone in its generation
sums nothing: its gradients stay where backward puts them (Trainer._solo) and its statistics sit
in a tensor of their own.

The optimiser steps only after the all-reduce succeeded: when a peer dies mid-step the step
raises CollectiveError and every survivor still holds the state of the last completed step.

On a GPU the host must never wait for the device but once a step. The task's metrics stay
tensors on the device and ride in the statistics; the statistics are the step's one
device-to-host read (`to_host`, counted in `host_reads`), and it cannot come later: whether the
optimiser steps (a loss that is not finite) is decided from it. Before that read, while the
device computes, the next step's items are read ahead (elastic.worker.readahead).
"""

from __future__ import annotations

import functools
import json
import math
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from elastic.tasks.api import UserCodeError
from elastic.tasks.runtime import BoundTask
from elastic.wording import counted
from elastic.worker.data import SampleStream, derive_seed, seed_torch, share_bounds
from elastic.worker.readahead import ReadAhead, Share
from elastic.worker.settings import BUCKET_BYTES

METRIC_SLOTS = 8
"""The task's named training metrics averaged over the global batch, as the loss is: the first
this many, by name. The step's all-reduce carries them in slots of a fixed number, so that a rank
whose metrics differ cannot make the collectives' sizes disagree."""

# The buffer of the per-step all-reduce ends with statistics after the gradients: the metric
# sums (weighted by samples), then six values. The generation to switch to is summed with zeros
# from the other ranks; float32 holds it exactly up to 2**24. A rank whose loss is not finite
# votes for it, so that every rank fails or skips the same step. Each rank adds a fingerprint of
# its metrics' names: the sums are averages only if every rank added the same.
_METRIC_NAMES, _NONFINITE_VOTES, _LOSS_SUM, _COUNT, _STOP_VOTES, _SWITCH_TO = -6, -5, -4, -3, -2, -1
_STATS = 6 + METRIC_SLOTS
_ITEM_SALT = 0xDA7A
_SEED_RANGES = 128
"""Item seed ranges a trainer remembers: a step's and the next one's, per hosted virtual worker
(a rank that hosts more than 64 derives some twice, as before there was a memory)."""


class NonFiniteLossError(UserCodeError):
    """The step's loss was NaN or infinite on some rank, and the job's `nan_loss` is "fail"."""


def finite_or_zero(value: float) -> float:
    """A metric as the step's all-reduce carries it: a NaN or infinite one as 0, so that it
    never reads as a loss that is not finite."""
    return value if math.isfinite(value) else 0.0


def names_fingerprint(names: list[str]) -> int:
    """12 bits that tell metric name lists apart (0 for none): a sum of 4,096 of them is still
    exact in float32."""
    return zlib.crc32(",".join(names).encode()) & 0xFFF if names else 0


class CollectiveError(RuntimeError):
    """The step's all-reduce failed: a peer died, or did not answer within the group's timeout.
    Nothing of the step was applied."""


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """Reduce `tensor` in place over the ranks of the default process group with `op`. A group
    of one has nothing to add, so nothing is called: on an H100 the host waited about 15 ms a
    step inside NCCL's all-reduce of a group of one, and gloo hands even that to its thread."""
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)


def all_reduce_sum(buffer: torch.Tensor) -> None:
    """Sum `buffer` in place over the ranks of the default process group."""
    all_reduce(buffer, dist.ReduceOp.SUM)


class GradientBuckets:
    """Overlaps the sum of the gradients over the ranks with backward, as DDP's buckets do.

    The parameters are cut, from the last (whose gradients backward computes first), into
    buckets of consecutive parameters, so that each bucket is one contiguous slice of the step's
    buffer. A hook on each parameter counts the gradients that arrived; a bucket whose count is
    complete is scaled and sent (an asynchronous all-reduce) while backward goes on. Buckets are
    sent strictly in their order, whatever order the gradients arrive in, so that every rank
    issues the same collectives in the same order; `finish` sends the ones a batch left
    incomplete (a parameter it did not use). Between `arm` and `finish` only."""

    def __init__(self, parameters: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
        offsets = [0]
        for parameter in parameters:
            offsets.append(offsets[-1] + parameter.numel())
        nbytes = [parameter.numel() * parameter.element_size() for parameter in parameters]
        self.slices: list[tuple[int, int]] = []
        self._bucket_of = [0] * len(parameters)
        self._sizes: list[int] = []
        stop = len(parameters)
        while stop > 0:
            start, size = stop - 1, nbytes[stop - 1]
            while start > 0 and size + nbytes[start - 1] <= bucket_bytes:
                start -= 1
                size += nbytes[start]
            for index in range(start, stop):
                self._bucket_of[index] = len(self.slices)
            self.slices.append((offsets[start], offsets[stop]))
            self._sizes.append(stop - start)
            stop = start
        self._buffer: torch.Tensor | None = None
        self._scale = 1.0
        self._pending: list[int] = []
        self._next = 0
        self._handles: list[Any] = []
        self._hooks = [
            parameter.register_post_accumulate_grad_hook(self._hook(index)) for index, parameter in enumerate(parameters)
        ]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def arrived(_: torch.Tensor) -> None:
            if self._buffer is None:
                return  # a backward outside a step (a warm-up pass)
            self._pending[self._bucket_of[index]] -= 1
            while self._next < len(self.slices) and self._pending[self._next] <= 0:
                self._send()

        return arrived

    def arm(self, buffer: torch.Tensor, scale: float) -> None:
        """Before a step's backward: its gradients go to `buffer`, times `scale` when sent."""
        self._buffer, self._scale = buffer, scale
        self._pending, self._next, self._handles = list(self._sizes), 0, []

    def _send(self) -> None:
        assert self._buffer is not None
        start, stop = self.slices[self._next]
        part = self._buffer[start:stop]
        part.mul_(self._scale)
        self._handles.append(dist.all_reduce(part, op=dist.ReduceOp.SUM, async_op=True))
        self._next += 1

    def finish(self) -> list[Any]:
        """After backward (or instead of it, for a rank without samples): sends the buckets not
        sent yet, in order, disarms, and returns the requests to wait for."""
        if self._buffer is not None:
            while self._next < len(self.slices):
                self._send()
        self._buffer = None
        handles, self._handles = self._handles, []
        return handles

    def disarm(self) -> None:
        """After a failed backward: nothing more is sent (the step is given up)."""
        self._buffer = None
        self._handles = []


SwitchVote = int | Callable[[], int]
"""The generation a rank asks the group to switch to (0: none), or a function that returns it.
A function is asked at the last moment, just before the step's all-reduce, so that joiners that
got ready during the step's compute are switched to after this step rather than the next: up to
a step sooner."""


def vote(switch_to: SwitchVote) -> int:
    return switch_to() if callable(switch_to) else switch_to


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
    switch_to: int = 0
    """The generation every rank switches to after this step, or 0."""
    skipped: bool = False
    """The loss was not finite on some rank and the job skips such steps: nothing of the step
    was applied (parameters, optimiser, scheduler, running statistics), and `loss` is NaN."""


class SampleRecorder:
    """Appends, for each completed step, the sample indices this rank trained on to a file
    shared by all ranks and generations (one JSON object a line, one write per line)."""

    def __init__(self, path: Path, job_id: int, generation: int, rank: int, world_size: int) -> None:
        self._path = path
        self._job_id = job_id
        self.rebind(generation, rank, world_size)

    def rebind(self, generation: int, rank: int, world_size: int) -> None:
        """Record later steps as `rank` of `world_size` in `generation`."""
        self._fields = {
            "job_id": self._job_id,
            "generation": generation,
            "rank": rank,
            "world_size": world_size,
        }

    def record(self, step: int, indices: torch.Tensor, loss: float | None = None) -> None:
        """Record that 0-based step `step` trained on `indices`, and the step's mean loss over
        the global batch (the same on every rank). Raises OSError."""
        entry = {**self._fields, "step": step, "indices": indices.tolist(), "loss": loss}
        line = json.dumps(entry) + "\n"
        descriptor = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)


class TrainerOptions(TypedDict, total=False):
    """The keyword arguments of Trainer that the trainers of the consistency modes (strict,
    hybrid) take and pass on unchanged; see Trainer."""

    recorder: SampleRecorder | None
    compute_done: Callable[[], None] | None
    scheduler: LRScheduler | None
    skip_nonfinite: bool


class Trainer:
    """Trains the bound task `problem` one global step at a time as `rank` of `world_size`. `reduce` sums a
    tensor in place over all ranks; by default over the default process group, which must then
    be initialised, even for a world of one. `compute_done`, if given, is called when this
    rank's share of the step is computed, just before the step's collectives (the StepClock)."""

    def __init__(
        self,
        problem: BoundTask,
        optimizer: torch.optim.Optimizer,
        stream: SampleStream,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        recorder: SampleRecorder | None = None,
        reduce: Callable[[torch.Tensor], None] = all_reduce_sum,
        compute_done: Callable[[], None] | None = None,
        scheduler: LRScheduler | None = None,
        skip_nonfinite: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.problem = problem
        self.optimizer = optimizer
        self.bucket_bytes = bucket_bytes
        """Size of the gradient's buckets overlapped with backward; 0: one all-reduce after it."""
        self.scheduler = scheduler
        self.skip_nonfinite = skip_nonfinite
        """What a step whose loss is not finite does: skipped if true, else NonFiniteLossError."""
        self._step_lr: float | None = None
        self._metrics: dict[str, float] = {}
        self.stream = stream
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.recorder = recorder
        self.reduce = reduce
        self.compute_done = compute_done
        self._parameters = [p for p in problem.model.parameters() if p.requires_grad]
        if not self._parameters:
            raise ValueError("the model has no trainable parameters")
        self._gradient_size = sum(p.numel() for p in self._parameters)
        first = self._parameters[0]
        self._dtype = first.dtype
        self._device = first.device
        self._buffer: torch.Tensor | None = None
        self._gradient_views: list[torch.Tensor] = []
        self._stats: torch.Tensor | None = None
        self._buckets: GradientBuckets | None = None
        self._saved_buffers: list[torch.Tensor] = []
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._grouped_for: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._listed_buffers: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]] | None = None
        self._buffer_list: list[torch.Tensor] = []
        self.host_reads = 0
        """Device-to-host reads the steps made (each a sync on a GPU): a step makes one, the
        read of its agreed statistics, but for a strict step (see StrictTrainer.step)."""
        self.readahead = ReadAhead(problem)
        self._derived_seeds = functools.lru_cache(maxsize=_SEED_RANGES)(self._derive_seeds)
        self.read_ahead_here = self._device.type != "cpu"
        """Whether items read in this process (no data_workers) are read a step ahead, on the
        main thread while the device computes (elastic.worker.readahead); on a CPU that only
        changes the order of the work. Reader processes always read a step ahead."""

    def _overlapped(self) -> GradientBuckets | None:
        """The buckets that overlap the gradient's all-reduce with backward: with the default
        all-reduce over more than one rank and buckets on (a test's own `reduce` gets the whole
        buffer)."""
        if self.reduce is not all_reduce_sum or self.world_size < 2 or not self.bucket_bytes:
            return None
        if self._buckets is None:
            self._buckets = GradientBuckets(self._parameters, self.bucket_bytes)
        return self._buckets

    def _solo(self) -> bool:
        """Whether this rank trains alone with the default all-reduce (which then sums nothing):
        its gradients stay where backward puts them, as in a user's loop that zeroes them with
        `set_to_none`, rather than in the all-reduce's buffer, which costs a zeroing pass and an
        accumulation kernel per parameter a step (1.1 ms of a 47 ms step of the digits MLP on a
        CPU core, by cProfile; on a GPU a memset and a kernel per parameter)."""
        return self.world_size == 1 and self.reduce is all_reduce_sum

    def rebind(self, rank: int, world_size: int) -> None:
        """Train later steps as `rank` of `world_size` (after a resize)."""
        self.rank = rank
        self.world_size = world_size
        self.readahead.drop()

    def to_host(self, tensor: torch.Tensor) -> list[Any]:
        """`tensor`'s values on the host: one device-to-host read, counted in host_reads."""
        self.host_reads += 1
        return tensor.tolist()

    def metric_terms(self, names: list[str], weight: float) -> torch.Tensor:
        """The task's metrics `names` of its last loss, times `weight`, as one tensor on the
        device in the gradients' dtype, NaN and infinities as 0 (finite_or_zero): no read."""
        values = self.problem.metric_values
        stacked = torch.stack([values[name].to(self._device, self._dtype) for name in names])
        return torch.nan_to_num(stacked, nan=0.0, posinf=0.0, neginf=0.0).mul_(weight)

    def next_batch_start(self, step: int) -> int:
        """The stream position the step after `step` starts at, as far as is known during
        `step` (a read-ahead that guessed wrong is dropped: see elastic.worker.readahead)."""
        return self.batch_start(step + 1)

    def shares_ahead(self, step: int) -> list[Share]:
        """What step `step` + 1 reads on this rank, with the slicing of now."""
        first = self.next_batch_start(step)
        start, stop = share_bounds(self.batch_size, self.world_size, self.rank)
        indices = self.stream.positions(first + start, first + stop)
        return [Share(tuple(indices.tolist()), self.item_seeds(first + start, stop - start),
                      step_seed(self.seed, step + 1, self.rank))]

    def start_reading_ahead(self, step: int) -> None:
        """Hands step `step` + 1's items to the readers (or, reading here, notes them)."""
        if self.problem.data_workers or self.read_ahead_here:
            self.readahead.start(self.shares_ahead(step))

    def step(self, step: int, stop_requested: bool, switch_to: SwitchVote = 0) -> StepOutcome:
        """Train 0-based step `step` and return what all ranks agree on. A collective call:
        every rank must call it with the same `step`; `switch_to` is the generation this rank
        asks to switch to (0: none), or a function that says it, asked once the step's compute
        is done (see SwitchVote). Raises CollectiveError if a peer fails or times out."""
        rng_seed = step_seed(self.seed, step, self.rank)
        seed_torch(rng_seed, self._device)
        first = self.batch_start(step)
        start, stop = share_bounds(self.batch_size, self.world_size, self.rank)
        indices = self.stream.positions(first + start, first + stop)
        buffer = self._fresh_gradients()  # None when solo: backward's own gradients
        stats = self._solo_stats() if buffer is None else buffer[-_STATS:]
        count = len(indices)
        saved_buffers = self._copy_model_buffers()  # what a step that is not applied gives back
        buckets = None if buffer is None else self._overlapped()
        if buckets is not None and buffer is not None:
            buckets.arm(buffer, count / self.batch_size)
        if count:
            try:
                batch = self.readahead.batch(indices, self.item_seeds(first + start, count), rng_seed)
                self.start_reading_ahead(step)
                loss = self.problem.loss(batch)
                loss.backward()  # accumulates into the zeroed views, that is into the buffer
            except BaseException:  # the task's own error: nothing of the step stays
                if buckets is not None:
                    buckets.disarm()
                self._restore_model_buffers(saved_buffers)
                raise
            share = count / self.batch_size
            if buffer is None:
                self._zero_missing_gradients()
            elif buckets is None and share != 1.0:  # x * 1.0 is x, bit for bit: one pass over the gradients saved
                buffer[: self._gradient_size].mul_(share)
            stats[_LOSS_SUM] = loss.detach() * count
            stats[_NONFINITE_VOTES] = (~torch.isfinite(loss.detach())).to(stats.dtype)
            names = self.metric_names()
            if names:
                stats[: len(names)] = self.metric_terms(names, count)
        else:
            self.start_reading_ahead(step)
        # fill_ passes a number to the kernel; `stats[i] = number` copies it from pageable host
        # memory, which waits for everything queued before it (the whole backward) on a GPU.
        stats[_METRIC_NAMES].fill_(names_fingerprint(self.metric_names()))
        stats[_COUNT].fill_(count)
        stats[_STOP_VOTES].fill_(1.0 if stop_requested else 0.0)
        stats[_SWITCH_TO].fill_(vote(switch_to))
        if self.compute_done is not None:
            self.compute_done()
        try:
            if buffer is None:
                self._sum_statistics(stats)
            elif buckets is None:
                self.reduce(buffer)
            else:  # the gradients' buckets are on their way; the statistics go last
                sent = buckets.finish()
                self.reduce(stats)
                for request in sent:
                    request.wait()
        except RuntimeError as err:  # what gloo and NCCL raise, DistBackendError included
            self._restore_model_buffers(saved_buffers)
            raise CollectiveError(f"the all-reduce of step {step} failed: {err}") from err
        self.readahead.prepare()  # the next step's items, while the device computes this one's
        agreed = self.to_host(stats)  # the step's one device-to-host read
        try:
            skipped = self.nonfinite_agreed(step, agreed[_NONFINITE_VOTES])
        except NonFiniteLossError:
            self._restore_model_buffers(saved_buffers)
            raise
        if skipped:
            self._restore_model_buffers(saved_buffers)
        else:
            self.optimizer.step()
            self.advance_schedule()
            self.agree_metrics(agreed[:METRIC_SLOTS], agreed[_METRIC_NAMES], agreed[_COUNT])
        outcome = StepOutcome(
            step=step + 1,
            loss=math.nan if skipped else agreed[_LOSS_SUM] / agreed[_COUNT],
            samples=round(agreed[_COUNT]),
            stop=agreed[_STOP_VOTES] > 0,
            switch_to=round(agreed[_SWITCH_TO]),
            skipped=skipped,
        )
        self._committed(step, indices, outcome)
        return outcome

    def nonfinite_agreed(self, step: int, votes: float) -> bool:
        """Whether step `step` is skipped, given the ranks' votes that its loss was not finite.
        Raises NonFiniteLossError if some rank voted and the job does not skip such steps; every rank
        sees the same votes, so all of them raise at the same step."""
        if votes <= 0:
            return False
        if not self.skip_nonfinite:
            raise NonFiniteLossError(
                f"the loss was not finite (NaN or infinite) at step {step + 1} on {counted(round(votes), 'worker')}; "
                "the job's nan_loss setting is fail (set it to skip to skip such steps)"
            )
        return True

    def item_seeds(self, position: int, count: int) -> tuple[int, ...] | None:
        """The seeds of the `count` items from stream position `position` on, when the task
        reads its items in reader processes (None otherwise: they are read here, after the
        step's own seeding). An item's seed depends only on the job's seed and its position.
        A range is derived once: the read-ahead asks for the next step's, which then asks again
        (5 us an item: 1.3 ms of host time a step for 128 items, asked twice)."""
        if not self.problem.data_workers:
            return None
        return self._derived_seeds(position, count)

    def _derive_seeds(self, position: int, count: int) -> tuple[int, ...]:
        return tuple(derive_seed(self.seed, at, _ITEM_SALT) for at in range(position, position + count))

    def advance_schedule(self) -> None:
        """Notes the rate the step trained at, then steps the task's learning-rate scheduler
        once; called after the optimiser stepped."""
        self._step_lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheduler is not None:
            self.scheduler.step()

    def _copy_model_buffers(self) -> list[torch.Tensor]:
        """Copies of the model's buffers (running statistics, small beside the parameters), to
        undo the forward of a step that is not applied: skipped, failed, or cut by a peer's
        death. Into copies kept from step to step, in one multi-tensor copy (one kernel on a
        GPU, where a clone each was a kernel and an allocation per buffer)."""
        buffers = self._current_model_buffers()
        saved = self._saved_buffers
        if len(saved) != len(buffers) or any(
            kept.shape != buffer.shape or kept.dtype != buffer.dtype or kept.device != buffer.device
            for kept, buffer in zip(saved, buffers, strict=True)
        ):
            saved = self._saved_buffers = [torch.empty_like(buffer) for buffer in buffers]
        for kept, current in self._by_dtype(saved, buffers):
            torch._foreach_copy_(kept, current)
        return saved

    def _restore_model_buffers(self, saved: list[torch.Tensor]) -> None:
        for kept, current in self._by_dtype(saved, self._current_model_buffers()):
            torch._foreach_copy_(current, kept)

    def _by_dtype(
        self, saved: list[torch.Tensor], buffers: list[torch.Tensor]
    ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """`saved` and `buffers` (alike, pairwise) split by dtype and device, kept while both lists
        are the very same: a multi-tensor copy of mixed dtypes (batch norm's float statistics and int64
        step counts) takes the slow path on a GPU, a kernel a tensor (60 for the ResNet example)."""
        held = self._grouped_for
        if held is None or held[0] is not saved or held[1] is not buffers:
            groups: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for kept, buffer in zip(saved, buffers, strict=True):
                pair = groups.setdefault((buffer.dtype, buffer.device), ([], []))
                pair[0].append(kept)
                pair[1].append(buffer)
            self._groups = list(groups.values())
            self._grouped_for = (saved, buffers)  # the lists themselves, compared with `is`
        return self._groups

    def _current_model_buffers(self) -> list[torch.Tensor]:
        """The model's buffers (each once, as `Module.buffers` lists them), detached. The list is
        kept while every module still holds the very tensor it listed, checked in a dict lookup
        each: walking the module tree for it each step was 0.2 ms of host time on the ResNet-style
        example's 60 buffers. A module that assigns a buffer anew makes it list them again (one
        that registers a new buffer after the first step is not seen)."""
        listed = self._listed_buffers
        if listed is not None and all(owner.get(name) is tensor for owner, name, tensor in listed):
            return self._buffer_list  # a model without buffers is listed once too
        seen: set[int] = set()
        listed = []
        for module in self.problem.model.modules():
            for name, tensor in module._buffers.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    listed.append((module._buffers, name, tensor))
        self._listed_buffers = listed
        self._buffer_list = [tensor.detach() for _, _, tensor in listed]
        return self._buffer_list

    # --- what a subclass changes -------------------------------------------------------------

    def batch_start(self, step: int) -> int:
        """The stream position of step `step`'s first sample: the global batch is fixed."""
        return step * self.batch_size

    def _committed(self, step: int, indices: torch.Tensor, outcome: StepOutcome) -> None:
        """Called once step `step` is applied, with the sample indices this rank trained on."""
        if self.recorder is not None:
            self.recorder.record(step, indices, outcome.loss)

    @property
    def metrics(self) -> dict[str, float]:
        """The task's named training metrics of the last applied step, averaged over the global
        batch; this rank's own if the ranks' metrics had different names."""
        return self._metrics

    def metric_names(self) -> list[str]:
        """The names of the metrics the step's all-reduce averages (METRIC_SLOTS at most)."""
        return sorted(self.problem.metric_values)[:METRIC_SLOTS]

    def agree_metrics(self, sums: list[float], fingerprints: float, total_weight: float) -> None:
        """Takes the step's reduced metric sums as the metrics, if every rank summed metrics of
        the same names (their fingerprints add up to world_size of this rank's)."""
        names = self.metric_names()
        if names and total_weight > 0 and round(fingerprints) == names_fingerprint(names) * self.world_size:
            self._metrics = {name: sums[slot] / total_weight for slot, name in enumerate(names)}
        elif self.problem.metric_values:  # this rank's own, in one more read (the ranks disagree)
            own = dict(self.problem.metric_values)
            values = self.to_host(torch.stack([value.to(self._device, torch.float64) for value in own.values()]))
            self._metrics = dict(zip(own, values, strict=True))
        else:
            self._metrics = {}

    @property
    def lr(self) -> float:
        """The learning rate of the optimiser's first parameter group in the last applied step
        (before any step: its rate now)."""
        if self._step_lr is not None:
            return self._step_lr
        return float(self.optimizer.param_groups[0]["lr"])

    def rebind_members(self, rank: int, world_size: int, shares: list[int] | None, step: int) -> None:
        """Train later steps, from `step` on, as `rank` of `world_size` (after a resize);
        `shares` are the virtual workers per rank where the mode has them. Raises ValueError if
        they do not fit."""
        self.rebind(rank, world_size)

    def small_state(self) -> dict[str, Any]:
        """Picklable values that the mode carries between steps and that a joiner, or a run
        resumed from the checkpoint, needs: they travel in the state's outline. A subclass adds
        its own to these (the scheduler's state)."""
        return {} if self.scheduler is None else {"scheduler": self.scheduler.state_dict()}

    def load_small_state(self, state: dict[str, Any]) -> None:
        """Takes on what small_state returned on a holder of the state. Raises ValueError if
        the state has a scheduler's and this job has none, or the other way round."""
        self.readahead.drop()
        carried = state.get("scheduler")
        if (carried is None) != (self.scheduler is None):
            raise ValueError(
                "the state "
                + ("carries a learning-rate scheduler's, but the task defines none" if carried is not None
                   else "carries no learning-rate scheduler's, but the task defines one")
            )
        if self.scheduler is not None and carried is not None:
            self.scheduler.load_state_dict(carried)

    def bulk_state(self) -> list[torch.Tensor]:
        """Tensors of the mode's own state, moved with the model's (elastic.worker.transfer):
        every worker of the job builds them with the same shapes."""
        return []

    def exported_model_state(self) -> dict[str, torch.Tensor]:
        """The model's state to hand its owner, copied to the CPU. It does not depend on how the
        job was run: strict mode leaves virtual worker 0's buffers in the model after every
        step."""
        return {name: value.detach().to("cpu", copy=True) for name, value in self.problem.model.state_dict().items()}

    def state_arrived(self) -> None:
        """Called once this worker holds the state anew (from a peer or the checkpoint)."""

    def warm_up(self, rows: int) -> None:
        """Runs one forward and backward pass on `rows` samples, in eval mode (no running
        statistics move, no dropout) and without an optimiser step, then zeroes the gradients:
        a joiner does this while it warms up, so that its first real step, inside the resize's
        pause, does not also pay for first-touch memory and kernel set-up."""
        self._fresh_gradients()
        self._warm_pass(rows)
        self._fresh_gradients()

    def _warm_pass(self, rows: int) -> None:
        """One forward and backward pass on `rows` samples in eval mode, its gradients going
        where the parameters' gradients point now."""
        if not rows:
            return
        model = self.problem.model
        training = model.training
        model.eval()
        try:
            self.problem.loss(self.problem.batch(range(min(rows, self.problem.num_samples)))).backward()
        finally:
            model.train(training)

    def _fresh_gradients(self) -> torch.Tensor | None:
        """Readies the parameters' gradients for a step's backward: none, when the rank trains
        alone (_solo: backward makes them, and the all-reduce's buffer is let go), else the
        all-reduce's buffer, zeroed, which it returns."""
        if not self._solo():
            return self._gradients_in_buffer()
        for parameter in self._parameters:
            parameter.grad = None
        self._buffer, self._gradient_views = None, []
        return None

    def _sum_statistics(self, stats: torch.Tensor) -> None:
        """Sums the step's statistics when its gradients are not in the all-reduce's buffer:
        alone (_solo), there is nothing to sum (a sharded step sums them: elastic.worker.sharded_step)."""

    def _zero_missing_gradients(self) -> None:
        """After a solo backward: a parameter the batch did not use gets a zero gradient, as it
        has in the all-reduce's buffer at any other world size (an optimiser steps a parameter
        whose gradient is None not at all: no momentum, no weight decay)."""
        for parameter in self._parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)

    def _solo_stats(self) -> torch.Tensor:
        """The step's statistics when the rank trains alone (the tail of the all-reduce's buffer
        otherwise), zeroed: kept from step to step."""
        if self._stats is None:
            self._stats = torch.zeros(_STATS, dtype=self._dtype, device=self._device)
        else:
            self._stats.zero_()
        return self._stats

    def _gradients_in_buffer(self) -> torch.Tensor:
        """Returns the step's all-reduce buffer, zeroed, with every parameter's gradient a view of
        its slice: backward writes into it and the optimiser reads the reduced sum from it. One
        buffer while the rank has peers, so a step allocates (and faults in) no gradient memory;
        a parameter the batch does not use keeps a zero gradient. The views are made with the
        buffer and kept (making them each step was 0.2 ms of host time for 62 parameters)."""
        if self._buffer is None:
            self._buffer = torch.zeros(self._gradient_size + _STATS, dtype=self._dtype, device=self._device)
            offset, self._gradient_views = 0, []
            for parameter in self._parameters:
                size = parameter.numel()
                self._gradient_views.append(self._buffer[offset : offset + size].view_as(parameter))
                offset += size
        else:
            self._buffer.zero_()
        for parameter, view in zip(self._parameters, self._gradient_views, strict=True):
            if parameter.grad is not view:
                parameter.grad = view
        return self._buffer
