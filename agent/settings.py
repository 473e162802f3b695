"""The agent's configuration: its settings (AgentSettings, one field per flag of `python -m agent`,
each with its type, default, bounds, environment variable and help), the command line built from
them (typer: one option per field, named after it), and the configuration the agent runs with
(AgentConfig: the settings resolved against the token file and the Slurm allocation), from
which the worker supervisor's own configuration is made (supervisor_config).

A value given as a flag wins over the field's variable. A bad value, a missing token or a Slurm
job the agent cannot serve exits 2 (a usage error), quoting the flag or the variable and the
value.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NoReturn

import typer
from pydantic import Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from typer.core import TyperCommand

from agent import slurm as slurm_job
from agent.devices import GpuSelection, backend_names
from agent.devices.simulated import MAX_PACE
from agent.environments import DEFAULT_BUILD_DEADLINE_S, DEFAULT_MAX_BYTES
from agent.isolation import JOB_UID_COUNT, JobIsolation, confinement_works
from elastic.environ_settings import EnvironSettings, SettingsError, refusal
from elastic.wire import POOL_NAME_PATTERN, NodeRegistration

PROGRAM = "python -m agent"
PROJECT_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_STANDBYS = 8
"""`--standbys on`: a standby on each free device of a node of up to 8 (a full GPU server); a
node with more free devices (a simulated one of hundreds) keeps 8, not hundreds of processes."""

DEFAULT_PREPARED = 2
"""Standbys prepared a job: its next two workers here skip their build (a standby holds a model
built for the job, on its free device, until the job takes it or stops growing here)."""

OPTIONAL_VALUE = {"slurm": "on"}
"""Flags that may be given alone, and the value they then take (`--slurm` is `--slurm on`)."""


class AgentSettings(EnvironSettings):
    """`python -m agent`'s settings: field `x_y` is flag `--x-y`, read from its variable when the
    flag is not given."""

    portal: str = Field(
        "http://127.0.0.1:8000", validation_alias="BUNGEE_PORTAL_URL", description="the portal's base URL"
    )
    token_file: Path | None = Field(
        None,
        validation_alias="BUNGEE_AGENT_TOKEN_FILE",
        description="a file holding the agent token the portal issued, readable by the agent's user only (the "
        "way to pass it: a --token shows in every local user's ps)",
    )
    token: str | None = Field(
        None, validation_alias="BUNGEE_AGENT_TOKEN", description="the agent token itself, if no --token-file"
    )
    name: str | None = Field(
        None,
        validation_alias="BUNGEE_NODE_NAME",
        description="this node's name (default: the machine's host name)",
    )
    address: str = Field(
        "127.0.0.1",
        validation_alias="BUNGEE_NODE_ADDRESS",
        description="the host name or IP at which workers on other nodes reach this node",
    )
    backend: str = Field(
        "auto",
        validation_alias="BUNGEE_DEVICE_BACKEND",
        description="device backend: nvml, simulated, or auto (nvml if it finds a GPU, else simulated)",
    )
    devices: int | None = Field(
        None,
        ge=1,
        validation_alias="BUNGEE_SIM_DEVICES",
        description="number of simulated slots (default: one per CPU)",
    )
    sim_pace: float = Field(
        1.0,
        ge=1,
        le=MAX_PACE,
        validation_alias="BUNGEE_SIM_PACE",
        description="simulated slots only: stretch each step by this factor, the worker sleeping after each step "
        "for this less one times the CPU time it took, as a GPU's step leaves its host's CPU mostly idle: a "
        "worker keeps at most 1/pace of a core busy, and several simulated nodes (a demo, a test suite) share a "
        "few cores without every worker running flat out; 1 runs flat out",
    )
    redis_url: str | None = Field(
        None,
        validation_alias="BUNGEE_AGENT_REDIS_URL",
        description="Redis URL for the command stream, instead of the one the portal hands out (with its node's "
        "own Redis user); give it a user that may only read this node's stream (docs/operator/security.md)",
    )
    report_interval: float | None = Field(
        None,
        gt=0,
        validation_alias="BUNGEE_REPORT_INTERVAL_S",
        description="seconds between reports (default: what the portal says at registration)",
    )
    stop_grace: float = Field(
        30.0,
        ge=0,
        validation_alias="BUNGEE_STOP_GRACE_S",
        description="seconds a worker has after SIGTERM to save and exit before SIGKILL",
    )
    on_term: Literal["drain", "stop"] = Field(
        "drain",
        validation_alias="BUNGEE_AGENT_ON_TERM",
        description="what SIGTERM does: drain (the node leaves gracefully: the portal moves its jobs off it, "
        "each shrinking in place at its next step, and the agent exits once its workers are gone or at "
        "--drain-deadline; what Slurm's preemption and time limit and a Kubernetes eviction need) or stop "
        "(the workers save their step and exit at once); SIGINT always stops, and so does a second SIGTERM",
    )
    drain_deadline: float = Field(
        60.0,
        gt=0,
        validation_alias="BUNGEE_DRAIN_DEADLINE_S",
        description="seconds a drain may take; then the workers still here save and exit (give the cluster "
        "engine's grace period this plus --stop-grace)",
    )
    worker_module: str = Field(
        "elastic.worker",
        validation_alias="BUNGEE_WORKER_MODULE",
        description="the module each worker runs as `python -m MODULE`",
    )
    standbys: int = Field(
        DEFAULT_STANDBYS,
        ge=0,
        validation_alias="BUNGEE_STANDBYS",
        description="keep a warm standby worker on each free device, so that a joiner starts in well under a "
        "second (each costs a process with torch imported, a few hundred MB; on a GPU, its context): on (up "
        f"to {DEFAULT_STANDBYS} a node), off, or the most to keep; they start one at a time",
    )
    prepared_standbys: int = Field(
        DEFAULT_PREPARED,
        ge=0,
        validation_alias="BUNGEE_PREPARED_STANDBYS",
        description="of those standbys, prepare up to this many for each job that may grow on this node: they "
        "build its model before a worker is asked for, so that a joiner taken from one also skips its build "
        "(each holds one model on its free device); 0: none",
    )
    standby_start: Literal["fork", "exec"] = Field(
        "fork",
        validation_alias="BUNGEE_STANDBY_START",
        description="how a standby on a CPU slot starts: fork (forked from one process of the node that has "
        "imported torch and the worker runtime once: milliseconds, its libraries' memory shared) or exec (a "
        "new interpreter that imports them: seconds of CPU each); with fork, a worker no standby serves is "
        "forked too; a GPU's standby and worker always start as their own process",
    )
    env_dir: Path | None = Field(
        None,
        validation_alias="BUNGEE_ENV_DIR",
        description="where jobs' own Python environments (a requirements.txt with their code) are built and "
        "cached (default: STATE_DIR/environments)",
    )
    env_find_links: str = Field(
        "",
        validation_alias="BUNGEE_ENV_FIND_LINKS",
        description="wheelhouses (directories or URLs, separated by spaces) that jobs' packages may come from, "
        "beside the index uv or pip is configured with (UV_INDEX_URL, PIP_INDEX_URL; UV_OFFLINE=1: the "
        "wheelhouses only)",
    )
    env_index_options: bool = Field(
        False,
        validation_alias="BUNGEE_ENV_INDEX_OPTIONS",
        description="on: a job's requirements.txt may name its own index or wheelhouse (--index-url, "
        "--extra-index-url, --find-links, --no-index); set the portal's BUNGEE_ENV_INDEX_OPTIONS alike",
    )
    env_build_deadline: float = Field(
        DEFAULT_BUILD_DEADLINE_S,
        gt=0,
        validation_alias="BUNGEE_ENV_BUILD_DEADLINE_S",
        description="seconds a job's environment may take to build before the job fails",
    )
    env_cache_gb: float = Field(
        DEFAULT_MAX_BYTES / 1024**3,
        gt=0,
        validation_alias="BUNGEE_ENV_CACHE_GB",
        description="the most disk the cached environments may take, in GiB; the least recently used ones not "
        "in use go first",
    )
    data_dir: Path = Field(
        PROJECT_ROOT / "var",
        validation_alias="BUNGEE_DATA_DIR",
        description="the data directory (the portal's, where they share a machine): the state directory is "
        "DATA_DIR/agent/NAME unless --state-dir says otherwise",
    )
    state_dir: Path | None = Field(
        None,
        validation_alias="BUNGEE_AGENT_STATE_DIR",
        description="where the workers' output and records live, so that a restarted agent takes its workers "
        "back (default: DATA_DIR/agent/NAME)",
    )
    slurm: Literal["auto", "on", "off"] = Field(
        "auto",
        validation_alias="BUNGEE_SLURM",
        description="run as a Slurm batch job, the node being the allocation (named NODE-jobID, its GPUs or a "
        "count of slots, see agent.slurm): on (--slurm alone), off, or auto (when SLURM_JOB_ID is set)",
    )
    slurm_pool: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_POOL",
        description="in a Slurm job: the portal's Slurm pool the agent job belongs to (the pool's batch script "
        "sets it); the node is then named POOL-NODE-jobID, the names the pool's token may register",
    )
    slurm_signal: float | None = Field(
        None,
        ge=0,
        validation_alias="BUNGEE_SLURM_SIGNAL_S",
        description="in a Slurm job: how many seconds before its time limit Slurm sends it SIGTERM (its "
        "--signal=B:TERM@N; the pool's batch script sets it), which tells a time limit's SIGTERM from a "
        "preemption's (default: --drain-deadline)",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", validation_alias="BUNGEE_LOG_LEVEL", description="logging level"
    )
    isolation: Literal["auto", "uid", "namespaces", "none"] = Field(
        "auto",
        validation_alias="BUNGEE_AGENT_ISOLATION",
        description="how jobs' processes are kept from the platform's secrets and each other: uid (each job "
        "as a uid of its own, in a mount namespace where the agent's state, data and token file are out of "
        "sight, with a private /tmp; the agent must run as root), namespaces (the same out of sight, for an "
        "agent that is not root: the job keeps the agent's uid, in user namespaces of its own, the machine "
        "read-only to it but for its own directories), none (as the agent's user, seeing what it sees), or "
        "auto (uid as root, else namespaces where user namespaces work, else none, said in the log)",
    )
    job_uid_base: int = Field(
        200_000,
        ge=1000,
        validation_alias="BUNGEE_AGENT_JOB_UID_BASE",
        description="with --isolation uid: job N runs as uid and gid BASE + N modulo 1,048,576; keep that "
        "range free of the machine's own users",
    )
    liveness_file: Path | None = Field(
        None,
        validation_alias="BUNGEE_LIVENESS_FILE",
        description="a file touched at every turn of the registration and report loops, for an exec probe "
        "(python -m elastic.liveness FILE --max-age S); unset: none is written",
    )

    @field_validator("job_uid_base")
    @classmethod
    def _uids_left(cls, value: int) -> int:
        if value + JOB_UID_COUNT > 2**32 - 2:
            raise ValueError(f"leaves fewer than {JOB_UID_COUNT} uids below 4294967294")
        return value

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in backend_names():
            raise ValueError(f"is not one of {', '.join(backend_names())}")
        return value

    @field_validator("slurm_pool", mode="before")
    @classmethod
    def _pool_name(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.strip()
            if value and not re.fullmatch(POOL_NAME_PATTERN, value):
                raise ValueError("is not a pool's name (1 to 40 letters, digits, _ or ., no -)")
        return value

    @field_validator("standbys", mode="before")
    @classmethod
    def _on_or_off(cls, value: object) -> object:
        if value in ("on", "off"):
            return DEFAULT_STANDBYS if value == "on" else 0
        if isinstance(value, str) and not value.lstrip("-").isdigit():
            raise ValueError("is not on, off or a number of standbys")
        return value

    def agent_config(self, allocation: slurm_job.SlurmAllocation | None) -> AgentConfig:
        """The configuration the agent runs with, inside `allocation` if it is a Slurm job's.
        Raises ValueError, quoting the value, for a token it cannot read or a bad node name."""
        token = self.token
        if self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except OSError as err:
                raise ValueError(
                    f"cannot read the agent token from --token-file {str(self.token_file)!r}: {err.strerror}"
                ) from None
            if not token:
                raise ValueError(f"the token file {str(self.token_file)!r} is empty")
        if not token:
            raise ValueError(
                "an agent token is required: pass --token-file (or set BUNGEE_AGENT_TOKEN_FILE, or BUNGEE_AGENT_TOKEN)"
            )
        name = self.name or socket.gethostname()
        backend = slurm_job.backend_for(allocation, self.backend) if allocation is not None else self.backend
        try:
            NodeRegistration(name=name, address=self.address, backend=backend, devices=[])
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise ValueError(f"invalid node name {name!r} or address {self.address!r}: {problems}") from None
        return AgentConfig(
            portal_url=self.portal,
            token=token,
            node_name=name,
            address=self.address,
            backend=backend,
            sim_devices=self.devices,
            sim_pace=self.sim_pace,
            redis_url=self.redis_url or None,
            report_interval_s=self.report_interval,
            stop_grace_s=self.stop_grace,
            on_term=self.on_term,
            drain_deadline_s=self.drain_deadline,
            worker_module=self.worker_module,
            log_level=self.log_level,
            standbys=self.standbys,
            prepared_standbys=self.prepared_standbys,
            standby_start=self.standby_start,
            gpus=slurm_job.gpu_selection(allocation, backend),
            state_dir=(self.state_dir or self.data_dir / "agent" / name).resolve(),
            state_dir_of_one_job=allocation is not None and self.state_dir is None and name == allocation.node_name,
            env_dir=self.env_dir.resolve() if self.env_dir else None,
            env_find_links=tuple(self.env_find_links.split()),
            env_build_deadline_s=self.env_build_deadline,
            env_cache_bytes=int(self.env_cache_gb * 1024**3),
            env_index_options=self.env_index_options,
            slurm_signal_s=self.slurm_signal,
            slurm_job_id=allocation.job_id if allocation is not None else None,
            liveness_file=self.liveness_file,
            isolation=self._isolation(),
            job_uid_base=self.job_uid_base,
            token_file=self.token_file.resolve() if self.token_file is not None else None,
            data_dir=self.data_dir.resolve(),
        )

    def _isolation(self) -> str:
        """uid, namespaces or none, as --isolation asks and this machine allows (auto: the first
        that works of uid as root, namespaces otherwise). Raises ValueError, saying why, for one
        that was asked for and cannot be had."""
        root = os.geteuid() == 0
        if self.isolation == "none":
            return "none"
        if self.isolation == "uid" and not root:
            raise ValueError(
                f"--isolation uid needs the agent to run as root (it runs as uid {os.geteuid()}): "
                "run it as root, or pass --isolation namespaces"
            )
        if self.isolation == "namespaces" and root:
            raise ValueError("--isolation namespaces is for an agent that is not root: as root, pass --isolation uid")
        mode = "uid" if root else "namespaces"
        why_not = confinement_works(unprivileged=not root)
        if why_not is None:
            return mode
        if self.isolation != "auto":
            raise ValueError(f"--isolation {mode} cannot confine jobs on this machine: {why_not}")
        logging.getLogger(__name__).warning(
            "jobs run as the agent's user and see what it sees: confining them (%s) does not work here: %s. "
            "See docs/operator/security.md", mode, why_not,
        )
        return "none"


@dataclass(frozen=True)
class SupervisorConfig:
    """The worker supervisor's configuration (agent.supervisor); the agent makes it from its own
    (AgentConfig.supervisor_config)."""

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
    none); agent.standby_keeper says which devices are free. The agent keeps up to 8 unless told
    otherwise (--standbys)."""
    prepared_per_job: int = 0
    """Prepare up to this many of those standbys for each job that may grow on this node (its
    model built before a worker is asked for: agent.standby); 0: none. The agent prepares up to
    2 unless told otherwise (--prepared-standbys)."""
    isolation: JobIsolation | None = None
    """How jobs' processes are confined (agent.isolation); None: they run as the agent's user."""
    fork_standbys: bool = False
    """Fork the standbys of CPU slots from the node's fork server (elastic.worker.forkserver)
    rather than start each as a new interpreter. The agent does unless told otherwise
    (--standby-start)."""

    def grace_s(self, joined: bool) -> float:
        """How long a worker has between SIGTERM and SIGKILL: the stop grace, or the short one if
        it never `joined` a group (it has nothing to save)."""
        return self.stop_grace_s if joined else min(self.warming_stop_grace_s, self.stop_grace_s)


