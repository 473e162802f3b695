"""The live socket while a store is away: refused as the API refuses, not failed.

The API answers 503 with Retry-After when Redis or the database does not answer
(portal.error_pages). A socket needs both from its first moment (its session or token from the
database, its channel and groups in Redis), and before this an error there escaped the
application: the server answered the handshake 500, or dropped an open socket with 1011, and
logged a traceback. Here the same errors (portal.error_pages.unavailable_store) close the socket
with 1013, "try again later", accepting it first where it was not yet (a handshake refused before
acceptance reaches a browser as 1006, with no code to act on), and log one line. The page's
socket (static/js/live.js) waits at least the API's Retry-After before it tries again. Any other
error is left to the server, as before."""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import Any

from portal.error_pages import unavailable_store

log = logging.getLogger(__name__)

TRY_AGAIN_LATER_CLOSE_CODE = 1013


class _RefusedWhileStoresAway:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        accepted = closed = False

        async def watched_send(message: dict[str, Any]) -> None:
            nonlocal accepted, closed
            accepted = accepted or message["type"] == "websocket.accept"
            closed = closed or message["type"] == "websocket.close"
            await send(message)

        try:
            await self.inner(scope, receive, watched_send)
        except Exception as exception:
            store = unavailable_store(exception)
            if store is None:
                raise
            # What failed stays in the log (hosts, ports); the close reason goes to anyone.
            log.warning("socket %s: closed with %s, the portal's %s is not answering: %s",
                        scope.get("path"), TRY_AGAIN_LATER_CLOSE_CODE, store, exception)
            if closed:
                return
            # A client already gone makes the server refuse these sends; nothing is left to tell.
            with suppress(OSError):
                if not accepted:
                    await send({"type": "websocket.accept"})
                await send({"type": "websocket.close", "code": TRY_AGAIN_LATER_CLOSE_CODE,
                            "reason": f"the portal's {store} is not answering; try again shortly"})


def refused_while_stores_away(inner: Any) -> Any:
    """The websocket application `inner`, closing with 1013 instead of failing when Redis or
    the database does not answer (this module's docstring)."""
    return _RefusedWhileStoresAway(inner)
