"""A request body that does not arrive in time is answered 408 by the real server the platform
runs (uvicorn, portal.launcher.portal_command), and its connection closed: one that stalls after
its first bytes, and one that trickles a byte at a time, each byte in time but the whole too slow
(BUNGEE_BODY_TIMEOUT_S set small here, BUNGEE_BODY_MIN_RATE_BYTES_S above the trickle's rate)."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import pytest

from tests.body_limit_support import LyingUpload, read_answer, request_head, stalled_upload
from tests.platform import running_portal

pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0
ENV = {"BUNGEE_BODY_TIMEOUT_S": str(TIMEOUT_S), "BUNGEE_BODY_MIN_RATE_BYTES_S": "100"}


def trickled_upload(base_url: str, path: str, declared_bytes: int, every_s: float, within_s: float) -> LyingUpload:
    """POSTs to `path` declaring `declared_bytes` and sends one byte of the body every `every_s`
    until an answer comes (or `within_s` passes); then reads it."""
    host, port, head = request_head(base_url, path, f"Content-Length: {declared_bytes}")
    with socket.create_connection((host, port), timeout=10) as connection:
        started = time.monotonic()
        connection.sendall(head)
        sent = 0
        while time.monotonic() - started < within_s:
            readable, _, _ = select.select([connection], [], [], every_s)
            if readable:
                upload = LyingUpload(time.monotonic() - started, sent)
                read_answer(connection, upload)
                return upload
            if sent < declared_bytes - 1:
                connection.sendall(b"x")
                sent += 1
    return LyingUpload(None, sent)


def check_timed_out(upload: LyingUpload, log: str) -> None:
    assert upload.status == 408, (upload, log)
    error = upload.error()
    assert error["status"] == 408 and error["code"] == "body_timeout", error
    assert "BUNGEE_BODY_TIMEOUT_S" in error["message"]
    assert upload.headers is not None and upload.headers["connection"] == "close"
    assert upload.closed in ("eof", "reset"), "the server closed the connection"


def test_a_stalled_or_trickled_body_is_408(tmp_path: Path) -> None:
    with running_portal(tmp_path, extra_env=ENV) as portal:
        stalled = stalled_upload(portal.base_url, "/api/jobs", 1000, sent_bytes=10, within_s=30)
        check_timed_out(stalled, portal.group.tail("portal"))
        assert "no part of it arrived" in stalled.error()["message"]
        trickled = trickled_upload(portal.base_url, "/api/jobs", 1000, every_s=TIMEOUT_S / 4, within_s=30)
        check_timed_out(trickled, portal.group.tail("portal"))
        assert "slower than 100 bytes a second" in trickled.error()["message"]
