"""What a pool token may not do: register a node outside its pool (403 naming its prefix), or
a node that any token holds (403), not even one its own pool registered; report for any node,
not even one it registered; or call any other agent endpoint (403 saying to use the node token).
Nothing it sends then is stored, and no token is issued."""

from __future__ import annotations

from typing import Any

import pytest

from portal.accounts.models import ApiToken
from portal.cluster.models import Device, Node
from portal.cluster.models import DeviceSample as DeviceSampleRow
from tests.conftest import ApiClient
from tests.test_agent_node_binding import assert_forbidden, registration, sample

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _pool_limits(settings: Any) -> None:
    """The pools here are started by no Slurm pool of the portal's: an operator's bound lets them
    register (portal.cluster.binding)."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"pool_limits": ["slurm:100:100", "k8s:100:100"]})

POOL_REFUSED = (
    "this is a pool token: it only registers new nodes of its pool (POST /api/agent/register); "
    "report, upload and fetch with the node token that registration returned (node_token)"
)


def pool_token(users: dict, pool: str = "slurm", label: str = "pool slurm") -> ApiClient:
    return ApiClient(ApiToken.issue(users["alice"], label, ApiToken.Role.POOL, pool=pool)[1])


def issued() -> int:
    return ApiToken.objects.filter(issued_by__isnull=False).count()


@pytest.mark.parametrize(
    "name", ["gpu-07", "slurm", "slurm-", "slurmx-1", "slurm_gpu-1", "Slurm-1", "x-slurm-1"]
)
def test_a_name_outside_the_pool_is_refused_naming_the_prefix(users: dict, name: str) -> None:
    reply = pool_token(users).post("/api/agent/register", registration(name))
    assert_forbidden(reply, "slurm-", name)
    assert "pool 'slurm'" in reply.json()["error"]["message"]
    assert not Node.objects.exists() and issued() == 0


def test_a_node_an_agent_token_holds_is_refused(users: dict, api: dict) -> None:
    assert api["agent"].post("/api/agent/register", registration("slurm-a", "10.0.0.1", 2)).status_code == 200
    assert_forbidden(
        pool_token(users).post("/api/agent/register", registration("slurm-a", "6.6.6.6", 8)), "slurm-a"
    )
    node = Node.objects.get(name="slurm-a")
    assert node.address == "10.0.0.1" and node.agent_token.label == "agent test"  # type: ignore[union-attr]
    assert Device.objects.filter(node=node).count() == 2 and issued() == 0


def test_a_node_its_own_pool_registered_is_refused(users: dict) -> None:
    """Neither the pool token that registered the node (an agent that lost its node token) nor
    another token of the same pool takes it over from the node token that holds it."""
    first = pool_token(users)
    reply = first.post("/api/agent/register", registration("slurm-a", "10.0.0.1", 2))
    assert reply.status_code == 200, reply.content
    held_by = Node.objects.get(name="slurm-a").agent_token
    second = pool_token(users, label="pool slurm, another")
    for pool in (first, second):
        assert_forbidden(pool.post("/api/agent/register", registration("slurm-a", "6.6.6.6", 8)), "slurm-a")
    node = Node.objects.get(name="slurm-a")
    assert node.address == "10.0.0.1" and node.agent_token == held_by and issued() == 1
    assert Device.objects.filter(node=node).count() == 2


def test_a_pool_token_never_reports(users: dict, api: dict) -> None:
    pool = pool_token(users)
    assert pool.post("/api/agent/register", registration("slurm-mine")).status_code == 200
    assert api["agent"].post("/api/agent/register", registration("node-a")).status_code == 200
    seen = dict(Node.objects.values_list("name", "last_seen_at"))
    for name in ("slurm-mine", "node-a", "slurm-nobody"):
        body = {"node": name, "samples": [sample(0)], "events": [], "running": []}
        reply = pool.post("/api/agent/report", body)
        assert reply.status_code == 403, (name, reply.content)
        assert reply.json()["error"]["message"] == POOL_REFUSED
    assert dict(Node.objects.values_list("name", "last_seen_at")) == seen
    assert not DeviceSampleRow.objects.exists()


def _agent_operations() -> list[tuple[str, str]]:
    from django.test import Client

    document = Client().get("/api/openapi.json").json()
    return [
        (method, path)
        for path, operations in document["paths"].items()
        for method in operations
        if path.startswith("/api/agent/")
    ]


def test_every_agent_endpoint_but_registration_refuses_a_pool_token(users: dict, cluster: Any) -> None:
    """Read from the API's own document, so that an endpoint added later is checked too."""
    pool = pool_token(users)
    operations = _agent_operations()
    assert ("post", "/api/agent/register") in operations and len(operations) >= 5
    for method, path in operations:
        if path == "/api/agent/register":
            continue
        url = path.format(digest="0" * 64, job_id=1)
        reply = pool.post(url, {}) if method == "post" else pool.get(url)
        assert reply.status_code == 403, (method, path, reply.content)
        assert reply.json()["error"]["message"] == POOL_REFUSED, (method, path)


def test_a_pool_token_is_no_user_token(users: dict) -> None:
    pool = pool_token(users)
    for path in ("/api/jobs", "/api/cluster"):
        assert pool.get(path).status_code == 403, path
    assert pool.get("/metrics").status_code == 403
