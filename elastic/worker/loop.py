"""The training loop of one worker inside a generation's group: step after step until the job
is done, a stop is agreed, or a switch to the next generation is agreed (every rank learns of
both at the same step boundary, through the step's all-reduce: elastic.worker.trainer). Beside
it, what rank 0 does between steps: it measures the pause of the last switch (ResizeMeter) and
saves the periodic checkpoint (CheckpointSaver), in the background while training goes on."""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.spec import JobSpec
from elastic.wire import Membership
from elastic.worker import COMPLETED_EXIT_CODE, STOPPED_EXIT_CODE
from elastic.worker.checkpoint import TrainingState, save_checkpoint
from elastic.worker.events import EventWriter, ProgressReporter
from elastic.worker.position import WorkerPosition
from elastic.worker.step_clock import StepClock
from elastic.worker.stop import StopRequest
from elastic.worker.trainer import CollectiveError, Trainer

PAUSE_STEPS = 5
"""Steps after a switch whose median is the 'normal step' taken off the pause it reports."""
_STEP_HISTORY = 20


def _size(byte_count: int) -> str:
    """`byte_count` for people: 512 B, 40.0 kB, 205.0 MB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if byte_count >= size:
            return f"{byte_count / size:.1f} {unit}"
    return f"{byte_count} B"


def _detached_copy(value: Any) -> Any:
    """A copy of a state_dict (nested dicts and lists) whose tensors are CPU copies that later
    steps do not change."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _detached_copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_detached_copy(item) for item in value)
    return value


def _worth_logging(count: int) -> bool:
    """Whether the `count`th occurrence of a repeated event goes to the log: the first three,
    then every hundredth."""
    return count <= 3 or count % 100 == 0


# --- resize measurement ----------------------------------------------------------------------


@dataclass
class PendingResize:
    """Rank 0's measurements of a switch, reported once a few steps show the new pace."""

    generation: int
    step: int
    members_before: list[str]
    members_after: list[str]
    bytes_moved: int
    phases: dict[str, float]
    last_step_end: float | None
    step_ends: list[float] = field(default_factory=list)


