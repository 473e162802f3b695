"""What the portal has still to learn of this node's workers, kept until a report has delivered it:
their events, in memory (an EventBuffer), and each worker's record, on disk (agent.records), which
says how far the portal has the worker's output. The supervisor adds the events as its workers
start, print and exit; the agent drains them into a report (`drain`) and says when the portal took
it (`delivered`): each worker's record then moves on to where that drain had read its output, so
that a supervisor that re-adopts the worker reads on from there, and the records of the workers
whose "exited" event was in it go.

Not thread-safe: the supervisor calls it under its own lock, so that a drain sees each worker's
read offset and the events of the lines read up to it together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

from agent.events import EventBuffer
from agent.records import RecordStore
from agent.worker_process import ExitOutcome, WorkerProcess
from elastic.wire import ExitReason, LaunchCommand, OwnPackages, WorkerAssignment, WorkerEvent

log = logging.getLogger(__name__)


class WorkerEvents:
    """The node's worker events on their way to the portal, and the workers' records.
    `generations(job_id)` gives a job's launched and stop-below generations, as the supervisor has
    them: each record keeps them."""

    def __init__(
        self, records: RecordStore, capacity: int, generations: Callable[[int], tuple[int, int]]
    ) -> None:
        self.records = records
        self._buffer = EventBuffer(capacity)
        self._generations = generations
        self._ended: list[WorkerProcess] = []
        """Workers whose "exited" event is in the buffer."""
        self._drained: dict[str, tuple[WorkerProcess, int]] = {}
        """Since the last `delivered`: per worker, how far its output was read at the latest drain."""
        self._drained_ended: list[WorkerProcess] = []
        """Since the last `delivered`: workers whose "exited" event was drained."""

    @property
    def dropped(self) -> int:
        """How many events were dropped for lack of room (EventBuffer)."""
        return self._buffer.dropped

    def add(self, event: WorkerEvent) -> None:
        self._buffer.add(event)

    def job_log(self, command: LaunchCommand, line: str) -> None:
        """Adds `line` to the log of `command`'s job, as its first worker here."""
        self._as_first_worker(command, "log", message=line)

    def job_environment(self, command: LaunchCommand, own_packages: OwnPackages) -> None:
        """Tells the portal which environment of its own `command`'s job has on this node, as its
        first worker here (the portal takes it only from a node the job was placed on)."""
        self._as_first_worker(command, "environment", own_packages=own_packages)

    def _as_first_worker(self, command: LaunchCommand, kind: Literal["log", "environment"], **fields: Any) -> None:
        """Adds an event of `kind` about `command`'s job, as its first worker here (none if the
        command starts no worker here)."""
        if command.workers:
            self.add(WorkerEvent(job_id=command.job_id, generation=command.generation, rank=command.workers[0].rank,
                                 kind=kind, at=time.time(), **fields))

    def start_failed(
        self, command: LaunchCommand, assignment: WorkerAssignment, message: str, reason: ExitReason
    ) -> None:
        """Reports that the worker `assignment` of `command` could not start (`message` says why)."""
        log.error(
            "job %d generation %d rank %d: %s", command.job_id, command.generation, assignment.rank, message
        )
        self.add(
            WorkerEvent(
                job_id=command.job_id,
                generation=command.generation,
                rank=assignment.rank,
                kind="exited",
                at=time.time(),
                device_index=assignment.device_index,
                reason=reason,
                message=message,
            )
        )

    def exited(self, worker: WorkerProcess, outcome: ExitOutcome) -> None:
        """Adds the "exited" event of `worker`, which ended as `outcome` says; its record goes
        once that event is delivered."""
        self.add(
            worker.event(
                "exited",
                pid=worker.pid,
                device_index=worker.device_index,
                exit_code=outcome.exit_code,
                reason=outcome.reason,
                step=worker.last_step,
                message=outcome.message,
                user_error=worker.announced_user_error if outcome.reason == "user_error" else None,
            )
        )
        self._ended.append(worker)

    def save(self, worker: WorkerProcess) -> None:
        """Writes the worker's record as it stands (an error is logged: the worker then cannot be
        re-adopted)."""
        launched, stop_before = self._generations(worker.job_id)
        record = worker.record(str(self.records.output_path(worker.stem)), launched, stop_before)
        try:
            self.records.save(worker.stem, record)
        except OSError as err:
            log.error("could not save the record of pid %d (it cannot be re-adopted): %s", record.pid, err)

    def drain(self, workers: Iterable[WorkerProcess]) -> list[WorkerEvent]:
        """Removes and returns the events since the last drain, oldest first; `workers` are those
        whose output is still read (their offsets are what `delivered` then saves)."""
        events = self._buffer.take()
        for worker in workers:
            self._drained[worker.stem] = (worker, worker.read_offset)
        self._drained_ended += self._ended
        self._ended = []
        return events

    def delivered(self) -> None:
        """Every event drained so far reached the portal (or was given up on): the records move
        on, and those of workers whose "exited" event was among them go."""
        drained, self._drained = self._drained, {}
        ended, self._drained_ended = self._drained_ended, []
        for worker, offset in drained.values():
            if offset > worker.delivered_offset and worker not in ended:
                worker.delivered_offset = offset
                self.save(worker)
        for worker in ended:
            self.records.remove(worker.stem)
