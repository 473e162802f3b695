"""Starts, watches and stops this node's elastic workers, and takes them back after the agent
itself died and started again. This module keeps the per-job generation ledger and decides what
happens to each worker; the rest lives beside it:

- agent.worker_process: one worker's life (WorkerState, its transition table), its pid, pidfd and
  timers, and how its exit is settled;
- agent.spawn: how a worker is started (a warm standby, the fork server, or cold), with what
  environment, and the standby pool;
- agent.output: the one thread that reads every worker's output and sees it end.

Each worker is `python -m elastic.worker` in its own session, told what to do by a WorkerConfig
in its environment. Its stdout and stderr are appended to a file in the agent's state directory,
never to a pipe, so that a worker trains on when its agent dies (nothing the agent holds can kill
it: no pipe to break, no shared process group, no parent-death signal). The output reader decodes
each line with elastic.membership.codec: a line that starts with WORKER_EVENT_PREFIX is a
structured event, any other line becomes a log event. The supervisor adds the lifecycle events
itself: "started" right after the spawn, "exited" once the process and its output are gone, with
the reason its exit code gives.

Commands are versioned by the job's generation. Per job the supervisor remembers the highest
generation it launched and the generation below which it was told to stop; a launch that is
not newer than both is ignored, so a repeated or late command changes nothing. Launches are taken
one at a time, and spawn their workers outside the supervisor's lock (a slow start holds up no
report): each worker is listed, as starting, before its spawn begins, so that a stop or a
shutdown that arrives meanwhile reaches it once it runs.

A resize happens in place (elastic.worker.membership): a newer launch starts only the joiners it
lists and leaves every running worker alone. Survivors switch generation by themselves and say
so with a "joined" event, after which the supervisor reports them under their new generation and
rank, with the same pid. Workers of the job on devices the launch does not keep are leavers:
they read the membership record and exit with LEFT_EXIT_CODE at the switch; one still running
`leave_grace_s` later is killed. A stop (cancel, finish, agent shutdown) is SIGTERM, SIGKILL
after the grace period.

Re-adoption (agent.records): every worker has a record on disk: its key, pid and process start
time, its output file and how far the portal has its events, and its job's generations. A new
supervisor on the same state directory `adopt()`s the workers whose process still runs: it reads
their output from where the portal's knowledge ends and watches their exit through a pidfd, as it
is not their parent. Their exit status is then the code of the "exiting" event they write last;
one that vanished without it failed, with an unknown code. Records of workers that ended while no
agent ran are reported as exited once. A record goes when the "exited" event of its worker has
reached the portal (`events_delivered`).
"""

from __future__ import annotations

import logging
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.devices import DeviceBackend, DeviceError, WorkerPlacement
from agent.events import EventBuffer
from agent.output import OutputReader
from agent.records import RecordStore, open_process
from agent.spawn import Launch, SpawnError, WorkerSpawner
from agent.worker_process import WorkerProcess
from elastic.membership.codec import decode
from elastic.wire import (
    ExitReason,
    LaunchCommand,
    RunningWorker,
    StopCommand,
    WorkerAssignment,
    WorkerEvent,
)

log = logging.getLogger(__name__)

_REAP_AFTER_KILL_S = 10.0


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


RESIZE_QUIET_S = 2.0
"""Standbys are prepared only this long after a worker here joined a generation (and never while
one has not yet): the resize's transfer and first step have the node's memory to themselves."""


@dataclass
class _Job:
    launched_generation: int = 0
    stop_before_generation: int = 0
    launch: Launch | None = None
    """The newest generation launched here: what a standby prepared for the job is given."""
    deferred: dict[int, WorkerAssignment] = field(default_factory=dict)
    """Device index -> the joiner of the newest launch not started there because an older
    worker of the job still ran on the device (the portal had given it up: its node was lost).
    That worker joins the generation if it can; if it exits instead, the joiner starts then."""


