"""What agents send, taken apart: the node and its samples go to portal.cluster.ingest, the
worker events to portal.jobs.ingest, and the node's workers after a (re)start to the lifecycle.
Also the board's view of the cluster, which needs both."""

from __future__ import annotations

import functools
import logging
from typing import Any, TypeVar

from django.db import transaction
from django.http import FileResponse, HttpRequest
from ninja import Field, Router, Schema
from pydantic import BaseModel, StrictBool, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from elastic.wire import (
    MAX_LIST,
    NODE_NAME_PATTERN,
    AgentReport,
    DeviceSample,
    DrainNotice,
    NodeRegistration,
    RegistrationReply,
    RunningWorker,
    WorkerEvent,
)
from portal.auth import agent_auth, registration_auth, user_auth
from portal.bodies import MESSAGE_CHARS, cut, shown
from portal.cluster import drain
from portal.cluster.binding import bind, check_claim, reporting_node
from portal.cluster.ingest import count_refused, ingest_samples, node_seen, register_node
from portal.cluster.models import Node, ReportRefusals
from portal.errors import forbidden, not_found
from portal.jobs import artifacts, lifecycle
from portal.jobs.board import cluster_state
from portal.jobs.ingest import Refused, ingest_events, not_its_worker
from portal.jobs.models import Job
from portal.jobs.states import ACTIVE_STATES
from portal.live import broadcast
from portal.uploads import multipart_files

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

board_router = Router(auth=user_auth, tags=["cluster"])
agent_router = Router(auth=agent_auth, tags=["agents"])


def placed(node: Node, running: list[RunningWorker]) -> list[RunningWorker]:
    """The workers of `running` (what the node's agent says it re-adopted) that the portal placed
    on `node`: the plan of each one's generation put its rank on its device, and its pid is the
    one that worker reported first (portal.jobs.ingest.not_its_worker). The others are counted as
    refused (/metrics) and logged, and do not keep any worker of the portal's alive."""
    kept, refused = [], []
    for worker in running:
        why = not_its_worker(
            node, worker.job_id, worker.generation, worker.rank, worker.device_index, worker.pid,
            lifecycle.ranks_held(node, worker.job_id, worker.generation),
            lifecycle.bound_pids(worker.job_id, worker.generation),
        )
        if why is None:
            kept.append(worker)
        else:
            refused.append(why)
    if refused:
        count_refused(node, ReportRefusals.Reason.NOT_ITS_WORKER, len(refused))
        log.warning("node %s registered with %d worker(s) it was not given, the first: %s",
                    node.name, len(refused), refused[0])
    return kept


def register(registration: NodeRegistration) -> tuple[Node, RegistrationReply]:
    """The node and its devices, then what becomes of the workers it ran (those the portal
    placed there: `placed`)."""
    with transaction.atomic():
        node, reply = register_node(registration)
        lifecycle.node_registered(node, placed(node, registration.running))
    broadcast.node_changed(node.name, node.state, node.last_seen_at)
    broadcast.allocation_changed(lifecycle.allocation_rows())
    return node, reply


def ingest_report(node: Node, report: AgentReport) -> list[Refused]:
    """Takes the node's report; returns the worker events refused (portal.jobs.ingest), counted
    per reason for /metrics."""
    node_seen(node)
    if report.drain is not None:
        drain.draining(node, report.drain)
    if report.samples:
        ingest_samples(node, report.samples)
    refused = ingest_events(node, report.events)
    for reason in ReportRefusals.Reason:
        count_refused(node, reason, sum(1 for r in refused if r.reason == reason))
    if report.leaving:
        drain.left(node)
    return refused


@board_router.get("/cluster", summary="Nodes, devices, latest samples, who holds each device, and the active jobs")
def get_cluster(request: HttpRequest) -> dict[str, Any]:
    return cluster_state()


# exclude_none: the reply to an agent token has no `node_token` at all, so that an agent older
# than the field (its messages forbid unknown fields) still reads it.
@agent_router.post(
    "/register",
    auth=registration_auth,
    response=RegistrationReply,
    exclude_none=True,
    summary="An agent registers its node",
)
def register_endpoint(request: HttpRequest, payload: NodeRegistration) -> RegistrationReply:
    """The first registration with a token claims the node's name for it; 403 if another token
    holds the name or this token serves another node. With a pool token: only a new node of
    its pool that the pool started (an agent job the Slurm pool submitted, registering at most
    the devices it asked for; for another pool, within BUNGEE_POOL_LIMITS), else 403 naming the
    name or the device count; the reply's `node_token` is the node's own agent token, shown this
    once (portal.cluster.binding)."""
    token = request.api_token  # type: ignore[attr-defined]
    with transaction.atomic():
        check_claim(payload.name, token, len(payload.devices))
        node, reply = register(payload)
        node_token = bind(node, token)
    return reply.model_copy(update={"node_token": node_token})


class ReportIn(Schema):
    """An agent's report as the portal reads it: each sample, event and running worker is
    checked on its own against its model in elastic.wire (DeviceSample, WorkerEvent,
    RunningWorker); the valid ones are stored and the others refused in the reply, so that one
    bad item never holds a node's reports back."""

    node: str = Field(min_length=1, max_length=100, pattern=NODE_NAME_PATTERN)
    samples: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_LIST)
    events: list[dict[str, Any]] = Field(default_factory=list, max_length=10_000)
    running: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_LIST)
    drain: DrainNotice | None = Field(None, description="while the node drains: why, and when its devices leave")
    leaving: StrictBool = Field(False, description="the agent's last report after a drain: its workers are gone")