@dataclass(frozen=True)
class AgentConfig:
    """What the agent runs with: its settings resolved (the token read, the node named, the
    backend and GPUs of a Slurm allocation, the state directory found)."""

    portal_url: str
    token: str
    node_name: str
    address: str
    backend: str
    sim_devices: int | None
    redis_url: str | None
    report_interval_s: float | None
    stop_grace_s: float
    worker_module: str
    log_level: str
    state_dir: Path
    state_dir_of_one_job: bool = False
    """The state directory is the default one of a Slurm job's node (named after the job): no
    later agent uses it, so a drained agent removes it on its way out."""
    standbys: int = DEFAULT_STANDBYS
    """The most warm standby workers the node keeps (0: none)."""
    prepared_standbys: int = DEFAULT_PREPARED
    """The most of them prepared for one job that may grow here (0: none)."""
    standby_start: str = "fork"
    """How a standby on a CPU slot starts: "fork" (from the node's fork server, which imported
    the worker runtime once) or "exec" (a new interpreter that imports it)."""
    sim_pace: float = 1.0
    """Simulated slots only: the factor by which every step's compute is stretched (1: none)."""
    on_term: str = "drain"
    """What SIGTERM does: "drain" (the node leaves gracefully: agent.drain) or "stop" (the
    workers save and exit at once)."""
    drain_deadline_s: float = 60.0
    """How long a drain may take before the agent stops what is left."""
    gpus: GpuSelection | None = None
    """nvml only: the machine's GPUs that are this node's (a Slurm allocation's); None: all."""
    env_dir: Path | None = None
    """Where jobs' own environments are cached (agent.environments); None: STATE_DIR/environments."""
    env_find_links: tuple[str, ...] = ()
    """Wheelhouses the environments' packages may come from, beside the node's index."""
    env_build_deadline_s: float = DEFAULT_BUILD_DEADLINE_S
    env_cache_bytes: int = DEFAULT_MAX_BYTES
    env_index_options: bool = False
    """Jobs' requirements may name where packages come from (as the portal's setting of the same name)."""
    slurm_signal_s: float | None = None
    """In a Slurm job: how long before its time limit Slurm signals it; None: drain_deadline_s."""
    slurm_job_id: str | None = None
    """The Slurm job the agent serves (agent.slurm.detect); None: it serves none, and a TERM is
    not Slurm's to explain."""
    liveness_file: Path | None = None
    """The file the agent's loops touch for an exec probe (elastic.liveness); None: none."""
    isolation: str = "none"
    """"uid" or "namespaces": jobs' processes are confined (agent.isolation); "none": they run as
    the agent's user."""
    job_uid_base: int = 200_000
    token_file: Path | None = None
    data_dir: Path | None = None

    def supervisor_config(self) -> SupervisorConfig:
        """The worker supervisor's configuration on this node."""
        return SupervisorConfig(
            worker_module=self.worker_module,
            stop_grace_s=self.stop_grace_s,
            node_name=self.node_name,
            node_address=self.address,
            state_dir=self.state_dir,
            standbys=self.standbys,
            prepared_per_job=self.prepared_standbys,
            fork_standbys=self.standby_start == "fork",
            isolation=self.job_isolation(),
        )

    def job_isolation(self) -> JobIsolation | None:
        """How this node confines jobs, or None where it does not."""
        if self.isolation == "none":
            return None
        hide = [self.state_dir, self.env_dir, self.data_dir, self.token_file]
        if self.isolation == "namespaces":  # the agent's user's own files (its keys, its CLI's token) too
            hide.append(Path.home())
        return JobIsolation(self.job_uid_base, JOB_UID_COUNT, tuple(str(p) for p in hide if p is not None),
                            unprivileged=self.isolation == "namespaces")


