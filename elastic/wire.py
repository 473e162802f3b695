"""The messages that cross a process boundary: agent to portal (HTTP, JSON), portal to agent
(commands on a per-node Redis stream), portal to workers (the job's membership record in Redis,
see elastic.membership.redis) and worker to agent (JSON lines on the worker's stdout, which the
agent reads from a file).

Both sides import these models, so a field renamed here is renamed everywhere at once. Commands
and membership records carry the job's membership generation; an agent ignores a command older
than what it has seen, and workers act only on the newest record.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, TypeAdapter, model_validator

WORKER_EVENT_PREFIX = "@bungee "
"""A worker writes its structured events to stdout as this prefix followed by one JSON object."""


class _Message(BaseModel):
    # NaN and infinity are no JSON, and no value any message needs.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


LATEST_AT = 4.1e9
"""Unix seconds of 2099: a time past it is a broken clock or a bad report."""
MAX_LIST = 4096
"""The most items a list in a message holds (devices, samples, workers, members, step times)."""


# --- devices ---------------------------------------------------------------------------------


class DeviceInfo(_Message):
    """A device as the agent first reports it; `index` is its position on the node."""

    index: int = Field(ge=0)
    uuid: str
    name: str
    kind: Literal["gpu", "cpu-slot"]
    memory_total_bytes: int = Field(ge=0)


class DeviceProcess(_Message):
    """A process that holds memory on (or, for a CPU slot, runs on) a device."""

    pid: int = Field(ge=0, le=2**31)
    name: str = Field(max_length=255)
    memory_bytes: int = Field(ge=0, le=2**50)
    utilization_pct: float | None = Field(
        None, ge=0, le=100, description="this process's share of the device's compute, where known"
    )
    ours: bool = Field(description="started by the agent as an elastic worker")
    job_id: int | None = None


class DeviceSample(_Message):
    """One reading of one device, taken at `taken_at` (Unix seconds) by the agent."""

    index: int = Field(ge=0, le=MAX_LIST)
    taken_at: float = Field(ge=0, le=LATEST_AT)
    utilization_pct: float = Field(ge=0, le=100)
    memory_used_bytes: int = Field(ge=0, le=2**50)
    memory_total_bytes: int = Field(ge=0, le=2**50)
    temperature_c: float | None = Field(None, ge=-100, le=250)
    power_w: float | None = Field(None, ge=0, le=100_000)
    processes: list[DeviceProcess] = Field(default_factory=list, max_length=MAX_LIST)
    owner_present: bool = Field(
        False, description="a process the agent did not start is on the device: its owner is back"
    )


# --- agent to portal -------------------------------------------------------------------------


OWN_PACKAGES_FILE = "bungee-own-packages.json"
"""An OwnPackages as JSON, in the top directory of the environment it describes (the sys.prefix
of its interpreter): how a worker knows that it runs in a job's own environment, and which."""
OWN_PACKAGES_MAX_CHARS = 64 * 1024
"""The most characters a record of a job's own packages holds, all its strings together: it rides
in a worker event (a report) and in the job's manifest."""


class OwnPackages(_Message):
    """A job's own environment on a node (agent.environments): the requirements the job declared
    (`source`: the file they came from) as uv was given them (elastic.requirements.Declared.lines:
    the index lines, then each requirement, normalised and sorted), every package uv installed
    with its version, and the environment's digest. `left_out`: how many requirements and
    packages did not fit in OWN_PACKAGES_MAX_CHARS (dropped from the end; `fitted` drops them)."""

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    source: str = Field("requirements.txt", max_length=100)
    requirements: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=MAX_LIST)
    packages: dict[Annotated[str, Field(min_length=1, max_length=200)], Annotated[str, Field(max_length=200)]] = Field(
        default_factory=dict, max_length=MAX_LIST
    )
    left_out: int = Field(0, ge=0, le=2**31)

    @model_validator(mode="after")
    def _bounded(self) -> OwnPackages:
        if _chars(self.requirements, self.packages) > OWN_PACKAGES_MAX_CHARS:
            raise ValueError(f"the requirements and packages hold over {OWN_PACKAGES_MAX_CHARS} characters")
        return self

    @classmethod
    def fitted(cls, digest: str, source: str, requirements: list[str], packages: dict[str, str]) -> OwnPackages:
        """The record of these, with what does not fit in its bounds left out from the end (the
        packages first, sorted by name), and counted in `left_out`. Raises ValueError for a
        digest or source that is not one."""
        given = len(requirements) + len(packages)
        requirements = [line[:4096] for line in requirements[:MAX_LIST]]
        named = sorted((name[:200], version[:200]) for name, version in packages.items() if name)[:MAX_LIST]
        total = _chars(requirements, dict(named))
        while named and total > OWN_PACKAGES_MAX_CHARS:
            name, version = named.pop()
            total -= len(name) + len(version)
        while requirements and total > OWN_PACKAGES_MAX_CHARS:
            total -= len(requirements.pop())
        left_out = given - len(requirements) - len(named)
        return cls(digest=digest, source=source, requirements=requirements, packages=dict(named), left_out=left_out)


