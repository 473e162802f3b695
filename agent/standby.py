"""Warm standby workers: one waiting process per free device, so that a joiner skips the slow part
of a worker's start-up (elastic.worker.standby says what a standby does and does not do).

How a standby starts: on a CPU slot, the pool forks it from the node's fork server
(elastic.worker.forkserver), one process that imported torch and the worker runtime once, so a
standby is warm milliseconds after it is asked for and shares those libraries' memory; a GPU's
standby starts as a process of its own (a GPU's driver must not be initialised before a fork, so
each makes its context after it starts). Either way a standby that takes a job is, from then on, a
worker in its own session, writing to its own output file, that outlives the agent. While the
fork server imports (once, at the agent's start), no CPU standby starts; if it dies, or refuses a
standby, standbys start as processes of their own again (logged).

The pool is the spawner's (agent.spawn, one owner; agent.standby_keeper tells it, from the
supervisor's ledger, which devices are free and which jobs may grow): it starts a standby on each
device the agent calls free that has none, kills the standby of a device that is not free any
more (its owner came back, or a worker started there cold), and hands a standby to a launch on
its device. A standby is taken only if it was started with the placement the device has now (a
played slowdown changes the environment a worker must start with); otherwise it is killed and the
worker starts cold.

A standby runs at SCHED_IDLE until it is handed a worker: its seconds of importing use only
CPU that nothing else wants, so training on the node (CPU slots share the cores) does not slow
down while a standby warms up. Handing it a worker gives its threads the normal policy back; where
the agent may not do that (no CAP_SYS_NICE), the standby is killed and the worker starts cold.

A standby may also be prepared for a job (elastic.worker.build): the keeper names the jobs
that may grow on this node, and the pool sends the warm, unprepared standbys of the lowest free
devices (where the scheduler grows a job first) the environment of a worker of theirs, up to
`prepared_per_job` a job, one preparation at a time. The standby builds that job's model at idle
priority, so a joiner taken from it skips its build too. A standby prepared for a job is handed
only that job's worker: a launch of another job on its device kills it and starts cold, and so
does a job that stops growing here (no worker of it left on the node, or its last generation
at its most workers).

A preparation has a deadline (PREPARE_TIMEOUT_S): a job whose build hangs (its code waits on
something that never comes) has that standby killed and is never prepared on this node again, so
that it cannot hold up every other job's preparations.

A standby's life, and who moves it on, is StandbyState's docstring; the pool logs every step of
it with the seconds it took. A standby that dies while waiting is logged with its output's tail;
its device gets no new one for RESTART_BACKOFF_S, so a standby that cannot start does not burn a
core in a loop.
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from agent.devices import WorkerPlacement
from elastic.transitions import InvalidMove, check_move
from elastic.worker.forkserver import READY_TIMEOUT_S, ForkedProcess, ForkServer, ForkServerError
from elastic.worker.standby import Assignment, Preparation, PreparationFailed, Prepared, Ready, said

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 60.0
"""How long a device waits for a new standby after one died on its own."""
PREPARE_TIMEOUT_S = 300.0
"""The longest a standby may take to build the job it was prepared for."""
_TAIL_BYTES = 2000
PIPE_BYTES = 1 << 20
"""A standby's stdin holds this much (Linux's default pipe-max-size), so that an assignment with
a large job spec still goes in one write; one larger still starts the worker cold."""


def _ended(process: subprocess.Popen[bytes] | ForkedProcess) -> bool:
    """Whether the process has ended (and is reaped); a forked one may have ended with its code
    unknown."""
    return process.poll() is not None or (isinstance(process, ForkedProcess) and process.ended)


def normal_priority(pid: int) -> None:
    """Gives every thread of process `pid` the normal scheduling policy back (a standby warms
    up at SCHED_IDLE; the worker it becomes must not). Raises OSError where that is not allowed
    (leaving SCHED_IDLE needs CAP_SYS_NICE or a permissive RLIMIT_NICE)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(task), os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