class WorkerSupervisor:
    """The node's workers. Every public method is thread-safe and returns promptly, except
    launch(), which returns once its workers are spawned (without holding up the others), and
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
        self._spawner = WorkerSpawner(self.config, self._records, state_dir)
        self._jobs: dict[int, _Job] = {}
        self._last_join = -RESIZE_QUIET_S
        """When a worker here last said "joined" (time.monotonic)."""
        self._workers: list[WorkerProcess] = []
        """Those whose "exited" event is not out yet, starting ones included."""
        self._events = EventBuffer(self.config.event_capacity)
        self._closed = False
        self._lock = threading.RLock()
        self._launching = threading.Lock()
        """Held by a launch (and a deferred joiner's start) for its whole spawn, not `_lock`."""
        self._ended: list[WorkerProcess] = []
        """Workers whose "exited" event is in the buffer."""
        self._drained: dict[str, tuple[WorkerProcess, int]] = {}
        """Since the last events_delivered: per worker, how far its output was read at the latest
        drain."""
        self._drained_ended: list[WorkerProcess] = []
        """Since the last events_delivered: workers whose "exited" event was drained."""
        self._reader = OutputReader(self._records.output_path, self._take_line, self._report_exit)

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
        launch = Launch(command, backend, redis_url, code_dir, initial_model, python)
        with self._launching:
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
                job.launch = launch
                job.deferred = {}
                mine = [w for w in self._workers if w.job_id == command.job_id and not w.done.is_set()]
                leave = (
                    f"did not leave within {self.config.leave_grace_s:g} s of generation {command.generation}"
                )
                for worker in mine:
                    if worker.device_index in command.members:
                        worker.keep()
                    else:
                        worker.expect_to_leave(self.config.leave_grace_s, leave)
                    self._persist(worker)
                busy = {worker.device_index for worker in mine if not worker.leaving}
                starting = []
                for assignment in command.workers:
                    if assignment.device_index in busy:
                        log.info(
                            "job %d generation %d: device %d already runs a worker of the job; it joins "
                            "(or, if it exits first, a new one starts)",
                            command.job_id,
                            command.generation,
                            assignment.device_index,
                        )
                        job.deferred[assignment.device_index] = assignment
                        continue
                    starting.append((assignment, self._starting(command, assignment)))
            for assignment, worker in starting:
                self._start(launch, assignment, worker)
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
                self._events.add(
                    WorkerEvent(
                        job_id=command.job_id,
                        generation=command.generation,
                        rank=command.workers[0].rank,
                        kind="log",
                        at=time.time(),
                        message=line,
                    )
                )

    def stop(self, command: StopCommand) -> int:
        """Asks the job's workers here whose generation is below `command.before_generation`
        (on `command.devices`, if given) to stop (SIGTERM; SIGKILL after the grace period; one
        still starting, once it runs). A stop of the whole job also ignores later launches below
        that generation. Returns how many workers were asked; their exits are reported when they
        happen."""
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
        """Returns the workers whose exit has not been reported yet (and that have a process:
        one still being spawned is listed once it runs)."""
        with self._lock:
            listed = [worker.running_worker() for worker in self._workers if not worker.done.is_set()]
        return [worker for worker in listed if worker is not None]

    def idle(self) -> bool:
        """Whether no worker is here: none running, none being spawned, every exit reported."""
        with self._lock:
            return not self._workers

    def keep_standbys(self, backend: DeviceBackend, taken: set[int]) -> None:
        """Keeps a warm standby on each device of `backend` that runs no worker of ours and is
        not in `taken` (its owner is there), and none on any other. Does nothing unless
        standbys are on."""
        with self._lock:
            closed = self._closed
        if closed:
            self._spawner.close_standbys()
            return

        def placements() -> dict[int, WorkerPlacement]:
            with self._lock:
                busy = {worker.device_index for worker in self._workers if not worker.done.is_set()}
            placements = {}
            for device in backend.devices():
                if device.index not in busy | taken:
                    try:
                        placements[device.index] = backend.placement(device.index)
                    except DeviceError as err:
                        log.warning("no standby on device %d: %s", device.index, err)
            return placements

        self._spawner.keep_standbys(placements, self._growing, self._prepared_env, self._quiet)

    def _quiet(self) -> bool:
        """Whether no resize is under way on this node: every worker here has joined its
        generation, the last of them at least RESIZE_QUIET_S ago (its first step is done)."""
        with self._lock:
            live = [worker for worker in self._workers if not worker.done.is_set()]
            return (
                all(worker.joined for worker in live) and time.monotonic() - self._last_join >= RESIZE_QUIET_S
            )

    def _growing(self) -> list[int]:
        """The jobs a standby may be prepared for, by id: those with a worker here whose newest
        generation launched here has fewer workers than the job's most."""
        with self._lock:
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
        with self._lock:
            launch = self._jobs[job_id].launch
        assert launch is not None
        command = launch.command
        config = self._spawner.worker_config(
            launch,
            WorkerAssignment(rank=command.world_size, device_index=device_index),
            placement,
            generation=command.generation + 1,
            world_size=command.world_size + 1,
        )
        return self._spawner.env_of(config, placement)

    def standby_pids(self) -> dict[int, int]:
        """pid -> device index of the standbys waiting: processes of ours, not an owner's."""
        return self._spawner.standby_pids()

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
        adopted: list[WorkerProcess] = []
        with self._lock:
            for stem, record in self._records.load().items():
                job = self._jobs.setdefault(record.job_id, _Job())
                job.launched_generation = max(job.launched_generation, record.launched_generation)
                job.stop_before_generation = max(job.stop_before_generation, record.stop_before_generation)
                pidfd = open_process(record.pid, record.start_time) if record.exit_code is None else None
                worker = WorkerProcess.adopted(stem, record, pidfd)
                self._workers.append(worker)
                adopted.append(worker)
                log.info(
                    "job %d generation %d rank %d (pid %d): %s",
                    worker.job_id,
                    worker.generation,
                    worker.rank,
                    record.pid,
                    "re-adopted" if pidfd is not None else "ended while no agent ran",
                )
        running = [worker.running_worker() for worker in adopted if worker.pidfd is not None]
        for worker in adopted:
            if worker.stop_requested is not None and worker.pidfd is not None:
                worker.resume_stop(self.config.stop_grace_s)
            self._reader.watch(worker)
        return [worker for worker in running if worker is not None]

    def shutdown(self, grace_s: float | None = None) -> None:
        """Refuses further launches, stops every worker (SIGTERM, SIGKILL after `grace_s`,
        default each worker's grace: a worker that never joined gets the short one) and waits
        for them to exit."""
        with self._lock:
            self._closed = True
            # A launch lists its workers, as starting, only while not closed: this is all of them.
            workers = list(self._workers)
        self._spawner.close_standbys()
        self._stop_and_wait(workers, "agent shutting down", grace_s)
        self._spawner.close_forkserver()
        self._reader.close(_REAP_AFTER_KILL_S)

    # --- launching ---------------------------------------------------------------------------

    def _starting(self, command: LaunchCommand, assignment: WorkerAssignment) -> WorkerProcess:
        """Lists the worker `assignment` of `command`, as starting (call under the lock)."""
        stem = WorkerSpawner.new_stem(command, assignment)
        worker = WorkerProcess(
            command.job_id, command.generation, assignment.rank, assignment.device_index, stem
        )
        self._workers.append(worker)
        return worker

    def _start(self, launch: Launch, assignment: WorkerAssignment, worker: WorkerProcess) -> None:
        """Spawns `worker` (listed as starting), outside the lock, and reports it started; or
        reports that it could not start."""
        try:
            spawned = self._spawner.spawn(launch, assignment, worker.stem)
        except SpawnError as err:
            worker.spawn_failed()
            with self._lock:
                self._workers.remove(worker)
                self._start_failed(launch.command, assignment, str(err))
            worker.done.set()
            return
        stop = worker.spawned(spawned.process, spawned.start_time, spawned.pidfd)
        self._persist(worker)
        log.info(
            "started job %d generation %d rank %d on device %d: pid %d%s",
            worker.job_id,
            worker.generation,
            worker.rank,
            worker.device_index,
            spawned.process.pid,
            spawned.how,
        )
        with self._lock:
            self._events.add(
                worker.event("started", pid=spawned.process.pid, device_index=worker.device_index)
            )
        self._reader.watch(worker)
        if stop is not None:
            self._terminate(worker, stop, self._grace(worker))

    def _start_failed(
        self,
        command: LaunchCommand,
        assignment: WorkerAssignment,
        message: str,
        reason: ExitReason = "failed",
    ) -> None:
        log.error(
            "job %d generation %d rank %d: %s", command.job_id, command.generation, assignment.rank, message
        )
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

    def _start_deferred(self, launch: Launch, assignment: WorkerAssignment) -> None:
        """Starts the joiner a launch left to a worker that exited instead of joining (see
        _Job.deferred), unless a newer launch or a stop came meanwhile, or the supervisor is shut
        down."""
        command = launch.command
        with self._launching:
            with self._lock:
                job = self._jobs[command.job_id]
                if (
                    self._closed
                    or job.launch is not launch
                    or command.generation < job.stop_before_generation
                ):
                    return
                log.info(
                    "job %d generation %d: the worker on device %d exited instead of joining; starting its joiner",
                    command.job_id,
                    command.generation,
                    assignment.device_index,
                )
                worker = self._starting(command, assignment)
            self._start(launch, assignment, worker)

    def _persist(self, worker: WorkerProcess) -> None:
        """Writes the worker's record as it stands."""
        with self._lock:
            job = self._jobs.get(worker.job_id, _Job())
            record = worker.record(
                str(self._records.output_path(worker.stem)),
                job.launched_generation,
                job.stop_before_generation,
            )
            try:
                self._records.save(worker.stem, record)
            except OSError as err:
                log.error(
                    "could not save the record of pid %d (it cannot be re-adopted): %s", record.pid, err
                )

    # --- what the output reader sees -----------------------------------------------------------

    def _take_line(self, worker: WorkerProcess, raw: bytes, offset: int) -> None:
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
                worker.said_joined(event.generation, event.rank)
                self._last_join = time.monotonic()
                event = event.model_copy(update={"pid": worker.pid, "device_index": worker.device_index})
                changed = True
            if event.kind != "exiting":
                self._events.add(event)
        if changed:
            self._persist(worker)

    def _report_exit(self, worker: WorkerProcess) -> None:
        with self._lock:  # so that no command finds it exited but still listed
            outcome = worker.settle()
            # Kept until the event reaches the portal: an agent that dies first reports it again.
            self._persist(worker)
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
            deferred = self._deferred_joiner(worker)
        worker.done.set()
        if deferred is not None:
            threading.Thread(
                target=self._start_deferred, args=deferred, name=f"deferred-job-{worker.job_id}", daemon=True
            ).start()
        if self._on_exit is not None:
            self._on_exit()

    def _deferred_joiner(self, exited: WorkerProcess) -> tuple[Launch, WorkerAssignment] | None:
        """The joiner a launch left to `exited` (see _Job.deferred), if `exited` never joined that
        generation and it is still the job's newest here. Call under the lock."""
        job = self._jobs.get(exited.job_id)
        if job is None or job.launch is None or self._closed:
            return None
        assignment = job.deferred.pop(exited.device_index, None)
        launch = job.launch
        if (
            assignment is None
            or exited.generation >= launch.command.generation
            or launch.command.generation < job.stop_before_generation
        ):
            return None
        return launch, assignment

    # --- stopping ----------------------------------------------------------------------------

    def _terminate(self, worker: WorkerProcess, why: str, grace_s: float) -> None:
        if worker.terminate(why, grace_s):
            self._persist(worker)

    def _grace(self, worker: WorkerProcess) -> float:
        """How long `worker` has between SIGTERM and SIGKILL: the stop grace, or the short one
        if it never joined a group (it has nothing to save)."""
        if worker.joined:
            return self.config.stop_grace_s
        return min(self.config.warming_stop_grace_s, self.config.stop_grace_s)

    def _stop_and_wait(self, workers: list[WorkerProcess], why: str, grace_s: float | None = None) -> None:
        """Stops `workers` (SIGTERM, then SIGKILL after `grace_s`, by default each one's own
        grace) and waits until they have exited."""
        graces = {id(worker): self._grace(worker) if grace_s is None else grace_s for worker in workers}
        for worker in workers:
            self._terminate(worker, why, graces[id(worker)])
        # A worker already asked to stop keeps its own, earlier deadline; this one is a bound.
        deadline = time.monotonic() + max(graces.values(), default=0.0) + _REAP_AFTER_KILL_S
        for worker in workers:
            if not worker.done.wait(timeout=max(0.0, deadline - time.monotonic())):
                log.error("pid %s did not go away even after SIGKILL", worker.pid)
