"""The agent's client with a pool token: it keeps the node token a registration returns in the
state directory (a file of mode 0600, replaced whole) and speaks with it from then on; a client
made later on that directory starts with it; a kept token the portal no longer knows (401) is
forgotten and the registration tried once with the pool token. (httpx's MockTransport plays the
portal; the real agent against the real portal is test_agent_pool_token.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agent.client import AgentAuthError, PortalClient
from agent.node_token import NodeTokenFile
from elastic.wire import AgentReport, NodeRegistration, RegistrationReply

REGISTRATION = NodeRegistration(name="slurm-a", address="10.0.0.2", backend="simulated", devices=[])
REPLY = RegistrationReply(
    node_id=3, commands_redis_url="redis://r:6379/0", commands_stream="s", report_interval_s=1.0
)
REFUSED = {"error": {"status": 401, "code": "unauthenticated", "message": "unknown token", "fields": []}}


def portal(answer: Callable[[httpx.Request], httpx.Response], seen: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.path} {request.headers['Authorization']}")
        return answer(request)

    return httpx.MockTransport(handle)


def pool_portal(request: httpx.Request) -> httpx.Response:
    """Issues node-1 to the pool token; knows node-1 and nothing else."""
    token = request.headers["Authorization"]
    if request.url.path == "/api/agent/register" and token == "Bearer pool":
        return httpx.Response(200, json={**REPLY.model_dump(mode="json"), "node_token": "node-1"})
    if token == "Bearer node-1" and request.url.path == "/api/agent/register":
        return httpx.Response(200, json=REPLY.model_dump(mode="json", exclude_none=True))
    if token == "Bearer node-1":
        return httpx.Response(200, json={"ok": True, "refused": []})
    return httpx.Response(401, json=REFUSED)


def test_the_node_token_is_kept_and_used_from_then_on(tmp_path: Path) -> None:
    seen: list[str] = []
    client = PortalClient(
        "http://portal.test", "pool", transport=portal(pool_portal, seen), state_dir=tmp_path / "state"
    )
    reply = client.register(REGISTRATION)
    assert reply == REPLY and reply.node_token is None, "the secret stays with the client"
    kept = tmp_path / "state" / "node-token"
    assert kept.read_text() == "node-1" and kept.stat().st_mode & 0o777 == 0o600
    client.report(AgentReport(node="slurm-a"))
    client.register(REGISTRATION)
    assert seen == [
        "/api/agent/register Bearer pool",
        "/api/agent/report Bearer node-1",
        "/api/agent/register Bearer node-1",
    ]
    assert [p.name for p in kept.parent.iterdir()] == ["node-token"], "no temporary file left behind"


def test_a_client_made_later_starts_with_the_kept_token(tmp_path: Path) -> None:
    NodeTokenFile(tmp_path / "node-token").write("node-1")
    seen: list[str] = []
    client = PortalClient(
        "http://portal.test", "pool", transport=portal(pool_portal, seen), state_dir=tmp_path
    )
    client.register(REGISTRATION)
    assert seen == ["/api/agent/register Bearer node-1"]


def test_a_kept_token_the_portal_does_not_know_is_forgotten_for_the_pool_token(tmp_path: Path) -> None:
    NodeTokenFile(tmp_path / "node-token").write("deleted")
    seen: list[str] = []
    client = PortalClient(
        "http://portal.test", "pool", transport=portal(pool_portal, seen), state_dir=tmp_path
    )
    assert client.register(REGISTRATION) == REPLY
    assert seen == ["/api/agent/register Bearer deleted", "/api/agent/register Bearer pool"]
    assert (tmp_path / "node-token").read_text() == "node-1"


def test_a_refused_pool_token_is_not_retried(tmp_path: Path) -> None:
    seen: list[str] = []
    client = PortalClient(
        "http://portal.test", "gone", transport=portal(pool_portal, seen), state_dir=tmp_path
    )
    with pytest.raises(AgentAuthError):
        client.register(REGISTRATION)
    assert seen == ["/api/agent/register Bearer gone"]


def test_a_node_token_that_cannot_be_kept_is_still_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(self: NodeTokenFile, token: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(NodeTokenFile, "write", disk_full)
    seen: list[str] = []
    client = PortalClient(
        "http://portal.test", "pool", transport=portal(pool_portal, seen), state_dir=tmp_path
    )
    client.register(REGISTRATION)
    client.report(AgentReport(node="slurm-a"))
    assert seen[-1] == "/api/agent/report Bearer node-1"
    assert not (tmp_path / "node-token").exists()
