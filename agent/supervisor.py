"""Starts, watches and stops this node's elastic workers, and takes them back after the agent
itself died and started again. This module keeps the per-job generation ledger and decides what
happens to each worker; the mechanisms live beside it:

- agent.worker_process: one worker's life (WorkerState, its transition table), its pid, pidfd and
  timers, what its output lines say of it, and how its exit is settled;
- agent.spawn: how a worker is started (a warm standby, the fork server, or cold), with what
  environment, and the standby pool;
- agent.output: the one thread that reads every worker's output and sees it end;
- agent.worker_events: the events on their way to the portal, and the workers' records on disk;
- agent.standby_keeper: which warm standbys the node keeps, read from this ledger;
- agent.settings: SupervisorConfig.

Each worker is `python -m elastic.worker` in its own session, told what to do by a WorkerConfig
in its environment, its stdout and stderr appended to a file (never a pipe: nothing the agent
holds can kill it, so it trains on when its agent dies). Each line becomes an event
(elastic.worker.event_codec: a structured one, or a log line); the supervisor adds "started" right
after the spawn and "exited" once the process and its output are gone.

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
they exit with LEFT_EXIT_CODE at the switch; one still running `leave_grace_s` later is killed.
A stop (cancel, finish, agent shutdown) is SIGTERM, SIGKILL after the grace period.

Re-adoption (agent.records): a new supervisor on the state directory of an earlier one `adopt()`s
the workers whose process still runs (their record names it by pid and start time): it reads their
output on from where the portal's knowledge ends and watches their exit through a pidfd, as it is
not their parent, so their exit code is the one their "exiting" event announced (unknown if none).
Workers that ended while no agent ran are reported as exited once.
"""

from __future__ import annotations

import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agent.devices import DeviceBackend
from agent.output import OutputReader
from agent.records import RecordStore, open_process
from agent.settings import SupervisorConfig
from agent.spawn import Launch, SpawnError, WorkerSpawner
from agent.standby_keeper import StandbyKeeper
from agent.worker_events import WorkerEvents
from agent.worker_process import WorkerProcess, WorkerState
from elastic.wire import (
    ExitReason,
    LaunchCommand,
    OwnPackages,
    RunningWorker,
    StopCommand,
    WorkerAssignment,
    WorkerEvent,
)
from elastic.worker.event_codec import decode

log = logging.getLogger(__name__)