# --- the command line --------------------------------------------------------------------------


def _shown_default(field: FieldInfo) -> str | None:
    """A field's default as its help shows it (None: no default worth showing)."""
    value = field.default
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def flag_help(name: str) -> str:
    """The help of field `name`'s flag: its description, its variable and its default."""
    field = AgentSettings.model_fields[name]
    shown = _shown_default(field)
    variable = AgentSettings.variable(name)
    where = f" (env {variable}; default {shown})" if shown is not None else f" (env {variable})"
    return f"{field.description}{where}"


def command_line(take: Callable[[dict[str, str]], None]) -> TyperCommand:
    """`python -m agent`'s command line: one option per AgentSettings field, each a string that
    the settings parse (so that a bad value reads the same from a flag as from a variable); it
    hands `take` the flags given, by field."""
    parameters = []
    for name in AgentSettings.model_fields:
        option = typer.Option(
            None,
            AgentSettings.flag(name),
            help=flag_help(name),
            metavar=name.upper(),
            show_default=False,
        )
        parameters.append(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=str | None)
        )

    def given(**flags: str | None) -> None:
        take({name: value for name, value in flags.items() if value is not None})

    given.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    app = typer.Typer(
        add_completion=False,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.command(
        help="Bungee node agent: registers this node with the portal, reports its devices and runs the elastic "
        "workers the portal assigns to it."
    )(given)
    command = typer.main.get_command(app)
    assert isinstance(command, TyperCommand)  # one command, no group
    return command


def _usage_error(message: str) -> NoReturn:
    """Exits 2, as a usage error does, saying what is wrong."""
    print(f"usage: {PROGRAM} [OPTIONS] (see --help)\n{PROGRAM}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _with_optional_values(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of each OPTIONAL_VALUE flag given alone (last, or before another
    flag) written out: click's options take a value or none, never either."""
    spelled = {AgentSettings.flag(name): value for name, value in OPTIONAL_VALUE.items()}
    written = []
    for index, word in enumerate(argv):
        written.append(word)
        alone = index + 1 == len(argv) or argv[index + 1].startswith("-")
        if word in spelled and alone:
            written.append(spelled[word])
    return written


def parse_flags(argv: Sequence[str] | None) -> dict[str, str]:
    """The flags given in `argv` (None: the process's), by field; exits 2 on an unknown flag or
    one missing its value (typer says which), and 0 after --help."""
    taken: list[dict[str, str]] = []
    try:
        command_line(taken.append).main(
            args=_with_optional_values(sys.argv[1:] if argv is None else argv), prog_name=PROGRAM
        )
    except SystemExit as done:
        if done.code not in (0, None) or not taken:  # a usage error, or --help
            raise
    return taken[0]


def read_settings(flags: Mapping[str, str], environ: Mapping[str, str]) -> AgentSettings:
    """The settings from `flags`, then `environ`; exits 2 quoting each bad value with the flag
    or the variable it came from."""
    try:
        return AgentSettings.from_environ(environ, **flags)
    except SettingsError as err:
        _usage_error(refusal(AgentSettings, err.error, {name: AgentSettings.flag(name) for name in flags}))


def parse_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> AgentConfig:
    """The configuration from `argv` and `environ`; exits 2 with a usage message if a value is
    missing or wrong. Inside a Slurm allocation (agent.slurm) the variables' values are the
    allocation's where it has them; a flag still wins."""
    flags = parse_flags(argv)
    settings = read_settings(flags, environ)
    try:
        allocation = slurm_job.detect(settings.slurm, environ, settings.slurm_pool)
        if allocation is not None:
            environ = slurm_job.agent_environ(environ, allocation, socket.gethostname())
            settings = read_settings(flags, environ)
        return settings.agent_config(allocation)
    except ValueError as err:  # SlurmEnvironmentError is one
        _usage_error(str(err))
