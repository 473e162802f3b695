"""A pool token registers a new node of its pool: the reply carries the node's own agent token
(issued by the pool token, owned by its user, bound to the node), with which the node then
reports and registers again; the pool token itself serves no node, so it registers many."""

from __future__ import annotations

import time
from typing import Any

import pytest

from portal.accounts.models import ApiToken
from portal.cluster.models import Node
from tests.conftest import ApiClient
from tests.test_agent_node_binding import registration, sample

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _pool_limits(settings: Any) -> None:
    """The pools here are started by no Slurm pool of the portal's: an operator's bound lets them
    register (portal.cluster.binding)."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"pool_limits": ["slurm:100:100", "k8s:100:100"]})


@pytest.fixture
def pool(users: dict) -> tuple[ApiToken, ApiClient]:
    token, secret = ApiToken.issue(users["alice"], "pool slurm", ApiToken.Role.POOL, pool="slurm")
    return token, ApiClient(secret)


def report(node: str) -> dict[str, Any]:
    return {"node": node, "samples": [sample(0), sample(1)], "events": [], "running": []}


def test_a_pool_token_registers_a_new_node_and_hands_it_a_token_of_its_own(
    pool: tuple[ApiToken, ApiClient], redis_client: Any
) -> None:
    pool_token, pool_client = pool
    reply = pool_client.post("/api/agent/register", registration("slurm-job42"))
    assert reply.status_code == 200, reply.content
    secret = reply.json()["node_token"]
    assert secret.startswith("bng_")

    node = Node.objects.get(name="slurm-job42")
    node_token = node.agent_token
    assert node_token is not None and node_token != pool_token
    assert ApiToken.lookup(secret) == node_token
    assert (node_token.role, node_token.issued_by, node_token.user.username, node_token.label) == (
        ApiToken.Role.AGENT,
        pool_token,
        "alice",
        "pool slurm: node slurm-job42",
    )

    node_client = ApiClient(secret)
    seen_at = node.last_seen_at
    time.sleep(0.01)
    assert node_client.post("/api/agent/report", report("slurm-job42")).status_code == 200
    node.refresh_from_db()
    assert node.last_seen_at > seen_at, "the node token's report was taken"

    again = node_client.post("/api/agent/register", registration("slurm-job42", "10.0.0.9", 3))
    assert again.status_code == 200, again.content
    assert "node_token" not in again.json(), "a node token registering again is issued nothing"
    node.refresh_from_db()
    assert node.address == "10.0.0.9" and node.devices.count() == 3 and node.agent_token == node_token
    assert ApiToken.objects.filter(issued_by=pool_token).count() == 1


def test_one_pool_token_registers_many_nodes_each_with_its_own_token(
    pool: tuple[ApiToken, ApiClient],
) -> None:
    pool_token, pool_client = pool
    secrets = []
    for name in ("slurm-job1", "slurm-job2", "slurm-job3"):
        reply = pool_client.post("/api/agent/register", registration(name))
        assert reply.status_code == 200, reply.content
        secrets.append(reply.json()["node_token"])
    assert len(set(secrets)) == 3
    holders = {node.name: node.agent_token for node in Node.objects.all()}
    assert {
        name: ApiToken.lookup(s)
        for name, s in zip(("slurm-job1", "slurm-job2", "slurm-job3"), secrets, strict=True)
    } == holders
    assert set(ApiToken.objects.filter(issued_by=pool_token)) == set(holders.values())
    for name, secret in zip(("slurm-job1", "slurm-job2"), secrets, strict=False):
        assert ApiClient(secret).post("/api/agent/report", report(name)).status_code == 200


def test_an_agent_tokens_reply_has_no_node_token(api: dict) -> None:
    """An agent token registers as before: nothing issued, and no `node_token` field at all, so
    that an agent older than the field (its messages forbid unknown ones) still reads the reply."""
    reply = api["agent"].post("/api/agent/register", registration("node-a"))
    assert reply.status_code == 200 and "node_token" not in reply.json(), reply.content
    assert not ApiToken.objects.filter(issued_by__isnull=False).exists()
