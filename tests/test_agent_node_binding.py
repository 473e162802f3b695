"""Every node speaks only for itself: the first registration with an agent token claims the node's
name for that token; another token may neither register that name nor report for it, and a token
serves one node."""

from __future__ import annotations

import time
from typing import Any

import pytest

from portal.accounts.models import ApiToken
from portal.cluster.models import Device, Node
from portal.cluster.models import DeviceSample as DeviceSampleRow
from portal.cluster.state import latest_key
from portal.jobs.models import JobLog
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC, ApiClient

pytestmark = pytest.mark.django_db


def registration(name: str, address: str = "10.0.0.1", devices: int = 2) -> dict[str, Any]:
    return {
        "name": name,
        "address": address,
        "backend": "simulated",
        "devices": [
            {
                "index": i,
                "uuid": f"{name}-{i}",
                "name": "CPU slot",
                "kind": "cpu-slot",
                "memory_total_bytes": 2**30,
            }
            for i in range(devices)
        ],
    }


def sample(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "taken_at": time.time(),
        "utilization_pct": 50.0,
        "memory_used_bytes": 1,
        "memory_total_bytes": 2**30,
    }


@pytest.fixture
def agents(users: dict, api: dict) -> dict[str, ApiClient]:
    """Three agent tokens: `a` (the fixtures' agent token), `b` and `c`, none registered yet."""
    issue = ApiToken.issue
    return {
        "a": api["agent"],
        "b": ApiClient(issue(users["staff"], "agent b", ApiToken.Role.AGENT)[1]),
        "c": ApiClient(issue(users["staff"], "agent c", ApiToken.Role.AGENT)[1]),
    }


def token_of(node: str) -> str | None:
    return Node.objects.get(name=node).agent_token.label  # type: ignore[union-attr]


def assert_forbidden(reply: Any, *names: str) -> None:
    assert reply.status_code == 403, reply.content
    error = reply.json()["error"]
    assert error["status"] == 403 and error["code"] == "forbidden"
    for name in names:
        assert repr(name) in error["message"], error["message"]


def test_the_first_registration_claims_the_name(agents: dict) -> None:
    assert agents["a"].post("/api/agent/register", registration("node-a")).status_code == 200
    assert token_of("node-a") == "agent test"


def test_another_token_cannot_register_a_claimed_name(agents: dict) -> None:
    assert agents["a"].post("/api/agent/register", registration("node-a", "10.0.0.1", 2)).status_code == 200
    reply = agents["b"].post("/api/agent/register", registration("node-a", "6.6.6.6", 8))
    assert_forbidden(reply, "node-a")
    node = Node.objects.get(name="node-a")
    assert node.address == "10.0.0.1" and token_of("node-a") == "agent test"
    assert list(Device.objects.filter(node=node, present=True).values_list("index", flat=True)) == [0, 1]
    assert Device.objects.filter(node=node).count() == 2


def test_the_same_token_registers_again_after_a_restart(agents: dict) -> None:
    assert agents["a"].post("/api/agent/register", registration("node-a", "10.0.0.1", 2)).status_code == 200
    reply = agents["a"].post("/api/agent/register", registration("node-a", "10.0.0.2", 3))
    assert reply.status_code == 200, reply.content
    node = Node.objects.get(name="node-a")
    assert node.address == "10.0.0.2" and node.devices.count() == 3 and token_of("node-a") == "agent test"


def test_one_token_serves_one_node(agents: dict) -> None:
    assert agents["a"].post("/api/agent/register", registration("node-a")).status_code == 200
    assert_forbidden(agents["a"].post("/api/agent/register", registration("node-b")), "node-a", "node-b")
    assert not Node.objects.filter(name="node-b").exists()


def test_deleting_a_token_frees_its_node_for_another(agents: dict) -> None:
    assert agents["a"].post("/api/agent/register", registration("node-a")).status_code == 200
    ApiToken.objects.filter(label="agent test").delete()
    assert agents["b"].post("/api/agent/register", registration("node-a")).status_code == 200
    assert token_of("node-a") == "agent b"


def test_a_report_for_another_node_is_refused_and_nothing_is_stored(
    agents: dict, api: dict, redis_client: Any
) -> None:
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    assert agents["a"].post("/api/agent/register", registration("node-a")).status_code == 200
    run_cycle()  # the job's ranks go to node-a's devices: node-a speaks for them
    assert agents["b"].post("/api/agent/register", registration("node-b")).status_code == 200
    node_a = Node.objects.get(name="node-a")
    seen_at = node_a.last_seen_at
    log_line = {
        "job_id": job_id,
        "generation": 1,
        "rank": 0,
        "kind": "log",
        "at": time.time(),
        "message": "forged",
    }
    forged = {"node": "node-a", "samples": [sample(0), sample(1)], "events": [log_line], "running": []}

    assert_forbidden(agents["b"].post("/api/agent/report", forged), "node-b", "node-a")
    node_a.refresh_from_db()
    assert node_a.last_seen_at == seen_at
    assert not JobLog.objects.exists() and not DeviceSampleRow.objects.exists()
    assert not any(redis_client.exists(latest_key(d.pk)) for d in node_a.devices.all())

    assert agents["a"].post("/api/agent/report", forged).status_code == 200, "the node itself may report"
    assert JobLog.objects.filter(line="forged").count() == 1


def test_a_token_that_has_not_registered_is_told_to_register_or_refused(agents: dict, cluster: Node) -> None:
    """`cluster` registered node-a without a token (as nodes were before tokens were bound): a
    report for it, or for a node nobody registered, is answered 409 unknown_node, and the agent
    registers, which claims it; a report for a node another token holds is refused."""
    report = {"node": "node-a", "samples": [], "events": [], "running": []}
    for name in ("node-a", "node-z"):
        reply = agents["c"].post("/api/agent/report", {**report, "node": name})
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "unknown_node", reply.content
    assert agents["c"].post("/api/agent/register", registration("node-a")).status_code == 200
    assert agents["c"].post("/api/agent/report", report).status_code == 200
    assert token_of("node-a") == "agent c"
    assert_forbidden(agents["b"].post("/api/agent/report", report), "node-a")
