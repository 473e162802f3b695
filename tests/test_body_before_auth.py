"""No body is read before the portal knows who sends it (portal.body_policy, applied by
portal.body_limit), driven through the portal's ASGI application: an upload of artifacts is taken
only with the agent token of a node the job ran on, a code upload only with a user token or a
session, and anything else gets the 1 MiB bound with credentials and less without. Every refusal
comes before a byte of the body is taken, in the API's error shape, and closes the connection."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from asgiref.testing import ApplicationCommunicator
from django.test import Client

from portal.accounts.models import ApiToken
from portal.body_limit import Bound
from portal.body_policy import decide
from portal.jobs.models import Job
from tests import test_artifacts_api

ran_here = test_artifacts_api.ran_here
"""Alice's job, whose rank 0 started on node-a, which tokens["agent"] serves."""

pytestmark = pytest.mark.django_db(transaction=True)  # the middleware reads the database from its own thread

GIB2 = str(2 * 1024**3).encode()


@pytest.fixture(autouse=True)
def data_dirs(settings: Any, tmp_path: Path) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})


def scope(path: str, token: str | None = None, cookie: str | None = None, length: bytes | None = GIB2) -> dict:
    headers = [(b"host", b"testserver"), (b"content-type", b"multipart/form-data; boundary=x")]
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    if cookie is not None:
        headers.append((b"cookie", cookie.encode()))
    headers.append((b"content-length", length) if length is not None else (b"transfer-encoding", b"chunked"))
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("testserver", 80),
    }


async def _exchange(request: dict) -> tuple[int, dict[str, str], dict, int]:
    from portal.asgi import application

    communicator = ApplicationCommunicator(application, request)
    chunks = 3
    for _ in range(chunks):
        await communicator.send_input({"type": "http.request", "body": b"x" * 1024, "more_body": True})
    start = await communicator.receive_output(timeout=20)
    body = await communicator.receive_output(timeout=20)
    await communicator.wait(timeout=20)
    headers = {name.decode(): value.decode() for name, value in start["headers"]}
    return start["status"], headers, json.loads(body["body"])["error"], chunks - communicator.input_queue.qsize()


def refused(request: dict, status: int) -> dict:
    """The refusal of `request`, checked to come with none of the body taken and the connection closed."""
    answered, headers, error, taken = asyncio.run(_exchange(request))
    assert (answered, error["status"]) == (status, status), error
    assert taken == 0, "the refusal came before any of the body was read"
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    return error


def bound(request: dict) -> Bound:
    decided = asyncio.run(decide(request))
    assert isinstance(decided, Bound), decided
    return decided


@pytest.mark.parametrize("length", [GIB2, None], ids=["declared", "chunked"])
def test_anonymous_uploads_are_401_before_a_byte(ran_here: Job, length: bytes | None) -> None:
    for path in (f"/api/agent/jobs/{ran_here.pk}/artifacts", f"/api/agent/jobs/{ran_here.pk + 99}/artifacts",
                 "/api/code", "/jobs/new/"):
        error = refused(scope(path, length=length), 401)
        assert error["code"] == "unauthenticated" and "no token" in error["message"], (path, error)
    error = refused(scope("/api/code", token="not-a-token", length=length), 401)
    assert "not valid" in error["message"]


@pytest.mark.parametrize("length", [GIB2, None], ids=["declared", "chunked"])
def test_a_body_to_no_route_is_404_before_a_byte(length: bytes | None) -> None:
    for path in ("/api/agent/jobs/x/y/artifacts", "/api/agent/jobs/1/artifacts/", "/nowhere"):
        error = refused(scope(path, length=length), 404)
        assert error["code"] == "not_found" and repr(path) in error["message"]


def test_artifacts_need_the_agent_token_of_a_node_the_job_ran_on(
    ran_here: Job, tokens: dict[str, str], users: dict[str, Any]
) -> None:
    path = f"/api/agent/jobs/{ran_here.pk}/artifacts"
    error = refused(scope(path, tokens["alice"]), 403)
    assert "'user'" in error["message"]
    error = refused(scope(f"/api/agent/jobs/{ran_here.pk + 99}/artifacts", tokens["agent"]), 404)
    assert f"job {ran_here.pk + 99} does not exist" in error["message"]
    _, elsewhere = ApiToken.issue(users["staff"], "agent of no node", ApiToken.Role.AGENT)
    error = refused(scope(path, elsewhere), 403)
    assert "registered no node" in error["message"]
    other = Job.objects.get(pk=Client().post(
        "/api/jobs", test_artifacts_api.VALID_SPEC, content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {tokens['bob']}",
    ).json()["id"])
    error = refused(scope(f"/api/agent/jobs/{other.pk}/artifacts", tokens["agent"]), 403)
    assert f"job {other.pk} never ran on node 'node-a'" in error["message"]


def test_the_big_bounds_go_to_their_senders_only(
    ran_here: Job, tokens: dict[str, str], users: dict[str, Any], settings: Any
) -> None:
    assert bound(scope(f"/api/agent/jobs/{ran_here.pk}/artifacts", tokens["agent"])).limit == (
        settings.BUNGEE.artifact_max_bytes
    )
    code = bound(scope("/api/code", tokens["alice"]))
    assert code.limit > settings.BUNGEE.code_max_bytes and "BUNGEE_CODE_MAX_BYTES" in code.setting
    client = Client()
    client.force_login(users["alice"])
    session = f"sessionid={client.cookies['sessionid'].value}"
    assert bound(scope("/jobs/new/", cookie=session)).limit == code.limit
    assert bound(scope("/api/jobs", cookie=session)).limit == settings.BUNGEE.body_max_bytes
    error = refused(scope("/api/code", tokens["agent"]), 403)
    assert "'agent'" in error["message"]


def test_a_body_over_the_bound_of_its_sender_is_413_before_a_byte(tokens: dict[str, str], settings: Any) -> None:
    error = refused(scope("/api/jobs"), 413)
    assert "BUNGEE_ANONYMOUS_BODY_MAX_BYTES" in error["message"] and f"{int(GIB2)} bytes" in error["message"]
    error = refused(scope("/api/jobs", tokens["alice"]), 413)
    assert f"at most {settings.BUNGEE.body_max_bytes} bytes are taken (BUNGEE_BODY_MAX_BYTES)" in error["message"]
    small = str(settings.BUNGEE.anonymous_body_max_bytes + 1).encode()
    assert bound(scope("/login/", length=small)).limit == settings.BUNGEE.anonymous_body_max_bytes


def test_a_portal_under_a_prefix_routes_without_it() -> None:
    mounted = {**scope("/bungee/api/code"), "root_path": "/bungee"}
    assert refused(mounted, 401)["code"] == "unauthenticated"


def test_a_stale_session_is_anonymous_and_left_as_it_is(users: dict[str, Any]) -> None:
    """A session made before its user's password changed signs nobody in; the policy only reads
    it (django's get_user would delete it), so the session row is still there afterwards."""
    from django.contrib.sessions.models import Session

    client = Client()
    client.force_login(users["alice"])
    key = client.cookies["sessionid"].value
    users["alice"].set_password("a-new-password")
    users["alice"].save()
    error = refused(scope("/api/code", cookie=f"sessionid={key}"), 401)
    assert error["code"] == "unauthenticated"
    assert Session.objects.filter(session_key=key).exists(), "the policy wrote nothing"