def _chars(requirements: list[str], packages: dict[str, str]) -> int:
    return sum(map(len, requirements)) + sum(len(name) + len(version) for name, version in packages.items())


class UserError(_Message):
    """The job's own code failed (elastic.tasks.UserCodeError): what raised, in the error's own
    words, and the traceback of the job's own files (innermost last). The worker announces it
    with its exit; the agent reports it with the worker's "exited" event; the portal quotes it in
    the failed job's message."""

    error: str = Field(max_length=2000)
    traceback: str = Field("", max_length=8000)


class WorkerKey(_Message):
    job_id: int = Field(ge=1, le=2**31 - 1)
    generation: int = Field(ge=0, le=2**31 - 1)
    rank: int = Field(ge=0, le=2**20)


class RunningWorker(WorkerKey):
    pid: int = Field(ge=0, le=2**31)
    device_index: int = Field(ge=0, le=MAX_LIST)


NODE_NAME_PATTERN = r"^[A-Za-z0-9_.\-]+$"

POOL_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.]{0,39}"
"""A pool's name (for re.fullmatch): 1 to 40 letters, digits, "_" or ".", starting with a letter
or digit. No "-", so that the prefix `<pool>-` of one pool's nodes (slurm_node_name) is never the
start of another pool's prefix (a pool "slurm" cannot name nodes that look like pool
"slurm-gpu"'s). The portal checks it on pool tokens (portal.accounts.models) and on its Slurm
pool's setting (portal.slurm.config); the agent on BUNGEE_SLURM_POOL (agent.settings)."""


def slurm_node_name(slurm_node: str, job_id: int | str, pool: str = "") -> str:
    """The node of an agent that runs as a Slurm batch job: the Slurm node and the job
    ("gpu-07-job4211"), so that two allocations on one machine are two nodes; for an agent of a
    pool, behind the pool's name ("slurm-gpu-07-job4211"), the only names its pool token may
    register. The agent registers under it (agent.slurm) and the portal's Slurm pool finds its
    agent jobs' nodes by it (portal.slurm)."""
    return f"{pool}-{slurm_node}-job{job_id}" if pool else f"{slurm_node}-job{job_id}"


class NodeRegistration(_Message):
    """An agent (re)starting. `running`: the workers it runs already, those a previous agent of
    the node started and this one took over (re-adopted); the portal keeps their rows, and any
    other worker it thought ran on the node is gone."""

    name: str = Field(min_length=1, max_length=100, pattern=NODE_NAME_PATTERN)
    address: str = Field(min_length=1, max_length=255, description="host workers of other nodes reach")
    backend: str
    devices: list[DeviceInfo]
    agent_version: str = "1"
    running: list[RunningWorker] = Field(
        default_factory=list, description="workers of an earlier agent of this node that this one re-adopted"
    )


class RegistrationReply(_Message):
    node_id: int
    commands_redis_url: str
    commands_stream: str
    report_interval_s: float
    node_token: str | None = Field(
        None,
        description="a registration with a pool token: the node's own agent token, sent this once; "
        "the agent reports, uploads, fetches and registers again with it",
    )


ExitReason = Literal["completed", "stopped", "left", "failed", "user_error"]


