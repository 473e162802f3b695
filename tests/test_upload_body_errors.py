"""A multipart upload that is empty, cut short, of another type or without a usable boundary is
answered in the API's error shape, saying what was wrong, on both multipart endpoints (a job's
code, an agent's artifacts). Driven through the real ASGI application, with the bytes a client
would send, as a server hands them over."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from asgiref.testing import ApplicationCommunicator

from portal.jobs.models import Job
from tests import test_artifacts_api

# The application runs each view in a thread of its own, with a database connection of its own:
# what the test writes must be committed to be seen there.
pytestmark = pytest.mark.django_db(transaction=True)

BOUNDARY = "b0undary"
FORM = f"multipart/form-data; boundary={BOUNDARY}"
PART = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="code.zip"\r\n'
        "Content-Type: application/zip\r\n\r\n").encode()

CUT_SHORT = "a part the body cuts short before its boundary is dropped"

# name: (Content-Type or None, body, status, code, words in the message)
CASES: dict[str, tuple[str | None, bytes, int, str, str]] = {
    "empty form": (FORM, f"--{BOUNDARY}--\r\n".encode(), 400, "missing", CUT_SHORT),
    "empty body": (FORM, b"", 400, "missing", CUT_SHORT),
    "empty body, no boundary": ("multipart/form-data", b"", 400, "malformed_body",
                                "body cannot be read: Invalid boundary in multipart: None"),
    "no boundary": ("multipart/form-data", PART + b"PK\x05\x06" + bytes(18), 400, "malformed_body",
                    "Invalid boundary in multipart: None"),
    "a boundary of control characters": ("multipart/form-data; boundary=\x01\x02", PART, 400, "malformed_body",
                                         "Invalid boundary in multipart"),
    "a Content-Type not in ASCII": ("multipart/form-data; boundary=gr\u00fc\u00dfe", PART, 400, "malformed_body",
                                    "Invalid non-ASCII Content-Type in multipart"),
    "cut short": (FORM, PART + b"PK\x03\x04 the archive goes on", 400, "missing", CUT_SHORT),
    "another type": ("application/zip", b"PK\x05\x06" + bytes(18), 415, "unsupported_media_type",
                     "as multipart/form-data, not application/zip"),
    "no Content-Type": (None, b"", 415, "unsupported_media_type",
                        "as multipart/form-data, not a body without a Content-Type"),
}
MISSING = {"/api/code": ("invalid_request", "no field named 'file' in the upload"),
           "artifacts": ("invalid_artifacts", "model.pt is missing")}


@pytest.fixture(autouse=True)
def data_dirs(settings: Any, tmp_path: Path) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})


ran_here = test_artifacts_api.ran_here
"""Alice's job, whose rank 0 started on node-a (test_artifacts_api's fixture)."""


async def exchange(path: str, token: str, content_type: str | None, body: bytes) -> tuple[int, dict, Any]:
    """POSTs `body` to the portal's ASGI application; the status, headers and body of the answer."""
    from portal.asgi import application

    headers = [(b"host", b"testserver"), (b"authorization", f"Bearer {token}".encode()),
               (b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type.encode("utf-8")))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("testserver", 80),
    }
    communicator = ApplicationCommunicator(application, scope)
    await communicator.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await communicator.receive_output(timeout=20)
    chunks = [await communicator.receive_output(timeout=20)]
    while chunks[-1].get("more_body"):
        chunks.append(await communicator.receive_output(timeout=20))
    await communicator.wait(timeout=20)
    answered = {name.decode().lower(): value.decode() for name, value in start["headers"]}
    return start["status"], answered, json.loads(b"".join(chunk.get("body", b"") for chunk in chunks))


def check(endpoint: str, path: str, token: str, case: str) -> None:
    content_type, body, status, code, words = CASES[case]
    if code == "missing":
        code, missing = MISSING[endpoint]
        words = f"{missing} ({words})"
    answered_status, headers, answer = asyncio.run(exchange(path, token, content_type, body))
    assert answered_status == status, answer
    assert headers["content-type"].startswith("application/json")
    error = answer["error"]
    assert set(error) == {"status", "code", "message", "fields"} and error["status"] == status
    assert error["code"] == code and words in error["message"], error
    assert error["fields"], "the field at fault is named"


@pytest.mark.parametrize("case", list(CASES))
def test_a_code_upload(tokens: dict, case: str) -> None:
    check("/api/code", "/api/code", tokens["alice"], case)


@pytest.mark.parametrize("case", list(CASES))
def test_an_artifacts_upload(tokens: dict, ran_here: Job, case: str) -> None:
    check("artifacts", f"/api/agent/jobs/{ran_here.pk}/artifacts", tokens["agent"], case)
