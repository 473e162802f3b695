"""A real one-machine Slurm for tests: munged, slurmctld and slurmd (Debian's `slurm-wlm` 22.05
and `munge`), started as root in a temporary directory with a generated `slurm.conf`, on ports
of their own, so that two test runs on one machine do not meet.

The cluster has one node (the machine's short host name) whose simulated devices are a generic
resource, `slot` (SLOTS of them), and two partitions: `pool`, low priority (PriorityTier=1),
whose jobs are preempted (REQUEUE or CANCEL) with a grace time, and `owners` (PriorityTier=10),
whose jobs preempt them. Two Bungee nodes on this machine are two allocations of that node (two
agent jobs of `slot:2`; an agent names its node from the Slurm node and the job id), or, with
`nodes=2`, two Slurm nodes: Debian's 22.05 is built with MULTIPLE_SLURMD, so two slurmd run
side by side, each on a port of its own.

Every daemon runs in the foreground as a child of the test, and is stopped by the pid we
started (slurmd's pid file may never appear). Every client command is bounded in time, and every
wait polls a condition against a deadline. Without root, or without the daemons, the tests that
use it are skipped and say why; `.ci/run` installs the packages."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.process_support import stop_process

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SLOTS = 4
GRES = "slot"
POOL = "pool"
OWNERS = "owners"
GRACE_S = 20
"""The pool partition's GraceTime: a preempted pool job has this long between its SIGTERM and
its SIGKILL."""
COMMAND_TIMEOUT_S = 20.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol")

# How quickly things happen. Slurm's defaults are for a large cluster: the backfill pass, which
# is the one that preempts here (the limited pass at submission does not), runs every 30 s, the
# full main pass every 60 s (the owner's job waited ~49 s for its preemption with them), and a
# requeued job is held back for cred_expire (120 s) before it may start again. 22.05 has no
# PreemptParameters: its preempt_* options are SchedulerParameters, and the one that matters to
# Bungee is a SlurmctldParameters:
#   sched_interval=1, bf_interval=1   the main and the backfill pass every second: an owner's job
#       preempts within about a second of its sbatch (bench/slurm_preemption.py measures it);
#   preempt_send_user_signal   the job's --signal (B:TERM for an agent job) is sent when it is
#       preempted. Without it, GraceTime's first SIGTERM goes to the job's steps only, and a batch
#       job without steps (an agent) hears nothing until its grace is over (then TERM, and KILL
#       KillWait later): no drain. A cluster that lends Bungee its idle GPUs needs this setting.
# The end of a grace is enforced on the controller's time-limit pass (every 30 s in 22.05): a job
# still there is killed between GraceTime and GraceTime + 30 s (+ KillWait) after its TERM.
SCHEDULER_PARAMETERS = "sched_interval=1,bf_interval=1"
CRED_EXPIRE_S = 10
"""How long a requeued job waits before it may start again (AuthInfo cred_expire)."""


class SlurmCommandTimeoutError(AssertionError):
    """A Slurm client command did not answer in time."""


def missing_requirements() -> str | None:
    """Why a real Slurm cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "a real Slurm needs root (slurmd runs jobs as their user); run as root or in CI"
    missing = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if missing:
        return (
            f"Slurm or munge is not installed (missing {', '.join(missing)}): "
            "apt-get install slurm-wlm munge (.ci/run does)"
        )
    return None


def skip_without_slurm() -> None:
    """Skips the calling test (or module, at import) when a real Slurm cannot run here."""
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now, distinct (held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.2) -> object:
    """Polls `condition` until it returns something true; returns that. Raises AssertionError
    naming `what` if `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)


def machine_cpus() -> int:
    return len(os.sched_getaffinity(0))


def machine_memory_mb() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024))


def node_names(host: str, nodes: int) -> list[str]:
    """The Slurm node names: the host's own for one node; host1, host2, ... for several."""
    return [host] if nodes == 1 else [f"{host}{i}" for i in range(1, nodes + 1)]


