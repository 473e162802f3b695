"""API schemas of jobs. The submit body is the job spec itself (elastic.spec.JobSpec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ninja import Field, Schema
from pydantic import StrictInt

from elastic.spec import MAX_WORKERS_LIMIT


class HolderOut(Schema):
    id: int
    name: str
    owner: str
    devices: int
    pinned: bool
    finish_estimate_at: float | None = Field(description="when it should finish (Unix time); null: not known yet")


class QueueOut(Schema):
    position: int = Field(description="1: the next job to start in its pool")
    waiting: int = Field(description="jobs waiting in its pool")
    holders: list[HolderOut] = Field(description="the running jobs of its pool, the soonest to end first")
    start_estimate_at: float | None = Field(description="when it should start (Unix time); null: see no_estimate")
    no_estimate: str = Field(description="why there is no estimate")


class JobSummaryOut(Schema):
    id: int
    name: str
    owner: str
    state: str
    workload: str
    priority: str
    consistency: str
    min_workers: int
    max_workers: int
    workers: int
    generation: int
    steps_done: int
    total_steps: int
    progress: float | None = Field(description="steps done over total steps, 0 to 1")
    finish_estimate_at: float | None = Field(
        description="a running job: when it should finish (Unix time), from its last reported step rate"
    )
    created_at: datetime
    pinned_workers: int | None = Field(description="a manual resize the scheduler honours until lifted")
    pin_problem: str = Field(description="why the pin cannot be met now; empty when it is")
    schedule_reasons: list[str] = Field(description="why the job has what it has (pinned, minimum, fair share, ...)")
    schedule_note: str = Field(description="the same, in a sentence")
    batch_size: int | None = Field(description="hybrid jobs: the global batch size the scheduler chose")
    queue: QueueOut | dict[str, Any] = Field(
        description="a waiting job: its place in the queue, the jobs holding its pool, its estimated start; {} otherwise"
    )
    reason: str = Field("", description="a failed or cancelled job that you may manage (yours; any, for staff): "
                        "why it ended, in short (its message's first sentence); empty otherwise")


class AllocationOut(Schema):
    rank: int
    device_id: int
    node: str
    device_index: int
    backend: str = Field(description="the node's device backend: nvml, or simulated (CPU cores posing as devices, "
                         "whose temperature and power are modelled, not measured)")


class ResizeOut(Schema):
    generation: int
    reason: str
    workers_before: int
    workers_after: int
    devices_before: list[str]
    devices_after: list[str]
    requested_at: datetime = Field(description="when it was asked for: the pin's request for a manual resize")
    requested_by: str = Field(description="who asked for a manual resize; empty for the scheduler's own")
    completed_at: datetime | None = Field(description="the first step of the new generation")
    land_s: float | None = Field(description="from the request to the first step of the new generation")
    pause_s: float | None
    step: int | None
    members_before: list[str]
    members_after: list[str]
    bytes_moved: int | None
    phases: dict[str, float]


class WorkerOut(Schema):
    generation: int
    rank: int
    node: str
    device_index: int
    pid: int | None
    state: str
    exit_code: int | None
    reason: str


class ArtifactFileOut(Schema):
    name: str
    size: int
    sha256: str
    url: str


class ArtifactsOut(Schema):
    step: int
    ended: str
    stored_at: datetime
    files: list[ArtifactFileOut]
    final: dict[str, Any] | None = Field(description="the last step's loss and the task's evaluation metrics")
    bungee_version: str | None
    manifest_valid: bool = Field(
        description="false for a manifest kept before manifests were checked that fails the check: its "
        "final and bungee_version are then shown as null"
    )


class OwnPackagesOut(Schema):
    digest: str = Field(description="the environment's digest on that node")
    source: str = Field(description="the file the requirements came from: requirements.txt or pyproject.toml")
    requirements: list[str] = Field(
        description="the requirements the job declared, as uv reads them: its index lines, then each requirement "
        "(normalised, sorted)"
    )
    packages: dict[str, str] = Field(description="every package installed in the environment: name -> version")
    left_out: int = Field(description="requirements and packages left out of these lists for their size")
    node: str = Field(description="the node that reported it (the newest to build or find the environment)")


class JobDetailOut(JobSummaryOut):
    spec: dict[str, Any]
    message: str
    restarts: int
    attained_service_s: float
    last_loss: float | None
    samples_per_s: float | None
    virtual_workers: int | None = Field(description="strict mode: the job's fixed number of virtual workers")
    global_batch: int | None = Field(description="the global batch of the last step reported (hybrid: it follows the workers)")
    learning_rate: float | None = Field(description="the learning rate of the last step reported")
    started_at: datetime | None
    finished_at: datetime | None
    allocations: list[AllocationOut]
    resizes: list[ResizeOut]
    artifacts: ArtifactsOut | None = Field(
        description="the model, checkpoint and manifest, once the job has ended and they are kept"
    )
    workers_history: list[WorkerOut]
    own_packages: OwnPackagesOut | None = Field(
        description="the job's own packages (a requirements.txt or pyproject.toml beside its code), once a node "
        "built or found its environment; null for a job that has none, or before then"
    )


class ResizeIn(Schema):
    workers: StrictInt | None = Field(  # strict: JSON true is not a worker count
        ..., ge=1, le=MAX_WORKERS_LIMIT,
        description="the worker count to pin the job to, between the job's min_workers and max_workers "
        "(400 otherwise), or null to let the scheduler decide",
    )


class MetricOut(Schema):
    generation: int
    segment: int = Field(description="the stretch of the run it belongs to: 0, then one more after each rollback")
    step: int
    epoch: float | None
    loss: float | None
    samples_per_s: float | None
    metrics: dict[str, float] = Field(description="the task's named training metrics (rank 0's part of the step)")
    at: datetime
    loss_min: float | None = Field(description="the lowest loss of the rows this point stands for")
    loss_max: float | None = Field(description="the highest loss of the rows this point stands for")
    rows: int = Field(description="how many stored rows this point stands for (1: not downsampled)")


class RollbackOut(Schema):
    generation: int = Field(description="the generation that went back: every worker had gone, it resumed from the checkpoint")
    at_step_from: int = Field(description="the last step reported before it")
    to_step: int = Field(description="the completed steps it resumed from (the checkpoint's; 0 without one)")
    at: datetime = Field(description="when it reported its first step")


class MetricsOut(Schema):
    points: list[MetricOut] = Field(
        description="the whole run, oldest first, by segment then step: each point the newest row of its bucket of steps"
    )
    rollbacks: list[RollbackOut] = Field(description="where the run went back to an earlier step; each starts a segment")
    rows: int = Field(description="the stored rows the points were drawn from")


class EvaluationOut(Schema):
    step: int
    metrics: dict[str, float]
    at: datetime


class LogOut(Schema):
    id: int
    generation: int
    rank: int
    at: datetime
    line: str


class CodeLimitsOut(Schema):
    max_bytes: int = Field(description="the largest code upload, packed (BUNGEE_CODE_MAX_BYTES)")
    max_unpacked_bytes: int = Field(description="what the code may unpack to (BUNGEE_CODE_MAX_UNPACKED_BYTES)")
    max_files: int = Field(description="how many files and directories it may hold (BUNGEE_CODE_MAX_FILES)")


class SpecCheckOut(Schema):
    spec: dict[str, Any] = Field(description="the spec as it would be stored, defaults filled in")
    code_uploaded: bool = Field(description="whether the spec's code is uploaded already (its entrypoint then "
                                "checked too); false: upload it with POST /api/code, then submit")
    code_limits: CodeLimitsOut = Field(description="what POST /api/code takes, so that a client refuses code "
                                       "over it before sending any")
