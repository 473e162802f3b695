"""How a worker process comes to be: the environment and WorkerConfig it starts with, and the three
ways it is started (a warm standby of its device takes it, the node's fork server forks it, or a
new interpreter starts it cold), in its own session, its output appended to a file.

The spawner owns the standby pool (agent.standby), which is not thread-safe: every use of the pool
holds the spawner's pool lock, and nothing else. Once `close_standbys` has run, no standby (and no
fork server) starts again: it marks them closed under the pool lock, and a keep reads the mark
under that lock, so that a keep that raced the agent's shutdown starts nothing to outlive it. Each
use of the pool ends by publishing its standbys' pids under a small lock of their own: who asks for
them (each report) never waits for a spawn, which may hold the pool lock for long (a fork under
load). The supervisor calls `spawn` outside its own lock, so that a slow start holds up no report.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

import elastic
from agent.devices import DeviceBackend, DeviceError, WorkerPlacement
from agent.isolation import interpreter_paths
from agent.records import RecordStore, process_start_time
from agent.standby import StandbyPool
from agent.worker_process import Process
from elastic.wire import LaunchCommand, WorkerAssignment, WorkerConfig
from elastic.worker import WORKER_CONFIG_ENV
from elastic.worker import confine as confine_module
from elastic.worker.confine import CONFINEMENT_ENV
from elastic.worker.forkserver import ForkedProcess
from elastic.worker.stop import AGENT_PID_ENV

if TYPE_CHECKING:
    from agent.settings import SupervisorConfig

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Launch:
    """A launch as the supervisor received it: what a worker of it, or a standby prepared for
    its job, is started with."""

    command: LaunchCommand
    backend: DeviceBackend
    redis_url: str
    code_dir: Path | None
    initial_model: Path | None
    python: str | None = None
    """The interpreter of the job's own environment (agent.environments); None: the node's."""


@dataclass(frozen=True)
class Spawned:
    process: Process
    start_time: int | None
    pidfd: int | None


class SpawnError(Exception):
    """The worker could not be started; the message says why."""


class WorkerSpawner:
    """Starts the node's workers and keeps its standbys. Thread-safe."""

    def __init__(self, config: SupervisorConfig, records: RecordStore, state_dir: Path) -> None:
        self.config = config
        self._records = records
        self._state_dir = state_dir
        self.standbys = (
            StandbyPool(
                state_dir / "standby",
                config.python,
                config.worker_module,
                config.standbys,
                config.prepared_per_job,
                fork=config.fork_standbys,
                confined_argv=self.confined_argv,
            )
            if config.standbys > 0
            else None
        )
        self._pool_lock = threading.Lock()
        self._standbys_closed = False
        """Set by close_standbys; read and written under the pool lock only."""
        self._pids_lock = threading.Lock()
        self._standby_pids: dict[int, int] = {}
        """pid -> device index of the pool's standbys as its last use left them (under `_pids_lock`)."""
        self._standby_interpreters: set[str] = set()
        """The interpreters those standbys run (under `_pids_lock`)."""
        self._handing_over: dict[int, int] = {}
        """pid -> device index of the standbys a spawn took whose worker the supervisor does not
        list as running yet (under `_pids_lock`): told as standbys until then, so that a report
        never finds the process in neither list (an unknown process on a GPU is its owner's)."""

    def worker_env(self) -> dict[str, str]:
        """The environment every worker of this node starts with, before its device's and its
        own config: a standby is started with it too."""
        return {
            **process_environment(),
            **socket_interface_env(self.config.node_address, os.environ),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": python_path(),
            # The agent signals its workers itself (the fork server's and standbys' too): its
            # SIGTERM is the only one a worker obeys while it lives (elastic.worker.stop).
            AGENT_PID_ENV: str(os.getpid()),
        }

    def worker_config(
        self,
        launch: Launch,
        assignment: WorkerAssignment,
        placement: WorkerPlacement,
        generation: int | None = None,
        world_size: int | None = None,
    ) -> WorkerConfig:
        """The config of `launch`'s worker `assignment` (in another `generation` or
        `world_size`, if given)."""
        command = launch.command
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
            redis_url=launch.redis_url,
            coordination_key=command.coordination_key,
            code_dir=str(launch.code_dir) if launch.code_dir is not None else None,
            entrypoint=command.spec.get("entrypoint") if launch.code_dir is not None else None,
            initial_model=str(launch.initial_model) if launch.initial_model is not None else None,
        )

    def env_of(self, config: WorkerConfig, placement: WorkerPlacement, python: str | None = None) -> dict[str, str]:
        """The whole environment of the worker `config` on `placement`, run by `python` (None:
        the node's interpreter); where jobs are confined, with its job's confinement (its
        directories made). Raises OSError if they cannot be made."""
        env = {**self.worker_env(), **placement.env, WORKER_CONFIG_ENV: config.model_dump_json()}
        return {**env, **self.confinement_env(config.job_id, config.run_dir, python or self.config.python, env)}

    def confinement_env(
        self, job_id: int, run_dir: str, python: str, env: Mapping[str, str]
    ) -> dict[str, str]:
        """CONFINEMENT_ENV for a process of job `job_id` run by `python` with `env`, where jobs
        are confined (agent.isolation); {} where they are not. Raises OSError."""
        isolation = self.config.isolation
        if isolation is None:
            return {}
        reach = {*interpreter_paths(python), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))}
        confinement = isolation.confinement(job_id, self._state_dir, run_dir, reach)
        return {CONFINEMENT_ENV: confinement.to_json()}

    def confined(
        self, job_id: int, run_dir: str, argv: list[str], env: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """`argv` and `env` of a process of job `job_id` (an export), confined where jobs are.
        Raises OSError if the job's directories cannot be made."""
        confined_env = {**env, **self.confinement_env(job_id, run_dir, argv[0], env)}
        return self.confined_argv(argv, confined_env), confined_env

    def confined_argv(self, argv: list[str], env: Mapping[str, str]) -> list[str]:
        """`argv`, run confined first if `env` says so: the node's interpreter confines the process
        (elastic.worker.confine) before `argv[0]`, maybe a job's own environment's interpreter,
        runs any of its packages' code."""
        if CONFINEMENT_ENV not in env:
            return argv
        return [self.config.python, "-I", "-S", str(confine_module.__file__), "--", *argv]

    @staticmethod
    def new_stem(command: LaunchCommand, assignment: WorkerAssignment) -> str:
        return f"job{command.job_id}-gen{command.generation}-rank{assignment.rank}-{uuid.uuid4().hex[:8]}"

    def spawn(self, launch: Launch, assignment: WorkerAssignment, stem: str) -> Spawned:
        """Starts `launch`'s worker `assignment`, its output appended to the file of `stem`, and
        logs how. Raises SpawnError."""
        try:
            placement = launch.backend.placement(assignment.device_index)
        except DeviceError as err:
            raise SpawnError(f"cannot place the worker: {err}") from err
        try:
            env = self.env_of(self.worker_config(launch, assignment, placement), placement, launch.python)
        except OSError as err:
            raise SpawnError(f"cannot make the job's directories: {err}") from err
        argv = self.confined_argv([launch.python or self.config.python, "-m", self.config.worker_module], env)
        output_path = self._records.output_path(stem)
        # A job with an environment of its own takes a standby started in it, if its device has
        # one; the fork server runs the node's environment only.
        pool = self.standbys
        how = ""
        from_standby = False  # a warm standby placed itself (its cores included) when it warmed
        try:
            # A file, not a pipe: the worker must outlive the agent. Its own session keeps it out
            # of the agent's process group and away from the agent's terminal.
            with output_path.open("ab") as output:
                process: Process | None = None
                if pool is not None:
                    # A standby prepared for the job is confined already: it opens the output
                    # through the job's own directory (agent.isolation).
                    standby_output = (
                        self.config.isolation.worker_output(launch.command.job_id, self._state_dir, output_path)
                        if self.config.isolation is not None else output_path
                    )
                    with self._pool_lock:
                        try:
                            standby = pool.take(
                                assignment.device_index, placement, standby_output, env, launch.command.job_id,
                                launch.python,
                            )
                            if standby is not None:
                                with self._pids_lock:
                                    self._handing_over[standby.pid] = assignment.device_index
                        finally:
                            self._publish_standby_pids()
                        if standby is not None:
                            process, how, from_standby = standby.process, " (a warm standby)", True
                        elif launch.python is None:
                            process = pool.fork_worker(
                                self.config.worker_module, placement, output.fileno(), env
                            )
                            how = " (forked)" if process is not None else ""
                if process is None:
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
            raise SpawnError(f"cannot start {' '.join(argv)}: {err}") from err
        if placement.cpu_affinity and not from_standby:
            try:
                os.sched_setaffinity(process.pid, placement.cpu_affinity)
            except OSError as err:
                log.warning(
                    "could not pin pid %d to cores %s: %s", process.pid, sorted(placement.cpu_affinity), err
                )
        log.info(
            "started job %d generation %d rank %d on device %d: pid %d%s",
            launch.command.job_id,
            launch.command.generation,
            assignment.rank,
            assignment.device_index,
            process.pid,
            how,
        )
        return Spawned(process, process_start_time(process.pid), _pidfd(process))

    # --- standbys ----------------------------------------------------------------------------

    def keep_standbys(
        self,
        placements: Callable[[], dict[int, WorkerPlacement]],
        growing: Callable[[], list[int]],
        prepared_env: Callable[[int, int, WorkerPlacement], dict[str, str]],
        quiet: Callable[[], bool],
        starting: Callable[[], AbstractSet[int]],
        pythons: Callable[[], Mapping[int, str]] = dict,
    ) -> None:
        """Keeps a standby on each device of `placements()` (the free devices, asked once the pool
        is free) and prepares them for the jobs `growing()` (agent.standby; those in `pythons()`,
        asked after it, in their own environments' interpreters), leaving alone the
        devices `starting()` (a worker listed there has yet to take the pool: its standby waits
        for it). Skipped, as the next call does it, while a spawn is using the pool: the report
        loop never waits for a spawn. Does nothing once close_standbys has run."""
        if self.standbys is None or not self._pool_lock.acquire(blocking=False):
            return
        try:
            if not self._standbys_closed:
                free = placements()
                # Asked after the free devices: a worker listed in between is in `starting`, and
                # the standby its spawn will take stays.
                jobs = growing()
                self.standbys.keep(free, self.worker_env(), jobs, prepared_env, quiet(), starting(), pythons())
        finally:
            self._publish_standby_pids()
            self._pool_lock.release()

    def standby_pids(self) -> dict[int, int]:
        """pid -> device index of the standbys waiting, as the pool's last use left them, and of
        those taken whose worker is not listed as running yet. Never waits for a spawn using the
        pool (the standby it takes is listed until the take is done: ours either way). Ask it
        before the supervisor's running workers: a standby is then in one answer or the other."""
        with self._pids_lock:
            return {**self._standby_pids, **self._handing_over}

    def standby_interpreters(self) -> set[str]:
        """The interpreters the standbys waiting run, as the pool's last use left them (a job's
        environment that one of them runs is in use). Never waits for a spawn."""
        with self._pids_lock:
            return set(self._standby_interpreters)

    def handed_over(self, pid: int) -> None:
        """The supervisor lists the worker of process `pid` as running now: if that process was a
        standby, standby_pids stops telling it."""
        with self._pids_lock:
            self._handing_over.pop(pid, None)

    def _publish_standby_pids(self) -> None:
        """Publishes the pool's standbys for standby_pids. Call under the pool lock, after each use
        of the pool that may start, take, kill or forget a standby."""
        assert self.standbys is not None
        pids, interpreters = self.standbys.pids(), self.standbys.interpreters()
        with self._pids_lock:
            self._standby_pids, self._standby_interpreters = pids, interpreters

    def close_standbys(self) -> None:
        """Kills the standbys, for good: keep_standbys starts none after this."""
        if self.standbys is not None:
            with self._pool_lock:
                self._standbys_closed = True
                try:
                    self.standbys.close()
                finally:
                    self._publish_standby_pids()

    def close_forkserver(self) -> None:
        if self.standbys is not None:
            with self._pool_lock:
                self.standbys.close_forkserver()


def _pidfd(process: Process) -> int | None:
    """A pidfd of the worker just started (its parent, the agent or the fork server, has not
    reaped it: the pid is still its own). None where the kernel has none (the reader then sees
    its end at its next pass)."""
    if isinstance(process, ForkedProcess) and process.ended:
        return None
    try:
        return os.pidfd_open(process.pid)
    except OSError:
        return None