class WorkerEvent(WorkerKey):
    """Something a worker did. `kind` decides which of the optional fields are set:

    - started: pid, device_index (the agent spawned the process; it is warming up)
    - joined: pid, device_index; the worker is rank `rank` of generation `generation`, whose
      process group formed and whose training state it now holds. A survivor sends one at every
      resize, so its generation and rank follow it while its pid stays the same.
    - resized (rank 0 only): generation `generation` took over at `step`: members_before and
      members_after ("node/device_index"), pause_s, bytes_moved, phases (seconds per phase);
      sent a few steps later (the pause needs the pace after it) but dated (`at`) at the end of
      the first step of the new generation: when the resize landed
    - progress: step, total_steps, epoch, loss, samples_per_s, global_batch, lr; metrics, the
      named metrics the task's `loss` returned, averaged over the step's global batch
    - evaluation (rank 0): step, metrics, the task's `evaluate` over its eval_data (every
      spec.eval_every_steps, and at the end)
    - log: message
    - exited: exit_code, reason (completed, stopped, left, failed, user_error), step (last completed step);
      user_error, what the job's code raised, where it announced one
    - step_times (every rank): step_times, its compute seconds (step start to all-reduce) of
      its latest steps, oldest first: the portal finds stragglers from them
    - exiting (worker to agent only): exit_code, the code the worker is about to exit with, its
      last line, and user_error where the job's own code failed. The agent keeps them and
      reports "exited": it is how an agent that is not the worker's parent (one that re-adopted
      it) learns the code, and what a worker cut short by a signal during its teardown meant to
      say.
    - form_failed: the group of generation `failed_generation` did not form within its
      rendezvous deadline (message says why); the portal expires that generation at once
    - artifacts (rank 0): the job's model, checkpoint and manifest after `step` steps are in the
      directory `message` on the worker's node (elastic.worker.artifacts); the agent uploads
      them to the portal before it reports the event
    - environment (agent only): own_packages, the job's own environment on this node, which the
      agent built or found in its cache before it started the worker of rank `rank` in it
    """

    kind: Literal[
        "started", "joined", "resized", "progress", "log", "exited", "step_times", "exiting", "form_failed",
        "artifacts", "evaluation", "environment",
    ]
    at: float = Field(ge=0, le=LATEST_AT)
    pid: int | None = Field(None, ge=0, le=2**31)
    device_index: int | None = Field(None, ge=0, le=MAX_LIST)
    step: int | None = Field(None, ge=0, le=2**31 - 1)
    total_steps: int | None = Field(None, ge=0, le=2**31 - 1)
    epoch: float | None = Field(None, ge=0, le=1e9)
    loss: float | None = None
    samples_per_s: float | None = Field(None, ge=0)
    message: str | None = Field(None, max_length=100_000)
    exit_code: int | None = Field(None, ge=-255, le=255)
    reason: ExitReason | None = None
    members_before: list[str] | None = Field(None, max_length=MAX_LIST)
    members_after: list[str] | None = Field(None, max_length=MAX_LIST)
    pause_s: float | None = Field(
        None, ge=0, le=1e6, description="last step end before the switch to first step end after it, less a normal step"
    )
    bytes_moved: int | None = Field(None, ge=0, description="training state bytes the joiners received")
    phases: dict[str, float] | None = Field(None, max_length=64)
    step_times: list[float] | None = Field(None, max_length=MAX_LIST)
    failed_generation: int | None = Field(None, ge=1, description="form_failed: the generation that did not form")
    global_batch: int | None = Field(None, ge=1, description="progress: the global batch of the last step")
    lr: float | None = Field(None, ge=0, description="progress: the learning rate of the last step")
    metrics: dict[str, float] | None = Field(
        None, max_length=64, description="progress: the task's named training metrics; evaluation: its evaluation metrics"
    )
    own_packages: OwnPackages | None = Field(None, description="environment: the job's own packages on the node")
    user_error: UserError | None = Field(None, description="exiting, exited: what the job's own code raised")


DrainCause = Literal[
    "slurm_preemption", "slurm_time_limit", "slurm_pool_idle", "slurm_cancel", "slurm_term", "pod_eviction",
    "operator", "agent_stop",
]
DRAIN_CAUSES: dict[str, str] = {
    "slurm_preemption": "node preempted by Slurm",
    "slurm_time_limit": "Slurm time limit",
    "slurm_pool_idle": "idle, given back to Slurm",
    "slurm_cancel": "node's Slurm job cancelled",
    "slurm_term": "Slurm TERM: preemption, limit or cancel",
    "pod_eviction": "pod evicted",
    "operator": "node drained by an operator",
    "agent_stop": "node's agent stopped",
}
"""Why a node drains, as a job's timeline names it (each at most 40 characters, a resize reason).
slurm_term: a TERM from Slurm that the agent could not tell apart (squeue did not say)."""
SLURM_GIVE_BACK_COMMENT = "bungee_pool_idle"
"""The comment the portal's Slurm pool puts on an agent job it cancels because it is idle, just
before its scancel: the agent reads it (squeue's %k) to tell that TERM from an operator's cancel."""
MAX_DRAIN_S = 86_400.0


