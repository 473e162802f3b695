"""The messages that cross a process boundary: agent to portal (HTTP, JSON), portal to agent
(commands on a per-node Redis stream) and worker to agent (JSON lines on the worker's stdout).

Both sides import these models, so a field renamed here is renamed everywhere at once. Commands
carry the job's membership generation; an agent ignores a command older than what it has seen.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

WORKER_EVENT_PREFIX = "@bungee "
"""A worker writes its structured events to stdout as this prefix followed by one JSON object."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


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

    pid: int
    name: str
    memory_bytes: int = Field(ge=0)
    utilization_pct: float | None = Field(
        None, ge=0, le=100, description="this process's share of the device's compute, where known"
    )
    ours: bool = Field(description="started by the agent as an elastic worker")
    job_id: int | None = None


class DeviceSample(_Message):
    """One reading of one device, taken at `taken_at` (Unix seconds) by the agent."""

    index: int = Field(ge=0)
    taken_at: float
    utilization_pct: float = Field(ge=0, le=100)
    memory_used_bytes: int = Field(ge=0)
    memory_total_bytes: int = Field(ge=0)
    temperature_c: float | None = None
    power_w: float | None = None
    processes: list[DeviceProcess] = []
    owner_present: bool = Field(
        False, description="a process the agent did not start is on the device: its owner is back"
    )


# --- agent to portal -------------------------------------------------------------------------


class NodeRegistration(_Message):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.\-]+$")
    address: str = Field(min_length=1, max_length=255, description="host workers of other nodes reach")
    backend: str
    devices: list[DeviceInfo]
    agent_version: str = "1"


class RegistrationReply(_Message):
    node_id: int
    commands_redis_url: str
    commands_stream: str
    report_interval_s: float


class WorkerKey(_Message):
    job_id: int
    generation: int
    rank: int


class WorkerEvent(WorkerKey):
    """Something a worker did. `kind` decides which of the optional fields are set:

    - started: pid, device_index
    - progress: step, total_steps, epoch, loss, samples_per_s
    - log: message
    - exited: exit_code, reason (completed, stopped, failed), step (last completed step)
    """

    kind: Literal["started", "progress", "log", "exited"]
    at: float
    pid: int | None = None
    device_index: int | None = None
    step: int | None = None
    total_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    message: str | None = None
    exit_code: int | None = None
    reason: Literal["completed", "stopped", "failed"] | None = None


class RunningWorker(WorkerKey):
    pid: int
    device_index: int


class AgentReport(_Message):
    """What an agent sends every report interval: fresh samples, new events, live workers."""

    node: str
    samples: list[DeviceSample] = []
    events: list[WorkerEvent] = []
    running: list[RunningWorker] = []


# --- portal to agent -------------------------------------------------------------------------


class WorkerAssignment(_Message):
    rank: int = Field(ge=0)
    device_index: int = Field(ge=0)


class LaunchCommand(_Message):
    """Start this node's workers of `generation` of a job. Idempotent: a second copy, or a copy
    for a generation the agent has already started or passed, changes nothing."""

    kind: Literal["launch"] = "launch"
    job_id: int
    generation: int = Field(ge=1)
    world_size: int = Field(ge=1)
    master_addr: str
    master_port: int = Field(gt=0, lt=65536)
    workers: list[WorkerAssignment]
    spec: dict[str, Any]
    run_dir: str = Field(description="where the job's periodic checkpoint lives")


class StopCommand(_Message):
    """Stop this node's workers of the job whose generation is below `before_generation`.
    Workers finish the step in flight, save the state and exit."""

    kind: Literal["stop"] = "stop"
    job_id: int
    before_generation: int
    reason: Literal["resize", "cancel", "owner", "finished"] = "resize"


class SimulateOwnerCommand(_Message):
    """Simulated backend only: play the owner of a device arriving (`present`) or leaving."""

    kind: Literal["simulate_owner"] = "simulate_owner"
    device_index: int = Field(ge=0)
    present: bool


AgentCommand = Annotated[
    LaunchCommand | StopCommand | SimulateOwnerCommand, Field(discriminator="kind")
]
agent_command_adapter: TypeAdapter[AgentCommand] = TypeAdapter(AgentCommand)


def parse_command(raw: str | bytes) -> LaunchCommand | StopCommand | SimulateOwnerCommand:
    """Parse one command from its JSON text; raises pydantic.ValidationError if it is not one."""
    return agent_command_adapter.validate_json(raw)


# --- agent to worker -------------------------------------------------------------------------


class WorkerConfig(_Message):
    """Everything one worker process needs; the agent passes it as JSON in BUNGEE_WORKER_CONFIG."""

    job_id: int
    generation: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str = Field(description='"cpu" or "cuda:N"')
    spec: dict[str, Any]
    run_dir: str


def command_stream(node_name: str, prefix: str = "bungee") -> str:
    """The Redis stream that carries a node's commands (the portal names it at registration)."""
    return f"{prefix}:node:{node_name}:commands"
