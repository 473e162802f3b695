"""An ASGI middleware that decides, before Django reads a byte of a request's body, whether to read
it at all and how much of it: Django's ASGI handler spools a whole body to memory and disk before
any view runs, so a view's own checks (who sends it, how big it is) come too late to keep a 10 GB
upload off the disk. The decision (portal.body_policy) is made from the request's headers alone:
a refusal then (no or a wrong token, a route that does not exist, a declared Content-Length over
the bound) is answered at once, with the body unread. A body without a declared length (chunked)
is cut off where it passes the bound and answered 413 too. A body that stalls, or arrives slower
than the bound's rate, is answered 408. Every answer of this layer has the API's error shape and
closes the connection (the client may still be sending)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The types Django's ASGIHandler declares (django-stubs), so that it type-checks as our app.
Scope = dict[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Bound:
    """The largest body a request takes, the setting that sets it (named in the refusal) and what
    a client can do to send less (said after it, if anything). `stall_s`: the longest wait for the
    next part of the body; the whole body must arrive within `stall_s` plus one second per
    `min_rate_bytes_s` bytes of it."""

    limit: int
    setting: str
    advice: str = ""
    stall_s: float = 30.0
    min_rate_bytes_s: int = 256 * 1024
    subject: str = "the request body"
    """What the body is, as a refusal names it ("the code upload")."""


@dataclass(frozen=True)
class Refusal:
    """An answer given from the headers alone, before the body is read: who sends the request
    may not send it (401, 403), or what it names does not exist (404)."""

    status: int
    code: str
    message: str


Decide = Callable[[Scope], Awaitable[Bound | Refusal]]


def _error(status: int, code: str, message: str, field: str = "", value: Any = None) -> bytes:
    fields = [{"field": field, "message": message, "value": value}] if field else []
    return json.dumps({"error": {"status": status, "code": code, "message": message, "fields": fields}}).encode()


def _too_large(size: int | None, bound: Bound) -> bytes:
    said = f"{size} bytes" if size is not None else f"over {bound.limit} bytes"
    advice = f"; {bound.advice}" if bound.advice else ""
    return json.dumps({"error": {
        "status": 413, "code": "too_large",
        "message": f"{bound.subject} is {said}; at most {bound.limit} bytes are taken ({bound.setting}){advice}",
        "fields": [{"field": "body", "message": f"at most {bound.limit} bytes ({bound.setting})", "value": size}],
    }}).encode()


def _too_slow(received: int, bound: Bound, stalled: bool) -> bytes:
    why = (
        f"no part of it arrived for {bound.stall_s:g} s" if stalled
        else f"it arrived slower than {bound.min_rate_bytes_s} bytes a second (after {bound.stall_s:g} s)"
    )
    message = (
        f"the request body was not received in time: {received} bytes came, then {why} "
        "(BUNGEE_BODY_TIMEOUT_S, BUNGEE_BODY_MIN_RATE_BYTES_S)"
    )
    return _error(408, "body_timeout", message, "body", received)


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, or None if it declares none (or not a number)."""
    declared = next((value for name, value in scope.get("headers", []) if name == b"content-length"), None)
    return int(declared) if declared is not None and declared.isdigit() else None


class BodyLimit:
    def __init__(self, app: App, decide: Decide) -> None:
        self.app = app
        self.decide = decide
        """The bound for a request, or its refusal; read per request, so that a setting changed
        in tests applies."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decided = await self.decide(scope)
        if isinstance(decided, Refusal):
            await self._refuse(send, decided.status, _error(decided.status, decided.code, decided.message))
            return
        bound = decided
        declared = declared_length(scope)
        if declared is not None and declared > bound.limit:
            await self._refuse(send, 413, _too_large(declared, bound))
            return
        received = 0
        complete = False
        refusal: tuple[int, bytes] | None = None
        started = time.monotonic()

        async def bounded() -> Message:
            nonlocal received, complete, refusal
            if refusal is not None:
                return {"type": "http.disconnect"}
            if complete:  # Django then waits for the client to disconnect while its view runs
                return await receive()
            overall_s = bound.stall_s + received / bound.min_rate_bytes_s - (time.monotonic() - started)
            wait_s = min(bound.stall_s, overall_s)
            try:
                message = await asyncio.wait_for(receive(), timeout=max(wait_s, 0.0))
            except TimeoutError:
                refusal = (408, _too_slow(received, bound, stalled=wait_s == bound.stall_s))
                return {"type": "http.disconnect"}  # Django then drops the request unanswered
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > bound.limit:
                    refusal = (413, _too_large(None, bound))
                    return {"type": "http.disconnect"}
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, bounded, send)
        if refusal is not None:
            await self._refuse(send, *refusal)

    @staticmethod
    async def _refuse(send: Send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body})
