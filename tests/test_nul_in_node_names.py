"""A NUL in a node's name (which PostgreSQL cannot store or even compare) is refused naming the
value, not a 500: a staff drain of `/api/nodes/%00/drain` is 404, an agent's report or
registration with one is 400 on the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def test_a_drain_of_a_name_with_a_nul_is_404_naming_it(tokens: dict, cluster: Any) -> None:
    reply = Client().post("/api/nodes/%00/drain", "{}", content_type="application/json",
                          HTTP_AUTHORIZATION=f"Bearer {tokens['staff']}")
    assert reply.status_code == 404, reply.content
    error = reply.json()["error"]
    assert error["code"] == "not_found" and "'\\x00'" in error["message"], error


@pytest.mark.parametrize(("path", "body"), [
    ("/api/agent/report", {"node": "node\x00a"}),
    ("/api/agent/register", {"name": "node\x00a", "address": "127.0.0.2", "backend": "simulated", "devices": []}),
])
def test_an_agent_naming_its_node_with_a_nul_is_400_on_the_field(tokens: dict, path: str, body: dict) -> None:
    reply = Client().post(path, json.dumps(body), content_type="application/json",
                          HTTP_AUTHORIZATION=f"Bearer {tokens['agent']}")
    assert reply.status_code == 400, reply.content
    [field] = reply.json()["error"]["fields"]
    assert field["field"] in ("node", "name") and field["value"] == "node\x00a", field