class RefusedItem(Schema):
    item: str = Field(description='where it was in the report, as "events[3]"')
    message: str
    value: Any = None


class ReportOut(Schema):
    ok: bool
    refused: list[RefusedItem] = Field(description="the items not stored, and why")


@functools.cache
def _list_of(model: type[M]) -> TypeAdapter[list[M]]:
    return TypeAdapter(list[model])  # type: ignore[valid-type]


def _checked(
    kind: str, items: list[dict[str, Any]], model: type[M], refused: list[dict[str, Any]]
) -> tuple[list[M], list[int]]:
    """The valid items of `items`, and where each was in it; each invalid one goes to `refused`."""
    try:  # the usual report, every item valid: checked in one call (1,024 calls took 10-20 ms)
        return _list_of(model).validate_python(items), list(range(len(items)))
    except PydanticValidationError:
        pass
    valid, positions = [], []
    for index, item in enumerate(items):
        try:
            valid.append(model.model_validate(item))
            positions.append(index)
        except PydanticValidationError as err:
            problem = err.errors()[0]
            where = ".".join(str(part) for part in problem["loc"])
            refused.append({
                "item": f"{kind}[{index}]",
                "message": cut(f"{where}: {problem['msg']}" if where else problem["msg"], MESSAGE_CHARS),
                "value": shown(problem.get("input")),
            })
    return valid, positions


@agent_router.post("/report", response=ReportOut, summary="An agent's periodic report")
def report(request: HttpRequest, payload: ReportIn) -> dict[str, Any]:
    """403 if the report names a node other than the token's; 409 "unknown_node" if the token
    has not registered it and no other token holds it (the agent then registers). Items that
    are not valid are refused one by one in the reply (`refused`), and so is every worker event
    about a worker the node does not hold (its generation's plan put that rank elsewhere) or a
    job that does not exist; the others are stored."""
    node = reporting_node(payload.node, request.api_token)  # type: ignore[attr-defined]
    refused: list[dict[str, Any]] = []
    samples, _ = _checked("samples", payload.samples, DeviceSample, refused)
    events, event_positions = _checked("events", payload.events, WorkerEvent, refused)
    running, _ = _checked("running", payload.running, RunningWorker, refused)
    count_refused(node, ReportRefusals.Reason.INVALID, len(refused))
    checked = AgentReport(
        node=payload.node, samples=samples, events=events, running=running, drain=payload.drain,
        leaving=payload.leaving,
    )
    for item in ingest_report(node, checked):
        event = events[item.index]
        refused.append({
            "item": f"events[{event_positions[item.index]}]",
            "message": cut(item.message, MESSAGE_CHARS),
            "value": {"job_id": event.job_id, "generation": event.generation, "rank": event.rank, "kind": event.kind},
        })
    if refused:
        log.warning("node %s: refused %d item(s) of a report, the first %s", node.name, len(refused), refused[0])
    return {"ok": True, "refused": refused}


@agent_router.post("/jobs/{int:job_id}/artifacts", summary="An agent hands over a job's artifacts")
def artifacts_endpoint(request: HttpRequest, job_id: int) -> dict[str, Any]:
    """Multipart: model.pt, checkpoint.pt, manifest.json. 403 unless the job's rank 0 ran
    on the token's node; 415 for another type of body, 400 for one that cannot be read
    (portal.uploads) or if a file is missing or not what the manifest's digest says."""
    token = request.api_token  # type: ignore[attr-defined]
    node = Node.objects.filter(agent_token=token).first()
    if node is None:
        raise forbidden("this agent token has registered no node yet")
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        raise not_found(f"job {job_id}")
    uploads = multipart_files(request, "model.pt, checkpoint.pt and manifest.json, a field each")
    row = artifacts.store(node, job, uploads)
    return {"job_id": job_id, "step": row.step, "files": row.files}



@agent_router.get("/jobs/{int:job_id}/initial-model", summary="An agent fetches the model a job starts from")
def initial_model_endpoint(request: HttpRequest, job_id: int) -> FileResponse:
    """The final model of the job that job `job_id`'s spec names in init_from, with its sha256 in
    the X-Bungee-Sha256 header. 403 unless the job is active and holds a device of the token's
    node; 404 if it starts from no kept model."""
    node = Node.objects.filter(agent_token=request.api_token).first()  # type: ignore[attr-defined]
    if node is None:
        raise forbidden("this agent token has registered no node yet")
    job = Job.objects.filter(pk=job_id, state__in=ACTIVE_STATES, allocations__device__node=node).first()
    if job is None:
        raise forbidden(f"no active job {job_id} holds a device of node {node.name!r}")
    found = artifacts.initial_model(job)
    if found is None:
        raise not_found(f"the model job {job_id} starts from")
    path, digest = found
    response = FileResponse(path.open("rb"), content_type="application/octet-stream")
    response["X-Bungee-Sha256"] = digest
    return response
