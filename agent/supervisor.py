"""Starts, watches and stops this node's elastic workers, and takes them back after the agent
itself died and started again.

Each worker is `python -m elastic.worker` in its own session, told what to do by a WorkerConfig
in its environment. Its stdout and stderr are appended to a file in the agent's state directory,
never to a pipe, so that a worker trains on when its agent dies (nothing the agent holds can kill
it: no pipe to break, no shared process group, no parent-death signal). The supervisor tails the
file and decodes each line with elastic.membership.codec: a line that starts with
WORKER_EVENT_PREFIX is a structured event, any other line becomes a log event. The supervisor
adds the lifecycle events itself: "started" right after the spawn, "exited" once the process and
its output are gone, with the reason its exit code gives.

Commands are versioned by the job's generation. Per job the supervisor remembers the highest
generation it launched and the generation below which it was told to stop; a launch that is
not newer than both is ignored, so a repeated or late command changes nothing.

A resize happens in place (elastic.worker.membership): a newer launch starts only the joiners it
lists and leaves every running worker alone. Survivors switch generation by themselves and say
so with a "joined" event, after which the supervisor reports them under their new generation and
rank, with the same pid. Workers of the job on devices the launch does not keep are leavers:
they read the membership record and exit with LEFT_EXIT_CODE at the switch; one still running
`leave_grace_s` later is killed. A stop (cancel, finish, agent shutdown) is SIGTERM, SIGKILL
after the grace period.

Re-adoption (agent.records): every worker has a record on disk: its key, pid and process start
time, its output file and how far the portal has its events, and its job's generations. A new
supervisor on the same state directory `adopt()`s the workers whose process still runs: it tails
their output from where the portal's knowledge ends and watches their exit through a pidfd, as it
is not their parent. Their exit status is then the code of the "exiting" event they write last;
one that vanished without it failed, with an unknown code. Records of workers that ended while no
agent ran are reported as exited once. A record goes when the "exited" event of its worker has
reached the portal (`events_delivered`).
"""

from __future__ import annotations

import functools
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

import elastic
from agent.devices import DeviceBackend, DeviceError, WorkerPlacement
from agent.events import EventBuffer
from agent.records import RecordStore, WorkerRecord, open_process, process_start_time
from agent.standby import StandbyPool
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
from elastic.worker import (
    COMPLETED_EXIT_CODE,
    LEFT_EXIT_CODE,
    STOPPED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    WORKER_CONFIG_ENV,
)
from elastic.worker.forkserver import ForkedProcess

log = logging.getLogger(__name__)

_MAX_READ_BYTES = 64 * 1024
_REAP_AFTER_KILL_S = 10.0
_TAIL_EVERY_S = 0.05
"""How often a worker's output file is read while it has nothing new."""
_PROJECT_ROOT = str(Path(elastic.__file__).resolve().parent.parent)


AGENT_SECRETS = ("BUNGEE_AGENT_TOKEN", "BUNGEE_AGENT_TOKEN_FILE")
"""What the agent's environment holds that no worker, and so no job's code, may read."""


def process_environment() -> dict[str, str]:
    """The agent's environment without its secrets: what a worker or an export starts with."""
    return {name: value for name, value in os.environ.items() if name not in AGENT_SECRETS}