class DrainNotice(_Message):
    """A node is leaving: its devices go by `deadline_at` (Unix time), for `cause`. The agent
    repeats it in every report while it drains; the portal plans the node's jobs without it."""

    cause: DrainCause
    deadline_at: StrictFloat = Field(ge=0, le=LATEST_AT)  # strict: JSON true is no time


class AgentReport(_Message):
    """What an agent sends every report interval: fresh samples, new events, live workers; while
    it drains, its notice; and in its last report after a drain, `leaving`: its workers are gone
    and so is the agent."""

    node: str = Field(max_length=100)
    samples: list[DeviceSample] = Field(default_factory=list, max_length=MAX_LIST)
    events: list[WorkerEvent] = Field(default_factory=list, max_length=10_000)
    running: list[RunningWorker] = Field(default_factory=list, max_length=MAX_LIST)
    drain: DrainNotice | None = None
    leaving: bool = False


# --- portal to agent -------------------------------------------------------------------------


class WorkerAssignment(_Message):
    rank: int = Field(ge=0)
    device_index: int = Field(ge=0)


class LaunchCommand(_Message):
    """Generation `generation` of a job, as far as this node is concerned: start the joiners in
    `workers` (new processes), keep the job's workers on the devices in `members`, and expect the
    job's other workers here to leave by themselves (they read the membership record). Survivors
    are never restarted. Idempotent: a second copy, or a copy for a generation the agent has
    already seen or passed, changes nothing."""

    kind: Literal["launch"] = "launch"
    job_id: int
    generation: int = Field(ge=1)
    world_size: int = Field(ge=1)
    master_addr: str
    master_port: int = Field(gt=0, lt=65536)
    workers: list[WorkerAssignment] = Field(description="joiners to start on this node")
    members: list[int] = Field(
        default_factory=list, description="device indices of this node in the generation, joiners included"
    )
    spec: dict[str, Any]
    run_dir: str = Field(description="where the job's periodic checkpoint lives")
    coordination_key: str = Field(description="Redis key prefix of the job's membership records")
    redis_url: str = Field(
        description="the Redis its workers connect to, as the job's own Redis user: it reaches the job's keys only"
    )


class StopCommand(_Message):
    """Stop this node's workers of the job whose generation is below `before_generation` (only
    those on `devices`, if given). Workers finish the step in flight, save the state and exit;
    a joiner still warming up just exits."""

    kind: Literal["stop"] = "stop"
    job_id: int
    before_generation: int
    reason: Literal["resize", "cancel", "owner", "finished"] = "resize"
    devices: list[int] | None = None


class ExportCommand(_Message):
    """The job ended failed after it had trained, and no worker handed over its artifacts: once
    no worker of the job runs on this node any more, write them from the job's periodic
    checkpoint in `run_dir`, if this node holds it (elastic.worker.export), and hand them over as
    rank 0 does at a job's end."""

    kind: Literal["export"] = "export"
    job_id: int
    generation: int = Field(ge=1)
    spec: dict[str, Any]
    run_dir: str


class ExportConfig(_Message):
    """What `python -m elastic.worker.export` exports: the ExportCommand's job, with the job's own
    code where it has some (`code_dir`, as the agent fetched it, and its `entrypoint`). The
    agent (agent.export) passes it as JSON in BUNGEE_EXPORT_CONFIG."""

    job_id: int = Field(ge=1)
    generation: int = Field(ge=1)
    spec: dict[str, Any]
    run_dir: str
    code_dir: str | None = None
    entrypoint: str | None = None


class SimulateOwnerCommand(_Message):
    """Simulated backend only: play the owner of a device arriving (`present`) or leaving."""

    kind: Literal["simulate_owner"] = "simulate_owner"
    device_index: int = Field(ge=0)
    present: bool


class SimulateSlowdownCommand(_Message):
    """Simulated backend only: make a device `factor` times slower (1 is normal speed) for the
    workers started on it from now on."""

    kind: Literal["simulate_slowdown"] = "simulate_slowdown"
    device_index: int = Field(ge=0)
    factor: float = Field(ge=1.0, le=100.0)


class DrainCommand(_Message):
    """Drain this node (an operator asked, through the portal): its jobs move off it by
    `deadline_s` from now, and then the agent exits, as on SIGTERM."""

    kind: Literal["drain"] = "drain"
    deadline_s: float = Field(gt=0, le=MAX_DRAIN_S)
    cause: DrainCause = "operator"