def slurm_conf(directory: Path, host: str, nodes: int, ports: Sequence[int], preempt_mode: str,
               grace_s: int, slots: int) -> str:
    """The slurm.conf of a test cluster in `directory` (the shape of
    /work/shared/slurm/slurm.conf.example, which ran on this kind of machine). `ports`: the
    controller's, then one per node. Several nodes on one machine are several slurmd, each on
    its own port (Debian's build has MULTIPLE_SLURMD); each gets the machine's CPUs."""
    names = node_names(host, nodes)
    cpus = machine_cpus()
    memory_mb = max(machine_memory_mb() // (2 * nodes), 1)
    node_lines = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
        f"RealMemory={memory_mb} Gres={GRES}:{slots} State=UNKNOWN"
        for name, port in zip(names, ports[1:], strict=True)
    )
    listed = ",".join(names)
    return f"""\
ClusterName=bungeetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
AuthType=auth/munge
AuthInfo=socket={directory}/munge.sock,cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool-%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters={SCHEDULER_PARAMETERS}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes={GRES}
PreemptType=preempt/partition_prio
PreemptMode={preempt_mode}
JobRequeue=1
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
MpiDefault=none
KillWait=5
SlurmctldParameters=preempt_send_user_signal
SlurmctldDebug=debug
{node_lines}
PartitionName={POOL} Nodes={listed} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode={preempt_mode} GraceTime={grace_s} OverSubscribe=NO
PartitionName={OWNERS} Nodes={listed} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


@dataclass
class Job:
    """One line of `squeue`: a job's id, name, partition, state and reason."""

    id: int
    name: str
    partition: str
    state: str
    reason: str


