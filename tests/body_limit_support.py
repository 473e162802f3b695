"""An upload that lies about its size, over a raw socket, as a client that means harm would send
it: headers declaring a huge `Content-Length`, then body bytes a chunk at a time, at most
`max_body_bytes` of them spread over `within_s`, for as long as no answer has come. Used by
tests/test_body_limit_server.py and bench/body_limit.py against a real portal."""

from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

CHUNK_BYTES = 16 * 1024


@dataclass
class LyingUpload:
    answered_after_s: float | None
    """From the headers sent to the first byte of the answer; None: no answer within the bound."""
    body_bytes_sent: int
    """How much of the declared body the client had sent when the answer came (or at the bound)."""
    status: int | None = None
    headers: dict[str, str] | None = None
    body: bytes = b""
    closed: str | None = None
    """How the server ended the connection after its answer: "eof" (FIN) or "reset" (RST, which
    the kernel sends when the server closes with body bytes unread); None: it stayed open."""

    def error(self) -> dict[str, Any]:
        """The answer's body as the API's error shape (its "error" object)."""
        return dict(json.loads(self.body)["error"])


def request_head(base_url: str, path: str, length: str, content_type: str = "application/json") -> tuple[str, int, bytes]:
    """The host, the port and the request's head, with `length` as its last header."""
    address = urlsplit(base_url)
    assert address.hostname is not None and address.port is not None, base_url
    head = (f"POST {path} HTTP/1.1\r\nHost: {address.hostname}:{address.port}\r\n"
            f"Content-Type: {content_type}\r\n{length}\r\n\r\n").encode()
    return address.hostname, address.port, head


def lying_upload(
    base_url: str, path: str = "/api/jobs", declared_bytes: int | None = 2**31, max_body_bytes: int = 1024 * 1024,
    within_s: float = 16.0,
) -> LyingUpload:
    """POSTs to `path` declaring `declared_bytes` (None: chunked, declaring no length), sending a
    chunk of the body, then waiting for an answer for up to within_s / chunks, and so on, until an
    answer comes or `max_body_bytes` are sent and `within_s` has passed. Then reads the answer
    whole and whether the server closed the connection (each read bounded by 10 s). Anonymous:
    no cookie, no token."""
    chunks = max_body_bytes // CHUNK_BYTES
    pace_s = within_s / chunks
    length = f"Content-Length: {declared_bytes}" if declared_bytes is not None else "Transfer-Encoding: chunked"
    host, port, head = request_head(base_url, path, length)
    chunk = b"x" * CHUNK_BYTES
    if declared_bytes is None:
        chunk = f"{CHUNK_BYTES:x}\r\n".encode() + chunk + b"\r\n"
    with socket.create_connection((host, port), timeout=10) as connection:
        started = time.monotonic()
        connection.sendall(head)
        deadline = started + within_s
        sent = 0
        while True:
            readable, _, _ = select.select([connection], [], [], max(0.0, min(pace_s, deadline - time.monotonic())))
            if readable:
                upload = LyingUpload(time.monotonic() - started, sent)
                break
            if time.monotonic() >= deadline:
                return LyingUpload(None, sent)
            if sent < chunks * CHUNK_BYTES:
                try:
                    connection.sendall(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    upload = LyingUpload(time.monotonic() - started, sent)
                    break
                sent += CHUNK_BYTES
        read_answer(connection, upload)
    return upload


def stalled_upload(
    base_url: str, path: str, declared_bytes: int | None, sent_bytes: int, within_s: float
) -> LyingUpload:
    """POSTs to `path` declaring `declared_bytes` (None: chunked, the bytes then sent as one
    chunk), sends `sent_bytes` of the body and then nothing, waiting up to `within_s` for an
    answer; then reads it as lying_upload does. Anonymous."""
    length = f"Content-Length: {declared_bytes}" if declared_bytes is not None else "Transfer-Encoding: chunked"
    host, port, head = request_head(base_url, path, length)
    body = b"x" * sent_bytes
    if declared_bytes is None and sent_bytes:
        body = f"{sent_bytes:x}\r\n".encode() + body + b"\r\n"
    with socket.create_connection((host, port), timeout=10) as connection:
        started = time.monotonic()
        connection.sendall(head + body)
        readable, _, _ = select.select([connection], [], [], within_s)
        if not readable:
            return LyingUpload(None, sent_bytes)
        upload = LyingUpload(time.monotonic() - started, sent_bytes)
        read_answer(connection, upload)
    return upload


def read_answer(connection: socket.socket, upload: LyingUpload) -> None:
    """Reads the server's answer into `upload`: its status, headers and body, and how the server
    ended the connection after it."""
    received = b""
    try:
        while b"\r\n\r\n" not in received:
            data = connection.recv(65536)
            if not data:
                upload.closed = "eof"
                return
            received += data
        head, _, body = received.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin1").split("\r\n")
        upload.status = int(status_line.split()[1])
        upload.headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        length = int(upload.headers.get("content-length", "0"))
        while len(body) < length:
            data = connection.recv(65536)
            if not data:
                break
            body += data
        upload.body = body[:length]
        upload.closed = "eof" if connection.recv(65536) == b"" else None
    except ConnectionResetError:
        upload.closed = "reset"
    except TimeoutError:
        upload.closed = None
