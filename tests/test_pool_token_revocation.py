"""Deleting a pool token deletes the tokens it issued its nodes: they stop working (401) and
their nodes are free again, for a new pool token of the pool to register (a rotation). Deleting
one node's token frees that node alone, and the pool registers it again with a new token."""

from __future__ import annotations

from typing import Any

import pytest

from portal.accounts.models import ApiToken
from portal.cluster.models import Node
from tests.conftest import ApiClient
from tests.test_agent_node_binding import registration

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _pool_limits(settings: Any) -> None:
    """The pools here are started by no Slurm pool of the portal's: an operator's bound lets them
    register (portal.cluster.binding)."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"pool_limits": ["slurm:100:100", "k8s:100:100"]})


def report(node: str) -> dict:
    return {"node": node, "samples": [], "events": [], "running": []}


def register(pool: ApiClient, name: str) -> ApiClient:
    reply = pool.post("/api/agent/register", registration(name))
    assert reply.status_code == 200, reply.content
    return ApiClient(reply.json()["node_token"])


def test_deleting_the_pool_token_revokes_its_nodes_tokens(users: dict, api: dict) -> None:
    pool_row, secret = ApiToken.issue(users["alice"], "pool slurm", ApiToken.Role.POOL, pool="slurm")
    pool = ApiClient(secret)
    nodes = {name: register(pool, name) for name in ("slurm-job1", "slurm-job2")}
    assert api["agent"].post("/api/agent/register", registration("node-a")).status_code == 200
    for name, client in nodes.items():
        assert client.post("/api/agent/report", report(name)).status_code == 200

    pool_row.delete()

    for name, client in nodes.items():
        for path, body in (("/api/agent/report", report(name)), ("/api/agent/register", registration(name))):
            reply = client.post(path, body)
            assert reply.status_code == 401, (name, path, reply.content)
            assert reply.json()["error"]["code"] == "unauthenticated"
    assert pool.post("/api/agent/register", registration("slurm-job3")).status_code == 401
    assert {n.name: n.agent_token_id for n in Node.objects.all()} == {
        "slurm-job1": None,
        "slurm-job2": None,
        "node-a": ApiToken.objects.get(label="agent test").pk,
    }, "the pool's nodes are free again; a node another token holds is not touched"
    assert api["agent"].post("/api/agent/report", report("node-a")).status_code == 200

    rotated = ApiClient(ApiToken.issue(users["alice"], "pool slurm", ApiToken.Role.POOL, pool="slurm")[1])
    again = register(rotated, "slurm-job1")
    assert again.post("/api/agent/report", report("slurm-job1")).status_code == 200


def test_deleting_a_node_token_frees_that_node_for_its_pool(users: dict) -> None:
    pool = ApiClient(ApiToken.issue(users["alice"], "pool slurm", ApiToken.Role.POOL, pool="slurm")[1])
    lost = register(pool, "slurm-job1")
    kept = register(pool, "slurm-job2")
    assert pool.post("/api/agent/register", registration("slurm-job1")).status_code == 403

    Node.objects.get(name="slurm-job1").agent_token.delete()  # type: ignore[union-attr]

    assert lost.post("/api/agent/report", report("slurm-job1")).status_code == 401
    new = register(pool, "slurm-job1")
    assert new.post("/api/agent/report", report("slurm-job1")).status_code == 200
    assert kept.post("/api/agent/report", report("slurm-job2")).status_code == 200
    assert ApiToken.objects.filter(issued_by__pool="slurm").count() == 2