@dataclass
class SlurmCluster:
    """A running test cluster. `env` is the environment for Slurm client commands (this
    process's, with SLURM_CONF); `nodes` are the Slurm nodes' names, each with `slots` of the
    gres `gres`."""

    directory: Path
    env: dict[str, str]
    nodes: list[str]
    preempt_mode: str
    grace_s: int
    slots: int
    pool: str = POOL
    owners: str = OWNERS
    gres: str = GRES
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    def run(self, *args: str, timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Runs a Slurm client command against this cluster; raises SlurmCommandTimeoutError if it
        hangs, AssertionError (with its stderr) if it fails and `check`."""
        try:
            done = subprocess.run(
                list(args), env=self.env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd
            )
        except subprocess.TimeoutExpired:
            raise SlurmCommandTimeoutError(f"{' '.join(args)} did not answer within {timeout_s:g} s") from None
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, *options: str, script: str | None = None, wrap: str | None = None,
               cwd: Path | None = None) -> int:
        """Submits a batch job (a script's text, or a --wrap command); returns its id."""
        args = ["sbatch", "--parsable", *options]
        if wrap is not None:
            args.append(f"--wrap={wrap}")
        elif script is not None:
            path = Path(tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.directory)[1])
            path.write_text(script)
            args.append(str(path))
        done = self.run(*args, cwd=cwd or self.directory)
        return int(done.stdout.strip().split(";")[0])

    def jobs(self) -> dict[int, Job]:
        """Every job the controller still knows, finished ones included (for MinJobAge)."""
        done = self.run("squeue", "--noheader", "--states=all", "--format=%i|%j|%P|%T|%r")
        found: dict[int, Job] = {}
        for line in done.stdout.splitlines():
            job_id, name, partition, state, reason = line.strip().split("|", 4)
            found[int(job_id)] = Job(int(job_id), name, partition, state, reason)
        return found

    def state(self, job_id: int) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, PREEMPTED, ...), or "" if unknown."""
        job = self.jobs().get(job_id)
        return job.state if job else ""

    def wait_for_state(self, job_id: int, states: Sequence[str], timeout_s: float) -> str:
        """Waits until the job is in one of `states`; returns it."""
        return str(wait_until(
            lambda: (s := self.state(job_id)) in states and s,
            timeout_s,
            f"job {job_id} in {'/'.join(states)} (it is {self.state(job_id) or 'unknown'})",
        ))

    def scancel(self, *job_ids: int) -> None:
        if job_ids:
            self.run("scancel", *map(str, job_ids))

    def cancel_all(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Cancels every job and waits until none is left pending, running or completing."""
        alive = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "REQUEUED", "RESIZING")

        def left() -> list[int]:
            return [j.id for j in self.jobs().values() if j.state in alive]

        if left():
            self.run("scancel", "--full", *map(str, left()), check=False)
        wait_until(lambda: not left(), timeout_s, "every job of the test cluster ended")

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo shows it (idle, mix, alloc, down*, ...)."""
        done = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
        if done.returncode != 0:
            return {}
        return dict(line.split() for line in done.stdout.splitlines() if line.strip())

    def stop_controller(self) -> None:
        """Stops slurmctld (its state stays in StateSaveLocation): the controller outage a pool
        must live through. The jobs and slurmd run on."""
        stop_process(self.processes["slurmctld"], timeout_s=STOP_TIMEOUT_S)

    def start_controller(self) -> None:
        """Starts slurmctld again from its saved state (no -c: the jobs are kept) and waits until
        it answers and every node is back."""
        _start(self, "slurmctld", ["slurmctld", "-D"])
        wait_until(lambda: _alive(self, "slurmctld") and "UP" in self.run(
            "scontrol", "ping", check=False, timeout_s=5).stdout, START_TIMEOUT_S, "slurmctld answering again")
        wait_until(lambda: all(self.node_states().get(node) in ("idle", "mix", "alloc") for node in self.nodes),
                   START_TIMEOUT_S, "every node responding to slurmctld again")

    def log(self, daemon: str) -> str:
        """A daemon's log, for a failure message."""
        path = self.directory / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def pool_platform(work: Path, cluster: SlurmCluster, agent_args: str, extra_env: dict[str, str]) -> Iterator[Any]:
    """The whole platform (tests.platform) with the portal's Slurm pool on `cluster`'s pool
    partition, its agents started with `agent_args` in the Celery worker's environment (the test's
    database, Redis and data directory, and `extra_env` over all), their pool token in
    WORK/pool.token; no agent of its own."""
    import sys

    from tests.platform import ROOT, free_port, running_platform

    token_file = work / "pool.token"
    port = free_port()
    env = {
        "SLURM_CONF": cluster.env["SLURM_CONF"],
        "BUNGEE_SLURM_ENABLED": "true",
        "BUNGEE_SLURM_POOL": "slurm",
        "BUNGEE_SLURM_PARTITION": cluster.pool,
        "BUNGEE_SLURM_GRES": f"{cluster.gres}:1",
        "BUNGEE_SLURM_IDLE_S": "5",
        "BUNGEE_SLURM_EVERY_S": "1",
        "BUNGEE_SLURM_TOKEN_FILE": str(token_file),
        "BUNGEE_SLURM_PYTHON": sys.executable,
        "BUNGEE_SLURM_WORKDIR": str(ROOT),
        "BUNGEE_SLURM_OUTPUT": str(work / "agents" / "%x-%j.out"),
        "BUNGEE_SLURM_AGENT_ARGS": agent_args,
        "BUNGEE_SLURM_EXPORT": "ALL",
        "BUNGEE_SLURM_PORTAL_URL": f"http://127.0.0.1:{port}",
        **extra_env,
    }
    with running_platform(work, {}, env, port=port) as running:
        token = running.group.run("manage.py", "create_token", "alice", "--role", "pool", "--pool", "slurm").strip()
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        yield running
    cluster.cancel_all()


