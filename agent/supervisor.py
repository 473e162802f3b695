"""Starts, watches and stops this node's elastic workers.

Each worker is `python -m elastic.worker` in its own session, told what to do by a WorkerConfig
in its environment. Its stdout (stderr merged in) is read line by line and decoded by
elastic.membership.codec: a line that starts with WORKER_EVENT_PREFIX is a structured event, any
other line becomes a log event. The supervisor
adds the lifecycle events itself: "started" right after the spawn, "exited" once the process
and its output are gone, with the reason its exit code gives.

Commands are versioned by the job's generation. Per job the supervisor remembers the highest
generation it launched and the generation below which it was told to stop; a launch that is
not newer than both is ignored, so a repeated or late command changes nothing.

A resize happens in place (elastic.membership.redis): a newer launch starts only the joiners it
lists and leaves every running worker alone. Survivors switch generation by themselves and say
so with a "joined" event, after which the supervisor reports them under their new generation and
rank, with the same pid. Workers of the job on devices the launch does not keep are leavers:
they read the membership record and exit with LEFT_EXIT_CODE at the switch; one still running
`leave_grace_s` later is killed. A stop (cancel, finish, agent shutdown) is SIGTERM, SIGKILL
after the grace period.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import elastic
from agent.devices import DeviceBackend, DeviceError
from agent.events import EventBuffer
from elastic.membership.codec import decode
from elastic.wire import (
    ExitReason,
    LaunchCommand,
    RunningWorker,
    StopCommand,
    WorkerAssignment,
    WorkerConfig,
    WorkerEvent,
)
from elastic.worker import COMPLETED_EXIT_CODE, LEFT_EXIT_CODE, STOPPED_EXIT_CODE, WORKER_CONFIG_ENV

log = logging.getLogger(__name__)

_MAX_READ_BYTES = 64 * 1024
_REAP_AFTER_KILL_S = 10.0
_PROJECT_ROOT = str(Path(elastic.__file__).resolve().parent.parent)


def exit_reason(exit_code: int, stop_requested: bool = False) -> ExitReason:
    """Returns what a worker's exit code means: COMPLETED_EXIT_CODE (0) "completed",
    STOPPED_EXIT_CODE (75) "stopped", LEFT_EXIT_CODE (76) "left", anything else, a signal
    (negative) included, "failed".

    One exception: a worker killed by the SIGTERM the supervisor sent it (`stop_requested`)
    was "stopped". That is a worker still starting, before it could catch SIGTERM; it had
    trained nothing, so nothing was lost, and calling it a failure would read as a crash."""
    if exit_code == COMPLETED_EXIT_CODE:
        return "completed"
    if exit_code == LEFT_EXIT_CODE:
        return "left"
    if exit_code == STOPPED_EXIT_CODE or (stop_requested and exit_code == -signal.SIGTERM):
        return "stopped"
    return "failed"


@dataclass(frozen=True)
class SupervisorConfig:
    worker_module: str = "elastic.worker"
    """The module run as `python -m <worker_module>`; tests put a stand-in here."""
    python: str = sys.executable
    stop_grace_s: float = 30.0
    """How long a worker has, after SIGTERM, to finish its step and save before SIGKILL."""
    leave_grace_s: float = 120.0
    """How long a leaver may go on after the launch that left it out: the switch waits for the
    joiners to warm up, so this is generous. A leaver still there afterwards is killed."""
    node_name: str = field(default_factory=socket.gethostname)
    """This node's name, as the portal knows it: workers are named by it in membership records."""
    event_capacity: int = 10_000
    """Events held between two drains; see EventBuffer for what is dropped first."""


