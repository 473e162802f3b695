"""The admin's token list shows which tokens a pool issued: filtered by a pool, the pool's token
and its nodes' tokens; filtered by "any pool's node tokens", every pool-issued token alone."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from portal.accounts.models import ApiToken
from tests.conftest import ApiClient
from tests.test_agent_node_binding import registration

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _pool_limits(settings: Any) -> None:
    """The pools here are started by no Slurm pool of the portal's: an operator's bound lets them
    register (portal.cluster.binding)."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"pool_limits": ["slurm:100:100", "k8s:100:100"]})


def listed(page: bytes) -> set[str]:
    """The labels in the page's list of results (its filters name the pools too)."""
    results = page.split(b'id="result_list"', 1)[1].split(b"</table>", 1)[0]
    return {token.label for token in ApiToken.objects.all() if f">{token.label}<".encode() in results}


def test_the_token_list_filters_by_pool(users: dict, api: dict) -> None:
    for pool in ("slurm", "k8s"):
        secret = ApiToken.issue(users["alice"], f"pool {pool}", ApiToken.Role.POOL, pool=pool)[1]
        reply = ApiClient(secret).post("/api/agent/register", registration(f"{pool}-n1"))
        assert reply.status_code == 200, reply.content
    assert api["agent"].post("/api/agent/register", registration("node-a")).status_code == 200
    staff = Client()
    staff.force_login(type(users["staff"]).objects.create_superuser("admin", password="admin-pass"))

    page = staff.get("/admin/accounts/apitoken/", {"pool": "slurm"})
    assert page.status_code == 200
    assert listed(page.content) == {"pool slurm", "pool slurm: node slurm-n1"}
    page = staff.get("/admin/accounts/apitoken/", {"pool": "__issued__"})
    assert listed(page.content) == {"pool slurm: node slurm-n1", "pool k8s: node k8s-n1"}
    everything = staff.get("/admin/accounts/apitoken/").content
    assert {"agent test", "pool k8s", "pool slurm"} <= listed(everything)
