"""Request bodies are bounded before Django reads them (portal.body_limit), driven through the
real ASGI application: a declared Content-Length over the limit is 413 without a byte read; a
body without one is cut off where it passes the limit, 413 too; a small one reaches Django."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from asgiref.testing import ApplicationCommunicator
from django.core.asgi import get_asgi_application

from portal.body_limit import BodyLimit, Bound, Decide, Refusal, Scope

LIMIT = 1000


def scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/api/code", "raw_path": b"/api/code", "query_string": b"",
        "root_path": "", "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }


async def fixed_bound(scope: Scope) -> Bound | Refusal:
    return Bound(LIMIT, "BUNGEE_TEST_MAX_BYTES")


async def exchange(
    headers: list[tuple[bytes, bytes]], chunks: list[bytes], decide: Decide = fixed_bound
) -> tuple[int, bytes, int]:
    """Sends the request to /api/code; returns the status, the body and how many chunks were taken."""
    app = BodyLimit(get_asgi_application(), decide)
    communicator = ApplicationCommunicator(app, scope(headers))
    for index, chunk in enumerate(chunks):
        await communicator.send_input({"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1})
    start = await communicator.receive_output(timeout=10)
    body = await communicator.receive_output(timeout=10)
    await communicator.wait(timeout=10)
    taken = len(chunks) - communicator.input_queue.qsize()
    return start["status"], body["body"], taken


def test_a_declared_length_over_the_limit_is_413_before_reading() -> None:
    status, body, taken = asyncio.run(exchange([(b"content-length", b"5000000000")], [b"x" * 100] * 3))
    assert status == 413 and taken == 0
    error = json.loads(body)["error"]
    assert error["code"] == "too_large" and "5000000000 bytes" in error["message"]


def test_a_body_without_a_length_is_cut_off_at_the_limit() -> None:
    status, body, taken = asyncio.run(exchange([], [b"x" * 400] * 10))
    assert status == 413 and "over 1000 bytes" in json.loads(body)["error"]["message"]
    assert taken == 3, "reading stopped where the limit was passed"


def test_a_small_body_reaches_django() -> None:
    # Django answers: a POST without a session or a token is refused as unauthenticated.
    status, body, taken = asyncio.run(exchange([(b"content-length", b"2")], [b"{}"]))
    assert status == 401 and b"too_large" not in body and taken == 1


@pytest.mark.django_db(transaction=True)  # the middleware reads the database from its own thread
def test_a_code_upload_over_the_limit_names_its_setting_and_how_to_leave_files_out(
    settings: Any, tokens: dict[str, str]
) -> None:
    from portal.body_policy import decide

    settings.BUNGEE = settings.BUNGEE.model_copy(update={"code_max_bytes": 500})
    alice = (b"authorization", f"Bearer {tokens['alice']}".encode())
    status, body, taken = asyncio.run(exchange([alice, (b"content-length", b"56000000")], [b"x"], decide))
    message = json.loads(body)["error"]["message"]
    assert status == 413 and taken == 0
    assert "BUNGEE_CODE_MAX_BYTES=500" in message and ".bungeeignore" in message, message
    assert message.startswith("the code upload is 56000000 bytes") and "other fields" not in message, message


def test_a_view_that_runs_past_the_body_timeout_is_not_cut_off() -> None:
    """Once the body is in, Django waits on receive() for the client to go away while its view
    runs: the timeout is the body's, so that wait is not answered with a made-up disconnect."""
    heard: list[str] = []

    async def django_like(scope: Scope, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        try:
            heard.append((await asyncio.wait_for(receive(), timeout=0.5))["type"])
        except TimeoutError:
            heard.append("nothing")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    async def quick_timeout(scope: Scope) -> Bound | Refusal:
        return Bound(LIMIT, "BUNGEE_TEST_MAX_BYTES", stall_s=0.05)

    async def run() -> int:
        communicator = ApplicationCommunicator(BodyLimit(django_like, quick_timeout), scope([]))
        await communicator.send_input({"type": "http.request", "body": b"{}", "more_body": False})
        start = await communicator.receive_output(timeout=10)
        await communicator.receive_output(timeout=10)
        return int(start["status"])

    assert asyncio.run(run()) == 200 and heard == ["nothing"]