@dataclass
class _Worker:
    job_id: int
    generation: int
    rank: int
    device_index: int
    process: subprocess.Popen[bytes]
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the worker is reaped and its "exited" event is out."""
    # Held while signalling or reaping, so that a signal never reaches a recycled pid.
    lock: threading.Lock = field(default_factory=threading.Lock)
    reaped: bool = False
    stop_requested: str | None = None
    kill_timer: threading.Timer | None = None
    leave_timer: threading.Timer | None = None
    last_step: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def key(self) -> dict[str, int]:
        return {"job_id": self.job_id, "generation": self.generation, "rank": self.rank}

    def event(self, kind: Literal["started", "exited"], **fields: Any) -> WorkerEvent:
        return WorkerEvent(
            job_id=self.job_id,
            generation=self.generation,
            rank=self.rank,
            kind=kind,
            at=time.time(),
            **fields,
        )


@dataclass
class _Job:
    launched_generation: int = 0
    stop_before_generation: int = 0


class WorkerSupervisor:
    """The node's workers. Every public method is thread-safe and returns promptly, except
    shutdown(), which waits for the workers to exit."""

    def __init__(
        self, config: SupervisorConfig | None = None, on_exit: Callable[[], None] | None = None
    ) -> None:
        self.config = config or SupervisorConfig()
        self._on_exit = on_exit
        self._jobs: dict[int, _Job] = {}
        self._workers: list[_Worker] = []
        self._threads: set[threading.Thread] = set()
        self._events = EventBuffer(self.config.event_capacity)
        self._closed = False
        self._lock = threading.RLock()

    # --- commands ----------------------------------------------------------------------------

    def launch(self, command: LaunchCommand, backend: DeviceBackend, redis_url: str) -> bool:
        """Starts the joiners of `command.generation` here (their membership board is at
        `redis_url`) and sets leavers a deadline; survivors go on untouched. Returns False, and
        does nothing, if that generation was already launched or passed, or the supervisor is
        shut down."""
        with self._lock:
            job = self._jobs.setdefault(command.job_id, _Job())
            if self._closed:
                log.warning("ignoring launch of job %d: shutting down", command.job_id)
                return False
            if command.generation <= job.launched_generation:
                log.info(
                    "ignoring launch of job %d generation %d: generation %d already launched",
                    command.job_id,
                    command.generation,
                    job.launched_generation,
                )
                return False
            if command.generation < job.stop_before_generation:
                log.info(
                    "ignoring launch of job %d generation %d: told to stop below generation %d",
                    command.job_id,
                    command.generation,
                    job.stop_before_generation,
                )
                return False
            job.launched_generation = command.generation
            mine = [w for w in self._workers if w.job_id == command.job_id and not w.done.is_set()]
            for worker in mine:
                if worker.device_index in command.members:
                    self._cancel_leave(worker)
                else:
                    self._expect_to_leave(worker, command.generation)
            # Spawning under the lock: a stop that arrives now sees every new worker.
            busy = {worker.device_index for worker in mine if worker.leave_timer is None}
            for assignment in command.workers:
                if assignment.device_index in busy:
                    log.info(
                        "job %d generation %d: device %d already runs a worker of the job; it joins",
                        command.job_id,
                        command.generation,
                        assignment.device_index,
                    )
                    continue
                self._spawn(command, assignment, backend, redis_url)
        return True

    def stop(self, command: StopCommand) -> int:
        """Asks the job's workers here whose generation is below `command.before_generation`
        (on `command.devices`, if given) to stop (SIGTERM; SIGKILL after the grace period).
        A stop of the whole job also ignores later launches below that generation. Returns how
        many workers were asked; their exits are reported when they happen."""
        with self._lock:
            job = self._jobs.setdefault(command.job_id, _Job())
            if command.devices is None:
                job.stop_before_generation = max(job.stop_before_generation, command.before_generation)
            targets = [
                worker
                for worker in self._workers
                if worker.job_id == command.job_id
                and worker.generation < command.before_generation
                and (command.devices is None or worker.device_index in command.devices)
            ]
        for worker in targets:
            self._terminate(worker, f"stop ({command.reason})")
        return len(targets)

    # --- state -------------------------------------------------------------------------------

    def running(self) -> list[RunningWorker]:
        """Returns the workers whose exit has not been reported yet."""
        with self._lock:
            return [
                RunningWorker(
                    job_id=worker.job_id,
                    generation=worker.generation,
                    rank=worker.rank,
                    pid=worker.pid,
                    device_index=worker.device_index,
                )
                for worker in self._workers
                if not worker.done.is_set()
            ]

    def drain_events(self) -> list[WorkerEvent]:
        """Removes and returns the events since the last drain, oldest first."""
        return self._events.take()

    @property
    def dropped_events(self) -> int:
        return self._events.dropped

    def shutdown(self, grace_s: float | None = None) -> None:
        """Refuses further launches, stops every worker (SIGTERM, SIGKILL after `grace_s`,
        default the configured grace) and waits for them to exit."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        # Launch threads spawn under the lock and only while not closed, so `workers` is all
        # there will ever be; a launch thread still stopping older workers ends with them.
        self._stop_and_wait(workers, "agent shutting down", grace_s)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=self.config.stop_grace_s + _REAP_AFTER_KILL_S)

    # --- launching ---------------------------------------------------------------------------

    def _spawn(
        self, command: LaunchCommand, assignment: WorkerAssignment, backend: DeviceBackend, redis_url: str
    ) -> None:
        def failed(message: str) -> None:
            log.error(
                "job %d generation %d rank %d: %s",
                command.job_id,
                command.generation,
                assignment.rank,
                message,
            )
            self._events.add(
                WorkerEvent(
                    job_id=command.job_id,
                    generation=command.generation,
                    rank=assignment.rank,
                    kind="exited",
                    at=time.time(),
                    device_index=assignment.device_index,
                    reason="failed",
                    message=message,
                )
            )

        try:
            placement = backend.placement(assignment.device_index)
        except DeviceError as err:
            failed(f"cannot place the worker: {err}")
            return
        config = WorkerConfig(
            job_id=command.job_id,
            generation=command.generation,
            rank=assignment.rank,
            world_size=command.world_size,
            master_addr=command.master_addr,
            master_port=command.master_port,
            device=placement.device,
            spec=command.spec,
            run_dir=command.run_dir,
            node=self.config.node_name,
            device_index=assignment.device_index,
            redis_url=redis_url,
            coordination_key=command.coordination_key,
        )
        python_path = os.pathsep.join(path for path in (_PROJECT_ROOT, os.environ.get("PYTHONPATH")) if path)
        env = {
            **os.environ,
            **placement.env,
            WORKER_CONFIG_ENV: config.model_dump_json(),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": python_path,
        }
        argv = [self.config.python, "-m", self.config.worker_module]
        try:
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as err:
            failed(f"cannot start {' '.join(argv)}: {err}")
            return
        if placement.cpu_affinity:
            try:
                os.sched_setaffinity(process.pid, placement.cpu_affinity)
            except OSError as err:
                log.warning(
                    "could not pin pid %d to cores %s: %s", process.pid, sorted(placement.cpu_affinity), err
                )
        worker = _Worker(
            job_id=command.job_id,
            generation=command.generation,
            rank=assignment.rank,
            device_index=assignment.device_index,
            process=process,
        )
        self._workers.append(worker)
        log.info(
            "started job %d generation %d rank %d on device %d: pid %d",
            worker.job_id,
            worker.generation,
            worker.rank,
            worker.device_index,
            worker.pid,
        )
        self._events.add(worker.event("started", pid=worker.pid, device_index=worker.device_index))
        reader = self._start_thread(f"read-{worker.pid}", lambda: self._read(worker))
        self._start_thread(f"watch-{worker.pid}", lambda: self._watch(worker, reader))

    def _start_thread(self, name: str, target: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except Exception:
                log.exception("thread %s failed", name)
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return thread

    # --- watching ----------------------------------------------------------------------------

    def _read(self, worker: _Worker) -> None:
        stdout = worker.process.stdout
        assert stdout is not None
        with stdout:
            for raw in iter(lambda: stdout.readline(_MAX_READ_BYTES), b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if not line.strip():
                    continue
                event = decode(worker.key, line)
                if event.kind == "progress" and event.step is not None:
                    worker.last_step = event.step
                elif event.kind == "joined":
                    with self._lock:
                        worker.generation, worker.rank = event.generation, event.rank
                    event = event.model_copy(update={"pid": worker.pid, "device_index": worker.device_index})
                self._events.add(event)

    def _watch(self, worker: _Worker, reader: threading.Thread) -> None:
        try:
            # Wait without reaping, so that the pid (and its process group) stays ours.
            os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        with worker.lock:
            # Children the worker left behind would hold its stdout open; they are orphans.
            _signal_group(worker.pid, signal.SIGKILL)
        reader.join(timeout=_REAP_AFTER_KILL_S)
        with worker.lock:
            exit_code = worker.process.wait()
            worker.reaped = True
            for timer in (worker.kill_timer, worker.leave_timer):
                if timer is not None:
                    timer.cancel()
        reason = exit_reason(exit_code, worker.stop_requested is not None)
        message = _describe_exit(exit_code, worker.stop_requested)
        log.info(
            "job %d generation %d rank %d (pid %d) exited: %s",
            worker.job_id,
            worker.generation,
            worker.rank,
            worker.pid,
            message,
        )
        self._events.add(
            worker.event(
                "exited",
                pid=worker.pid,
                device_index=worker.device_index,
                exit_code=exit_code,
                reason=reason,
                step=worker.last_step,
                message=message,
            )
        )
        with self._lock:
            self._workers.remove(worker)
        worker.done.set()
        if self._on_exit is not None:
            self._on_exit()

    # --- stopping ----------------------------------------------------------------------------

    def _terminate(self, worker: _Worker, why: str, grace_s: float | None = None) -> None:
        """Sends SIGTERM once and arms a SIGKILL for when the grace period is over."""
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        with worker.lock:
            if worker.reaped or worker.stop_requested is not None:
                return
            worker.stop_requested = why
            log.info(
                "stopping job %d generation %d rank %d (pid %d): %s",
                worker.job_id,
                worker.generation,
                worker.rank,
                worker.pid,
                why,
            )
            try:
                os.kill(worker.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            worker.kill_timer = threading.Timer(grace, self._kill, args=(worker, grace))
            worker.kill_timer.daemon = True
            worker.kill_timer.start()

    def _expect_to_leave(self, worker: _Worker, generation: int) -> None:
        """Arms the kill of a leaver that has not left `leave_grace_s` from now (lock held)."""
        if worker.leave_timer is not None or worker.stop_requested is not None:
            return
        why = f"did not leave within {self.config.leave_grace_s:g} s of generation {generation}"
        worker.leave_timer = threading.Timer(self.config.leave_grace_s, self._kill_leaver, args=(worker, why))
        worker.leave_timer.daemon = True
        worker.leave_timer.start()

    def _cancel_leave(self, worker: _Worker) -> None:
        """A newer generation keeps the worker after all (lock held)."""
        if worker.leave_timer is not None:
            worker.leave_timer.cancel()
            worker.leave_timer = None

    def _kill_leaver(self, worker: _Worker, why: str) -> None:
        with worker.lock:
            if worker.reaped or worker.stop_requested is not None:
                return
            worker.stop_requested = why
            log.warning(
                "job %d generation %d rank %d (pid %d) %s: SIGKILL",
                worker.job_id,
                worker.generation,
                worker.rank,
                worker.pid,
                why,
            )
            _signal_group(worker.pid, signal.SIGKILL)

    def _kill(self, worker: _Worker, grace_s: float) -> None:
        with worker.lock:
            if worker.reaped:
                return
            log.warning(
                "job %d generation %d rank %d (pid %d) still running %.0f s after SIGTERM: SIGKILL",
                worker.job_id,
                worker.generation,
                worker.rank,
                worker.pid,
                grace_s,
            )
            _signal_group(worker.pid, signal.SIGKILL)

    def _stop_and_wait(self, workers: list[_Worker], why: str, grace_s: float | None = None) -> None:
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        for worker in workers:
            self._terminate(worker, why, grace)
        # A worker already asked to stop keeps its own, earlier deadline; this one is a bound.
        deadline = time.monotonic() + grace + _REAP_AFTER_KILL_S
        for worker in workers:
            if not worker.done.wait(timeout=max(0.0, deadline - time.monotonic())):
                log.error("pid %d did not go away even after SIGKILL", worker.pid)


def _describe_exit(exit_code: int, stop_requested: str | None) -> str:
    if exit_code < 0:
        try:
            what = f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            what = f"killed by signal {-exit_code}"
    else:
        what = f"exit code {exit_code} ({exit_reason(exit_code)})"
    return f"{what} after {stop_requested}" if stop_requested else what


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