class StandbyState(enum.StrEnum):
    """Where a standby is in its life. The pool (StandbyPool) is its only writer: it moves a
    standby on when it acts on it, or when it sees (at each `keep`, `take` and `standbys`) what
    the process said in its output or that it exited.

        starting   -> warm          it said READY_LINE: the interpreter, torch and the worker
                                    runtime are imported (and on a GPU the context is made)
        starting   -> taken         a launch on its device took it before it was warm: the
                                    assignment waits in its pipe, and it still skips what it did
        starting   -> killed        its device is not free any more (an owner came back, a worker
                                    started there cold), or the agent shut down
        starting   -> died          it exited on its own (logged with its output's tail; its device
                                    gets no new standby for RESTART_BACKOFF_S)
        warm       -> preparing     it was sent a job's Preparation (a job that may grow here; one
                                    started in a job's own environment is only ever sent that
                                    job's)
        warm       -> taken
        warm       -> killed        also to start one in a job's own environment on its device
        warm       -> died
        preparing  -> prepared      it said PREPARED_LINE: the job's model is built
        preparing  -> build-failed  it said PREPARATION_FAILED_LINE: still that job's only (its
                                    worker builds, and fails, on its own)
        preparing  -> taken         that job's launch took it while it built (it goes on from
                                    where the build is)
        preparing  -> killed        also PREPARE_TIMEOUT_S passed (the job is never prepared here
                                    again), or the job stopped growing here
        preparing  -> died
        prepared   -> taken         only by a launch of the job it was prepared for; another
                                    job's launch on its device kills it
        prepared   -> killed
        prepared   -> died
        build-failed -> taken
        build-failed -> killed
        build-failed -> died

taken, killed and died are final: a standby serves one worker and ends with it.

A standby started in a job's own environment (its interpreter is the environment's) is that job's
from its start: `job` is set while it is still starting, it is started confined as that job's
process where jobs are confined, and it is handed that job's worker or killed, like a prepared one.
"""

    STARTING = "starting"
    WARM = "warm"
    PREPARING = "preparing"
    PREPARED = "prepared"
    BUILD_FAILED = "build-failed"
    TAKEN = "taken"
    KILLED = "killed"
    DIED = "died"

    @property
    def final(self) -> bool:
        return not STANDBY_TRANSITIONS[self]


_S = StandbyState
_ENDS = frozenset({_S.TAKEN, _S.KILLED, _S.DIED})
STANDBY_TRANSITIONS: dict[StandbyState, frozenset[StandbyState]] = {
    _S.STARTING: _ENDS | {_S.WARM},
    _S.WARM: _ENDS | {_S.PREPARING},
    _S.PREPARING: _ENDS | {_S.PREPARED, _S.BUILD_FAILED},
    _S.PREPARED: _ENDS,
    _S.BUILD_FAILED: _ENDS,
    _S.TAKEN: frozenset(),
    _S.KILLED: frozenset(),
    _S.DIED: frozenset(),
}


class InvalidStandbyTransition(InvalidMove):
    what = "a standby"


def check_standby_transition(source: str, target: str) -> None:
    """Raises InvalidStandbyTransition unless a standby may go from `source` to `target`."""
    check_move(STANDBY_TRANSITIONS, StandbyState, source, target, InvalidStandbyTransition)


@dataclass
class Standby:
    """One standby process, as the pool sees it. Read it; only the pool changes it."""

    device_index: int
    placement: WorkerPlacement
    process: subprocess.Popen[bytes] | ForkedProcess
    output: Path
    """Its own output until it is assigned (then the worker's file takes over)."""
    job: int | None = None
    """The job it was prepared (or, in a job's own environment, started) for, if any: it serves
    no other."""
    python: str | None = None
    """The interpreter of the job's own environment it runs; None: the node's."""
    state: StandbyState = StandbyState.STARTING
    since: float = field(default_factory=time.monotonic)
    """When it entered its state (time.monotonic)."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def ready(self) -> bool:
        """Whether it is warm (prepared or not), as of the pool's last look."""
        return self.state in (StandbyState.WARM, StandbyState.PREPARING, StandbyState.PREPARED, StandbyState.BUILD_FAILED)

    def said(self) -> bytes:
        """Its output so far (b"" if it cannot be read)."""
        try:
            return self.output.read_bytes()
        except OSError:
            return b""

    def output_tail(self) -> str:
        return self.said()[-_TAIL_BYTES:].decode(errors="replace")