class ResizeMeter:
    """What each switch cost, as rank 0 reports it in a "resized" event: the pause (the gap
    between the last step before and the first step after, less a normal step), its phases and
    the bytes moved."""

    def __init__(self, events: EventWriter, total_steps: int) -> None:
        self.events = events
        self.total_steps = total_steps
        self.switch_started: float | None = None
        """perf_counter() when the group agreed on the switch under way, if one is."""
        self.pending: PendingResize | None = None
        self._step_seconds: deque[float] = deque(maxlen=_STEP_HISTORY)

    def announce(
        self,
        record: Membership,
        how: str,
        before_group: list[str],
        step: int,
        rank: int,
        bytes_moved: int,
        phases: dict[str, float],
        last_step_end: float | None,
        sources: int,
    ) -> None:
        """Rank `rank` entered generation `record` at `step`, its state having come by `how`
        ("memory", "checkpoint" or "fresh"); on rank 0, logs it and starts measuring the
        switch. `last_step_end`: the wall-clock end of the holders' last step before it."""
        if rank != 0:
            return
        where = f"step {step} of {self.total_steps}, world size {record.world_size}"
        if how == "fresh":
            self.events.log(f"starting from step 0 of {self.total_steps}, world size {record.world_size}")
        elif how == "checkpoint":
            self.events.log(
                f"resumed from the periodic checkpoint at {where}: no running worker held the training state"
            )
        else:
            moved = f"{_size(bytes_moved)} from {sources} holder(s)" if bytes_moved else "nothing to move"
            self.events.log(
                f"generation {record.generation}: {len(before_group)} -> {record.world_size} workers at {where}; {moved}"
            )
        self.pending = PendingResize(
            generation=record.generation,
            step=step,
            members_before=before_group,
            members_after=record.keys(),
            bytes_moved=bytes_moved,
            phases=phases,
            last_step_end=last_step_end if how == "memory" else None,
        )

    def step_took(self, seconds: float) -> None:
        """A step of this rank took `seconds` (the fallback 'normal step')."""
        self._step_seconds.append(seconds)

    def step_ended(self, at: float, now: bool) -> None:
        """Rank 0's step ended at wall-clock `at`: reports the last switch once PAUSE_STEPS
        steps after it (or `now`) give the pace."""
        pending = self.pending
        if pending is None:
            return
        pending.step_ends.append(at)
        if len(pending.step_ends) > PAUSE_STEPS or now:
            self.report()

    def report(self) -> None:
        """Emits the "resized" event of the last switch, if not done yet: its pause is known
        once a step after it ended. The event is dated at the end of the first step of the new
        generation, where the resize landed (now, if no step has ended since)."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        ends = pending.step_ends
        pause = None
        if pending.last_step_end is not None and ends:
            steps = [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)]
            normal = statistics.median(steps) if steps else statistics.median(self._step_seconds)
            pause = max(0.0, ends[0] - pending.last_step_end - normal)
            pending.phases["first_step"] = ends[0] - pending.last_step_end - sum(pending.phases.values())
        self.events.emit(
            "resized",
            at=ends[0] if ends else None,
            step=pending.step,
            members_before=pending.members_before,
            members_after=pending.members_after,
            pause_s=pause,
            bytes_moved=pending.bytes_moved,
            phases={name: round(seconds, 6) for name, seconds in pending.phases.items()},
        )


# --- checkpoints -----------------------------------------------------------------------------


class CheckpointSaver:
    """Rank 0's periodic checkpoint of the job `spec` at `path` (elastic.worker.checkpoint):
    the state of `model`, `optimizer` and the consistency mode's `trainer`."""

    def __init__(
        self,
        path: Path,
        spec: JobSpec,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer: Trainer,
        events: EventWriter,
    ) -> None:
        self.path = path
        self.spec = spec
        self.model = model
        self.optimizer = optimizer
        self.trainer = trainer
        self.events = events
        self.last_save = time.monotonic()
        self._saving: threading.Thread | None = None

    def restart_clock(self) -> None:
        """Counts the time to the next periodic save from now (a new rank 0)."""
        self.last_save = time.monotonic()

    def due(self, every_s: float) -> bool:
        return time.monotonic() - self.last_save >= every_s

    def save(self, step: int, background: bool = False) -> None:
        """Writes the state after `step` completed steps to the checkpoint. In the background,
        the step only pays for a copy of the state in memory; the file is written and synced by
        a thread while training goes on (one write at a time)."""
        self.finish()
        state = TrainingState(
            step=step,
            workload=self.spec.task_name,
            seed=self.spec.seed,
            model=_detached_copy(self.model.state_dict()),
            optimizer=_detached_copy(self.optimizer.state_dict()),
            trainer=copy.deepcopy(self.trainer.small_state()),
            trainer_tensors=[_detached_copy(tensor) for tensor in self.trainer.bulk_state()],
        )
        self.last_save = time.monotonic()
        if not background:
            save_checkpoint(self.path, state)
            return
        self._saving = threading.Thread(
            target=self._write, args=(state,), name="checkpoint-writer", daemon=True
        )
        self._saving.start()

    def _write(self, state: TrainingState) -> None:
        try:
            save_checkpoint(self.path, state)
        except OSError as err:
            self.events.log(f"could not write the periodic checkpoint of step {state.step}: {err}")

    def finish(self) -> None:
        """Waits for the background write in flight, if any."""
        if self._saving is not None:
            self._saving.join()
            self._saving = None


# --- the loop --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwitchAgreed:
    """Every rank of the group finished the same step and agreed to switch to `generation`."""

    generation: int


def group_barrier() -> None:
    """Waits for every rank of the default process group."""
    dist.barrier()


