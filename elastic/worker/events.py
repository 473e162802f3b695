"""The worker's structured output: elastic.wire.WorkerEvent objects written to stdout as single
lines (elastic.worker.event_codec), which the agent decodes; any other stdout line is a plain log
line to the agent."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, TextIO

from elastic.wire import WORKER_EVENT_PREFIX, UserError, WorkerConfig, WorkerEvent
from elastic.worker.event_codec import WorkerKind, encode


def finite_only(metrics: dict[str, float] | None) -> dict[str, float] | None:
    """`metrics` without the values that are NaN or infinite (no message carries them), or None
    if none is left."""
    kept = {name: value for name, value in (metrics or {}).items() if math.isfinite(value)}
    return kept or None


class EventWriter:
    """Writes the events of one worker, stamped with its job and its current generation and
    rank (those it was launched with until it joins a generation)."""

    def __init__(self, config: WorkerConfig, stream: TextIO | None = None) -> None:
        self._job_id = config.job_id
        self.generation = config.generation
        self.rank = config.rank
        self._stream = stream if stream is not None else sys.stdout

    @classmethod
    def for_job(cls, job_id: int, generation: int, rank: int = 0, stream: TextIO | None = None) -> EventWriter:
        """A writer for a process that is not one of the job's workers (elastic.worker.export)."""
        writer = cls.__new__(cls)
        writer._job_id, writer.generation, writer.rank = job_id, generation, rank
        writer._stream = stream if stream is not None else sys.stdout
        return writer

    def rebind(self, generation: int, rank: int) -> None:
        """Stamp later events with `generation` and `rank`."""
        self.generation = generation
        self.rank = rank

    def emit(self, kind: WorkerKind, at: float | None = None, **fields: Any) -> WorkerEvent:
        """Write one event and flush; return it. `at`: when it happened, if not now. Raises
        pydantic.ValidationError if a field does not belong to WorkerEvent."""
        event = WorkerEvent(
            job_id=self._job_id,
            generation=self.generation,
            rank=self.rank,
            kind=kind,
            at=time.time() if at is None else at,
            **fields,
        )
        self._stream.write(encode(event) + "\n")
        self._stream.flush()
        return event

    def log(self, message: str) -> WorkerEvent:
        """Write a log event carrying `message`; return it."""
        return self.emit("log", message=message)


def announce_exit(exit_code: int, stream: TextIO | None = None, user_error: UserError | None = None) -> None:
    """Write the worker's last line, the "exiting" event with the code it is about to exit with
    (and, where the job's own code failed, what it raised: `user_error`), and flush. It carries
    no job, generation or rank (the agent fills them in), so that it can be written however early
    the worker fails."""
    out = stream if stream is not None else sys.stdout
    said: dict[str, Any] = {"kind": "exiting", "exit_code": exit_code}
    if user_error is not None:
        said["user_error"] = user_error.model_dump()
    out.write(WORKER_EVENT_PREFIX + json.dumps(said) + "\n")
    out.flush()


class ProgressReporter:
    """Rank 0's progress events: at most one every `every_s` seconds, plus the first step after
    a (re)start and any step the caller forces (the last one). `samples_per_s` is the global
    throughput since the previous report, or since the reporter was started."""

    def __init__(
        self,
        events: EventWriter,
        total_steps: int,
        batch_size: int,
        samples_per_epoch: int,
        every_s: float,
    ) -> None:
        self._events = events
        self._total_steps = total_steps
        self._batch_size = batch_size
        self._samples_per_epoch = samples_per_epoch
        self._every_s = every_s
        self._last_report_at = time.monotonic()
        self._samples_since_report = 0
        self._reported_once = False
        self._unreported: dict[str, Any] | None = None
        """The last step recorded and not yet reported, as its event's fields."""

    def restart_clock(self) -> None:
        """Measure throughput from now on (call it just before the first step)."""
        self._last_report_at = time.monotonic()
        self._samples_since_report = 0

    def step_done(
        self,
        step: int,
        loss: float,
        samples: int,
        force: bool = False,
        global_batch: int | None = None,
        lr: float | None = None,
        samples_done: int | None = None,
        metrics: dict[str, float] | None = None,
    ) -> bool:
        """Record that global step `step` (completed steps) trained `samples` samples with mean
        loss `loss`, at global batch `global_batch` and learning rate `lr` where given; report it
        if due. `samples_done`: the job's samples so far, where the batch changes (by default
        `step` fixed batches); `metrics`: the task's named training metrics. Return whether an
        event was written."""
        self._samples_since_report += samples
        self._unreported = {
            "step": step,
            "total_steps": self._total_steps,
            "epoch": (step * self._batch_size if samples_done is None else samples_done) / self._samples_per_epoch,
            "loss": loss,
            "global_batch": global_batch,
            "lr": lr,
            "metrics": finite_only(metrics),
        }
        if self._reported_once and not force and time.monotonic() - self._last_report_at < self._every_s:
            return False
        return self.flush()

    def flush(self) -> bool:
        """Reports the last step recorded, if it has not been: the job ends there (its code
        failed), and the portal must know the last step applied. Returns whether it wrote one."""
        if self._unreported is None:
            return False
        now = time.monotonic()
        elapsed = now - self._last_report_at
        samples_per_s = self._samples_since_report / elapsed if elapsed > 0 else 0.0
        self._events.emit("progress", samples_per_s=samples_per_s, **self._unreported)
        self._unreported = None
        self._reported_once = True
        self._last_report_at = now
        self._samples_since_report = 0
        return True