_REAP_AFTER_KILL_S = 10.0


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
        records = RecordStore(state_dir / "workers")
        self._spawner = WorkerSpawner(self.config, records, state_dir)
        self._standbys = StandbyKeeper(self._spawner, self)
        self._jobs: dict[int, _Job] = {}
        self._last_join = -math.inf
        """When a worker here last said "joined" (time.monotonic)."""
        self._workers: list[WorkerProcess] = []
        """Those whose "exited" event is not out yet, starting ones included. A worker leaves it,
        under the lock, before its `done` is set (and never comes back): none listed is done."""
        self._events = WorkerEvents(records, self.config.event_capacity, self._generations)
        """Used under `_lock` only."""
        self._closed = False
        self._lock = threading.RLock()
        self._launching = threading.Lock()
        """Held by a launch (and a deferred joiner's start) for its whole spawn, not `_lock`."""
        self._reader = OutputReader(records.output_path, self._take_line, self._report_exit)

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
        `redis_url`; a job with code of its own runs it from `code_dir`, with its own
        environment's interpreter `python` if it has one; one that starts from another job's
        model finds it at `initial_model`) and sets leavers a deadline; survivors go on. Returns False, and does nothing, if that generation
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
                mine = [worker for worker in self._workers if worker.job_id == command.job_id]
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
        with self._lock:
            for assignment in command.workers:
                self._events.start_failed(command, assignment, message, reason)

    def job_log(self, command: LaunchCommand, line: str) -> None:
        """Adds `line` to the log of `command`'s job, as its first worker here (what the agent
        does for the job before a worker runs: building its environment)."""
        with self._lock:
            self._events.job_log(command, line)

    def job_environment(self, command: LaunchCommand, own_packages: OwnPackages) -> None:
        """Reports the environment of its own that `command`'s job has on this node."""
        with self._lock:
            self._events.job_environment(command, own_packages)

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
            self._terminate(worker, f"stop ({command.reason})", self.config.grace_s(worker.joined))
        return len(targets)

    # --- state -------------------------------------------------------------------------------

    def running(self) -> list[RunningWorker]:
        """Returns the workers whose exit has not been reported yet (and that have a process:
        one still being spawned is listed once it runs)."""
        with self._lock:
            listed = [worker.running_worker() for worker in self._workers]
        return [worker for worker in listed if worker is not None]

    def idle(self) -> bool:
        """Whether no worker is here: none running, none being spawned, every exit reported."""
        with self._lock:
            return not self._workers

    # --- what the standby keeper reads (agent.standby_keeper.NodeWorkers) ---------------------

    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def busy_devices(self) -> set[int]:
        with self._lock:
            return {worker.device_index for worker in self._workers}

    def starting_devices(self) -> set[int]:
        with self._lock:
            return {worker.device_index for worker in self._workers if worker.state is WorkerState.STARTING}

    def newest_launches(self) -> dict[int, Launch]:
        with self._lock:
            live = {worker.job_id for worker in self._workers}
            return {
                job_id: job.launch
                for job_id, job in sorted(self._jobs.items())
                if job_id in live and job.launch is not None
            }

    def settled_since(self) -> float | None:
        with self._lock:
            return self._last_join if all(worker.joined for worker in self._workers) else None

    # --- standbys ----------------------------------------------------------------------------

    def keep_standbys(self, backend: DeviceBackend, taken: set[int]) -> None:
        """Keeps a warm standby on each free device of `backend` not in `taken` (agent.standby_keeper)."""
        self._standbys.keep(backend, taken)

    def standby_pids(self) -> dict[int, int]:
        """pid -> device index of the standbys waiting: processes of ours, not an owner's."""
        return self._spawner.standby_pids()

    def standby_interpreters(self) -> set[str]:
        """The interpreters the standbys waiting run (a job's environment among them is in use)."""
        return self._spawner.standby_interpreters()

    def confined(
        self, job_id: int, run_dir: str, argv: list[str], env: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """A process of job `job_id` (an export) as this node runs it: see WorkerSpawner.confined."""
        return self._spawner.confined(job_id, run_dir, argv, env)

    def drain_events(self) -> list[WorkerEvent]:
        """Removes and returns the events since the last drain, oldest first."""
        with self._lock:
            return self._events.drain(self._workers)

    def events_delivered(self) -> None:
        """Says that every event drained so far reached the portal (or was given up on): a
        supervisor that re-adopts the workers reads their output on from there, and the records
        of workers whose "exited" event was among them are removed."""
        with self._lock:
            self._events.delivered()

    @property
    def dropped_events(self) -> int:
        with self._lock:
            return self._events.dropped

    def adopt(self) -> list[RunningWorker]:
        """Takes over the workers an earlier supervisor on the same state directory left (see
        the module's docstring). Those still running are watched and their output is read on
        from where the portal's knowledge of it ends; those that ended meanwhile are reported as
        exited. Returns the workers now running. Call it once, before the first launch."""
        adopted: list[WorkerProcess] = []
        with self._lock:
            for stem, record in self._events.records.load().items():
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
        graces = {
            id(worker): self.config.grace_s(worker.joined) if grace_s is None else grace_s
            for worker in workers
        }
        for worker in workers:
            self._terminate(worker, "agent shutting down", graces[id(worker)])
        # A worker already asked to stop keeps its own, earlier deadline; this one is a bound.
        deadline = time.monotonic() + max(graces.values(), default=0.0) + _REAP_AFTER_KILL_S
        for worker in workers:
            if not worker.done.wait(timeout=max(0.0, deadline - time.monotonic())):
                log.error("pid %s did not go away even after SIGKILL", worker.pid)
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
                self._events.start_failed(launch.command, assignment, str(err), "failed")
            worker.done.set()
            return
        stop = worker.spawned(spawned.process, spawned.start_time, spawned.pidfd)
        self._spawner.handed_over(spawned.process.pid)
        self._persist(worker)
        with self._lock:
            self._events.add(
                worker.event("started", pid=spawned.process.pid, device_index=worker.device_index)
            )
        self._reader.watch(worker)
        if stop is not None:
            self._terminate(worker, stop, self.config.grace_s(worker.joined))

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
            self._events.save(worker)

    def _generations(self, job_id: int) -> tuple[int, int]:
        """The job's launched and stop-below generations (a worker's record keeps them)."""
        job = self._jobs.get(job_id, _Job())
        return job.launched_generation, job.stop_before_generation

    # --- what the output reader sees -----------------------------------------------------------

    def _take_line(self, worker: WorkerProcess, raw: bytes, offset: int) -> None:
        """Turns one output line, which ends at `offset` in the file, into an event."""
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        with self._lock:
            worker.read_offset = offset
            if not line.strip():
                return
            event = decode(worker.key, line)
            report = worker.heard(event)
            if report is not None:
                self._events.add(report)
            if event.kind == "joined":
                self._last_join = time.monotonic()
        if event.kind in ("exiting", "joined"):  # what its record keeps changed
            self._persist(worker)

    def _report_exit(self, worker: WorkerProcess) -> None:
        with self._lock:  # so that no command finds it exited but still listed
            outcome = worker.settle()
            # Kept until the event reaches the portal: an agent that dies first reports it again.
            self._persist(worker)
            self._events.exited(worker, outcome)
            self._workers.remove(worker)
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
