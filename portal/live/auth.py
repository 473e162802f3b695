"""WebSocket authentication: the browser's session, or an API token in the `Authorization:
Bearer` header (or the `token` query parameter) for scripts.

Which handshakes are let in at all (`origin_checked`): a browser sends an `Origin` header with
every WebSocket handshake, so a handshake with one must come from a page of this portal (a
cross-site page is refused whatever it authenticates with: its cookies would otherwise speak for
its visitor). A handshake without one comes from a script, not a browser; it is let in only with
an `Authorization: Bearer` token, and its cookies are dropped so that it is the token that
speaks."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import AllowedHostsOriginValidator, WebsocketDenier

from portal.accounts.models import ApiToken


@database_sync_to_async
def _user_for_token(secret: str) -> Any:
    token = ApiToken.lookup(secret)
    return token.user if token is not None and token.role == ApiToken.Role.USER else None


def _authorization_bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization" and value.lower().startswith(b"bearer "):
            return value[7:].decode("latin1").strip() or None
    return None


def _bearer(scope: dict[str, Any]) -> str | None:
    header = _authorization_bearer(scope)
    if header:
        return header
    query = parse_qs(scope.get("query_string", b"").decode())
    return query.get("token", [None])[0]


class TokenAuthMiddleware:
    """Sets scope["user"] from a bearer token when one is sent; else leaves the session's user."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        secret = _bearer(scope)
        if secret:
            user = await _user_for_token(secret)
            if user is not None:
                scope = dict(scope, user=user)
        return await self.inner(scope, receive, send)


def TokenOrSessionAuthMiddleware(inner: Any) -> Any:  # noqa: N802 - named like Channels' stacks
    return AuthMiddlewareStack(TokenAuthMiddleware(inner))


class _OriginChecked:
    def __init__(self, inner: Any) -> None:
        self.from_browser = AllowedHostsOriginValidator(inner)
        self.from_script = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        headers = scope.get("headers", [])
        if any(name == b"origin" for name, _ in headers):
            return await self.from_browser(scope, receive, send)
        if _authorization_bearer(scope) is None:
            return await WebsocketDenier()(scope, receive, send)
        without_cookies = [(name, value) for name, value in headers if name != b"cookie"]
        return await self.from_script(dict(scope, headers=without_cookies), receive, send)


def origin_checked(inner: Any) -> Any:
    """The handshakes let in (this module's docstring): a page of this portal, or a script with
    a bearer token and no Origin."""
    return _OriginChecked(inner)
