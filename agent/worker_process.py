"""One elastic worker process as the agent holds it: its life (WorkerState), its pid and pidfd,
the timers that end it when it outstays a stop or a leave, and how its exit is settled into the
"exited" event the portal reads (its exit status, the code it announced, or neither).

The supervisor (agent.supervisor) decides what happens to a worker: it is started, kept, left
out, stopped. The worker makes it happen and refuses a move its state does not allow
(InvalidWorkerTransition): the one place its state changes is `WorkerProcess._move`. What its
output lines say of it (its step, a generation joined, the code it exits with) it takes in itself
(`heard`). The output reader (agent.output) sees the process end and reads its last lines; `ended`
and `settle` are its calls.

A worker is the agent's child (started cold), the fork server's (forked, or a forked standby that
took the launch), or nobody's the agent knows of (re-adopted after an agent restart: its
pidfd names it, and its exit code is what it announced). A lock of its own is held while it is
signalled or reaped, so that a signal never reaches a recycled pid.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from agent.records import WorkerRecord
from elastic.transitions import InvalidMove, check_move
from elastic.wire import ExitReason, RunningWorker, UserError, WorkerEvent
from elastic.worker import COMPLETED_EXIT_CODE, LEFT_EXIT_CODE, STOPPED_EXIT_CODE, USER_ERROR_EXIT_CODE
from elastic.worker.forkserver import ForkedProcess

log = logging.getLogger(__name__)

Process = subprocess.Popen[bytes] | ForkedProcess


class WorkerState(enum.StrEnum):
    """Where a worker is in its life. Its WorkerProcess is the only writer (`_move`).

            starting -> warming     it was spawned: its process runs ("started" is reported)
            starting -> exited      it could not be spawned (an "exited" event says why; no process)
            adopted  -> joined      it said "joined" a newer generation than its record's
            adopted  -> leaving     a launch left its device out: its leave timer is armed
            adopted  -> stopping    asked to stop (or its record says the last agent had asked)
            adopted  -> ended       its process is gone (or was gone when it was taken back)
            warming  -> joined      it said "joined": it may hold the training state from now on
            warming  -> leaving
            warming  -> stopping    asked to stop: SIGTERM, and SIGKILL when its grace runs out
            warming  -> ended
            joined   -> leaving
            joined   -> stopping
            joined   -> ended
            leaving  -> warming     a newer launch keeps it after all (it never joined)
            leaving  -> joined      the same, for one that joined (or was adopted)
            leaving  -> stopping    asked to stop, or still there when its leave grace ran out
                                    (then SIGKILL at once)
            leaving  -> ended       it left (LEFT_EXIT_CODE), as a leaver does at the switch
            stopping -> ended
            ended    -> exited      its output is read to the end and its exit is settled

    adopted is where a worker re-adopted after an agent restart starts (it may hold the state: it
    counts as joined); starting is where every other one does. exited is final. A "joined" line
    changes a worker's generation and rank in any state it can still print in (a leaving or
    stopping worker may join a generation before it exits), and moves it only from adopted or
    warming.
    """

    STARTING = "starting"
    ADOPTED = "adopted"
    WARMING = "warming"
    JOINED = "joined"
    LEAVING = "leaving"
    STOPPING = "stopping"
    ENDED = "ended"
    EXITED = "exited"

    @property
    def final(self) -> bool:
        return not WORKER_TRANSITIONS[self]

    @property
    def running(self) -> bool:
        """Whether its process may still run: it may be signalled (its pid is still its own)."""
        return self in _RUNNING


_W = WorkerState
_RUNNING = frozenset({_W.ADOPTED, _W.WARMING, _W.JOINED, _W.LEAVING, _W.STOPPING})
WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    _W.STARTING: frozenset({_W.WARMING, _W.EXITED}),
    _W.ADOPTED: frozenset({_W.JOINED, _W.LEAVING, _W.STOPPING, _W.ENDED}),
    _W.WARMING: frozenset({_W.JOINED, _W.LEAVING, _W.STOPPING, _W.ENDED}),
    _W.JOINED: frozenset({_W.LEAVING, _W.STOPPING, _W.ENDED}),
    _W.LEAVING: frozenset({_W.WARMING, _W.JOINED, _W.STOPPING, _W.ENDED}),
    _W.STOPPING: frozenset({_W.ENDED}),
    _W.ENDED: frozenset({_W.EXITED}),
    _W.EXITED: frozenset(),
}


class InvalidWorkerTransition(InvalidMove):
    what = "a worker"


def check_worker_transition(source: str, target: str) -> None:
    """Raises InvalidWorkerTransition unless a worker may go from `source` to `target`."""
    check_move(WORKER_TRANSITIONS, WorkerState, source, target, InvalidWorkerTransition)


def exit_reason(exit_code: int, stop_requested: bool = False, joined: bool = True) -> ExitReason:
    """Returns what a worker's exit code means: COMPLETED_EXIT_CODE (0) "completed",
    STOPPED_EXIT_CODE (75) "stopped", LEFT_EXIT_CODE (76) "left", USER_ERROR_EXIT_CODE (77)
    "user_error", anything else, a signal (negative) included, "failed".

    Two exceptions, for a worker the supervisor asked to stop (`stop_requested`), which was
    "stopped": one killed by that SIGTERM (still starting, before it could catch it), and one
    that never `joined` a group and was SIGKILLed when its short grace ran out (still
    importing torch or building its model on a busy machine). Neither had trained anything, so
    nothing was lost, and calling it a failure would read as a crash. A worker that joined and
    was SIGKILLed after its grace did fail: it may not have saved its step."""
    if exit_code == COMPLETED_EXIT_CODE:
        return "completed"
    if exit_code == LEFT_EXIT_CODE:
        return "left"
    if exit_code == USER_ERROR_EXIT_CODE:
        return "user_error"
    if exit_code == STOPPED_EXIT_CODE:
        return "stopped"
    if stop_requested and (exit_code == -signal.SIGTERM or (exit_code == -signal.SIGKILL and not joined)):
        return "stopped"
    return "failed"


@dataclass(frozen=True)
class ExitOutcome:
    """How a worker ended, as its "exited" event says it."""

    exit_code: int | None
    """Its exit code (the one it announced, where that says more than its status); None if
    unknown."""
    reason: ExitReason
    message: str


def settle_exit(
    exit_code: int | None,
    announced: int | None,
    stop_requested: str | None = None,
    finished: bool = False,
    joined: bool = True,
) -> ExitOutcome:
    """Returns how a worker ended from its exit status `exit_code` (None: unknown, as for a
    worker this supervisor re-adopted and so is not the parent of), the code its "exiting" event
    `announced` (None: it wrote none), why it was asked to stop, if it was, whether its last
    reported step was the job's last (`finished`), and whether it ever `joined` a group.

    The announced code counts where the status says less: the status is unknown, or a signal
    ended the process after it announced (the "finished" stop's SIGTERM landing in the
    interpreter's teardown of a worker that completed does not make it "stopped"). A worker
    that reached the job's last step completed, whatever ended it. With neither a status nor an
    announcement the worker failed, and the message says its code is unknown."""
    if announced is not None and (exit_code is None or exit_code < 0):
        reason = exit_reason(announced)
        said = f"exit code {announced} ({reason})"
        if exit_code is None:
            return ExitOutcome(announced, reason, f"{said}, as it announced")
        after = f" after {stop_requested}" if stop_requested else ""
        return ExitOutcome(announced, reason, f"{said}; then {_killed_by(exit_code)} in its teardown{after}")
    if exit_code is None:
        if finished:
            return ExitOutcome(None, "completed", "exit code unknown; its last step was the job's last")
        return ExitOutcome(
            None,
            "failed",
            "exit code unknown: it ended while its agent was away (a re-adopted worker is not the "
            "agent's child) and announced none",
        )
    reason = exit_reason(exit_code, stop_requested is not None, joined)
    message = _describe_exit(exit_code, stop_requested)
    if finished and reason != "completed":
        return ExitOutcome(exit_code, "completed", f"{message}, after the job's last step")
    return ExitOutcome(exit_code, reason, message)


class WorkerProcess:
    """One worker of this node. Its identity (job, generation, rank) follows the generations it
    joins; its state moves only through its methods, each of which raises
    InvalidWorkerTransition from a state it may not act in. Thread-safe."""

    def __init__(
        self,
        job_id: int,
        generation: int,
        rank: int,
        device_index: int,
        stem: str,
        state: WorkerState = WorkerState.STARTING,
    ) -> None:
        self.job_id = job_id
        self.generation = generation
        self.rank = rank
        self.device_index = device_index
        self.stem = stem
        """Names its output file and its record (agent.records)."""
        self.state = state
        self.pid: int | None = None
        """None until it is spawned."""
        self.start_time: int | None = None
        self.process: Process | None = None
        """None for a worker re-adopted after an agent restart: the agent is not its parent. A
        ForkedProcess for one forked (or taken from a forked standby): the fork server is its
        parent, and keeps it unreaped until it is waited for here."""
        self.pidfd: int | None = None
        """Names its process while it runs, whoever its parent: the output reader waits on it,
        and a re-adopted worker is signalled through it."""
        self.joined = state is WorkerState.ADOPTED
        """It said "joined" (or was re-adopted, and may have): it may hold the training state."""
        self.stop_requested: str | None = None
        """Why it was asked to stop, if it was (while starting: the stop it gets once spawned)."""
        self.last_step: int | None = None
        self.total_steps: int | None = None
        self.announced_exit: int | None = None
        self.announced_user_error: UserError | None = None
        self.exit_code: int | None = None
        """Its exit status, once this supervisor (or the one that started it) reaped it."""
        self.read_offset = 0
        """Bytes of its output read so far, whole lines: their events are in the buffer or out."""
        self.delivered_offset = 0
        """Bytes of its output whose events reached the portal."""
        self.done = threading.Event()
        """Set by the supervisor once the worker is off its list: its "exited" event is out (after
        `settle`), or its spawn failed."""
        self._lock = threading.Lock()
        self._kill_timer: threading.Timer | None = None
        self._leave_timer: threading.Timer | None = None
        self._since = time.monotonic()

    @classmethod
    def adopted(cls, stem: str, record: WorkerRecord, pidfd: int | None) -> WorkerProcess:
        """A worker an earlier supervisor on the same state directory left, as its `record`
        says; `pidfd` names its process if that still runs (None: it is gone)."""
        worker = cls(
            record.job_id, record.generation, record.rank, record.device_index, stem, WorkerState.ADOPTED
        )
        worker.pid, worker.start_time, worker.pidfd = record.pid, record.start_time, pidfd
        worker.stop_requested = record.stop_requested
        worker.last_step, worker.total_steps = record.last_step, record.total_steps
        worker.announced_exit, worker.exit_code = record.announced_exit, record.exit_code
        worker.announced_user_error = record.announced_user_error
        worker.read_offset = worker.delivered_offset = record.offset
        return worker

    # --- what it is ------------------------------------------------------------------------

    @property
    def key(self) -> dict[str, int]:
        return {"job_id": self.job_id, "generation": self.generation, "rank": self.rank}

    @property
    def finished(self) -> bool:
        """Whether its last reported step was the job's last."""
        return (
            self.last_step is not None and self.total_steps is not None and self.last_step >= self.total_steps
        )

    @property
    def leaving(self) -> bool:
        return self.state is WorkerState.LEAVING

    def running_worker(self) -> RunningWorker | None:
        """It as the portal's reports list it; None while it has no process yet."""
        if self.pid is None:
            return None
        return RunningWorker(
            job_id=self.job_id,
            generation=self.generation,
            rank=self.rank,
            pid=self.pid,
            device_index=self.device_index,
        )

    def event(self, kind: str, **fields: Any) -> WorkerEvent:
        return WorkerEvent(
            job_id=self.job_id,
            generation=self.generation,
            rank=self.rank,
            kind=kind,  # type: ignore[arg-type]
            at=time.time(),
            **fields,
        )

    def record(self, output: str, launched_generation: int, stop_before_generation: int) -> WorkerRecord:
        """What agent.records keeps of it (with its job's generations, as the supervisor has them)."""
        assert self.pid is not None, "a worker not yet spawned has no record"
        return WorkerRecord(
            job_id=self.job_id,
            generation=self.generation,
            rank=self.rank,
            device_index=self.device_index,
            pid=self.pid,
            start_time=self.start_time,
            output=output,
            offset=self.delivered_offset,
            launched_generation=launched_generation,
            stop_before_generation=stop_before_generation,
            stop_requested=self.stop_requested,
            exit_code=self.exit_code,
            announced_exit=self.announced_exit,
            announced_user_error=self.announced_user_error,
            last_step=self.last_step,
            total_steps=self.total_steps,
        )

    def has_ended(self) -> bool:
        """Whether its process has exited (it is not reaped: its pid stays its own). Never blocks."""
        if self.process is None:
            if self.pidfd is None:
                return True
            readable, _, _ = select.select([self.pidfd], [], [], 0)
            return bool(readable)
        if isinstance(self.process, ForkedProcess):
            return self.process.ended
        try:
            return os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
        except ChildProcessError:
            return True

    # --- its life ----------------------------------------------------------------------------

    def _move(self, target: WorkerState, detail: str = "", only_from: WorkerState | None = None) -> None:
        """The one place its state changes (raises InvalidWorkerTransition; also where the move
        is listed but the caller's act is not that move: `only_from` another state). Call under
        its lock."""
        if only_from is not None and self.state is not only_from:
            raise InvalidWorkerTransition(self.state, target)
        check_worker_transition(self.state, target)
        now = time.monotonic()
        log.debug(
            "job %d generation %d rank %d (pid %s): %s -> %s after %.1f s%s",
            self.job_id,
            self.generation,
            self.rank,
            self.pid,
            self.state.value,
            target.value,
            now - self._since,
            f" ({detail})" if detail else "",
        )
        self.state, self._since = target, now

    def spawned(self, process: Process, start_time: int | None, pidfd: int | None) -> str | None:
        """starting -> warming: `process` runs it. Returns the stop it was asked for meanwhile, if
        any (the caller then `terminate`s it)."""
        with self._lock:
            self._move(WorkerState.WARMING)
            self.process, self.pid, self.start_time, self.pidfd = process, process.pid, start_time, pidfd
            pending, self.stop_requested = self.stop_requested, None
            return pending

    def spawn_failed(self) -> None:
        """starting -> exited: it never ran."""
        with self._lock:
            self._move(WorkerState.EXITED, only_from=WorkerState.STARTING)

    def heard(self, event: WorkerEvent) -> WorkerEvent | None:
        """Takes in an event its output printed: "exiting" says the code it exits with (kept for
        its "exited" event, and not reported: None is returned), "progress" its step, "joined" its
        new generation and rank (`said_joined`; the event reported carries its pid and device).
        Returns the event to report."""
        if event.kind == "exiting":
            self.announced_exit, self.announced_user_error = event.exit_code, event.user_error
            return None
        if event.kind == "progress" and event.step is not None:
            self.last_step = event.step
            self.total_steps = event.total_steps or self.total_steps
        elif event.kind == "joined":
            self.said_joined(event.generation, event.rank)
            return event.model_copy(update={"pid": self.pid, "device_index": self.device_index})
        return event

    def said_joined(self, generation: int, rank: int) -> None:
        """It joined `generation` as `rank` (adopted or warming -> joined)."""
        with self._lock:
            if self.state in (WorkerState.STARTING, WorkerState.EXITED):
                raise InvalidWorkerTransition(self.state, WorkerState.JOINED)
            if self.state in (WorkerState.ADOPTED, WorkerState.WARMING):
                self._move(WorkerState.JOINED, f"generation {generation}")
            self.generation, self.rank, self.joined = generation, rank, True

    def expect_to_leave(self, grace_s: float, why: str) -> None:
        """-> leaving: SIGKILLed `grace_s` from now unless it has left (or is kept) by then, with
        `why` as its stop. Nothing if it is leaving, stopping or gone already."""
        with self._lock:
            if self.state in (WorkerState.LEAVING, WorkerState.STOPPING, WorkerState.ENDED):
                return
            self._move(WorkerState.LEAVING)
            self._leave_timer = _timer(grace_s, self._leave_expired, why)

    def keep(self) -> None:
        """A newer launch keeps it: leaving -> joined (or warming, if it never joined). Nothing
        in any other state it may be in."""
        with self._lock:
            if self.state is not WorkerState.LEAVING:
                if self.state in (WorkerState.STARTING, WorkerState.EXITED):
                    raise InvalidWorkerTransition(self.state, WorkerState.WARMING)
                return
            self._move(WorkerState.JOINED if self.joined else WorkerState.WARMING)
            _cancel(self._leave_timer)
            self._leave_timer = None

    def terminate(self, why: str, grace_s: float) -> bool:
        """-> stopping: SIGTERM, and SIGKILL to its process group `grace_s` later. A worker still
        starting is stopped once spawned. Returns whether it was asked now (so that its record
        changed); False if it was asked before, or has gone."""
        with self._lock:
            if self.state is WorkerState.STARTING:
                self.stop_requested = self.stop_requested or why
                return False
            if not self.state.running or self.state is WorkerState.STOPPING:
                return False
            log.info(
                "stopping job %d generation %d rank %d (pid %s): %s",
                self.job_id,
                self.generation,
                self.rank,
                self.pid,
                why,
            )
            assert self.pid is not None
            try:
                if self.pidfd is not None and self.process is None:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGTERM)
                else:
                    os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                return False
            self._stopping(why, grace_s)
            return True

    def resume_stop(self, grace_s: float) -> None:
        """adopted -> stopping: its record says the last agent asked it to stop; the SIGKILL of
        that stop is armed again, `grace_s` from now."""
        with self._lock:
            assert self.stop_requested is not None
            self._stopping(self.stop_requested, grace_s)

    def _stopping(self, why: str, grace_s: float) -> None:
        self._move(WorkerState.STOPPING, why)
        self.stop_requested = why
        _cancel(self._leave_timer)
        self._kill_timer = _timer(grace_s, self._kill_after_grace, grace_s)

    def _kill_after_grace(self, grace_s: float) -> None:
        with self._lock:
            if not self.state.running:
                return
            log.warning(
                "job %d generation %d rank %d (pid %s) still running %.0f s after SIGTERM: SIGKILL",
                self.job_id,
                self.generation,
                self.rank,
                self.pid,
                grace_s,
            )
            self._kill_group()

    def _leave_expired(self, why: str) -> None:
        """leaving -> stopping, SIGKILL at once: it did not leave in time."""
        with self._lock:
            if self.state is not WorkerState.LEAVING:
                return
            self._move(WorkerState.STOPPING, why)
            self.stop_requested = why
            log.warning(
                "job %d generation %d rank %d (pid %s) %s: SIGKILL",
                self.job_id,
                self.generation,
                self.rank,
                self.pid,
                why,
            )
            self._kill_group()

    def _kill_group(self) -> None:
        if self.pid is not None:
            signal_group(self.pid, signal.SIGKILL)

    def ended(self) -> None:
        """-> ended: its process has exited (`has_ended`). Kills what it left in its process
        group (orphans that would hold on to its device) and disarms its timers; a re-adopted
        worker's pidfd is closed (from here its pid may be another process's)."""
        with self._lock:
            self._move(WorkerState.ENDED)
            if self.process is not None or self.pidfd is not None:
                # Unreaped (or, re-adopted, its group still holding a child it left): still ours.
                self._kill_group()
            _cancel(self._kill_timer)
            _cancel(self._leave_timer)
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None

    def settle(self) -> ExitOutcome:
        """ended -> exited: reaps it (a re-adopted one's exit code is its record's, if the agent
        that started it reaped it; else unknown) and returns how it ended."""
        with self._lock:
            self._move(WorkerState.EXITED, only_from=WorkerState.ENDED)
            if self.process is not None:
                self.exit_code = self.process.wait()
        outcome = settle_exit(
            self.exit_code, self.announced_exit, self.stop_requested, self.finished, self.joined
        )
        log.info(
            "job %d generation %d rank %d (pid %s) exited: %s",
            self.job_id,
            self.generation,
            self.rank,
            self.pid,
            outcome.message,
        )
        return outcome


def signal_group(pgid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _timer(delay_s: float, callback: Any, *args: Any) -> threading.Timer:
    timer = threading.Timer(delay_s, callback, args=args)
    timer.daemon = True
    timer.start()
    return timer


def _cancel(timer: threading.Timer | None) -> None:
    if timer is not None:
        timer.cancel()


def _killed_by(exit_code: int) -> str:
    """Says which signal a negative exit status stands for."""
    try:
        return f"killed by {signal.Signals(-exit_code).name}"
    except ValueError:
        return f"killed by signal {-exit_code}"


def _describe_exit(exit_code: int, stop_requested: str | None) -> str:
    what = _killed_by(exit_code) if exit_code < 0 else f"exit code {exit_code} ({exit_reason(exit_code)})"
    return f"{what} after {stop_requested}" if stop_requested else what
