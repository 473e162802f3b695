"""An ASGI middleware that bounds every HTTP request body before Django reads it: Django's ASGI
handler spools a whole body to memory and disk before any view runs, so a view's own size check
comes too late to keep a 10 GB upload off the disk. A declared Content-Length over the limit is
answered 413 at once; a body sent without one (chunked) is cut off where it passes the limit and
answered 413 too. The answer has the API's error shape."""

from __future__ import annotations

import json
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
    """The largest body a path takes, the setting that sets it (named in the refusal) and what
    a client can do to send less (said after it, if anything)."""

    limit: int
    setting: str
    advice: str = ""


def _too_large(size: int | None, bound: Bound) -> bytes:
    said = f"{size} bytes" if size is not None else f"over {bound.limit} bytes"
    advice = f"; {bound.advice}" if bound.advice else ""
    return json.dumps({"error": {
        "status": 413, "code": "too_large",
        "message": f"the request body is {said}; at most {bound.limit} bytes are taken ({bound.setting}){advice}",
        "fields": [{"field": "body", "message": f"at most {bound.limit} bytes ({bound.setting})", "value": size}],
    }}).encode()


class BodyLimit:
    def __init__(self, app: App, bound: Callable[[str], Bound]) -> None:
        self.app = app
        self.bound = bound
        """The bound for a request's path; read per request, so that a setting changed in tests
        applies."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        bound = self.bound(scope.get("path", ""))
        limit = bound.limit
        declared = next((value for name, value in scope.get("headers", []) if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, _too_large(int(declared), bound))
            return
        received = 0
        cut = False

        async def bounded() -> Message:
            nonlocal received, cut
            if cut:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    cut = True
                    return {"type": "http.disconnect"}  # Django then drops the request unanswered
            return message

        await self.app(scope, bounded, send)
        if cut:
            await self._refuse(send, _too_large(None, bound))

    @staticmethod
    async def _refuse(send: Send, body: bytes) -> None:
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body})
