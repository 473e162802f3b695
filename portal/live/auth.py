"""WebSocket authentication: the browser's session, or an API token in the `Authorization:
Bearer` header (or the `token` query parameter) for scripts."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async

from portal.accounts.models import ApiToken


@database_sync_to_async
def _user_for_token(secret: str) -> Any:
    token = ApiToken.lookup(secret)
    return token.user if token is not None and token.role == ApiToken.Role.USER else None


def _bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization" and value.lower().startswith(b"bearer "):
            return value[7:].decode().strip()
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