def socket_interface_env(address: str, environ: Mapping[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming the interface that holds `address` (an
    IP or a host name), unless `environ` sets them already. Without them gloo listens on what
    the machine's host name resolves to, often 127.0.0.1, which peers on other hosts cannot
    reach. Empty if no interface holds the address (it is then a NAT's or a proxy's)."""
    interface = interface_holding(address)
    if interface is None:
        return {}
    return {name: interface for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in environ}


@functools.cache
def interface_holding(address: str) -> str | None:
    """The name of this machine's network interface that holds `address` (resolved once), or
    None."""
    try:
        ips = {str(info[4][0]) for info in socket.getaddrinfo(address, None)}
    except OSError:
        return None
    for interface, addresses in psutil.net_if_addrs().items():
        if any(a.address in ips for a in addresses):
            return interface
    return None


def python_path() -> str:
    """PYTHONPATH for a process of the runtime (a worker, an export): the project first."""
    return os.pathsep.join(path for path in (_PROJECT_ROOT, os.environ.get("PYTHONPATH")) if path)


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


@dataclass(frozen=True)
class SupervisorConfig:
    worker_module: str = "elastic.worker"
    """The module run as `python -m <worker_module>`; tests put a stand-in here."""
    python: str = sys.executable
    stop_grace_s: float = 30.0
    """How long a worker has, after SIGTERM, to finish its step and save before SIGKILL."""
    warming_stop_grace_s: float = 3.0
    """The same for a worker that never joined a group: it holds no state, so it has nothing to
    save (it exits at once on SIGTERM); one that hangs while warming up is killed this soon."""
    leave_grace_s: float = 120.0
    """How long a leaver may go on after the launch that left it out: the switch waits for the
    joiners to warm up, so this is generous. A leaver still there afterwards is killed."""
    node_name: str = field(default_factory=socket.gethostname)
    """This node's name, as the portal knows it: workers are named by it in membership records."""
    node_address: str = "127.0.0.1"
    """Where workers on other nodes reach this node's (the agent's --address): the workers'
    collectives listen on the interface that holds it (socket_interface_env)."""
    event_capacity: int = 10_000
    """Events held between two drains; see EventBuffer for what is dropped first."""
    state_dir: Path | None = None
    """Where the workers' output files and records live (agent.records): a supervisor started
    on the directory an earlier one used re-adopts the workers it left. None: a temporary
    directory of this supervisor's own, so nothing outlives it."""
    standbys: int = 0
    """Keep a warm standby worker on each free device (agent.standby), up to this many (0:
    none); `keep_standbys` says which devices are free. The agent keeps up to 8 unless told
    otherwise (--standbys)."""
    prepared_per_job: int = 0
    """Prepare up to this many of those standbys for each job that may grow on this node (its
    model built before a worker is asked for: agent.standby); 0: none. The agent prepares up to
    2 unless told otherwise (--prepared-standbys)."""
    fork_standbys: bool = False
    """Fork the standbys of CPU slots from the node's fork server (elastic.worker.forkserver)
    rather than start each as a new interpreter. The agent does unless told otherwise
    (--standby-start)."""


@dataclass
class _Worker:
    job_id: int
    generation: int
    rank: int
    device_index: int
    pid: int
    stem: str
    """Names its output file and its record (agent.records)."""
    start_time: int | None
    process: subprocess.Popen[bytes] | ForkedProcess | None = None
    """None for a worker this supervisor re-adopted: it is not its parent. A ForkedProcess for
    one taken from a forked standby: the fork server is its parent, and keeps it unreaped until
    it is waited for here."""
    pidfd: int | None = None
    """A re-adopted worker's process while it runs: waited on and signalled without a pid race."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the worker is reaped and its "exited" event is out."""
    gone: threading.Event = field(default_factory=threading.Event)
    """Set once the process has exited and its leftover children are killed: its output is
    complete."""
    # Held while signalling or reaping, so that a signal never reaches a recycled pid.
    lock: threading.Lock = field(default_factory=threading.Lock)
    reaped: bool = False
    stop_requested: str | None = None
    kill_timer: threading.Timer | None = None
    leave_timer: threading.Timer | None = None
    last_step: int | None = None
    total_steps: int | None = None
    joined: bool = False
    """It said "joined" (or was re-adopted, and may have): it may hold the training state."""
    announced_exit: int | None = None
    exit_code: int | None = None
    """Its exit status, once this supervisor (or the one that started it) reaped it."""
    read_offset: int = 0
    """Bytes of its output read so far, whole lines: their events are in the buffer or out."""
    delivered_offset: int = 0
    """Bytes of its output whose events reached the portal."""

    @property
    def key(self) -> dict[str, int]:
        return {"job_id": self.job_id, "generation": self.generation, "rank": self.rank}

    @property
    def finished(self) -> bool:
        """Whether its last reported step was the job's last."""
        return (
            self.last_step is not None and self.total_steps is not None and self.last_step >= self.total_steps
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


RESIZE_QUIET_S = 2.0
"""Standbys are prepared only this long after a worker here joined a generation (and never while
one has not yet): the resize's transfer and first step have the node's memory to themselves."""


@dataclass
class _Job:
    launched_generation: int = 0
    stop_before_generation: int = 0
    launch: _Launch | None = None
    """The newest generation launched here: what a standby prepared for the job is given."""
    deferred: dict[int, WorkerAssignment] = field(default_factory=dict)
    """Device index -> the joiner of the newest launch not started there because an older
    worker of the job still ran on the device (the portal had given it up: its node was lost).
    That worker joins the generation if it can; if it exits instead, the joiner starts then."""


@dataclass(frozen=True)
class _Launch:
    command: LaunchCommand
    backend: DeviceBackend
    redis_url: str
    code_dir: Path | None
    initial_model: Path | None
    python: str | None = None
    """The interpreter of the job's own environment (agent.environments); None: the node's."""


class WorkerSupervisor:
    """The node's workers. Every public method is thread-safe and returns promptly, except
    shutdown(), which waits for the workers to exit."""

    def __init__(
        self, config: SupervisorConfig | None = None, on_exit: Callable[[], None] | None = None
    ) -> None:
        self.config = config or SupervisorConfig()
        self._on_exit = on_exit
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        state_dir = self.config.state_dir
        if state_dir is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="bungee-agent-", ignore_cleanup_errors=True)
            state_dir = Path(self._scratch.name)
        self.state_dir = state_dir
        """Where the agent keeps what outlives it: worker records, jobs' code."""
        self._records = RecordStore(state_dir / "workers")
        self._standbys = (
            StandbyPool(
                state_dir / "standby",
                self.config.python,
                self.config.worker_module,
                self.config.standbys,
                self.config.prepared_per_job,
                fork=self.config.fork_standbys,
            )
            if self.config.standbys > 0
            else None
        )
        self._jobs: dict[int, _Job] = {}
        self._last_join = -RESIZE_QUIET_S
        """When a worker here last said "joined" (time.monotonic)."""
        self._workers: list[_Worker] = []
        self._threads: set[threading.Thread] = set()
        self._events = EventBuffer(self.config.event_capacity)
        self._closed = False
        self._lock = threading.RLock()
        self._ended: list[_Worker] = []
        """Workers whose "exited" event is in the buffer."""
        self._drained: dict[str, tuple[_Worker, int]] = {}
        """Since the last events_delivered: per worker, how far its output was read at the latest
        drain."""
        self._drained_ended: list[_Worker] = []
        """Since the last events_delivered: workers whose "exited" event was drained."""

    # --- commands ----------------------------------------------------------------------------

    def launch(
        self,
        command: LaunchCommand,
        backend: DeviceBackend,
        redis_url: str,
        code_dir: Path | None = None,
        initial_model: Path | None = None,
        python: str | None = None,
    ) -> bool:
        """Starts the joiners of `command.generation` here (their membership board is at
        `redis_url`; a job with code of its own runs it from `code_dir`, with the interpreter of
        its own environment `python` if it has one; one that starts from
        another job's model finds it at `initial_model`) and sets leavers a
        deadline; survivors go on untouched. Returns False, and does nothing, if that generation
        was already launched or passed, or the supervisor is shut down."""
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
            job.launch = _Launch(command, backend, redis_url, code_dir, initial_model, python)
            job.deferred = {}
            mine = [w for w in self._workers if w.job_id == command.job_id and not w.done.is_set()]
            for worker in mine:
                if worker.device_index in command.members:
                    self._cancel_leave(worker)
                else:
                    self._expect_to_leave(worker, command.generation)
                self._persist(worker)
            # Spawning under the lock: a stop that arrives now sees every new worker.
            busy = {worker.device_index for worker in mine if worker.leave_timer is None}
            for assignment in command.workers:
                if assignment.device_index in busy:
                    log.info(
                        "job %d generation %d: device %d already runs a worker of the job; it joins (or, "
                        "if it exits first, a new one starts)",
                        command.job_id,
                        command.generation,
                        assignment.device_index,
                    )
                    job.deferred[assignment.device_index] = assignment
                    continue
                self._spawn(command, assignment, backend, redis_url, code_dir, initial_model, python)
        return True

    def launch_failed(self, command: LaunchCommand, message: str, reason: ExitReason = "failed") -> None:
        """Reports that none of the workers `command` would start here could start (`reason`
        "user_error": through the job's fault, so that it fails at once)."""
        for assignment in command.workers:
            self._start_failed(command, assignment, message, reason)

    def job_log(self, command: LaunchCommand, line: str) -> None:
        """Adds `line` to the log of `command`'s job, as its first worker here (what the agent
        does for the job before a worker runs: building its environment)."""
        if command.workers:
            with self._lock:
                self._events.add(WorkerEvent(job_id=command.job_id, generation=command.generation,
                                             rank=command.workers[0].rank, kind="log", at=time.time(), message=line))

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
            self._terminate(worker, f"stop ({command.reason})", self._grace(worker))
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

    def keep_standbys(self, backend: DeviceBackend, taken: set[int]) -> None:
        """Keeps a warm standby on each device of `backend` that runs no worker of ours and is
        not in `taken` (its owner is there), and none on any other. Does nothing unless
        standbys are on."""
        with self._lock:
            if self._standbys is None:
                return
            if self._closed:
                self._standbys.close()
                return
            busy = {worker.device_index for worker in self._workers if not worker.done.is_set()}
            free = [device.index for device in backend.devices() if device.index not in busy | taken]
            placements = {}
            for index in free:
                try:
                    placements[index] = backend.placement(index)
                except DeviceError as err:
                    log.warning("no standby on device %d: %s", index, err)
            self._standbys.keep(placements, self._worker_env(), self._growing(), self._prepared_env, self._quiet())

    def _quiet(self) -> bool:
        """Whether no resize is under way on this node: every worker here has joined its
        generation, the last of them at least RESIZE_QUIET_S ago (its first step is done)."""
        live = [worker for worker in self._workers if not worker.done.is_set()]
        return all(worker.joined for worker in live) and time.monotonic() - self._last_join >= RESIZE_QUIET_S

    def _growing(self) -> list[int]:
        """The jobs a standby may be prepared for, by id: those with a worker here whose newest
        generation launched here has fewer workers than the job's most."""
        live = {worker.job_id for worker in self._workers if not worker.done.is_set()}
        return [
            job_id
            for job_id, job in sorted(self._jobs.items())
            if job_id in live
            and job.launch is not None
            and job.launch.python is None  # a standby runs the node's environment, not the job's
            and job.launch.command.world_size < int(job.launch.command.spec.get("max_workers", 0))
        ]

    def _prepared_env(self, job_id: int, device_index: int, placement: WorkerPlacement) -> dict[str, str]:
        """The environment of the worker job `job_id` would start on `device_index` if it grew
        by one: its newest launch here, one rank more (provisional: a worker takes its rank and
        generation when it enters one)."""
        launch = self._jobs[job_id].launch
        assert launch is not None
        command = launch.command
        config = self._worker_config(
            command,
            WorkerAssignment(rank=command.world_size, device_index=device_index),
            placement,
            launch.redis_url,
            launch.code_dir,
            launch.initial_model,
            generation=command.generation + 1,
            world_size=command.world_size + 1,
        )
        return {**self._worker_env(), **placement.env, WORKER_CONFIG_ENV: config.model_dump_json()}

    def standby_pids(self) -> dict[int, int]:
        """pid -> device index of the standbys waiting: processes of ours, not an owner's."""
        with self._lock:
            return self._standbys.pids() if self._standbys is not None else {}

    def drain_events(self) -> list[WorkerEvent]:
        """Removes and returns the events since the last drain, oldest first."""
        with self._lock:
            events = self._events.take()
            for worker in self._workers:
                self._drained[worker.stem] = (worker, worker.read_offset)
            self._drained_ended += self._ended
            self._ended = []
        return events

    def events_delivered(self) -> None:
        """Says that every event drained so far reached the portal (or was given up on): a
        supervisor that re-adopts the workers reads their output on from there, and the records
        of workers whose "exited" event was among them are removed."""
        with self._lock:
            drained, self._drained = self._drained, {}
            ended, self._drained_ended = self._drained_ended, []
            for worker, offset in drained.values():
                if offset > worker.delivered_offset and worker not in ended:
                    worker.delivered_offset = offset
                    self._persist(worker)
            for worker in ended:
                self._records.remove(worker.stem)

    @property
    def dropped_events(self) -> int:
        return self._events.dropped

    def adopt(self) -> list[RunningWorker]:
        """Takes over the workers an earlier supervisor on the same state directory left (see
        the module's docstring). Those still running are watched and their output is read on
        from where the portal's knowledge of it ends; those that ended meanwhile are reported as
        exited. Returns the workers now running. Call it once, before the first launch."""
        adopted: list[_Worker] = []
        with self._lock:
            for stem, record in self._records.load().items():
                job = self._jobs.setdefault(record.job_id, _Job())
                job.launched_generation = max(job.launched_generation, record.launched_generation)
                job.stop_before_generation = max(job.stop_before_generation, record.stop_before_generation)
                pidfd = open_process(record.pid, record.start_time) if record.exit_code is None else None
                worker = _Worker(
                    job_id=record.job_id,
                    generation=record.generation,
                    rank=record.rank,
                    device_index=record.device_index,
                    pid=record.pid,
                    stem=stem,
                    start_time=record.start_time,
                    pidfd=pidfd,
                    reaped=pidfd is None,
                    stop_requested=record.stop_requested,
                    last_step=record.last_step,
                    total_steps=record.total_steps,
                    joined=True,
                    announced_exit=record.announced_exit,
                    exit_code=record.exit_code,
                    read_offset=record.offset,
                    delivered_offset=record.offset,
                )
                self._workers.append(worker)
                adopted.append(worker)
                log.info(
                    "job %d generation %d rank %d (pid %d): %s",
                    worker.job_id,
                    worker.generation,
                    worker.rank,
                    worker.pid,
                    "re-adopted" if pidfd is not None else "ended while no agent ran",
                )
        for worker in adopted:
            reader = self._start_thread(f"read-{worker.pid}", functools.partial(self._tail, worker))
            self._start_thread(f"watch-{worker.pid}", functools.partial(self._watch_adopted, worker, reader))
            if worker.stop_requested is not None and not worker.reaped:
                with worker.lock:
                    self._arm_kill(worker, self.config.stop_grace_s)
        return [
            RunningWorker(
                job_id=w.job_id, generation=w.generation, rank=w.rank, pid=w.pid, device_index=w.device_index
            )
            for w in adopted
            if not w.reaped
        ]

    def shutdown(self, grace_s: float | None = None) -> None:
        """Refuses further launches, stops every worker (SIGTERM, SIGKILL after `grace_s`,
        default each worker's grace: a worker that never joined gets the short one) and waits
        for them to exit."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        # Launch threads spawn under the lock and only while not closed, so `workers` is all
        # there will ever be; a launch thread still stopping older workers ends with them.
        if self._standbys is not None:
            with self._lock:
                self._standbys.close()
        self._stop_and_wait(workers, "agent shutting down", grace_s)
        if self._standbys is not None:
            with self._lock:
                self._standbys.close_forkserver()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=self.config.stop_grace_s + _REAP_AFTER_KILL_S)

    # --- launching ---------------------------------------------------------------------------

    def _start_failed(
        self, command: LaunchCommand, assignment: WorkerAssignment, message: str, reason: ExitReason = "failed"
    ) -> None:
        log.error("job %d generation %d rank %d: %s", command.job_id, command.generation, assignment.rank, message)
        self._events.add(
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

    def _spawn(
        self,
        command: LaunchCommand,
        assignment: WorkerAssignment,
        backend: DeviceBackend,
        redis_url: str,
        code_dir: Path | None = None,
        initial_model: Path | None = None,
        python: str | None = None,
    ) -> None:
        def failed(message: str) -> None:
            self._start_failed(command, assignment, message)

        try:
            placement = backend.placement(assignment.device_index)
        except DeviceError as err:
            failed(f"cannot place the worker: {err}")
            return
        config = self._worker_config(command, assignment, placement, redis_url, code_dir, initial_model)
        env = {**self._worker_env(), **placement.env, WORKER_CONFIG_ENV: config.model_dump_json()}
        argv = [python or self.config.python, "-m", self.config.worker_module]
        stem = f"job{command.job_id}-gen{command.generation}-rank{assignment.rank}-{uuid.uuid4().hex[:8]}"
        output_path = self._records.output_path(stem)
        try:
            # A file, not a pipe: the worker must outlive the agent. Its own session keeps it out
            # of the agent's process group and away from the agent's terminal.
            with output_path.open("ab") as output:
                # Standbys and the fork server run the node's environment: a job with its own
                # starts a new interpreter of it (docs/operator/environments.md: what a grow costs).
                pool = self._standbys if python is None else None
                standby = (
                    pool.take(assignment.device_index, placement, output_path, env, command.job_id)
                    if pool is not None
                    else None
                )
                forked = (
                    pool.fork_worker(self.config.worker_module, placement, output.fileno(), env)
                    if standby is None and pool is not None
                    else None
                )
                process: subprocess.Popen[bytes] | ForkedProcess
                if standby is not None:
                    process = standby.process
                elif forked is not None:
                    process = forked
                else:
                    process = subprocess.Popen(
                        argv,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
        except OSError as err:
            self._records.remove(stem)
            failed(f"cannot start {' '.join(argv)}: {err}")
            return
        if placement.cpu_affinity and standby is None:
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
            pid=process.pid,
            stem=stem,
            start_time=process_start_time(process.pid),
            process=process,
        )
        self._workers.append(worker)
        self._persist(worker)
        log.info(
            "started job %d generation %d rank %d on device %d: pid %d%s",
            worker.job_id,
            worker.generation,
            worker.rank,
            worker.device_index,
            worker.pid,
            " (a warm standby)" if standby is not None else " (forked)" if forked is not None else "",
        )
        self._events.add(worker.event("started", pid=worker.pid, device_index=worker.device_index))
        reader = self._start_thread(f"read-{worker.pid}", lambda: self._tail(worker))
        self._start_thread(f"watch-{worker.pid}", lambda: self._watch_child(worker, reader))

    def _worker_config(
        self,
        command: LaunchCommand,
        assignment: WorkerAssignment,
        placement: WorkerPlacement,
        redis_url: str,
        code_dir: Path | None,
        initial_model: Path | None,
        generation: int | None = None,
        world_size: int | None = None,
    ) -> WorkerConfig:
        """The config of `command`'s worker `assignment` (in another `generation` or
        `world_size`, if given)."""
        return WorkerConfig(
            job_id=command.job_id,
            generation=command.generation if generation is None else generation,
            rank=assignment.rank,
            world_size=command.world_size if world_size is None else world_size,
            master_addr=command.master_addr,
            master_port=command.master_port,
            device=placement.device,
            spec=command.spec,
            run_dir=command.run_dir,
            node=self.config.node_name,
            device_index=assignment.device_index,
            redis_url=redis_url,
            coordination_key=command.coordination_key,
            code_dir=str(code_dir) if code_dir is not None else None,
            entrypoint=command.spec.get("entrypoint") if code_dir is not None else None,
            initial_model=str(initial_model) if initial_model is not None else None,
        )

    def _worker_env(self) -> dict[str, str]:
        """The environment every worker of this node starts with, before its device's and its
        own config: a standby is started with it too."""
        return {
            **process_environment(),
            **socket_interface_env(self.config.node_address, os.environ),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": python_path(),
        }

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

    def _persist(self, worker: _Worker) -> None:
        """Writes the worker's record as it stands. Never call it holding `worker.lock`."""
        with self._lock:
            job = self._jobs.get(worker.job_id, _Job())
            record = WorkerRecord(
                job_id=worker.job_id,
                generation=worker.generation,
                rank=worker.rank,
                device_index=worker.device_index,
                pid=worker.pid,
                start_time=worker.start_time,
                output=str(self._records.output_path(worker.stem)),
                offset=worker.delivered_offset,
                launched_generation=job.launched_generation,
                stop_before_generation=job.stop_before_generation,
                stop_requested=worker.stop_requested,
                exit_code=worker.exit_code,
                announced_exit=worker.announced_exit,
                last_step=worker.last_step,
                total_steps=worker.total_steps,
            )
            try:
                self._records.save(worker.stem, record)
            except OSError as err:
                log.error(
                    "could not save the record of pid %d (it cannot be re-adopted): %s", worker.pid, err
                )

    # --- watching ----------------------------------------------------------------------------

    def _tail(self, worker: _Worker) -> None:
        """Reads the worker's output from `read_offset` as it grows, until the process is gone
        and every line is read."""
        try:
            output = self._records.output_path(worker.stem).open("rb")
        except OSError as err:
            log.error("cannot read the output of pid %d: %s", worker.pid, err)
            return
        with output:
            output.seek(worker.read_offset)
            while True:
                complete = worker.gone.is_set()  # before reading: a read after it gets everything
                raw = output.readline(_MAX_READ_BYTES)
                if raw.endswith(b"\n") or len(raw) == _MAX_READ_BYTES or (raw and complete):
                    self._take_line(worker, raw, output.tell())
                    continue
                if raw:  # the worker is still writing this line
                    output.seek(-len(raw), os.SEEK_CUR)
                if complete:
                    return
                worker.gone.wait(_TAIL_EVERY_S)

    def _take_line(self, worker: _Worker, raw: bytes, offset: int) -> None:
        """Turns one output line, which ends at `offset` in the file, into an event."""
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        changed = False
        with self._lock:
            worker.read_offset = offset
            if not line.strip():
                return
            event = decode(worker.key, line)
            if event.kind == "exiting":
                worker.announced_exit = event.exit_code
                changed = True
            elif event.kind == "progress" and event.step is not None:
                worker.last_step = event.step
                worker.total_steps = event.total_steps or worker.total_steps
            elif event.kind == "joined":
                worker.generation, worker.rank, worker.joined = event.generation, event.rank, True
                self._last_join = time.monotonic()
                event = event.model_copy(update={"pid": worker.pid, "device_index": worker.device_index})
                changed = True
            if event.kind != "exiting":
                self._events.add(event)
        if changed:
            self._persist(worker)

    def _watch_child(self, worker: _Worker, reader: threading.Thread) -> None:
        assert worker.process is not None
        # Wait without reaping, so that the pid (and its process group) stays ours.
        if isinstance(worker.process, ForkedProcess):
            worker.process.wait_ended()
        else:
            try:
                os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                pass
        with worker.lock:
            # Children the worker left behind are orphans that would hold on to its device.
            _signal_group(worker.pid, signal.SIGKILL)
        worker.gone.set()
        reader.join(timeout=_REAP_AFTER_KILL_S)
        with worker.lock:
            exit_code = worker.process.wait()
            worker.reaped = True
            self._cancel_timers(worker)
        self._report_exit(worker, exit_code)

    def _watch_adopted(self, worker: _Worker, reader: threading.Thread) -> None:
        if worker.pidfd is not None:
            select.select([worker.pidfd], [], [])  # readable once the process has exited
            with worker.lock:
                worker.reaped = True
                # Its process group outlives it while a child it left is in it: still ours.
                _signal_group(worker.pid, signal.SIGKILL)
                os.close(worker.pidfd)
                worker.pidfd = None
        worker.gone.set()
        reader.join(timeout=_REAP_AFTER_KILL_S)
        with worker.lock:
            self._cancel_timers(worker)
        self._report_exit(worker, worker.exit_code)

    def _report_exit(self, worker: _Worker, exit_code: int | None) -> None:
        outcome = settle_exit(
            exit_code, worker.announced_exit, worker.stop_requested, worker.finished, worker.joined
        )
        log.info(
            "job %d generation %d rank %d (pid %d) exited: %s",
            worker.job_id,
            worker.generation,
            worker.rank,
            worker.pid,
            outcome.message,
        )
        worker.exit_code = exit_code
        # Kept until the event reaches the portal: an agent that dies first reports it again.
        self._persist(worker)
        with self._lock:
            self._events.add(
                worker.event(
                    "exited",
                    pid=worker.pid,
                    device_index=worker.device_index,
                    exit_code=outcome.exit_code,
                    reason=outcome.reason,
                    step=worker.last_step,
                    message=outcome.message,
                )
            )
            self._workers.remove(worker)
            self._ended.append(worker)
            self._start_deferred(worker)
        worker.done.set()
        if self._on_exit is not None:
            self._on_exit()

    def _start_deferred(self, exited: _Worker) -> None:
        """Starts the joiner a launch left to `exited` (see _Job.deferred), if `exited` never
        joined that generation and it is still the job's newest here. Call under the lock."""
        job = self._jobs.get(exited.job_id)
        if job is None or job.launch is None or self._closed:
            return
        assignment = job.deferred.pop(exited.device_index, None)
        launch = job.launch
        if (
            assignment is None
            or exited.generation >= launch.command.generation
            or launch.command.generation < job.stop_before_generation
        ):
            return
        log.info(
            "job %d generation %d: the worker on device %d exited instead of joining; starting its joiner",
            exited.job_id,
            launch.command.generation,
            exited.device_index,
        )
        self._spawn(
            launch.command, assignment, launch.backend, launch.redis_url, launch.code_dir, launch.initial_model,
            launch.python,
        )

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
                if worker.pidfd is not None:
                    signal.pidfd_send_signal(worker.pidfd, signal.SIGTERM)
                else:
                    os.kill(worker.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            self._arm_kill(worker, grace)
        self._persist(worker)

    def _arm_kill(self, worker: _Worker, grace_s: float) -> None:
        """Arms the SIGKILL of a worker asked to stop, `grace_s` from now (worker.lock held)."""
        worker.kill_timer = threading.Timer(grace_s, self._kill, args=(worker, grace_s))
        worker.kill_timer.daemon = True
        worker.kill_timer.start()

    @staticmethod
    def _cancel_timers(worker: _Worker) -> None:
        for timer in (worker.kill_timer, worker.leave_timer):
            if timer is not None:
                timer.cancel()

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

    def _grace(self, worker: _Worker) -> float:
        """How long `worker` has between SIGTERM and SIGKILL: the stop grace, or the short one
        if it never joined a group (it has nothing to save)."""
        if worker.joined:
            return self.config.stop_grace_s
        return min(self.config.warming_stop_grace_s, self.config.stop_grace_s)

    def _stop_and_wait(self, workers: list[_Worker], why: str, grace_s: float | None = None) -> None:
        """Stops `workers` (SIGTERM, then SIGKILL after `grace_s`, by default each one's own
        grace) and waits until they have exited."""
        graces = {id(worker): self._grace(worker) if grace_s is None else grace_s for worker in workers}
        for worker in workers:
            self._terminate(worker, why, graces[id(worker)])
        # A worker already asked to stop keeps its own, earlier deadline; this one is a bound.
        deadline = time.monotonic() + max(graces.values(), default=0.0) + _REAP_AFTER_KILL_S
        for worker in workers:
            if not worker.done.wait(timeout=max(0.0, deadline - time.monotonic())):
                log.error("pid %d did not go away even after SIGKILL", worker.pid)


def _killed_by(exit_code: int) -> str:
    """Says which signal a negative exit status stands for."""
    try:
        return f"killed by {signal.Signals(-exit_code).name}"
    except ValueError:
        return f"killed by signal {-exit_code}"


def _describe_exit(exit_code: int, stop_requested: str | None) -> str:
    what = _killed_by(exit_code) if exit_code < 0 else f"exit code {exit_code} ({exit_reason(exit_code)})"
    return f"{what} after {stop_requested}" if stop_requested else what


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
