"""`manage.py create_token`: prints a working token; `--replace` deletes the user's earlier tokens
of that label and role, which frees the node an agent token held for the new one (and, for a
pool token, deletes the tokens of the nodes it registered); `--role pool --pool NAME`."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from django.core.management import CommandError, call_command

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


def create_token(*args: str) -> str:
    out = io.StringIO()
    call_command("create_token", *args, stdout=out)
    return out.getvalue().strip()


def test_replace_frees_the_node_for_the_new_token(users: dict) -> None:
    first = ApiClient(create_token("alice", "--role", "agent", "--label", "agent of node-a"))
    assert first.post("/api/agent/register", registration("node-a")).status_code == 200
    other = ApiClient(create_token("alice", "--role", "agent", "--label", "agent of node-a"))
    assert other.post("/api/agent/register", registration("node-a")).status_code == 403

    replacing = ApiClient(create_token("alice", "--role", "agent", "--label", "agent of node-a", "--replace"))
    assert replacing.post("/api/agent/register", registration("node-a")).status_code == 200
    assert first.post("/api/agent/register", registration("node-a")).status_code == 401
    assert ApiToken.objects.filter(label="agent of node-a").count() == 1
    assert Node.objects.get(name="node-a").agent_token == ApiToken.objects.get(label="agent of node-a")


def test_replace_keeps_other_labels_and_roles(users: dict) -> None:
    create_token("alice", "--label", "agent of node-a")
    create_token("alice", "--role", "agent", "--label", "agent of node-b")
    create_token("alice", "--role", "agent", "--label", "agent of node-a", "--replace")
    assert sorted(ApiToken.objects.values_list("label", "role")) == [
        ("agent of node-a", "agent"),
        ("agent of node-a", "user"),
        ("agent of node-b", "agent"),
    ]


def test_a_pool_token_registers_nodes_of_its_pool(users: dict) -> None:
    pool = ApiClient(create_token("alice", "--role", "pool", "--pool", "slurm"))
    token = ApiToken.objects.get(role="pool")
    assert (token.pool, token.label, token.user.username) == ("slurm", "pool slurm", "alice")
    assert pool.post("/api/agent/register", registration("slurm-job1")).status_code == 200
    assert pool.post("/api/agent/register", registration("node-a")).status_code == 403


@pytest.mark.parametrize(
    "args,message",
    [
        (["--role", "pool"], "--pool NAME"),
        (["--role", "agent", "--pool", "slurm"], "role 'pool' and only with it"),
        (["--role", "pool", "--pool", "slurm-gpu"], "'slurm-gpu' is not a pool name"),
        (["--role", "pool", "--pool", "x" * 41], "is not a pool name"),
    ],
)
def test_a_pool_name_goes_with_role_pool_alone_and_has_no_dash(
    users: dict, args: list[str], message: str
) -> None:
    with pytest.raises(CommandError, match=re.escape(message)):
        create_token("alice", *args)
    assert not ApiToken.objects.exists()


def test_replacing_a_pool_token_revokes_its_nodes_tokens(users: dict) -> None:
    pool = ApiClient(create_token("alice", "--role", "pool", "--pool", "slurm"))
    node = ApiClient(pool.post("/api/agent/register", registration("slurm-job1")).json()["node_token"])
    report = {"node": "slurm-job1", "samples": [], "events": [], "running": []}
    assert node.post("/api/agent/report", report).status_code == 200
    create_token("alice", "--role", "pool", "--pool", "slurm", "--replace")
    assert node.post("/api/agent/report", report).status_code == 401
    assert list(ApiToken.objects.values_list("role", flat=True)) == ["pool"]


def test_a_user_that_does_not_exist_is_refused_saying_how_to_make_one(db: Any) -> None:
    with pytest.raises(CommandError, match=r"no user named 'ADMIN'.*manage.py createsuperuser --username ADMIN"):
        create_token("ADMIN", "--role", "pool", "--pool", "slurm")
