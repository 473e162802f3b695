"""`manage.py create_token`: prints a working token; `--replace` deletes the user's earlier tokens
of that label and role, which frees the node an agent token held for the new one."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from portal.accounts.models import ApiToken
from portal.cluster.models import Node
from tests.conftest import ApiClient
from tests.test_agent_node_binding import registration

pytestmark = pytest.mark.django_db


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