class TrainingLoop:
    """Trains from `position.step` to `total_steps`, advancing `position` (step, last step end);
    on rank 0 (`position.is_leader`) it reports progress, measures resizes and saves the
    checkpoint every `checkpoint_every_s`. `pending()` is the generation this rank asks the group
    to switch to (0: none); `barrier` waits for every rank once rank 0 saved (a stop, the end)."""

    def __init__(
        self,
        trainer: Trainer,
        position: WorkerPosition,
        clock: StepClock,
        progress: ProgressReporter,
        events: EventWriter,
        stop: StopRequest,
        saver: CheckpointSaver,
        resizes: ResizeMeter,
        total_steps: int,
        checkpoint_every_s: float,
        pending: Callable[[], int],
        barrier: Callable[[], None] = group_barrier,
        export: Callable[[int, str, float | None], None] | None = None,
        evaluate: Callable[[int], object] | None = None,
        eval_every_steps: int | None = None,
    ) -> None:
        self.trainer = trainer
        self.position = position
        self.clock = clock
        self.progress = progress
        self.events = events
        self.stop = stop
        self.saver = saver
        self.resizes = resizes
        self.total_steps = total_steps
        self.checkpoint_every_s = checkpoint_every_s
        self.pending = pending
        self.barrier = barrier
        self.export = export
        """Rank 0's export of the job's artifacts at its end: (step, "completed", "stopped" or
        "failed", the last step's loss) (elastic.worker.artifacts)."""
        self.evaluate = evaluate
        """Rank 0's evaluation of the task after a step, every `eval_every_steps` steps."""
        self.eval_every_steps = eval_every_steps
        self._last_loss: float | None = None
        self.skipped_steps = 0
        """Steps skipped for a loss that was not finite (nan_loss: skip)."""

    def train(self) -> int | SwitchAgreed:
        """Trains until the job is done (COMPLETED_EXIT_CODE) or a stop is agreed
        (STOPPED_EXIT_CODE), rank 0 having saved the checkpoint, or a switch is agreed
        (SwitchAgreed). Raises CollectiveError if a peer fails. Rank 0 reports the first step of
        each generation at once (its new batch and rate), then every progress period."""
        position = self.position
        first_of_generation = True
        while position.step < self.total_steps:
            began = time.perf_counter()
            self.clock.start()
            outcome = self.trainer.step(position.step, self.stop.requested, self.pending)
            if not (outcome.switch_to or outcome.stop):
                self.clock.step_done()  # a simulated node's pace; a switch or a stop goes on at once
            self.clock.report(generation_changed=bool(outcome.switch_to))
            self.resizes.step_took(time.perf_counter() - began)
            position.last_step_end = time.time()
            position.step = outcome.step
            finished = position.step == self.total_steps
            if outcome.skipped:
                self.skipped_steps += 1
                if position.is_leader and _worth_logging(self.skipped_steps):
                    self.events.log(
                        f"step {position.step}: the loss was not finite, the step was skipped (nan_loss: skip); "
                        f"{self.skipped_steps} step(s) skipped in this worker's life"
                    )
            else:
                self._last_loss = outcome.loss
            if position.is_leader:
                if not outcome.skipped:
                    self.progress.step_done(
                        position.step,
                        outcome.loss,
                        outcome.samples,
                        force=finished or outcome.stop or bool(outcome.switch_to) or first_of_generation,
                        global_batch=self.trainer.batch_size,
                        lr=self.trainer.lr,
                        samples_done=self.trainer.batch_start(position.step),
                        metrics=self.trainer.metrics,
                    )
                    first_of_generation = False
                self.resizes.step_ended(position.last_step_end, now=finished or bool(outcome.switch_to))
            if finished:
                break
            if outcome.stop:
                self._log(f"stopping at step {position.step}")
                self.save_and_wait("stopped")
                return STOPPED_EXIT_CODE
            if (
                position.is_leader
                and self.evaluate is not None
                and self.eval_every_steps
                and position.step % self.eval_every_steps == 0
            ):
                self.evaluate(position.step)  # the others wait in the next step's all-reduce
            if outcome.switch_to:
                self.resizes.switch_started = time.perf_counter()
                return SwitchAgreed(outcome.switch_to)
            if position.is_leader and self.saver.due(self.checkpoint_every_s):
                self.saver.save(position.step, background=True)
        self._log(f"completed all {self.total_steps} steps")
        self.save_and_wait("completed")
        return COMPLETED_EXIT_CODE

    def save_and_wait(self, ended: str) -> None:
        """Rank 0 saves the state after the current step; every rank waits until it has; then
        rank 0 exports the job's artifacts (the others need not wait for its evaluation).
        Raises CollectiveError if the barrier fails."""
        if self.position.is_leader:
            self.saver.save(self.position.step)
        try:
            self.barrier()
        except RuntimeError as err:
            raise CollectiveError(f"the barrier after saving failed: {err}") from err
        if self.position.is_leader:
            self.export_now(ended)

    def export_now(self, ended: str) -> None:
        """Exports the job's artifacts of the current step, if this loop exports any (rank 0)."""
        if self.export is not None:
            self.export(self.position.step, ended, self._last_loss)

    def _log(self, message: str) -> None:
        if self.position.is_leader:
            self.events.log(message)
