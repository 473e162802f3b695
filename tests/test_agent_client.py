"""The agent's portal client: what it sends, and how it sorts the portal's answers into
errors worth retrying and errors that are final (httpx's MockTransport plays the portal; the
real HTTP path is in test_agent_process.py)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from agent.client import AgentAuthError, PortalClient, PortalRejectedError, PortalUnavailableError
from elastic.wire import AgentReport, NodeRegistration, RegistrationReply

REGISTRATION = NodeRegistration(name="node-a", address="10.0.0.2", backend="simulated", devices=[])
REPLY = RegistrationReply(
    node_id=3,
    commands_redis_url="redis://r:6379/0",
    commands_stream="bungee:node:node-a:commands",
    report_interval_s=1.0,
)


def client_answering(status: int, body: object, seen: list[httpx.Request] | None = None) -> PortalClient:
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    return PortalClient("http://portal.test/", "tok-1", transport=httpx.MockTransport(handle))


def portal_error(status: int, code: str, message: str) -> dict[str, object]:
    return {"error": {"status": status, "code": code, "message": message, "fields": []}}


def test_register_posts_the_registration_with_the_token_and_returns_the_reply() -> None:
    seen: list[httpx.Request] = []
    client = client_answering(200, REPLY.model_dump(mode="json"), seen)
    assert client.register(REGISTRATION) == REPLY
    [request] = seen
    assert (request.method, str(request.url)) == ("POST", "http://portal.test/api/agent/register")
    assert request.headers["Authorization"] == "Bearer tok-1"
    assert NodeRegistration.model_validate_json(request.content) == REGISTRATION


def test_report_posts_the_report() -> None:
    seen: list[httpx.Request] = []
    report = AgentReport(node="node-a")
    client_answering(200, {"ok": True}, seen).report(report)
    assert str(seen[0].url) == "http://portal.test/api/agent/report"
    assert json.loads(seen[0].content) == report.model_dump(mode="json")


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_token_is_an_auth_error_quoting_the_portal(status: int) -> None:
    client = client_answering(status, portal_error(status, "unauthorized", "token revoked"))
    with pytest.raises(
        AgentAuthError, match=f"answered {status}.*token was refused: token revoked"
    ) as caught:
        client.register(REGISTRATION)
    assert caught.value.status == status


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503])
def test_a_portal_that_cannot_serve_now_is_worth_retrying(status: int) -> None:
    with pytest.raises(PortalUnavailableError, match=f"answered {status}"):
        client_answering(status, "<html>bad gateway</html>").report(AgentReport(node="node-a"))


def test_any_other_refusal_is_final_and_carries_the_portals_code() -> None:
    client = client_answering(409, portal_error(409, "unknown_node", "node 'node-a' has not registered"))
    with pytest.raises(PortalRejectedError, match="has not registered") as caught:
        client.report(AgentReport(node="node-a"))
    assert (caught.value.status, caught.value.code) == (409, "unknown_node")


@pytest.mark.parametrize(
    ("body", "text"),
    [({"detail": "Unprocessable"}, "Unprocessable"), ("plain words", "plain words"), ("", "Bad Request")],
)
def test_error_text_from_other_shapes(body: object, text: str) -> None:
    with pytest.raises(PortalRejectedError, match=text):
        client_answering(400, body).register(REGISTRATION)


def test_a_reply_that_is_not_a_registration_reply_is_refused() -> None:
    with pytest.raises(PortalRejectedError, match="not a registration reply"):
        client_answering(200, {"hello": "world"}).register(REGISTRATION)


def test_no_portal_listening_is_worth_retrying() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = PortalClient(f"http://127.0.0.1:{port}", "tok-1", timeout_s=2.0)
    with pytest.raises(PortalUnavailableError, match="unreachable"):
        client.register(REGISTRATION)
