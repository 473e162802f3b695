"""A node that drains, as the portal sees it (the machine's PostgreSQL and Redis): its agent's
reports carry the notice, or staff drain it through the API (the agent is told on its command
stream); its devices are planned out at once, so a job on it shrinks in place onto its other
node (its survivor there untouched, the timeline naming the cause), and a job that would fall
below its minimum waits in the queue saying why. The agent's last report says it left: the node
is drained until it registers again. A draining node whose agent falls silent is lost."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from elastic.wire import AgentReport, DrainNotice, NodeRegistration, WorkerEvent, parse_command
from portal.cluster.ingest import register_node
from portal.cluster.models import Node
from portal.dispatch import stream_for
from portal.jobs.agents import ingest_report
from portal.jobs.lifecycle import nodes_lost
from portal.jobs.models import Job, ResizeEvent
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC
from tests.test_agent_node_binding import registration

pytestmark = pytest.mark.django_db


@pytest.fixture
def nodes(db: Any, redis_client: Any) -> dict[str, Node]:
    """node-a and node-b, one device each."""
    for name in ("node-a", "node-b"):
        register_node(NodeRegistration.model_validate(registration(name, devices=1)))
    return {node.name: node for node in Node.objects.all()}


def running_on_both(api: dict, nodes: dict[str, Node], **spec: Any) -> Job:
    """A job given both devices, whose workers started and formed its first generation."""
    reply = api["alice"].post("/api/jobs", {**VALID_SPEC, "steps": 10_000, **spec})
    assert reply.status_code == 201, reply.content
    job = Job.objects.get(pk=reply.json()["id"])
    run_cycle()
    job.refresh_from_db()
    placed = list(job.allocations.order_by("rank").values_list("rank", "device__node__name", "device__index"))
    assert sorted(name for _, name, _ in placed) == ["node-a", "node-b"]
    for rank, name, index in placed:
        report(nodes[name], event(job, "started", rank, pid=1000 + rank, device_index=index),
               event(job, "joined", rank, pid=1000 + rank, device_index=index))
    report(nodes[placed[0][1]], event(job, "resized", 0))
    job.refresh_from_db()
    return job


def event(job: Job, kind: str, rank: int, **fields: Any) -> WorkerEvent:
    return WorkerEvent(job_id=job.pk, generation=job.generation, rank=rank, kind=kind, at=time.time(), **fields)


def report(node: Node, *events: WorkerEvent, **fields: Any) -> None:
    ingest_report(node, AgentReport(node=node.name, events=list(events), **fields))


def notice(cause: str = "slurm_preemption", deadline_s: float = 30) -> DrainNotice:
    return DrainNotice(cause=cause, deadline_at=time.time() + deadline_s)  # type: ignore[arg-type]


def commands(redis: Any, node: str) -> list[Any]:
    return [parse_command(fields["command"]) for _, fields in redis.xrange(stream_for(node))]


def state(name: str) -> str:
    return str(Node.objects.get(name=name).state)


def test_a_job_on_a_draining_node_shrinks_in_place_onto_its_other_node(
    api: dict, nodes: dict[str, Node], redis_client: Any
) -> None:
    job = running_on_both(api, nodes)
    before = job.generation
    survivor = job.allocations.get(device__node__name="node-a").rank
    report(nodes["node-b"], drain=notice())
    assert state("node-b") == "draining"
    run_cycle()
    job.refresh_from_db()
    assert job.generation == before + 1 and job.state == "resizing"
    assert list(job.allocations.values_list("device__node__name", flat=True)) == ["node-a"]
    resize = ResizeEvent.objects.get(job=job, generation=job.generation)
    assert resize.reason == "node preempted by Slurm"
    assert resize.devices_before == ["node-a/0", "node-b/0"] or resize.devices_before == ["node-b/0", "node-a/0"]
    assert resize.devices_after == ["node-a/0"]
    # The survivor is not stopped: only a launch of the new generation goes to node-a, and
    # nothing starts anywhere (it holds the state; node-b's worker leaves by itself).
    launch = [c for c in commands(redis_client, "node-a") if c.kind == "launch"][-1]
    assert launch.generation == job.generation and launch.workers == [] and launch.members == [0]
    assert not [c for c in commands(redis_client, "node-a") if c.kind == "stop"]
    assert survivor in (0, 1)

    # node-b's worker left; its agent's last report says it left: the node is drained.
    report(nodes["node-b"], event(job, "exited", 1 - survivor, exit_code=0, reason="left", device_index=0)
           .model_copy(update={"generation": before}), drain=notice(), leaving=True)
    assert state("node-b") == "drained"
    run_cycle()
    job.refresh_from_db()
    assert list(job.allocations.values_list("device__node__name", flat=True)) == ["node-a"]


def test_a_job_that_would_fall_below_its_minimum_waits_saying_why(
    api: dict, nodes: dict[str, Node], redis_client: Any
) -> None:
    job = running_on_both(api, nodes, min_workers=2)
    report(nodes["node-b"], drain=notice())
    run_cycle()
    job.refresh_from_db()
    assert job.state == "queued" and job.allocations.count() == 0
    assert job.message == "node node-b drained: preempted by Slurm; waiting for 2 devices"
    assert ResizeEvent.objects.get(job=job, generation=job.generation).reason == "node preempted by Slurm"
    stops = {name: [c for c in commands(redis_client, name) if c.kind == "stop"] for name in ("node-a", "node-b")}
    assert all(stops.values()), "its workers are told to stop, saving their step"


def test_a_report_does_not_end_a_drain_but_a_registration_does(api: dict, nodes: dict[str, Node]) -> None:
    report(nodes["node-b"], drain=notice("slurm_time_limit"))
    report(nodes["node-b"])
    assert state("node-b") == "draining"
    node = Node.objects.get(name="node-b")
    assert node.drain_cause == "slurm_time_limit" and node.drain_deadline_at is not None
    register_node(NodeRegistration.model_validate(registration("node-b", devices=1)))
    node.refresh_from_db()
    assert (node.state, node.drain_cause, node.drain_deadline_at) == ("online", "", None)


def test_a_nearer_deadline_moves_a_drain_forward(nodes: dict[str, Node]) -> None:
    report(nodes["node-b"], drain=notice(deadline_s=60))
    far = Node.objects.get(name="node-b").drain_deadline_at
    report(nodes["node-b"], drain=notice(deadline_s=10))
    near = Node.objects.get(name="node-b").drain_deadline_at
    assert far is not None and near is not None and near < far - timedelta(seconds=40)


def test_a_draining_node_whose_agent_falls_silent_is_lost(nodes: dict[str, Node]) -> None:
    report(nodes["node-b"], drain=notice())
    Node.objects.filter(name="node-b").update(last_seen_at=timezone.now() - timedelta(minutes=5))
    assert nodes_lost() == ["node-b"]
    assert state("node-b") == "lost"


def test_staff_drain_a_node_through_the_api_and_its_agent_is_told(
    api: dict, nodes: dict[str, Node], redis_client: Any
) -> None:
    refused = api["alice"].post("/api/nodes/node-b/drain", {"deadline_s": 30})
    assert refused.status_code == 403 and "only staff may drain a node" in refused.json()["error"]["message"]
    assert api["staff"].post("/api/nodes/nowhere/drain", {}).status_code == 404
    assert api["staff"].post("/api/nodes/node-b/drain", {"deadline_s": 0}).status_code == 400

    reply = api["staff"].post("/api/nodes/node-b/drain", {"deadline_s": 30})
    assert reply.status_code == 200, reply.content
    shown = reply.json()
    assert (shown["state"], shown["drain_cause"]) == ("draining", "node drained by an operator")
    [told] = [c for c in commands(redis_client, "node-b") if c.kind == "drain"]
    assert (told.deadline_s, told.cause) == (30, "operator")
    again = api["staff"].post("/api/nodes/node-b/drain", {"deadline_s": 30})
    assert again.status_code == 200 and len([c for c in commands(redis_client, "node-b") if c.kind == "drain"]) == 1

    Node.objects.filter(name="node-a").update(state=Node.State.LOST)
    lost = api["staff"].post("/api/nodes/node-a/drain", {})
    assert lost.status_code == 409 and "only an online node drains" in lost.json()["error"]["message"]
    listed = {n["name"]: n["state"] for n in api["alice"].get("/api/nodes").json()}
    assert listed == {"node-a": "lost", "node-b": "draining"}