class StandbyPool:
    """The node's standbys. Not thread-safe: its owner (the spawner) calls it under its pool lock."""

    def __init__(
        self,
        directory: Path,
        python: str,
        worker_module: str,
        limit: int,
        prepared_per_job: int = 0,
        fork: bool = False,
        confined_argv: Callable[[list[str], Mapping[str, str]], list[str]] | None = None,
    ) -> None:
        self.directory = directory
        self.fork = fork
        """Fork the standbys of CPU slots from a fork server (started at the first `keep`)."""
        self._forkserver: ForkServer | None = None
        self.limit = limit
        """The most standbys kept at once."""
        self.prepared_per_job = prepared_per_job
        """The most standbys prepared for one job (0: none are)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.python = python
        """The node's interpreter: that of every standby not started in a job's own environment."""
        self.worker_module = worker_module
        self._confined_argv = confined_argv
        """The argv a process of a job starts with where jobs are confined (agent.spawn): a standby
        started in a job's own environment runs none of its packages' code unconfined."""
        self._standbys: dict[int, Standby] = {}
        self._dying: list[Standby] = []
        self._backoff_until: dict[int, float] = {}
        self._unpreparable: set[int] = set()
        """Jobs whose preparation ran past PREPARE_TIMEOUT_S here: never prepared again."""

    def keep(
        self,
        free: Mapping[int, WorkerPlacement],
        env: Mapping[str, str],
        growing: Sequence[int] = (),
        prepare_env: Callable[[int, int, WorkerPlacement], dict[str, str]] | None = None,
        quiet: bool = True,
        starting: AbstractSet[int] = frozenset(),
        pythons: Mapping[int, str] | None = None,
    ) -> None:
        """Makes the standbys match `free`, the free devices and their placements: a standby on
        each, lowest index first, up to `limit` (started with its placement and the environment
        `env` plus the placement's), none on any other device. Standbys forked from the fork
        server start together (they import nothing); others one at a time: the next once the
        last is warm, so that a node never imports torch in many processes at once (a scale-in
        that frees many devices would otherwise thrash a small node). While the fork server
        imports, none starts. Then prepares
        standbys for the jobs in `growing` (most wanted first), a worker of job J on device D
        having the environment `prepare_env(J, D, placement)`, and kills those prepared for a
        job not in it. A job of `growing` in `pythons` runs an environment of its own (that
        interpreter): its standbys are started in it (agent.standby.StandbyPool._prepare_own).
        Unless the node is `quiet` (no resize under way here), nothing is
        prepared: a build, even at idle priority, competes for memory bandwidth with the resize's
        transfer and first step. A device in `starting` (a worker is being started there, and
        its spawn has yet to take the pool) is left as it is: its standby, which the spawn takes,
        is neither killed nor prepared, and none is started there. Also reaps the standbys that
        were killed."""
        now = time.monotonic()
        self._observe()
        for index, standby in list(self._standbys.items()):
            if index in starting:
                continue
            if index not in free:
                self._kill(index, "its device is not free")
            elif standby.job is not None and standby.job not in growing:
                self._kill(index, f"job {standby.job}, which it was prepared for, does not grow here any more")
            elif (
                standby.job is not None
                and standby.state in (StandbyState.STARTING, StandbyState.PREPARING)
                and now - standby.since > PREPARE_TIMEOUT_S
            ):
                self._unpreparable.add(standby.job)
                self._kill(index, f"building job {standby.job} took more than {PREPARE_TIMEOUT_S:.0f} s; not preparing it again")
        warming = any(standby.state is StandbyState.STARTING for standby in self._standbys.values())
        if self.fork and self._forkserver is None and any(p.device == "cpu" for p in free.values()):
            self._forkserver = ForkServer(env, self.python, self.worker_module)
            log.info("fork server for standbys: pid %d, importing the worker runtime", self._forkserver.process.pid)
        # While the fork server imports (the node's one warm-up), the CPU slots wait for it.
        importing = self._forkserver is not None and not self._forkserver_lost() and not self._forkserver.ready
        if not warming and len(self._standbys) < self.limit:
            startable = [
                i for i in sorted(free.keys() - self._standbys.keys() - starting)
                if now >= self._backoff_until.get(i, 0.0) and not (importing and free[i].device == "cpu")
            ]
            # Forked, a standby imports nothing: every free device up to the limit gets one now.
            # Started on its own, one at a time.
            for index in startable[: self.limit - len(self._standbys)]:
                self._start(index, free[index], env)
                started = self._standbys.get(index)
                if started is None or not isinstance(started.process, ForkedProcess):
                    break
        if quiet and prepare_env is not None:
            self._prepare(growing, prepare_env, starting, pythons or {})
        self._reap()

    def _forkserver_lost(self) -> bool:
        """Whether the fork server died (then standbys start as processes of their own)."""
        server = self._forkserver
        if server is None or server.process.poll() is None:
            return False
        log.error("the standbys' fork server (pid %d) exited with %s; standbys start as processes of their own",
                  server.process.pid, server.process.returncode)
        server.close()
        self._forkserver = None
        self.fork = False
        return True

    def _prepare(
        self,
        growing: Sequence[int],
        prepare_env: Callable[[int, int, WorkerPlacement], dict[str, str]],
        starting: AbstractSet[int],
        pythons: Mapping[int, str],
    ) -> None:
        """Prepares one standby, if no other is being prepared (or started for a job): a warm one
        started in a growing job's own environment first (it is that job's already); else, for
        the job in `growing` with the fewest prepared standbys (the first such on a tie), if one
        has fewer than prepared_per_job, the warm, unprepared standby of the lowest free device
        (not in `starting`), or, for a job that runs an environment of its own (in `pythons`),
        one started in that environment in its place (_prepare_own)."""
        standbys = self._standbys.values()
        busy = any(
            s.state is StandbyState.PREPARING or (s.state is StandbyState.STARTING and s.job is not None)
            for s in standbys
        )
        if not growing or not self.prepared_per_job or busy:
            return
        # One started in a job's environment is warm: it is that job's to prepare, first.
        own = [i for i in sorted(self._standbys) if (s := self._standbys[i]).job is not None
               and s.state is StandbyState.WARM and s.job in growing and i not in starting]
        if own:
            candidates, job = own, self._standbys[own[0]].job
        else:
            counts = Counter(standby.job for standby in standbys if standby.job is not None)
            wanting = [j for j in growing if counts[j] < self.prepared_per_job and j not in self._unpreparable]
            if not wanting:
                return
            job = min(wanting, key=lambda j: (counts[j], growing.index(j)))
            candidates = [
                i for i in sorted(self._standbys)
                if (s := self._standbys[i]).state is StandbyState.WARM and s.job is None and i not in starting
            ]
            if not candidates:
                return
        assert job is not None
        python = pythons.get(job)
        index = candidates[0]
        standby = self._standbys[index]
        try:  # the environment makes the job's directories where jobs are confined: OSError
            env = prepare_env(job, index, standby.placement)
            if standby.python != python:
                self._prepare_own(index, job, python, env)
                return
            self._send(standby, Preparation(env=env).model_dump_json().encode() + b"\n")
        except OSError as err:
            log.warning("could not prepare device %d's standby (pid %d) for job %d: %s", index, standby.pid, job, err)
            self._kill(index, "it could not be prepared")
            return
        standby.job = job
        self._move(standby, StandbyState.PREPARING, f"for job {job}")

    def _prepare_own(self, index: int, job: int, python: str | None, env: Mapping[str, str]) -> None:
        """Replaces device `index`'s warm, unprepared standby of the node's environment by one
        started in job `job`'s own environment (`python`, with `env`, the environment of the
        worker the job would start there next: confined as that job's where jobs are). It is the
        job's from its start; once warm, the next keep prepares it (so the job's model is built
        in the interpreter its worker runs). One that cannot start is logged, and its device
        waits RESTART_BACKOFF_S."""
        placement = self._standbys[index].placement
        self._kill(index, f"job {job}, which may grow here, runs an environment of its own")
        self._start(index, placement, env, python=python, job=job)

    @staticmethod
    def _send(standby: Standby, line: bytes) -> None:
        """Writes `line` to the standby's stdin, whole, without blocking. Raises OSError.
        Through the pipe, never a file: the environment holds what the job may read and the disk
        may not keep. Into an empty pipe that can hold it all, the write neither blocks (the
        standby may still be importing) nor is cut short."""
        assert standby.process.stdin is not None
        pipe = standby.process.stdin.fileno()
        if len(line) > fcntl.fcntl(pipe, fcntl.F_GETPIPE_SZ):
            raise OSError(f"the message ({len(line)} bytes) is larger than the pipe")
        written = os.write(pipe, line)
        if written != len(line):
            raise OSError(f"only {written} of {len(line)} bytes went through")

    def take(
        self,
        index: int,
        placement: WorkerPlacement,
        output: Path,
        env: Mapping[str, str],
        job: int,
        python: str | None = None,
    ) -> Standby | None:
        """Hands device `index`'s standby the worker of job `job` whose output file is `output`,
        whose environment is `env` and whose interpreter is `python` (None: the node's); returns
        it, or None (the worker then starts cold) if the device has no live standby started with
        `placement` and that interpreter, unprepared or prepared for that job."""
        self._observe()
        standby = self._standbys.get(index)
        if standby is None:
            return None
        if standby.placement != placement:
            self._kill(index, "it was started for another placement")
            return None
        if standby.job is not None and standby.job != job:
            self._kill(index, f"it was prepared for job {standby.job}, not job {job}")
            return None
        if standby.python != python:
            self._kill(index, "it runs another environment than the worker's")
            return None
        line = Assignment(output=str(output), env=dict(env)).model_dump_json().encode() + b"\n"
        assert standby.process.stdin is not None
        try:
            normal_priority(standby.pid)
            self._send(standby, line)
            standby.process.stdin.close()
        except OSError as err:
            log.warning("could not hand device %d's standby (pid %d) a worker: %s", index, standby.pid, err)
            self._kill(index, "it could not be handed a worker")
            return None
        del self._standbys[index]
        self._move(standby, StandbyState.TAKEN, f"by job {job}")
        standby.output.unlink(missing_ok=True)
        return standby

    def pids(self) -> dict[int, int]:
        """pid -> device index of every standby waiting."""
        return {standby.pid: index for index, standby in self._standbys.items()}

    def interpreters(self) -> set[str]:
        """The interpreters of jobs' environments that standbys waiting run (an environment one of
        them runs must not be evicted)."""
        return {standby.python for standby in self._standbys.values() if standby.python is not None}

    def standbys(self) -> list[Standby]:
        """The standbys waiting, their states as of now."""
        self._observe()
        return list(self._standbys.values())

    def _observe(self) -> None:
        """Moves each waiting standby on to the state its process and its output show; forgets
        those that died (their device gets no new one for RESTART_BACKOFF_S)."""
        for index, standby in list(self._standbys.items()):
            if _ended(standby.process):
                del self._standbys[index]
                self._backoff_until[index] = time.monotonic() + RESTART_BACKOFF_S
                self._move(standby, StandbyState.DIED, f"with code {standby.process.returncode}")
                log.error(
                    "the standby on device %d (pid %d) died; none there for %.0f s. Its output:\n%s",
                    index, standby.pid, RESTART_BACKOFF_S, standby.output_tail(),
                )
                standby.output.unlink(missing_ok=True)
            elif standby.state is StandbyState.STARTING:
                if any(isinstance(line, Ready) for line in said(standby.said()[:_TAIL_BYTES])):
                    self._move(standby, StandbyState.WARM)
            elif standby.state is StandbyState.PREPARING:
                told = said(standby.said())
                if any(isinstance(line, Prepared) for line in told):
                    self._move(standby, StandbyState.PREPARED)
                elif any(isinstance(line, PreparationFailed) for line in told):
                    self._move(standby, StandbyState.BUILD_FAILED, standby.output_tail())

    @staticmethod
    def _move(standby: Standby, target: StandbyState, detail: str = "") -> None:
        """The one place a standby's state changes (raises InvalidStandbyTransition)."""
        check_standby_transition(standby.state, target)
        now = time.monotonic()
        log.info(
            "standby on device %d (pid %d): %s -> %s after %.1f s%s",
            standby.device_index, standby.pid, standby.state.value, target.value, now - standby.since,
            f" ({detail})" if detail else "",
        )
        standby.state, standby.since = target, now

    def close(self, timeout_s: float = 5.0) -> None:
        """Kills every standby and reaps them."""
        for index in list(self._standbys):
            self._kill(index, "the agent is shutting down")
        deadline = time.monotonic() + timeout_s
        for standby in self._dying:
            try:
                standby.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("standby pid %d did not die in %.0f s", standby.pid, timeout_s)
        self._reap()

    def close_forkserver(self) -> None:
        """Ends the fork server, once the workers forked from it have been stopped (it tells their
        exit codes; a worker that outlives it is still seen to end, its code unknown)."""
        if self._forkserver is not None:
            self._forkserver.close()
            self._forkserver = None

    def _start(
        self,
        index: int,
        placement: WorkerPlacement,
        env: Mapping[str, str],
        python: str | None = None,
        job: int | None = None,
    ) -> None:
        """Starts a standby on device `index` with `env` plus the placement's, run by `python`
        (a job's environment's; None: the node's, forked from the fork server where it can be)
        and, if `job` is given, that job's from its start."""
        output = self.directory / f"device{index}-{uuid.uuid4().hex[:8]}.out"
        args = ["--module", self.worker_module, "--device", placement.device]
        env = {**env, **placement.env}
        process: subprocess.Popen[bytes] | ForkedProcess | None = None
        try:
            ready = self._forkserver is not None and self._forkserver.ready
            if ready and placement.device == "cpu" and python is None:
                process = self._fork(output, args, env, placement)
            if process is None:
                argv = [python or self.python, "-m", "elastic.worker.standby", *args]
                if self._confined_argv is not None:
                    argv = self._confined_argv(argv, env)
                with output.open("ab") as sink:
                    process = subprocess.Popen(
                        argv, env=env, stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                if placement.cpu_affinity:
                    try:
                        os.sched_setaffinity(process.pid, placement.cpu_affinity)
                    except OSError as err:
                        log.warning(
                            "could not pin standby pid %d to cores %s: %s", process.pid, sorted(placement.cpu_affinity), err
                        )
        except OSError as err:
            log.error("cannot start a standby on device %d: %s", index, err)
            self._backoff_until[index] = time.monotonic() + RESTART_BACKOFF_S
            return
        try:
            # It warms up on idle CPU only: a node's training never waits for a standby.
            os.sched_setscheduler(process.pid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as err:
            log.warning("could not give standby pid %d idle priority: %s", process.pid, err)
        assert process.stdin is not None
        try:
            fcntl.fcntl(process.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError as err:  # the system's pipe-max-size is lower: the default 64 KiB stays
            log.debug("could not grow a standby's pipe to %d bytes: %s", PIPE_BYTES, err)
        self._standbys[index] = Standby(index, placement, process, output, job, python)
        log.info(
            "standby on device %d: pid %d%s%s", index, process.pid,
            " (forked)" if isinstance(process, ForkedProcess) else "",
            f" in job {job}'s own environment ({python})" if python is not None else "",
        )

    def fork_worker(self, module: str, placement: WorkerPlacement, output: int, env: Mapping[str, str]) -> ForkedProcess | None:
        """A worker that no standby serves (none on its device, or one that may not serve it),
        forked from the fork server all the same: `python -m module` in its own session, its
        output the descriptor `output`, stdin /dev/null. A server still importing (a node that
        has just arrived, whose first worker is asked for at once) is waited for, up to its own
        deadline: the rest of its imports take less than a new interpreter's whole, which would
        also compete with it for the cores. None (the caller starts it as a new interpreter) if
        the pool forks nothing, its server did not get ready, or the slot is a GPU's."""
        server = self._forkserver
        if server is None or placement.device != "cpu" or self._forkserver_lost():
            return None
        if not server.ready:
            waited = time.monotonic()
            log.info("waiting for the fork server's imports (%.1f s in) to fork a worker",
                     waited - server.started_at)
            if not server.wait_ready(max(0.0, READY_TIMEOUT_S - (waited - server.started_at))):
                log.warning("the fork server did not get ready; starting the worker on its own")
                return None
            log.info("the fork server got ready after %.1f s more", time.monotonic() - waited)
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            return server.spawn(
                module, env, null, output, output, new_session=True, cpu_affinity=sorted(placement.cpu_affinity or ())
            )
        except ForkServerError as err:
            log.warning("could not fork a worker: %s; starting it on its own", err)
            return None
        finally:
            os.close(null)

    def _fork(self, output: Path, args: list[str], env: dict[str, str], placement: WorkerPlacement) -> ForkedProcess | None:
        """Forks a standby from the fork server, its stdin a pipe of ours and its output `output`;
        None (and logged) if the server refused or is gone: the standby then starts on its own."""
        assert self._forkserver is not None
        read, write = os.pipe()
        try:
            with output.open("ab") as sink:
                process = self._forkserver.spawn(
                    "elastic.worker.standby", env, read, sink.fileno(), sink.fileno(), args=args,
                    new_session=True, cpu_affinity=sorted(placement.cpu_affinity or ()),
                )
        except ForkServerError as err:
            os.close(write)
            log.warning("could not fork a standby: %s; starting it on its own", err)
            return None
        except OSError:
            os.close(write)
            raise
        finally:
            os.close(read)
        process.stdin = open(write, "wb", buffering=0)  # noqa: SIM115 - the standby's stdin, closed at its hand-over or end
        return process

    def _kill(self, index: int, why: str) -> None:
        standby = self._standbys.pop(index)
        self._move(standby, StandbyState.KILLED, why)
        if not _ended(standby.process):
            try:
                os.killpg(standby.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._dying.append(standby)

    def _reap(self) -> None:
        alive = []
        for standby in self._dying:
            if not _ended(standby.process):
                alive.append(standby)
            else:
                standby.output.unlink(missing_ok=True)
                if standby.process.stdin is not None and not standby.process.stdin.closed:
                    standby.process.stdin.close()
        self._dying = alive