AgentCommand = Annotated[
    LaunchCommand | StopCommand | ExportCommand | SimulateOwnerCommand | SimulateSlowdownCommand | DrainCommand,
    Field(discriminator="kind"),
]
agent_command_adapter: TypeAdapter[AgentCommand] = TypeAdapter(AgentCommand)


def parse_command(
    raw: str | bytes,
) -> LaunchCommand | StopCommand | ExportCommand | SimulateOwnerCommand | SimulateSlowdownCommand | DrainCommand:
    """Parse one command from its JSON text; raises pydantic.ValidationError if it is not one."""
    return agent_command_adapter.validate_json(raw)


# --- agent to worker -------------------------------------------------------------------------


class WorkerConfig(_Message):
    """Everything one worker process needs; the agent passes it as JSON in BUNGEE_WORKER_CONFIG.
    `generation` is the one it was launched for; the membership records in Redis under
    `coordination_key` say which generation it ends up joining, with which rank."""

    job_id: int
    generation: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str = Field(description='"cpu" or "cuda:N"')
    spec: dict[str, Any]
    run_dir: str
    node: str = Field(description="the node's name, as in the membership records")
    device_index: int = Field(ge=0)
    redis_url: str
    coordination_key: str
    code_dir: str | None = Field(
        None, description="the directory of the job's own code; None: the shipped task the spec's workload names"
    )
    entrypoint: str | None = Field(None, description="the task in code_dir, as module:ClassName")
    initial_model: str | None = Field(
        None, description="a state dict the model starts from (the spec's init_from, fetched by the agent)"
    )

    @model_validator(mode="after")
    def _code_and_entrypoint_together(self) -> WorkerConfig:
        if (self.code_dir is None) != (self.entrypoint is None):
            raise ValueError("code_dir and entrypoint go together")
        return self

    @property
    def member_key(self) -> str:
        return member_key(self.node, self.device_index)


# --- portal to workers (Redis) ---------------------------------------------------------------


def member_key(node: str, device_index: int) -> str:
    """How a worker is named in membership records: at most one worker of a job per device."""
    return f"{node}/{device_index}"


class Member(_Message):
    node: str
    device_index: int = Field(ge=0)
    address: str = Field(description="host at which the node's workers are reached")
    joiner: bool = Field(description="a new process, or one still warming up: it holds no training state")

    @property
    def key(self) -> str:
        return member_key(self.node, self.device_index)


class Membership(_Message):
    """Generation `generation` of a job: its members in rank order and where they meet.

    `has_state`: a running group holds the training state in memory; joiners mark themselves
    ready and wait for its go. Otherwise nobody holds it: the members form the group as soon as
    they are ready and rank 0 restores the periodic checkpoint (or starts the job).
    `donor`: a worker of the running group that is not a member but must hand the state over
    (no member holds it, as when a job's only worker moves); it leaves after the transfer.
    `virtual_workers`: in strict mode, how many of the job's virtual workers each member hosts
    (the scheduler gives a faster device more, elastic.consistency.placement); None: even shares.
    `global_batch`: in hybrid mode, the global batch the scheduler chose for this generation
    (the worker keeps it within the job's bounds); None: batch_per_worker times the members.
    """

    job_id: int
    generation: int = Field(ge=1)
    master_addr: str
    master_port: int = Field(gt=0, lt=65536)
    members: list[Member] = Field(min_length=1)
    has_state: bool
    donor: Member | None = None
    virtual_workers: list[int] | None = Field(
        None,
        description="strict mode: virtual workers hosted by each member, in rank order (default: even shares)",
    )
    global_batch: int | None = Field(
        None,
        ge=1,
        description="hybrid mode: the global batch the scheduler chose (default: per-worker batch times members)",
    )

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, key: str) -> int | None:
        """Returns the rank of the member named `key`, or None if it is not a member."""
        for rank, member in enumerate(self.members):
            if member.key == key:
                return rank
        return None

    def keys(self) -> list[str]:
        return [member.key for member in self.members]


def command_stream(node_name: str, prefix: str = "bungee") -> str:
    """The Redis stream that carries a node's commands (the portal names it at registration)."""
    return f"{prefix}:node:{node_name}:commands"


def coordination_key(job_id: int, prefix: str = "bungee") -> str:
    """The Redis key prefix of a job's membership records (elastic.membership.redis)."""
    return f"{prefix}:job:{job_id}"