def _start(cluster: SlurmCluster, name: str, args: list[str]) -> None:
    output = open(cluster.directory / f"{name}.out", "wb")  # noqa: SIM115 (closed with the process)
    cluster.processes[name] = subprocess.Popen(
        args, env=cluster.env, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    output.close()


def _alive(cluster: SlurmCluster, name: str) -> bool:
    process = cluster.processes[name]
    if process.poll() is not None:
        tail = (cluster.directory / f"{name}.out").read_text(errors="replace")[-2000:]
        raise AssertionError(f"{name} exited {process.returncode} while starting: {tail}{cluster.log(name)[-2000:]}")
    return True


def _stop(cluster: SlurmCluster) -> None:
    """Stops the daemons we started, by pid, newest first: SIGTERM, then SIGKILL past the
    deadline."""
    for name in reversed(list(cluster.processes)):
        process = cluster.processes[name]
        if process.poll() is None:
            stop_process(process, timeout_s=STOP_TIMEOUT_S)


@contextlib.contextmanager
def slurm_cluster(preempt_mode: str = "REQUEUE", grace_s: int = GRACE_S, nodes: int = 1,
                  slots: int = SLOTS) -> Iterator[SlurmCluster]:
    """Starts a test cluster of `nodes` Slurm nodes with `slots` slots each, and yields it once
    every node is idle; on exit cancels every job and stops the daemons. Skips the test if a
    real Slurm cannot run here."""
    skip_without_slurm()
    if preempt_mode not in ("REQUEUE", "CANCEL"):
        raise ValueError(f"preempt_mode={preempt_mode!r}: the pool partition preempts by REQUEUE or CANCEL")
    host = socket.gethostname().split(".")[0]
    names = node_names(host, nodes)
    with tempfile.TemporaryDirectory(prefix="bungee-slurm-") as name:
        directory = Path(name)
        directory.chmod(0o711)  # munged wants its socket's directory searchable by everyone
        (directory / "state").mkdir()
        key = os.open(directory / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(key, "wb") as out:
            out.write(os.urandom(1024))
        conf = slurm_conf(directory, host, nodes, free_ports(1 + nodes), preempt_mode, grace_s, slots)
        (directory / "slurm.conf").write_text(conf)
        (directory / "gres.conf").write_text(
            "".join(f"NodeName={n} Name={GRES} Count={slots}\n" for n in names)
        )
        env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
        for variable in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SQUEUE_")) and v != "SLURM_CONF"]:
            del env[variable]  # a test run inside a Slurm job must not aim at that job's cluster
        cluster = SlurmCluster(directory=directory, env=env, nodes=names, preempt_mode=preempt_mode,
                               grace_s=grace_s, slots=slots)
        try:
            _start(cluster, "munged", [
                "munged", "--foreground", f"--key-file={directory}/munge.key",
                f"--socket={directory}/munge.sock", f"--pid-file={directory}/munged.pid",
                f"--log-file={directory}/munged.log", f"--seed-file={directory}/munge.seed",
            ])
            wait_until(lambda: _alive(cluster, "munged") and (directory / "munge.sock").exists(),
                       START_TIMEOUT_S, "munged listening")
            _start(cluster, "slurmctld", ["slurmctld", "-D", "-c"])
            wait_until(lambda: _alive(cluster, "slurmctld") and "UP" in cluster.run(
                "scontrol", "ping", check=False, timeout_s=5).stdout,
                START_TIMEOUT_S, "slurmctld answering")
            for node in names:
                (directory / f"spool-{node}").mkdir()
                _start(cluster, f"slurmd-{node}", ["slurmd", "-D", "-N", node])

            def all_idle() -> bool:
                return all(_alive(cluster, f"slurmd-{n}") for n in names) and all(
                    cluster.node_states().get(n) == "idle" for n in names)

            wait_until(all_idle, START_TIMEOUT_S, f"nodes {', '.join(names)} idle in sinfo")
            yield cluster
        finally:
            try:
                if "slurmctld" in cluster.processes and cluster.processes["slurmctld"].poll() is None:
                    cluster.cancel_all()
            finally:
                _stop(cluster)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A test cluster for the module (pool jobs requeued on preemption); each test leaves it
    with no job (see `no_jobs_left`)."""
    with slurm_cluster() as cluster:
        yield cluster


@pytest.fixture
def slurm_clean(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The module's cluster, every job cancelled after the test."""
    yield slurm
    slurm.cancel_all()
